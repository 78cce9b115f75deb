"""What the tests share, beside the tests themselves (tests/test_*.py import from here, never from each other).

- Modules the tests import: `from helpers.models import FIXTURE_MODELS`. pytest puts tests/ on sys.path.
- Fixture modules (synth_fixtures, serve_harness): registered once in tests/conftest.py's `pytest_plugins`, so a
  test takes their fixtures by name without importing them.
- Scripts run by path in a process of their own (`python tests/helpers/rpc_cache_check.py MODEL OUT.json`): a
  registered RPC device is seen by every model loaded afterwards in a process, and a llama.cpp abort kills only
  the child. Each puts tests/ on sys.path first, so that it imports its helpers by the same names as the tests.
"""
