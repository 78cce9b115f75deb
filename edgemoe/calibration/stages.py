"""Calibration data of a model: a directory with card.json and the artifacts of pluggable stages.

`edgemoe calibrate` runs the stages in order; each is a function taking a StageContext and
returning a dict that is merged into card.json under the stage's name. Built-in stages:

- ``traces``: record routing traces with gate inputs on the TRAIN split of the corpora
  (never the held-out last 10%), kept in memory for the later stages (not written: they
  are large);
- ``router_frequency``: per-layer expert frequencies (router_frequency.npz), for static placement;
- ``routing``: the routing of part of the traces (routing_trace.npz), for DP cache allocation
  (edgemoe.calibration.slot_alloc);
- ``predictors``: every predictor kind (edgemoe.calibration.predictor_fit), predictors/*.npz.
- ``sensitivity``: per-layer gating sensitivity (edgemoe.calibration.sensitivity).
- ``super_experts``: the experts no rule may drop (edgemoe.calibration.super_experts), super_experts.json.
- ``gating`` (optional: `--stage gating`): each adaptive top-k rule's threshold at 10/25/40% fewer activations
  and within the KL-divergence budget, with what each costs (edgemoe.calibration.gating_stage),
  gating_quality.json and thresholds.json; `edgemoe plan` prints it.

This module holds the stage interface (StageContext, Stage) and the registry; the trace stages
are in edgemoe.calibration.traces, the runner in edgemoe.calibration.run, the card in
edgemoe.calibration.card.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .card import CalibrationError

if TYPE_CHECKING:
    from ..analysis.trace import Trace
    from ..runtime.engine import Engine

ProgressFactory = Callable[
    ..., AbstractContextManager[Callable[[int], None]]
]  # progress_bar(total, desc, unit=...)


@dataclass(frozen=True)
class CorpusText:
    """The train split (first ~90%) of one corpus file; the held-out rest is never read."""

    path: Path
    byte_range: tuple[int, int]  # [start, end) of the train split in the file
    data: bytes = field(repr=False)

    @classmethod
    def train_split(cls, path: str | os.PathLike[str]) -> CorpusText:
        from .corpus import split_corpus

        sp = split_corpus(path)
        with sp.path.open("rb") as f:
            f.seek(sp.train_bytes[0])
            data = f.read(sp.train_bytes[1] - sp.train_bytes[0])
        return cls(path=sp.path, byte_range=sp.train_bytes, data=data)

    def text(self) -> str:
        return self.data.decode("utf-8", errors="replace")


@dataclass(frozen=True)
class StageContext:
    """What a calibration stage gets. Stages write files under out_dir and return their card entry."""

    model: Path
    # the stage's Engine, as a context manager (`with ctx.open_engine() as eng:`): a fresh one closed after the
    # stage, or one lent by first-use calibration (edgemoe.calibration.auto), which stays open
    open_engine: Callable[[], AbstractContextManager[Engine]]
    texts: tuple[CorpusText, ...]  # train splits of the corpora
    out_dir: Path  # the directory being built (renamed into place when all stages are done)
    seed: int
    tokens: int  # token budget of the calibration traces
    ctx: int  # tokens per sequence of the traces
    n_threads: int  # CPU threads (0 = default)
    progress: ProgressFactory  # progress(total, desc, unit=...) -> context manager yielding advance(n)
    options: Mapping[str, Mapping[str, Any]]  # per-stage options, e.g. {"predictors": {"epochs": 10}}
    card: Mapping[str, Any]  # card.json so far: the results of the earlier stages (read-only)
    artifacts: dict[str, Any] = field(default_factory=dict, repr=False)  # objects earlier stages hand on

    def traces(self) -> Trace:
        """The calibration traces recorded by the `traces` stage (kept in memory)."""
        tr = self.artifacts.get("traces")
        if tr is None:
            raise CalibrationError("no calibration traces: the traces stage must run before this one")
        return tr  # type: ignore[no-any-return]


StageFn = Callable[[StageContext], Mapping[str, Any]]


@dataclass(frozen=True)
class Stage:
    name: str  # key of its entry in card.json
    run: str | StageFn  # a function, or "module:function" imported only when the stage runs
    requires: tuple[str, ...] = ()  # stages that must run before it
    optional: bool = False  # run only when asked for by name (a long measurement), not by default

    def resolve(self) -> StageFn:
        if callable(self.run):
            return self.run
        mod, _, fn = self.run.partition(":")
        return getattr(importlib.import_module(mod), fn)  # type: ignore[no-any-return]


BUILTIN_STAGES: tuple[Stage, ...] = (
    Stage("traces", "edgemoe.calibration.traces:traces_stage"),
    Stage("router_frequency", "edgemoe.calibration.traces:router_frequency_stage", requires=("traces",)),
    Stage("routing", "edgemoe.calibration.slot_alloc:routing_stage", requires=("traces",)),
    Stage("predictors", "edgemoe.calibration.predictor_fit:predictors_stage", requires=("traces",)),
    Stage("sensitivity", "edgemoe.calibration.sensitivity:sensitivity_stage"),
    Stage("super_experts", "edgemoe.calibration.super_experts:super_experts_stage"),
    Stage(
        "gating", "edgemoe.calibration.gating_stage:gating_stage", requires=("sensitivity",), optional=True
    ),
)
_registered: list[Stage] = []
_RESERVED = {
    "format",
    "created",
    "model",
    "corpus",
    "tokens",
    "ctx",
    "seed",
    "edgemoe",
    "stages",
    "elapsed_s",
}


def register_stage(stage: Stage) -> None:
    """Add a stage after the built-in ones (and after those registered before it)."""
    if stage.name in _RESERVED or stage.name in {s.name for s in all_stages()}:
        raise CalibrationError(f"a calibration stage or card key named {stage.name!r} already exists")
    _registered.append(stage)


def unregister_stage(name: str) -> None:
    _registered[:] = [s for s in _registered if s.name != name]


def all_stages() -> list[Stage]:
    return [*BUILTIN_STAGES, *_registered]


def select_stages(names: Sequence[str] | None) -> list[Stage]:
    """The stages to run, in registry order, with the stages they require; unknown names fail. None: every stage
    but the optional ones."""
    stages = all_stages()
    by_name = {s.name: s for s in stages}
    if names is None:
        return [s for s in stages if not s.optional]
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise CalibrationError(f"unknown calibration stage(s) {unknown}: use {', '.join(by_name)}")
    want: set[str] = set()

    def add(n: str) -> None:
        if n not in want:
            want.add(n)
            for r in by_name[n].requires:
                add(r)

    for n in names:
        add(n)
    return [s for s in stages if s.name in want]
