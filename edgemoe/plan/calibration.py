"""What a cache request reads from a calibration (its policy's stages, its options', dp's routing trace) and
which of those stages the model's calibration lacks: decided by the plan, made by edgemoe.placement on the engine
it opens (first-use calibration)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..calibration import auto
from ..calibration.adaptive import default_calibration_dir
from ..policies.registry import policy_spec
from .request import CacheRequest


@dataclass(frozen=True)
class CalibrationNeed:
    """What the request's policy and allocation read from a calibration, and what the model's lacks."""

    what: str  # the options that need it, for messages ("--policy static and --alloc dp"); "" when none
    stages: tuple[str, ...]  # every stage they read
    missing: tuple[str, ...]  # the stages the calibration directory does not have (all, when there is none)
    directory: Path | None  # the directory given, else the model's (None: it has none yet)


NO_NEED = CalibrationNeed(what="", stages=(), missing=(), directory=None)


def calibration_needs(
    policies: tuple[str, ...], alloc: str | None, also: tuple[tuple[str, tuple[str, ...]], ...] = ()
) -> tuple[str, tuple[str, ...]]:
    """What the policies (their specs' stages), the options in `also` ((option, stages): a record's
    extra_calibration, e.g. dali's prefetcher) and the allocation (dp: a routing trace) read from a calibration:
    the options that need it, for messages, and the stages. ("", ()) when nothing is needed."""
    needs = [(f"`policy={p!r}`", policy_spec(p).stages) for p in policies if policy_spec(p).stages]
    needs += list(also)
    needs += [("`alloc='dp'`", auto.STAGES_FOR["dp"])] if alloc == "dp" else []
    stages = tuple(dict.fromkeys(s for _, ss in needs for s in ss))
    return " and ".join(w for w, _ in needs), stages


def calibration_need(model: Path, req: CacheRequest, given: Path | None) -> CalibrationNeed:
    """The request's need, against `given` (a calibration directory) or else the model's."""
    also = tuple(x for x in (req.config.extra_calibration(),) if x is not None)
    what, stages = calibration_needs((req.policy,), req.alloc, also)
    directory = given or default_calibration_dir(model)
    missing = auto.missing_stages(directory, stages) if stages else ()
    return CalibrationNeed(what=what, stages=stages, missing=missing, directory=directory)
