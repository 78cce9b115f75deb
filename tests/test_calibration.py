"""Calibration directories: hashing, lookup order, pluggable stages, atomic writes, the bundled fixture
calibrations, and `edgemoe calibrate` / `edgemoe predict-eval` end to end on a tiny budget."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from edgemoe.calibration import (
    CARD,
    Calibration,
    CalibrationConfig,
    CalibrationError,
    Stage,
    StageContext,
    find_calibration,
    model_sha256,
    register_stage,
    run_calibration,
    select_stages,
    unregister_stage,
)
from edgemoe.calibration import card as cal_mod
from edgemoe.calibration.corpus import default_corpus_dir, split_corpus
from edgemoe.cli import cli

from helpers.models import FIXTURE_MODELS, ROOT

QWEN = next(p for p in FIXTURE_MODELS if "qwen3moe" in p.name)
CORPORA = [default_corpus_dir() / "tinyshakespeare.txt", default_corpus_dir() / "python-docs.txt"]


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own per-user cache (never ~/.cache)."""
    d = tmp_path / "cache"
    monkeypatch.setenv("EDGEMOE_CACHE_DIR", str(d))
    return d


def _fake_card(model: Path, **model_over: Any) -> dict[str, Any]:
    from edgemoe.gguf.info import read_model_info

    info = read_model_info(model)
    m = {"file": model.name, "sha256": model_sha256(model), "layers": list(info.moe_layers),
         "n_expert": info.n_expert, "n_expert_used": info.n_expert_used, "n_embd": info.n_embd, **model_over}
    return {"format": cal_mod.FORMAT_VERSION, "model": m}


def _write_cal(d: Path, card: dict[str, Any]) -> Path:
    d.mkdir(parents=True)
    (d / CARD).write_text(json.dumps(card))
    return d


# -- hashing and lookup ---------------------------------------------------------------------------------
def test_model_hash_is_sha256_and_cached_by_path_size_mtime(tmp_path: Path, _cache: Path) -> None:
    f = tmp_path / "m.gguf"
    f.write_bytes(b"x" * (5 << 20))  # more than one 4 MiB chunk
    assert model_sha256(f) == hashlib.sha256(f.read_bytes()).hexdigest()
    index = json.loads((_cache / "hashes.json").read_text())
    index[str(f.resolve())]["sha256"] = "cached"
    (_cache / "hashes.json").write_text(json.dumps(index))
    assert model_sha256(f) == "cached"  # not re-read
    os.utime(f, ns=(1, 1))  # another mtime: hashed again
    assert model_sha256(f) == hashlib.sha256(f.read_bytes()).hexdigest()


def test_lookup_order_explicit_bundled_cache(tmp_path: Path, _cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cal_mod, "BUNDLED_DIR", tmp_path / "bundled")
    with pytest.raises(CalibrationError, match="edgemoe calibrate"):
        find_calibration(QWEN)
    cached = _write_cal(_cache / "calibration" / model_sha256(QWEN)[:16], _fake_card(QWEN))
    assert find_calibration(QWEN).source == "cache" and find_calibration(QWEN).path == cached
    stem = QWEN.name[:-len(".gguf")]
    bundled = _write_cal(tmp_path / "bundled" / stem, _fake_card(QWEN))
    assert find_calibration(QWEN).path == bundled and find_calibration(QWEN).source == "bundled"
    explicit = _write_cal(tmp_path / "mine", _fake_card(QWEN))
    assert find_calibration(QWEN, explicit).path == explicit
    # a bundled directory for another file of the same name is skipped
    (bundled / CARD).write_text(json.dumps(_fake_card(QWEN, sha256="0" * 64)))
    assert find_calibration(QWEN).source == "cache"


def test_explicit_calibration_of_another_model_fails(tmp_path: Path) -> None:
    d = _write_cal(tmp_path / "c", _fake_card(QWEN, n_expert=8))
    with pytest.raises(CalibrationError, match="another model.*n_expert 8 != 32"):
        find_calibration(QWEN, d)
    with pytest.raises(CalibrationError, match="not a calibration directory"):
        Calibration.load(tmp_path)
    (d / CARD).write_text(json.dumps({"format": 99}))
    with pytest.raises(CalibrationError, match="format 99"):
        Calibration.load(d)


# -- stages and atomic writes ---------------------------------------------------------------------------
def test_select_stages_adds_requirements_and_rejects_unknown() -> None:
    assert [s.name for s in select_stages(["predictors"])] == ["traces", "predictors"]
    names = [s.name for s in select_stages(None)]
    assert names[:4] == ["traces", "router_frequency", "routing", "predictors"]
    assert [s.name for s in select_stages(["sensitivity"])] == ["sensitivity"]  # needs no traces
    with pytest.raises(CalibrationError, match="unknown calibration stage.*nonsense"):
        select_stages(["nonsense"])
    with pytest.raises(CalibrationError, match="already exists"):
        register_stage(Stage("model", lambda ctx: {}))


def _cfg(**kw: Any) -> CalibrationConfig:
    return CalibrationConfig(model=QWEN, corpora=tuple(CORPORA[:1]), **kw)


def test_a_registered_stage_runs_and_lands_in_the_card(tmp_path: Path) -> None:
    seen: dict[str, Any] = {}

    def stage(ctx: StageContext) -> dict[str, Any]:
        seen["out"], seen["texts"] = ctx.out_dir, ctx.texts
        (ctx.out_dir / "extra.npy").write_bytes(b"1")
        with pytest.raises(CalibrationError, match="traces stage must run"):
            ctx.traces()
        return {"answer": 42, "seed": ctx.seed}

    register_stage(Stage("extra", stage))
    try:
        cal = run_calibration(_cfg(stages=("extra",), seed=7), tmp_path / "out")
    finally:
        unregister_stage("extra")
    assert cal.card["extra"] == {"answer": 42, "seed": 7} and cal.card["stages"] == ["extra"]
    assert (tmp_path / "out" / "extra.npy").is_file() and seen["out"].name.startswith("out.tmp-")
    tx = seen["texts"][0]
    assert tx.byte_range == split_corpus(CORPORA[0]).train_bytes and len(tx.data) == tx.byte_range[1]
    assert cal.card["corpus"][0]["heldout_bytes"][0] == tx.byte_range[1]
    assert cal.card["model"]["sha256"] == model_sha256(QWEN) and "commit" in cal.card["edgemoe"]


def test_a_failing_stage_leaves_nothing_and_keeps_the_old_directory(tmp_path: Path) -> None:
    def boom(ctx: StageContext) -> dict[str, Any]:
        (ctx.out_dir / "half.npz").write_bytes(b"partial")
        raise RuntimeError("interrupted")

    register_stage(Stage("boom", boom))
    work = tmp_path / "work"
    work.mkdir()
    try:
        with pytest.raises(RuntimeError):
            run_calibration(_cfg(stages=("boom",)), work / "out")
        assert list(work.iterdir()) == []
        old = _write_cal(work / "out", {"format": 1, "old": True})
        with pytest.raises(CalibrationError, match=r"`force=True`"):
            run_calibration(_cfg(stages=("boom",)), old)
        with pytest.raises(RuntimeError):
            run_calibration(_cfg(stages=("boom",)), old, force=True)
        assert json.loads((old / CARD).read_text())["old"] and sorted(p.name for p in work.iterdir()) == ["out"]
    finally:
        unregister_stage("boom")


def test_update_reruns_only_the_given_stages(tmp_path: Path) -> None:
    calls: list[str] = []
    register_stage(Stage("one", lambda ctx: calls.append("one") or {"v": 1}))
    register_stage(Stage("two", lambda ctx: calls.append("two") or {"v": len(calls)}))
    try:
        out = tmp_path / "out"
        run_calibration(_cfg(stages=("one", "two")), out)
        (out / "kept.npz").write_bytes(b"1")
        cal = run_calibration(_cfg(stages=("two",)), out, update=True)
        assert calls == ["one", "two", "two"] and cal.card["two"] == {"v": 3} and cal.card["one"] == {"v": 1}
        assert (out / "kept.npz").is_file() and cal.card["stages"] == ["one", "two"]
        assert cal.card["updates"][0]["stages"] == ["two"]
        with pytest.raises(CalibrationError, match="`tokens`"):
            run_calibration(_cfg(stages=("two",), tokens=99), out, update=True)
    finally:
        unregister_stage("one")
        unregister_stage("two")


def test_stale_temporary_directories_of_dead_runs_are_removed(tmp_path: Path) -> None:
    stale = tmp_path / "out.tmp-999999999"
    stale.mkdir()
    register_stage(Stage("noop", lambda ctx: {}))
    try:
        run_calibration(_cfg(stages=("noop",)), tmp_path / "out")
    finally:
        unregister_stage("noop")
    assert not stale.exists() and (tmp_path / "out" / CARD).is_file()


# -- end to end on a fixture ------------------------------------------------------------------------------
@pytest.mark.long  # the whole calibration through the CLI: minutes on 2 cores (`make test-long`)
def test_calibrate_and_predict_eval_cli(tmp_path: Path, _cache: Path) -> None:
    runner = CliRunner()
    args = ["calibrate", str(QWEN), "--tokens", "2048", "--ctx", "128", "--epochs", "2", "-t", "1"]
    for c in CORPORA:
        args += ["--corpus", str(c)]
    r = runner.invoke(cli, args, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    out = _cache / "calibration" / model_sha256(QWEN)[:16]  # the default --out: the per-user cache
    card = json.loads((out / CARD).read_text())
    # every stage but the optional ones (gating)
    assert card["stages"] == ["traces", "router_frequency", "routing", "predictors", "sensitivity", "super_experts"]
    assert card["super_experts"]["protected"] == [] and (out / "super_experts.json").is_file()
    assert (out / "sensitivity.json").is_file() and (out / "gating_validation_tokens.npy").is_file()
    assert card["sensitivity"]["validation_tokens"] > 0 and len(card["sensitivity"]["empirical"]) == 8
    assert card["traces"]["tokens"] == 2048 and card["traces"]["mode"] == "decode"
    for c, corpus in zip(CORPORA, card["corpus"], strict=False):  # never a byte of the held-out split
        ranges = card["traces"]["ranges"][str(c)]
        assert ranges and all(0 <= s < e <= corpus["train_bytes"][1] for s, e in ranges)
    assert set(card["predictors"]["validation"]) >= {"mlp", "gate", "residual", "first-layer", "prev-token",
                                                     "token-id"}
    assert (out / "router_frequency.npz").is_file() and (out / "predictors" / "mlp-d2.npz").is_file()
    assert card["routing"]["tokens"] == 2048 and (out / "routing_trace.npz").is_file()
    assert "validation" in r.output and "mlp" in r.output

    # predict-eval finds it in the cache (the bundled fixture directory is skipped only if absent or stale)
    r = runner.invoke(cli, ["predict-eval", str(QWEN), "--calibration", str(out), "--input", str(CORPORA[1]),
                            "--heldout", "--max-tokens", "512", "--ctx", "128", "-t", "1", "--json"],
                      catch_exceptions=False)
    assert r.exit_code == 0, r.output
    js = json.loads(r.stdout)
    assert set(js) == {"mlp", "gate", "residual", "first-layer", "prev-token", "token-id", "random"}
    assert set(js["mlp"]) == {"d1", "d2"} and len(js["mlp"]["d2"]["per_layer"]["recall"]) == 8
    assert js["first-layer"]["d1"]["layers"] == [0] and js["gate"]["d2"]["layers"] == list(range(2, 8))
    assert js["gate"]["d1"]["recall"] > js["random"]["d1"]["recall"]

    r = runner.invoke(cli, ["calibrate", str(QWEN), "--corpus", str(CORPORA[0]), "--out", str(out)])
    assert r.exit_code != 0 and "--force" in r.output
    r = runner.invoke(cli, ["predict-eval", str(QWEN), "--calibration", str(out), "--input", str(CORPORA[0]),
                            "--kind", "lstm"])
    assert r.exit_code != 0 and "unknown predictor kind 'lstm'" in r.output


# -- the committed calibrations of the fixtures --------------------------------------------------------
@pytest.mark.parametrize("model", FIXTURE_MODELS, ids=lambda p: p.name.split(".")[0])
def test_bundled_fixture_calibrations(model: Path) -> None:
    cal = find_calibration(model)
    assert cal.source == "bundled" and cal.path == ROOT / "calibrations" / model.name[:-len(".gguf")]
    size = sum(p.stat().st_size for p in cal.path.rglob("*") if p.is_file())
    assert size < 2.2e6, f"{cal.path} is {size} bytes"
    card = cal.card
    assert sorted(Path(c["path"]).name for c in card["corpus"]) == ["python-docs.txt", "tinyshakespeare.txt"]
    for c in card["corpus"]:
        assert all(e <= c["train_bytes"][1] for _, e in card["traces"]["ranges"][c["path"]])
    preds = cal.predictors(model)
    assert {p.kind.value for p in preds} == set(card["predictors"]["validation"])
    v = card["predictors"]["validation"]
    assert v["mlp"]["d2"]["recall"] > v["gate"]["d2"]["recall"]
