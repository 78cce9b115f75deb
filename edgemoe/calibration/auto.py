"""First-use calibration: a command that needs calibration data makes it, once, for a model without.

`--policy static|daop|promoe`, `--alloc dp`, `--gating fisher|empirical` and `--target-reduction`
read stages of a calibration (router_frequency, predictors, routing, sensitivity). When the model has none (no `--calibration`,
nothing bundled, nothing in the per-user cache), `ensure_calibration` runs just the stages needed on
a few thousand tokens of the project's corpora (their train splits; the bundled excerpts in
edgemoe/calibration/text/ where the corpora are absent) into the per-user cache, with a progress
bar, and says what it does and how long it takes. A per-user calibration that lacks a stage gets it
added (`calibrate --update`, with the corpora and settings its card names). An explicit or bundled
directory is never written to: a missing stage there is an error that says how to add it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING

from ..progress import progress_bar
from .card import Calibration, CalibrationError, default_out_dir, find_calibration
from .corpus import default_corpus_dir
from .run import CalibrationConfig, run_calibration
from .stages import ProgressFactory

if TYPE_CHECKING:
    from ..runtime.engine import Engine

AUTO_TOKENS = 2048  # calibration trace tokens of a first-use calibration
AUTO_CTX = 256
BUNDLED_TEXT = Path(__file__).resolve().parent / "text"

# what each need reads from a calibration
STAGES_FOR = {
    "static": ("router_frequency", "routing"),
    "dp": ("routing",),
    "sensitivity": ("sensitivity",),
    "predictors": ("predictors",),
}

Echo = Callable[[str], None]


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def auto_corpora() -> tuple[Path, ...]:
    """The project's corpora ($EDGEMOE_CORPUS_DIR or ../shared/corpus), else the bundled excerpts."""
    d = default_corpus_dir()
    files = sorted(d.glob("*.txt")) if d.is_dir() else []
    return tuple(files) or tuple(sorted(BUNDLED_TEXT.glob("*.txt")))


def _timed_progress(echo: Echo) -> ProgressFactory:
    """progress_bar, plus (without a terminal, where no bar is drawn) one line per stage with the time it
    will take, from its first step."""

    @contextlib.contextmanager
    def factory(total: int, desc: str, *, unit: str = "it") -> Iterator[Callable[[int], None]]:
        with progress_bar(total, desc, unit=unit) as bar:
            if sys.stderr.isatty():
                yield bar
                return
            t0, done, told = time.perf_counter(), 0, False

            def advance(n: int) -> None:
                nonlocal done, told
                bar(n)
                done += n
                if not told and done and done < total:
                    told = True
                    left = (time.perf_counter() - t0) / done * (total - done)
                    echo(f"  {desc}: about {left:.0f} s more at this machine's speed")

            yield advance

    return factory


# what each stage leaves in the directory: a directory made by hand (or by an older edgemoe) whose card
# does not list a stage still counts as having it when the file is there
STAGE_FILES = {
    "router_frequency": "router_frequency.npz",
    "routing": "routing_trace.npz",
    "sensitivity": "sensitivity.json",
    "predictors": "predictors",
    "super_experts": "super_experts.json",
}


def _missing(cal: Calibration, stages: Sequence[str]) -> list[str]:
    return [
        s
        for s in stages
        if s not in cal.card and not (s in STAGE_FILES and (cal.path / STAGE_FILES[s]).exists())
    ]


def missing_stages(directory: str | os.PathLike[str] | None, stages: Sequence[str]) -> tuple[str, ...]:
    """The stages of `stages` that the calibration in `directory` lacks: all of them where there is none, or where
    it cannot be read (ensure_calibration then says why)."""
    if directory is None:
        return tuple(stages)
    try:
        return tuple(_missing(Calibration.load(directory), stages))
    except CalibrationError:
        return tuple(stages)


def _engine_for(engine: Engine | None, ctx: int) -> Callable[[], AbstractContextManager[Engine]] | None:
    """The stages' engine: `engine`, lent (not closed after a stage), where its context holds the traces'
    sequences of `ctx` tokens; else None, and each stage opens its own (of context `ctx`)."""
    if engine is None or engine.n_ctx < ctx:
        return None
    return lambda: contextlib.nullcontext(engine)


def _same_dir(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return False


def ensure_calibration(
    model: str | os.PathLike[str],
    stages: Sequence[str],
    what: str,
    *,
    given: str | os.PathLike[str] | None = None,
    n_threads: int = 0,
    tokens: int = AUTO_TOKENS,
    ctx: int = AUTO_CTX,
    echo: Echo = _stderr,
    engine: Engine | None = None,
) -> Path:
    """A calibration directory of `model` holding `stages`, made or completed on first use.

    given: the directory the command was told to use (or found for the model); it is completed only
    when it is the model's per-user cache directory. `what` names the option that needs it (messages).
    tokens, ctx: of a new calibration's traces (an existing one is completed with its own).
    engine: an open Engine of `model` to run the stages on (open_engine's), where its context holds the traces'
    sequences; it is left reset, with no policy. Else (None, or a shorter context) each stage opens its own.
    """
    model = Path(model)
    cache = default_out_dir(model)
    cal: Calibration | None
    if given is not None:
        cal = Calibration.load(given, "cache" if _same_dir(Path(given), cache) else "explicit")
        cal.check_model(model)
    else:
        try:
            cal = find_calibration(model)
        except CalibrationError:
            cal = None
    if cal is not None:
        missing = _missing(cal, stages)
        if not missing:
            return cal.path
        if cal.source != "cache":
            stage_args = " ".join(f"--stage {s}" for s in missing)
            raise CalibrationError(
                f"{what} needs the {', '.join(missing)} calibration, which {cal.path} does not "
                f"have: run `edgemoe calibrate {model} --corpus FILE --out DIR` (or, with "
                f"the corpora its card names, `edgemoe calibrate {model} --out {cal.path} --update {stage_args}`) "
                "and pass its directory as `calibration`"
            )
        return _complete(model, cal, missing, what, n_threads, echo, engine)
    cfg = CalibrationConfig(
        model=model, corpora=auto_corpora(), tokens=tokens, ctx=ctx, n_threads=n_threads, stages=tuple(stages)
    )
    _announce(model, what, cfg, cache, echo, "has no calibration data yet")
    t0 = time.perf_counter()
    path = _run(cfg, cache, echo, engine).path
    echo(f"calibrated {model.name} in {time.perf_counter() - t0:.0f} s; later runs reuse {path}")
    return path


def _run(
    cfg: CalibrationConfig, out: Path, echo: Echo, engine: Engine | None, update: bool = False
) -> Calibration:
    lent = _engine_for(engine, cfg.ctx)
    try:
        return run_calibration(cfg, out, update=update, progress=_timed_progress(echo), open_engine=lent)
    finally:
        if lent is not None and engine is not None:
            engine.reset()  # the traces' last sequence is not the caller's


def _complete(
    model: Path,
    cal: Calibration,
    missing: list[str],
    what: str,
    n_threads: int,
    echo: Echo,
    engine: Engine | None = None,
) -> Path:
    card = cal.card
    corpora = tuple(Path(c["path"]) for c in card.get("corpus", []))
    absent = [str(p) for p in corpora if not p.is_file()]
    if absent or not corpora:
        raise CalibrationError(
            f"{what} needs the {', '.join(missing)} calibration; {cal.path} lacks it and its "
            f"corpora are gone ({', '.join(absent) or 'none named'}): run `edgemoe calibrate "
            f"{model} --corpus FILE --force`"
        )
    cfg = CalibrationConfig(
        model=model,
        corpora=corpora,
        tokens=int(card["tokens"]),
        ctx=int(card["ctx"]),
        seed=int(card["seed"]),
        n_threads=n_threads,
        stages=tuple(missing),
    )
    _announce(model, what, cfg, cal.path, echo, f"has a calibration without {', '.join(missing)}")
    t0 = time.perf_counter()
    path = _run(cfg, cal.path, echo, engine, update=True).path
    echo(f"added {', '.join(missing)} to {path} in {time.perf_counter() - t0:.0f} s")
    return path


def _announce(model: Path, what: str, cfg: CalibrationConfig, out: Path, echo: Echo, state: str) -> None:
    names = ", ".join(p.name for p in cfg.corpora)
    echo(
        f"{what} needs calibration data and {model.name} {state}: calibrating it now, once "
        f"(stages {', '.join(cfg.stages or ())}; {cfg.tokens} tokens of the train splits of {names}), "
        f"into {out}; each stage shows the time it has left. `edgemoe calibrate` does the same with "
        "more options"
    )
