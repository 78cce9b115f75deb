"""Trace recording, the .npz format round trip, and the trace / verify CLI."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from edgemoe.analysis.trace import DECODE, PREFILL, Trace, record_trace
from edgemoe.cli import cli
from edgemoe.errors import EdgeMoeError
from edgemoe.runtime.engine import Engine, LoadConfig

from helpers.models import FIXTURE_MODELS

MODEL = FIXTURE_MODELS[-1]  # the qwen3moe fixture
TEXT = ("ROMEO:\nBut soft, what light through yonder window breaks?\nIt is the east, and Juliet is the sun.\n"
        "The list type is a mutable sequence; append() adds an item to the end. ") * 4


def _trace(mode: str, **kw) -> Trace:  # type: ignore[no-untyped-def]
    with Engine(MODEL, LoadConfig(n_ctx=64, n_batch=32, n_ubatch=16)) as eng:
        toks = eng.tokenize(TEXT)[:150]
        return record_trace(eng, toks, ctx=64, mode=mode, prefill_tokens=8, **kw)


def test_prefill_trace_shapes_and_chunks() -> None:
    tr = _trace("prefill", probs=True, gate_inputs=True)
    T, L, k = tr.ids.shape
    assert T == 150 and L == 8 and k == 4
    assert tr.weights.shape == (T, L, k) and tr.probs.shape == (T, L, 32) and tr.gate_inputs.shape == (T, L, 256)
    assert tr.gate_inputs.dtype == np.float16
    assert (tr.phase == PREFILL).all()
    assert list(np.bincount(tr.seq)) == [64, 64, 22]  # chunks of ctx tokens, one fresh sequence each
    np.testing.assert_allclose(tr.weights.sum(-1), 1.0, rtol=1e-5)
    assert ((tr.ids >= 0) & (tr.ids < 32)).all()


def test_decode_trace_matches_prefill_routing() -> None:
    pre, dec = _trace("prefill"), _trace("decode")
    assert (dec.phase[dec.seq == 0][:8] == PREFILL).all() and (dec.phase[dec.seq == 0][8:] == DECODE).all()
    assert np.array_equal(pre.tokens, dec.tokens)
    # the same tokens at the same positions route (almost always) to the same experts, however batched
    same = (np.sort(pre.ids, -1) == np.sort(dec.ids, -1)).all(-1).mean()
    assert same > 0.98


def test_round_trip(tmp_path: Path) -> None:
    tr = _trace("prefill", probs=True, gate_inputs=True)
    tr.meta["note"] = "x"
    back = Trace.load(tr.save(tmp_path / "t.npz"))
    for name in ("tokens", "layers", "ids", "weights", "phase", "seq", "probs", "gate_inputs"):
        a, b = getattr(tr, name), getattr(back, name)
        assert a.dtype == b.dtype and np.array_equal(a, b), name
    assert back.meta["note"] == "x" and back.meta["format"] == 1 and back.meta["n_expert"] == 32


def test_interrupted_save_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tr = _trace("prefill")

    def boom(*a, **k):  # type: ignore[no-untyped-def]
        raise KeyboardInterrupt

    monkeypatch.setattr(np, "savez_compressed", boom)
    with pytest.raises(KeyboardInterrupt):
        tr.save(tmp_path / "t.npz")
    assert list(tmp_path.iterdir()) == []


def test_load_rejects_other_files(tmp_path: Path) -> None:
    p = tmp_path / "x.npz"
    np.savez(p, a=np.zeros(3))
    with pytest.raises(EdgeMoeError, match="not an edgemoe trace"):
        Trace.load(p)
    (tmp_path / "y.npz").write_text("nope")
    with pytest.raises(EdgeMoeError, match="cannot read trace"):
        Trace.load(tmp_path / "y.npz")


def test_trace_cli(tmp_path: Path) -> None:
    inp = tmp_path / "in.txt"
    inp.write_text(TEXT)
    out = tmp_path / "t.npz"
    res = CliRunner().invoke(cli, ["trace", str(MODEL), "--input", str(inp), "--out", str(out), "--max-tokens",
                                   "100", "--ctx", "64", "--mode", "decode", "--gate-inputs"],
                             catch_exceptions=False)
    assert res.exit_code == 0, res.output
    tr = Trace.load(out)
    assert tr.n_tokens == 100 and tr.gate_inputs is not None and tr.meta["mode"] == "decode"
    assert list(np.bincount(tr.seq)) == [64, 36]  # chunks of --ctx tokens (llama.cpp rounds n_ctx up)


def test_trace_cli_heldout_reads_only_the_last_tenth(tmp_path: Path) -> None:
    inp = tmp_path / "in.txt"
    inp.write_text("alpha beta gamma\n" * 90 + "ROMEO: wherefore\n" * 10)
    out = tmp_path / "t.npz"
    res = CliRunner().invoke(cli, ["trace", str(MODEL), "--input", str(inp), "--heldout", "--out", str(out),
                                   "--ctx", "64"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    tr = Trace.load(out)
    assert tr.meta["heldout"] is True
    with Engine(MODEL, LoadConfig(n_ctx=64)) as eng:
        want = eng.tokenize("ROMEO: wherefore\n" * 10)
    assert tr.tokens.tolist() == want[:tr.n_tokens]


@pytest.mark.parametrize("model", FIXTURE_MODELS, ids=lambda p: p.name.split(".")[0])
def test_verify_cli(model: Path) -> None:
    res = CliRunner().invoke(cli, ["verify", str(model), "--json"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)
    assert d["ok"] and [c["name"] for c in d["checks"]] == ["identity", "drop-last", "swap"]


def test_verify_cli_fails_when_a_check_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    import edgemoe.analysis.verify as v

    monkeypatch.setattr(v, "check_swap", lambda *a, **k: v.CheckResult("swap", False, "forced failure"))
    res = CliRunner().invoke(cli, ["verify", str(MODEL)])
    assert res.exit_code == 1
    assert "FAIL  swap" in res.output and "PASS  identity" in res.output
