"""Calibration data of a model: a directory with card.json and the artifacts of pluggable stages.

`edgemoe calibrate` runs the stages in order; each is a function taking a StageContext and
returning a dict that is merged into card.json under the stage's name. Built-in stages:

- ``traces``: record routing traces with gate inputs on the TRAIN split of the corpora
  (never the held-out last 10%), kept in memory for the later stages (not written: they
  are large);
- ``router_frequency``: per-layer expert frequencies (router_frequency.npz), for static placement;
- ``predictors``: every predictor kind (edgemoe.predictors.fit), predictors/*.npz.

The directory is built as DIR.tmp-<pid> and renamed into place only when every stage has
finished, so an interrupted run never leaves a half-written DIR. Lookup for a model
(find_calibration): an explicit --calibration DIR, then the bundled ``predictors/<gguf stem>/``
of this repository (fixtures), then the per-user cache
``~/.cache/edgemoe/calibration/<model sha256[:16]>/`` (where `calibrate` writes by default).
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import importlib
import json
import logging
import math
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import numpy as np

from . import __version__
from .errors import EdgeMoeError
from .progress import progress_bar

if TYPE_CHECKING:
    from .engine import Engine
    from .predictors import Predictor
    from .trace import Trace

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
CARD = "card.json"
REPO_ROOT = Path(__file__).resolve().parents[1]
BUNDLED_DIR = REPO_ROOT / "predictors"  # committed calibrations of the fixture models
TRACE_MODE = "decode"
TRACE_PREFILL_FRACTION = 0.75  # of each chunk prefilled; the rest decoded one token per step
DEFAULT_TOKENS = 16384
DEFAULT_CTX = 512

ProgressFactory = Callable[..., AbstractContextManager[Callable[[int], None]]]  # progress_bar(total, desc, unit=...)


class CalibrationError(EdgeMoeError):
    """Calibration data is missing, incomplete, for another model, or cannot be written."""


# -- where calibration data lives ------------------------------------------------------------
def cache_dir() -> Path:
    """EDGEMOE_CACHE_DIR, else $XDG_CACHE_HOME/edgemoe, else ~/.cache/edgemoe."""
    env = os.environ.get("EDGEMOE_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "edgemoe"


def model_sha256(path: str | os.PathLike[str]) -> str:
    """sha256 of a model file, read in 4 MiB chunks; remembered per (path, size, mtime) in the cache."""
    p = Path(path).resolve()
    st = p.stat()
    key = str(p)
    index_path = cache_dir() / "hashes.json"
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError):
        index = {}
    hit = index.get(key)
    if isinstance(hit, dict) and hit.get("size") == st.st_size and hit.get("mtime_ns") == st.st_mtime_ns:
        return str(hit["sha256"])
    h = hashlib.sha256()
    with p.open("rb") as f:
        for block in iter(lambda: f.read(4 << 20), b""):
            h.update(block)
    digest = h.hexdigest()
    index[key] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
    with contextlib.suppress(OSError):  # a read-only cache only costs a re-hash next time
        write_json(index_path, index)
    return digest


def default_out_dir(model: str | os.PathLike[str]) -> Path:
    """The per-user cache directory for this model file's calibration."""
    return cache_dir() / "calibration" / model_sha256(model)[:16]


def bundled_dir(model: str | os.PathLike[str]) -> Path:
    """predictors/<gguf file stem>/ in this repository (committed for the fixture models)."""
    name = Path(model).name
    return BUNDLED_DIR / (name.removesuffix(".gguf"))


_SCALAR_LIST = re.compile(r"\[\s*([^\[\]{}]*?)\s*\]", re.DOTALL)


def dumps(obj: Any) -> str:
    """Indented JSON with lists of numbers/strings kept on one line (per-layer arrays, byte ranges)."""
    text = json.dumps(obj, indent=1)
    return _SCALAR_LIST.sub(lambda m: "[" + re.sub(r"\s*\n\s*", " ", m.group(1)) + "]", text)


def write_json(path: Path, obj: Any) -> None:
    """Write JSON atomically (a temp file renamed into place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(dumps(obj) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def edgemoe_commit() -> dict[str, Any]:
    """The git commit of this edgemoe checkout (None when not run from one) and whether it is dirty."""
    if not (REPO_ROOT / ".git").exists():
        return {"version": __version__, "commit": None, "dirty": None}
    try:
        head = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip() != ""
    except (OSError, subprocess.SubprocessError):
        return {"version": __version__, "commit": None, "dirty": None}
    return {"version": __version__, "commit": head, "dirty": dirty}


# -- a calibration directory -------------------------------------------------------------------
@dataclass(frozen=True)
class Calibration:
    path: Path
    card: Mapping[str, Any]
    source: str = "explicit"  # explicit | bundled | cache

    @classmethod
    def load(cls, path: str | os.PathLike[str], source: str = "explicit") -> Calibration:
        p = Path(path)
        try:
            card = json.loads((p / CARD).read_text())
        except FileNotFoundError:
            raise CalibrationError(f"{p} is not a calibration directory (no {CARD}): run "
                                   "`edgemoe calibrate MODEL --corpus FILE --out DIR`") from None
        except (OSError, ValueError) as err:
            raise CalibrationError(f"cannot read {p / CARD}: {err}; run `edgemoe calibrate` again") from err
        if card.get("format") != FORMAT_VERSION:
            raise CalibrationError(f"{p / CARD} has format {card.get('format')}, this edgemoe reads "
                                   f"{FORMAT_VERSION}: run `edgemoe calibrate` again")
        return cls(path=p, card=card, source=source)

    def stage(self, name: str) -> Mapping[str, Any]:
        if name not in self.card:
            raise CalibrationError(f"{self.path} has no {name!r} calibration (stages: {self.card.get('stages')}); "
                                   f"run `edgemoe calibrate` with the {name} stage")
        return self.card[name]  # type: ignore[no-any-return]

    def check_model(self, model: str | os.PathLike[str]) -> None:
        """Raise when the card's model has another shape; warn when only the file differs."""
        from .gguf_info import read_model_info

        info = read_model_info(Path(model))
        m = self.card.get("model", {})
        want = {"layers": list(info.moe_layers), "n_expert": info.n_expert, "n_expert_used": info.n_expert_used,
                "n_embd": info.n_embd}
        diff = {k: (m.get(k), v) for k, v in want.items() if m.get(k) != v}
        if diff:
            raise CalibrationError(f"{self.path} was calibrated for another model ({m.get('file')}): "
                                   f"{', '.join(f'{k} {a} != {b}' for k, (a, b) in diff.items())}; "
                                   f"run `edgemoe calibrate {model}`")
        if m.get("sha256") != model_sha256(model):
            log.warning("%s was calibrated on %s (another file with the same shape); predictions may be off",
                        self.path, m.get("file"))

    def predictors(self, model: str | os.PathLike[str], *, kinds: Sequence[str] | None = None,
                   distances: Sequence[int] | None = None) -> list[Predictor]:
        from .predictors import load_predictors, spec_for_model

        entries = self.stage("predictors").get("files", [])
        return load_predictors(self.path, entries, spec_for_model(model), kinds=kinds, distances=distances)


def find_calibration(model: str | os.PathLike[str], explicit: str | os.PathLike[str] | None = None) -> Calibration:
    """--calibration DIR, else the bundled predictors/<stem>/ (same model file), else the per-user cache."""
    if explicit is not None:
        cal = Calibration.load(explicit, "explicit")
        cal.check_model(model)
        return cal
    sha = model_sha256(model)
    bundled = bundled_dir(model)
    if (bundled / CARD).is_file():
        cal = Calibration.load(bundled, "bundled")
        if cal.card.get("model", {}).get("sha256") == sha:
            return cal
        log.warning("ignoring %s: it was calibrated for another file named %s", bundled, Path(model).name)
    cached = cache_dir() / "calibration" / sha[:16]
    if (cached / CARD).is_file():
        return Calibration.load(cached, "cache")
    raise CalibrationError(f"no calibration data for {Path(model).name} (looked in {bundled} and {cached}): run "
                           f"`edgemoe calibrate {model} --corpus FILE` or pass --calibration DIR")


# -- stages ------------------------------------------------------------------------------------------
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
    open_engine: Callable[[], Engine]  # a fresh Engine (use `with ctx.open_engine() as eng:`)
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

    def resolve(self) -> StageFn:
        if callable(self.run):
            return self.run
        mod, _, fn = self.run.partition(":")
        return getattr(importlib.import_module(mod), fn)  # type: ignore[no-any-return]


BUILTIN_STAGES: tuple[Stage, ...] = (
    Stage("traces", "edgemoe.calibration:traces_stage"),
    Stage("router_frequency", "edgemoe.calibration:router_frequency_stage", requires=("traces",)),
    Stage("predictors", "edgemoe.predictors.fit:predictors_stage", requires=("traces",)),
    Stage("sensitivity", "edgemoe.sensitivity:sensitivity_stage"),
)
_registered: list[Stage] = []
_RESERVED = {"format", "created", "model", "corpus", "tokens", "ctx", "seed", "edgemoe", "stages", "elapsed_s"}


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
    """The stages to run, in registry order, with the stages they require; unknown names fail."""
    stages = all_stages()
    by_name = {s.name: s for s in stages}
    if names is None:
        return stages
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


# -- the built-in stages -----------------------------------------------------------------------------
def _chunk(eng: Engine, data: bytes, start: int, ctx: int) -> tuple[list[int], int] | None:
    """ctx tokens of data from `start` (BOS first when the model adds one) and the bytes they cover."""
    span = ctx * 8
    while True:
        end = min(len(data), start + span)
        toks = eng.tokenize(data[start:end].decode("utf-8", errors="ignore"))
        if len(toks) >= ctx or end == len(data):
            break
        span *= 2
    if len(toks) < ctx:
        return None
    toks = toks[:ctx]
    covered = sum(len(eng.token_piece(t)) for t in toks)  # specials (BOS) have an empty piece
    return toks, start + covered


def select_chunks(eng: Engine, texts: Sequence[CorpusText], tokens: int, ctx: int) -> tuple[list[int], list[list[list[int]]]]:
    """Chunks of ctx tokens spread evenly over each train split (an equal share of `tokens` per corpus).

    Returns the flat token list (a multiple of ctx) and, per corpus, the file byte ranges used.
    """
    flat: list[int] = []
    ranges: list[list[list[int]]] = []
    per_corpus = math.ceil(tokens / max(len(texts), 1))
    for tx in texts:
        n_chunks = max(1, math.ceil(per_corpus / ctx))
        used: list[list[int]] = []
        for c in range(n_chunks):
            start = int(c * len(tx.data) / n_chunks)
            if start > 0:  # begin at a line start
                nl = tx.data.find(b"\n", start)
                start = nl + 1 if 0 <= nl < len(tx.data) - 1 else start
            got = _chunk(eng, tx.data, start, ctx)
            if got is None:
                log.warning("%s: too little text after byte %d for a chunk of %d tokens", tx.path.name, start, ctx)
                continue
            toks, end = got
            flat += toks
            off = tx.byte_range[0]
            used.append([off + start, off + end])
        ranges.append(used)
    return flat, ranges


def traces_stage(ctx: StageContext) -> dict[str, Any]:
    """Record calibration traces (gate inputs on) on the train splits: the 'decode' mode mix."""
    from .trace import record_trace

    prefill = max(1, int(ctx.ctx * TRACE_PREFILL_FRACTION))
    with ctx.open_engine() as eng:
        flat, ranges = select_chunks(eng, ctx.texts, ctx.tokens, ctx.ctx)
        if len(flat) < 2 * ctx.ctx:
            raise CalibrationError(f"the corpora give {len(flat)} tokens, fewer than 2 chunks of --ctx {ctx.ctx}: "
                                   "give more text or lower --ctx")
        with ctx.progress(len(flat), "traces", unit="tok") as bar:
            tr = record_trace(eng, flat, ctx=ctx.ctx, mode=TRACE_MODE, prefill_tokens=prefill, gate_inputs=True,
                              progress=bar)
    ctx.artifacts["traces"] = tr
    return {"mode": TRACE_MODE, "prefill_tokens": prefill, "ctx": ctx.ctx, "tokens": tr.n_tokens,
            "sequences": len(np.unique(tr.seq)),
            "gate_inputs_mib": round(tr.gate_inputs.nbytes / 2**20, 1) if tr.gate_inputs is not None else 0,
            "ranges": {str(tx.path): r for tx, r in zip(ctx.texts, ranges)}}


def router_frequency_stage(ctx: StageContext) -> dict[str, Any]:
    """Per-layer expert frequencies over all calibration tokens, and over prefill / decode tokens."""
    from .trace import DECODE, PREFILL
    from .trace_stats import expert_counts, prefill_decode_similarity

    tr = ctx.traces()
    E = tr.n_expert
    counts = expert_counts(tr.ids, E)
    share = counts / np.maximum(counts.sum(1, keepdims=True), 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        entropy = -(np.where(share > 0, share * np.log(share), 0.0)).sum(1) / np.log(E)
    rel = "router_frequency.npz"
    with (ctx.out_dir / rel).open("wb") as f:
        np.savez_compressed(f, layers=tr.layers, counts=counts,
                            prefill_counts=expert_counts(tr.ids[tr.phase == PREFILL], E),
                            decode_counts=expert_counts(tr.ids[tr.phase == DECODE], E),
                            frequency=share.astype(np.float32))
    sim = prefill_decode_similarity(tr.ids, tr.phase, E)
    return {"file": rel, "tokens": tr.n_tokens, "entropy": np.round(entropy, 4).tolist(),
            "skew": np.round(share.max(1) * E, 3).tolist(),
            "prefill_decode_similarity": None if sim is None else np.round(sim, 4).tolist()}


# -- running -------------------------------------------------------------------------------------------
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
        raise CalibrationError(f"{out} exists: pass --force to replace it (it is replaced only once the new "
                               "calibration is complete)")
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


def _default_engine(cfg: CalibrationConfig) -> Callable[[], Engine]:
    def open_engine() -> Engine:
        from .engine import Engine, LoadConfig

        return Engine(cfg.model, LoadConfig(n_ctx=cfg.ctx, n_threads=cfg.n_threads))
    return open_engine


def _model_entry(model: Path) -> dict[str, Any]:
    from .gguf_info import read_model_info

    info = read_model_info(model)
    if not info.is_moe:
        raise CalibrationError(f"{model.name} is a dense model: there are no experts to calibrate")
    return {"file": model.name, "sha256": model_sha256(model), "size": info.file_size,
            "architecture": info.architecture, "layers": list(info.moe_layers), "n_expert": info.n_expert,
            "n_expert_used": info.n_expert_used, "n_embd": info.n_embd}


def _corpus_entry(tx: CorpusText) -> dict[str, Any]:
    size = tx.path.stat().st_size
    return {"path": str(tx.path), "name": tx.path.name, "size": size,
            "sha256": hashlib.sha256(tx.path.read_bytes()).hexdigest(),
            "train_bytes": list(tx.byte_range), "heldout_bytes": [tx.byte_range[1], size]}


def _updated_card(out_dir: Path, fresh: dict[str, Any], stages: Sequence[Stage]) -> dict[str, Any]:
    """The card of an existing calibration, checked against this run, to which `stages` are re-run."""
    card = dict(Calibration.load(out_dir).card)
    same = {"model sha256": (card["model"].get("sha256"), fresh["model"]["sha256"]),
            "corpora": ([c.get("sha256") for c in card.get("corpus", [])], [c["sha256"] for c in fresh["corpus"]]),
            "--tokens": (card.get("tokens"), fresh["tokens"]), "--ctx": (card.get("ctx"), fresh["ctx"]),
            "--seed": (card.get("seed"), fresh["seed"])}
    diff = [k for k, (a, b) in same.items() if a != b]
    if diff:
        raise CalibrationError(f"--update must run with what made {out_dir}; these differ: {', '.join(diff)} "
                               f"(see {out_dir / CARD}: tokens {card.get('tokens')}, ctx {card.get('ctx')}, "
                               f"seed {card.get('seed')}, corpora {[c.get('name') for c in card.get('corpus', [])]})")
    names = [s.name for s in stages]
    order = [s.name for s in all_stages()]
    card["stages"] = sorted(set(card.get("stages", [])) | set(names), key=lambda n: order.index(n) if n in order else 99)
    card["elapsed_s"] = dict(card.get("elapsed_s", {}))
    card.setdefault("updates", []).append({"at": fresh["created"], "stages": names, "edgemoe": fresh["edgemoe"]})
    return card


def run_calibration(cfg: CalibrationConfig, out: str | os.PathLike[str] | None = None, *, force: bool = False,
                    update: bool = False, progress: ProgressFactory = progress_bar,
                    open_engine: Callable[[], Engine] | None = None) -> Calibration:
    """Run the selected stages into a temporary directory, write card.json, and move it to `out`
    (default: the per-user cache for this model).

    update: run only the selected stages into the existing `out`, keeping the other stages' files
    and card entries (same model, corpora, tokens, ctx and seed as the card says).
    """
    model = Path(cfg.model)
    if not cfg.corpora:
        raise CalibrationError("no corpus: give at least one --corpus FILE (its train split is used)")
    out_dir = Path(out) if out is not None else default_out_dir(model)
    stages = select_stages(cfg.stages)
    texts = tuple(CorpusText.train_split(p) for p in cfg.corpora)
    card: dict[str, Any] = {
        "format": FORMAT_VERSION,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "model": _model_entry(model), "corpus": [_corpus_entry(t) for t in texts],
        "tokens": cfg.tokens, "ctx": cfg.ctx, "seed": cfg.seed, "edgemoe": edgemoe_commit(),
        "stages": [s.name for s in stages], "elapsed_s": {},
    }
    if update:
        if cfg.stages is None:
            raise CalibrationError("--update needs the stages to run (--stage NAME)")
        stages = [s for s in stages if s.name in cfg.stages or s.name == "traces"]  # traces: in memory only
        card = _updated_card(out_dir, card, stages)
    artifacts: dict[str, Any] = {}
    with _building(out_dir, force, keep=update) as tmp:
        for st in stages:
            sc = StageContext(model=model, open_engine=open_engine or _default_engine(cfg), texts=texts, out_dir=tmp,
                              seed=cfg.seed, tokens=cfg.tokens, ctx=cfg.ctx, n_threads=cfg.n_threads,
                              progress=progress, options=MappingProxyType(dict(cfg.options)),
                              card=MappingProxyType(json.loads(json.dumps(card))), artifacts=artifacts)
            t0 = time.perf_counter()
            log.info("calibration stage %s", st.name)
            result = st.resolve()(sc)
            card[st.name] = json.loads(json.dumps(dict(result)))  # JSON-clean now, not at the end
            card["elapsed_s"][st.name] = round(time.perf_counter() - t0, 2)
        write_json(tmp / CARD, card)
    return Calibration.load(out_dir)
