"""Engine by composition: no mixins, one object per concern, and the expert cache as engine.experts."""
from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from edgemoe.runtime.cache_config import CacheConfig, LruConfig
from edgemoe.runtime.engine import Engine, LoadConfig
from edgemoe.runtime.exclusive import ThreadGuard
from edgemoe.runtime.expert_cache import CacheController, ExpertCache
from edgemoe.runtime.gating import Gating
from edgemoe.runtime.handle import NativeHandle
from edgemoe.runtime.prediction import GraphPredictors
from edgemoe.runtime.routing import Routing
from edgemoe.runtime.sequence import KVSequence
from edgemoe.runtime.vocab import Vocabulary

from helpers.models import FIXTURE_MODELS, ROOT

# the controller's old path to its cache's counters; spelled in two parts so that this file does not hold it
OLD_PATH = ".cache" + ".cache"


def test_engine_has_no_mixin_bases() -> None:
    assert Engine.__mro__ == (Engine, object)


def test_old_expert_cache_path_is_gone() -> None:
    """engine.experts shows the cache's stats(), slots and policy: nothing reaches through the controller."""
    here = Path(__file__).resolve()
    found = []
    for top in ("edgemoe", "tests", "tools", "docs"):
        for path in sorted((ROOT / top).rglob("*")):
            if not path.is_file() or path.resolve() == here or "__pycache__" in path.parts:
                continue
            if OLD_PATH.encode() in path.read_bytes():
                found.append(str(path.relative_to(ROOT)))
    readme = (ROOT / "README.md").read_text()
    assert found == [] and OLD_PATH not in readme


@pytest.mark.parametrize("model", FIXTURE_MODELS[:1], ids=lambda p: p.name.split(".")[0])
def test_engine_holds_its_parts(model: Path) -> None:
    with Engine(model, LoadConfig(n_ctx=256, n_threads=2)) as eng:
        assert isinstance(eng.handle, NativeHandle) and isinstance(eng.gating, Gating)
        assert isinstance(eng.prefetch, GraphPredictors) and isinstance(eng.routing, Routing)
        assert isinstance(eng._seq, KVSequence) and isinstance(eng._vocab, Vocabulary)
        assert isinstance(eng._guard, ThreadGuard)
        assert eng.experts is None and eng.routing.hooks is None
        cache = eng.enable_expert_cache(CacheConfig(4, policy=LruConfig()))
        ctl = eng.experts
        assert isinstance(cache, ExpertCache) and isinstance(ctl, CacheController) and ctl.cache is cache
        eng.generate("hello", max_tokens=4)
        assert ctl.stats()["hits"] + ctl.stats()["misses"] > 0 and ctl.n_slots == cache.n_slots
        assert ctl.slots(next(iter(ctl.n_slots))) == cache.slots(next(iter(cache.n_slots)))
        assert not hasattr(eng, "cache")  # renamed experts; nothing in or outside the package used the old name
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert eng.enable_expert_cache(None) is None and eng.experts is None
