"""First-use calibration (edgemoe.calibration.auto): a command that needs calibration data makes it once,
into the per-user cache, completes a per-user one that lacks a stage, and never writes to an explicit or
bundled directory."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from edgemoe.calibration import CARD, CalibrationError, auto, model_sha256
from edgemoe.calibration.auto import STAGES_FOR, auto_corpora, ensure_calibration

from helpers.models import FIXTURE_MODELS, ROOT

QWEN = next(p for p in FIXTURE_MODELS if "qwen3moe" in p.name)


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "cache"
    monkeypatch.setenv("EDGEMOE_CACHE_DIR", str(d))
    return d


@pytest.fixture
def model(tmp_path: Path) -> Path:
    """The qwen3moe fixture under another name: no bundled calibration finds it."""
    p = tmp_path / "uncalibrated-qwen3moe.gguf"
    shutil.copy(QWEN, p)
    return p


def test_first_use_calibrates_once_into_the_user_cache(model: Path, _cache: Path) -> None:
    said: list[str] = []
    path = ensure_calibration(model, STAGES_FOR["static"], "--policy static", n_threads=1, tokens=512, ctx=128,
                              echo=said.append)
    assert path == _cache / "calibration" / model_sha256(model)[:16]
    card = json.loads((path / CARD).read_text())
    assert card["stages"] == ["traces", "router_frequency", "routing"]  # only what static needs
    assert (path / "router_frequency.npz").is_file() and (path / "routing_trace.npz").is_file()
    assert "--policy static needs calibration data" in said[0] and "calibrating it now, once" in said[0]
    assert any(line.startswith("  traces: about ") for line in said)  # the time it takes, without a terminal
    assert said[-1].startswith("calibrated uncalibrated-qwen3moe.gguf in ")
    # the second use finds it and runs nothing
    again: list[str] = []
    assert ensure_calibration(model, STAGES_FOR["static"], "--policy static", echo=again.append) == path
    assert again == []


def test_a_user_calibration_without_the_stage_is_completed(model: Path) -> None:
    path = ensure_calibration(model, STAGES_FOR["dp"], "--alloc dp", n_threads=1, tokens=512, ctx=128,
                              echo=lambda m: None)
    assert "router_frequency" not in json.loads((path / CARD).read_text())["stages"]
    said: list[str] = []
    assert ensure_calibration(model, STAGES_FOR["static"], "--policy static", n_threads=1, echo=said.append) == path
    card = json.loads((path / CARD).read_text())
    assert {"routing", "router_frequency"} <= set(card["stages"]) and card["tokens"] == 512  # its own settings
    assert (path / "routing_trace.npz").is_file() and (path / "router_frequency.npz").is_file()
    assert "without router_frequency" in said[0] and said[-1].startswith("added router_frequency to ")


def test_an_explicit_or_bundled_directory_is_never_written(model: Path, tmp_path: Path) -> None:
    explicit = tmp_path / "mine"
    ensure_calibration(model, STAGES_FOR["dp"], "--alloc dp", n_threads=1, tokens=512, ctx=128,
                       echo=lambda m: None)
    shutil.copytree(_cache_dir(model), explicit)
    before = sorted(p.name for p in explicit.iterdir())
    with pytest.raises(CalibrationError, match=r"--policy static needs the router_frequency calibration, which .*"
                                               r"mine does not have: run `edgemoe calibrate .* --update "
                                               r"--stage router_frequency"):
        ensure_calibration(model, STAGES_FOR["static"], "--policy static", given=explicit)
    assert sorted(p.name for p in explicit.iterdir()) == before
    # a bundled calibration (the fixture's own) has every stage: it is used as it is
    bundled = ensure_calibration(QWEN, STAGES_FOR["static"], "--policy static", echo=pytest.fail)
    assert bundled == ROOT / "calibrations" / QWEN.name.removesuffix(".gguf")


def _cache_dir(model: Path) -> Path:
    from edgemoe.calibration.card import default_out_dir

    return default_out_dir(model)


def test_corpora_fall_back_to_the_bundled_excerpts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert {p.name for p in auto_corpora()} == {"python-docs.txt", "tinyshakespeare.txt"}
    monkeypatch.setenv("EDGEMOE_CORPUS_DIR", str(tmp_path / "nowhere"))
    assert auto_corpora() == tuple(sorted(auto.BUNDLED_TEXT.glob("*.txt")))
    assert all(p.stat().st_size > 30_000 for p in auto_corpora())


def test_cli_static_policy_on_an_uncalibrated_model(model: Path, _cache: Path) -> None:
    """`--policy static` used to fail on a model without calibration; now it calibrates, then reuses it."""
    cmd = [sys.executable, "-m", "edgemoe", "generate", str(model), "-p", "To be", "-n", "4", "--temp", "0",
           "--expert-slots", "8", "--policy", "static", "-t", "1", "--json"]
    env = {**dict(__import__("os").environ), "EDGEMOE_CACHE_DIR": str(_cache)}
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert first.returncode == 0, first.stderr[-800:]
    assert "calibrating it now, once" in first.stderr and "calibrated uncalibrated-qwen3moe.gguf" in first.stderr
    out = json.loads(first.stdout.splitlines()[-1])
    assert out["cache"]["policy"] == "static" and out["cache"]["hits"] > 0
    second = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert second.returncode == 0 and "calibrating" not in second.stderr
    assert json.loads(second.stdout.splitlines()[-1])["tokens"] == out["tokens"]


def test_gating_that_needs_sensitivity_asks_the_same_way(model: Path, tmp_path: Path) -> None:
    from edgemoe.calibration.adaptive import GatingOptions, _need_calibration

    ensure_calibration(model, STAGES_FOR["dp"], "--alloc dp", n_threads=1, tokens=512, ctx=128,
                       echo=lambda m: None)
    explicit = tmp_path / "mine"
    shutil.copytree(_cache_dir(model), explicit)
    opts = GatingOptions(mode="fisher", threshold=0.3, calibration=explicit)
    with pytest.raises(CalibrationError, match=r"`gating='fisher'` needs the sensitivity calibration"):
        _need_calibration(opts, "`gating='fisher'`", model)


def test_cli_asks_for_the_stages_its_options_need(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from edgemoe import placement

    asked: list[tuple[tuple[str, ...], str]] = []

    def fake(model: Path, stages: tuple[str, ...], what: str, **kw: object) -> Path:
        asked.append((tuple(stages), what))
        return Path("/cal")

    monkeypatch.setattr(auto, "ensure_calibration", fake)
    assert placement.calibration_for(model, ("lru",), None, None) is None  # nothing needed, none found
    assert placement.calibration_for(model, ("lru", "static"), None, None) == Path("/cal")
    placement.calibration_for(model, ("promoe",), "dp", None)
    placement.calibration_for(model, ("static", "promoe"), None, None)
    assert asked == [(("router_frequency", "routing"), "`policy='static'`"),
                     (("predictors", "routing"), "`policy='promoe'` and `alloc='dp'`"),
                     (("router_frequency", "routing", "predictors"), "`policy='static'` and `policy='promoe'`")]
