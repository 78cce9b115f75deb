"""The speculation options of the commands: generate --json reports it and equals plain greedy; the refusals."""
from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from edgemoe.cli.main import cli

ROOT = Path(__file__).resolve().parent.parent
QWEN = str(ROOT / "models" / "edgemoe-tiny-qwen3moe.Q4_K_M.gguf")
PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks?\nROMEO:\nBut soft,"


def _generate(*extra: str) -> dict:
    res = CliRunner().invoke(cli, ["generate", QWEN, "-p", PROMPT, "-n", "24", "--temp", "0", "-t", "1", "--json",
                                   *extra])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_generate_lookup_and_draft_equal_plain_greedy() -> None:
    plain = _generate()
    assert "speculation" not in plain
    lookup = _generate("--speculate", "lookup", "--draft-max", "4")
    draft = _generate("--draft-model", QWEN, "--draft-max", "3")  # --draft-model alone means --speculate draft
    assert lookup["tokens"] == plain["tokens"] == draft["tokens"]
    assert lookup["speculation"]["mode"] == "lookup" and lookup["speculation"]["steps"] > 0
    assert draft["speculation"]["mode"] == "draft" and draft["speculation"]["acceptance"] == 1.0


def test_refusals_are_one_line() -> None:
    runner = CliRunner()
    res = runner.invoke(cli, ["generate", QWEN, "-p", "hi", "-n", "2", "--speculate", "mtp"])
    assert res.exit_code != 0 and "MTP heads" in res.output and "Traceback" not in res.output
    res = runner.invoke(cli, ["generate", QWEN, "-p", "hi", "-n", "2", "--speculate", "lookup", "--draft-model", QWEN])
    assert res.exit_code == 2 and "--speculate draft" in res.output
    res = runner.invoke(cli, ["generate", QWEN, "-p", "hi", "-n", "2", "--speculate", "lookup", "--draft-max", "0"])
    assert res.exit_code == 2


def test_bench_runs_the_best_stock_row_and_each_policy_again_with_speculation() -> None:
    res = CliRunner().invoke(cli, ["bench", QWEN, "--vram", "4MiB", "--prompt-tokens", "32", "--gen-tokens", "8",
                                   "-t", "1", "--policy", "lru", "--policy", "static", "--speculate", "lookup",
                                   "--profile", "none", "--json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout[res.stdout.index("{"):])["rows"]
    plain = [r["name"] for r in rows if r["speculation"] is None]
    spec = [r for r in rows if r["speculation"] is not None]
    # the stock row, then the first row of each policy, each once more with "+lookup" and its counters
    assert [r["name"] for r in spec] == [plain[0] + " +lookup"] + [
        next(n for n in plain if n.startswith(f"edgemoe {p}")) + " +lookup" for p in ("lru", "static")]
    assert all(r["speculation"]["mode"] == "lookup" and r["decode_tps"] > 0 for r in spec)
