"""Run calibration stages into a directory and write its card.json.

The directory is built as DIR.tmp-<pid> and renamed into place only when every stage has
finished, so an interrupted run never leaves a half-written DIR.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from ..progress import progress_bar
from .card import (
    CARD,
    FORMAT_VERSION,
    Calibration,
    CalibrationError,
    default_out_dir,
    edgemoe_commit,
    model_sha256,
    write_json,
)
from .stages import CorpusText, ProgressFactory, Stage, StageContext, all_stages, select_stages

if TYPE_CHECKING:
    from ..runtime.engine import Engine

log = logging.getLogger(__name__)

DEFAULT_TOKENS = 16384
DEFAULT_CTX = 512


@dataclass(frozen=True)
class CalibrationConfig:
    model: Path
    corpora: tuple[Path, ...]  # corpus files; only their train splits are read
    tokens: int = DEFAULT_TOKENS  # calibration trace budget (tokens, split evenly over the corpora)
    ctx: int = DEFAULT_CTX  # tokens per traced sequence
    seed: int = 0
    n_threads: int = 0  # llama.cpp and torch threads; 0 = default
    stages: tuple[str, ...] | None = None  # None = every registered stage
    options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # per-stage options


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def _building(out: Path, force: bool, *, keep: bool = False) -> Iterator[Path]:
    """Yield a fresh DIR.tmp-<pid> (a copy of DIR when `keep`); on success it replaces DIR, on any
    error it is removed."""
    if out.exists() and not (force or keep):
        raise CalibrationError(
            f"{out} exists: pass `force=True` to replace it (it is replaced only once the new "
            "calibration is complete)"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    for stale in out.parent.glob(f"{out.name}.tmp-*"):  # left by a killed run
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    tmp = out.parent / f"{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    if keep:
        shutil.copytree(out, tmp)
    else:
        tmp.mkdir()
    try:
        yield tmp
        old = out.parent / f"{out.name}.old-{os.getpid()}"
        if out.exists():
            os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _default_engine(cfg: CalibrationConfig) -> Callable[[], AbstractContextManager[Engine]]:
    def open_engine() -> Engine:
        from ..runtime.engine import Engine, LoadConfig

        return Engine(cfg.model, LoadConfig(n_ctx=cfg.ctx, n_threads=cfg.n_threads))

    return open_engine


def _model_entry(model: Path) -> dict[str, Any]:
    from ..gguf.info import read_model_info

    info = read_model_info(model)
    if not info.is_moe:
        raise CalibrationError(f"{model.name} is a dense model: there are no experts to calibrate")
    return {
        "file": model.name,
        "sha256": model_sha256(model),
        "size": info.file_size,
        "architecture": info.architecture,
        "layers": list(info.moe_layers),
        "n_expert": info.n_expert,
        "n_expert_used": info.n_expert_used,
        "n_embd": info.n_embd,
    }


def _corpus_entry(tx: CorpusText) -> dict[str, Any]:
    size = tx.path.stat().st_size
    return {
        "path": str(tx.path),
        "name": tx.path.name,
        "size": size,
        "sha256": hashlib.sha256(tx.path.read_bytes()).hexdigest(),
        "train_bytes": list(tx.byte_range),
        "heldout_bytes": [tx.byte_range[1], size],
    }


def _updated_card(out_dir: Path, fresh: dict[str, Any], stages: Sequence[Stage]) -> dict[str, Any]:
    """The card of an existing calibration, checked against this run, to which `stages` are re-run."""
    card = dict(Calibration.load(out_dir).card)
    same = {
        "model sha256": (card["model"].get("sha256"), fresh["model"]["sha256"]),
        "corpora": (
            [c.get("sha256") for c in card.get("corpus", [])],
            [c["sha256"] for c in fresh["corpus"]],
        ),
        "`tokens`": (card.get("tokens"), fresh["tokens"]),
        "`ctx`": (card.get("ctx"), fresh["ctx"]),
        "`seed`": (card.get("seed"), fresh["seed"]),
    }
    diff = [k for k, (a, b) in same.items() if a != b]
    if diff:
        raise CalibrationError(
            f"`update=True` must run with what made {out_dir}; these differ: {', '.join(diff)} "
            f"(see {out_dir / CARD}: tokens {card.get('tokens')}, ctx {card.get('ctx')}, "
            f"seed {card.get('seed')}, corpora {[c.get('name') for c in card.get('corpus', [])]})"
        )
    names = [s.name for s in stages]
    order = [s.name for s in all_stages()]
    card["stages"] = sorted(
        set(card.get("stages", [])) | set(names), key=lambda n: order.index(n) if n in order else 99
    )
    card["elapsed_s"] = dict(card.get("elapsed_s", {}))
    card.setdefault("updates", []).append(
        {"at": fresh["created"], "stages": names, "edgemoe": fresh["edgemoe"]}
    )
    return card


def run_calibration(
    cfg: CalibrationConfig,
    out: str | os.PathLike[str] | None = None,
    *,
    force: bool = False,
    update: bool = False,
    progress: ProgressFactory = progress_bar,
    open_engine: Callable[[], AbstractContextManager[Engine]] | None = None,
) -> Calibration:
    """Run the selected stages into a temporary directory, write card.json, and move it to `out`
    (default: the per-user cache for this model).

    update: run only the selected stages into the existing `out`, keeping the other stages' files
    and card entries (same model, corpora, tokens, ctx and seed as the card says).
    open_engine: the stages' engine, as a context manager (default: a fresh Engine of context cfg.ctx per stage,
    closed after it; first-use calibration lends open_engine's instead).
    """
    model = Path(cfg.model)
    if not cfg.corpora:
        raise CalibrationError("no corpus: give at least one file in `corpora` (its train split is used)")
    out_dir = Path(out) if out is not None else default_out_dir(model)
    stages = select_stages(cfg.stages)
    texts = tuple(CorpusText.train_split(p) for p in cfg.corpora)
    card: dict[str, Any] = {
        "format": FORMAT_VERSION,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "model": _model_entry(model),
        "corpus": [_corpus_entry(t) for t in texts],
        "tokens": cfg.tokens,
        "ctx": cfg.ctx,
        "seed": cfg.seed,
        "edgemoe": edgemoe_commit(),
        "stages": [s.name for s in stages],
        "elapsed_s": {},
    }
    if update:
        if cfg.stages is None:
            raise CalibrationError("`update=True` needs the stages to run (`stages`)")
        stages = [s for s in stages if s.name in cfg.stages or s.name == "traces"]  # traces: in memory only
        card = _updated_card(out_dir, card, stages)
    artifacts: dict[str, Any] = {}
    with _building(out_dir, force, keep=update) as tmp:
        for st in stages:
            sc = StageContext(
                model=model,
                open_engine=open_engine or _default_engine(cfg),
                texts=texts,
                out_dir=tmp,
                seed=cfg.seed,
                tokens=cfg.tokens,
                ctx=cfg.ctx,
                n_threads=cfg.n_threads,
                progress=progress,
                options=MappingProxyType(dict(cfg.options)),
                card=MappingProxyType(json.loads(json.dumps(card))),
                artifacts=artifacts,
            )
            t0 = time.perf_counter()
            log.info("calibration stage %s", st.name)
            result = st.resolve()(sc)
            card[st.name] = json.loads(json.dumps(dict(result)))  # JSON-clean now, not at the end
            card["elapsed_s"][st.name] = round(time.perf_counter() - t0, 2)
        write_json(tmp / CARD, card)
    return Calibration.load(out_dir)
