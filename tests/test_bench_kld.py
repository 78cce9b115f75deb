"""`bench --kld BASE`: each row that changes the output gets its KL divergence and same-top rate beside its speed."""
from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from edgemoe.cli import cli
from edgemoe.perf.bench.kld_column import changes_output, kld_cells
from edgemoe.runtime.config import LoadConfig

from helpers.models import FIXTURE_MODELS

MODEL = FIXTURE_MODELS[0]


def test_which_rows_change_the_output() -> None:
    f16, q8 = LoadConfig(), LoadConfig(cache_type_k="q8_0", cache_type_v="q8_0", flash_attn="on")
    assert changes_output("edgemoe static +precalc 5", f16)
    assert changes_output("edgemoe lru +gating ser", f16) and changes_output("edgemoe lru +degrade 0.5", f16)
    assert not changes_output("edgemoe static", f16) and not changes_output("stock -ot exps=CPU", f16)
    assert changes_output("stock -ot exps=CPU", q8)  # a quantized KV cache changes every row
    assert kld_cells(None) == ("-", "-") and kld_cells({"mean_kld": 0.01234, "same_top": 0.9712}) == ("0.0123", "97.1%")


def _bench(*extra: str) -> dict[str, dict]:
    args = ["bench", str(MODEL), "--vram", "520MiB", "--prompt-tokens", "32", "--gen-tokens", "8", "-t", "2",
            "--policy", "static", "--alloc", "equal", "--profile", "none", *extra]
    res = CliRunner().invoke(cli, [*args, "--json"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return {r["name"]: r for r in json.loads(res.stdout[res.stdout.index("{"):])["rows"]}


def test_bench_kld_column(tmp_path: Path) -> None:
    text = tmp_path / "t.txt"
    text.write_text("ROMEO:\nBut soft, what light through yonder window breaks? It is the east.\n" * 40)
    base = tmp_path / "base.kld"
    r = CliRunner().invoke(cli, ["perplexity", str(MODEL), "--input", str(text), "--ctx", "128", "--max-tokens", "256",
                                 "--prompt-tokens", "32", "-t", "2", "--kl-divergence-base", str(base)])
    assert r.exit_code == 0, r.output
    args = ["bench", str(MODEL), "--vram", "520MiB", "--prompt-tokens", "32", "--gen-tokens", "8", "-t", "2",
            "--policy", "static", "--alloc", "equal", "--profile", "none", "--precalc-from", "5", "--kld", str(base)]
    table = CliRunner().invoke(cli, args, catch_exceptions=False).stdout
    head, pc_line = (next(ln for ln in table.splitlines() if ln.startswith(s)) for s in ("configuration",
                                                                                          "edgemoe static +precalc"))
    assert "KLD same top" in " ".join(head.split()) and "%" in pc_line
    rows = _bench("--precalc-from", "5", "--kld", str(base))
    pc = rows["edgemoe static +precalc 5"]["kld"]
    assert pc is not None and pc["mean_kld"] > 0 and pc["tokens"] == 2 * (128 - 1 - 32)
    assert rows["edgemoe static"]["kld"] is None and rows["stock -ot exps=CPU"]["kld"] is None
    rows = _bench("-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on", "--kld", str(base))
    stock, cached = rows["stock -ot exps=CPU"]["kld"], rows["edgemoe static"]["kld"]
    assert stock is not None and stock["mean_kld"] > 0 and stock["same_top"] > 0.9
    # the cache's experts run from plain buffers, stock's from repacked ones (other kernels, last bits apart): about
    # the same divergence, which the KV cache's type makes
    assert cached is not None and abs(cached["mean_kld"] / stock["mean_kld"] - 1) < 0.2
