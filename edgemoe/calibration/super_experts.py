"""Super experts: the few experts whose down-projection output is orders of magnitude above every other's.

Su et al., "Unveiling Super Experts in Mixture-of-Experts Large Language Models" (2025): in Qwen3-30B-A3B and
others a handful of experts, at a few layers, produce extreme activation outliers in their down-projection
output (which become the model's massive activations and attention sinks); pruning three of them breaks the
model while pruning others barely moves it. Their signature, read here: per (layer, expert), the largest
magnitude of its down-projection output over the calibration tokens routed to it (its "peak").

A pair is a super expert when its peak is above the 99.5th percentile of every routed expert's peak and at
least a tenth of the largest (the paper's two conditions), and at least FACTOR times the median peak (the
paper's conditions always name someone; this one asks for orders of magnitude, so a model without outliers
has none). The peaks come from llama.cpp's own `ffn_moe_down-<il>` nodes (edgemoe.runtime.node_probe), any
architecture. Stored as super_experts.json; adaptive top-k and graceful degradation never drop or swap them
(edgemoe.policies.protected).
"""

from __future__ import annotations

import json
import re
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..policies.protected import ProtectedExperts
from ..policies.route import RouteRecord

if TYPE_CHECKING:
    from .stages import StageContext

FILE_NAME = "super_experts.json"
FACTOR = 10.0  # a super expert's peak is at least this many times the median peak
QUANTILE = 99.5  # ... above this percentile of all peaks
OF_MAX = 0.1  # ... and at least this share of the largest
_DOWN = re.compile(r"ffn_moe_down-(\d+)")


def find_super_experts(
    peaks: Mapping[int, np.ndarray],
    *,
    factor: float = FACTOR,
    quantile: float = QUANTILE,
    of_max: float = OF_MAX,
) -> list[tuple[int, int]]:
    """(layer, expert) pairs whose peak passes the three conditions; peaks: layer -> (n_expert,) (0: not routed)."""
    routed = np.concatenate([p[p > 0] for p in peaks.values()]) if peaks else np.zeros(0)
    if len(routed) == 0:
        return []
    bar = max(float(np.percentile(routed, quantile)), of_max * float(routed.max()))
    floor = factor * float(np.median(routed))
    return [
        (int(il), int(e)) for il, p in sorted(peaks.items()) for e in np.flatnonzero((p > bar) & (p >= floor))
    ]


@dataclass(frozen=True)
class SuperExperts:
    """What the calibration found: every (layer, expert)'s peak and the pairs protected."""

    peaks: dict[int, list[float]]  # layer -> per expert: largest |down-projection output| (0: never routed)
    routed: dict[int, list[int]]  # layer -> per expert: calibration tokens routed to it
    protected: list[list[int]]  # [[layer, expert], ...]
    tokens: int
    factor: float = FACTOR
    quantile: float = QUANTILE
    of_max: float = OF_MAX

    def protected_experts(self) -> ProtectedExperts:
        return ProtectedExperts.of((il, e) for il, e in self.protected)

    def summary(self) -> dict[str, Any]:
        """The card entry: the pairs, and how far the largest peak stands above the median."""
        routed = np.array([v for p in self.peaks.values() for v in p if v > 0])
        median = float(np.median(routed)) if len(routed) else 0.0
        return {
            "files": [FILE_NAME],
            "tokens": self.tokens,
            "protected": self.protected,
            "median_peak": median,
            "max_peak": float(routed.max()) if len(routed) else 0.0,
            "max_over_median": float(routed.max() / median) if median > 0 else None,
            "criterion": {"factor": self.factor, "quantile": self.quantile, "of_max": self.of_max},
        }

    def save(self, directory: Path) -> Path:
        from .card import write_json

        write_json(directory / FILE_NAME, asdict(self))
        return directory / FILE_NAME

    @classmethod
    def load(cls, directory: Path) -> SuperExperts:
        d = json.loads((directory / FILE_NAME).read_text())
        return cls(
            peaks={int(k): [float(x) for x in v] for k, v in d["peaks"].items()},
            routed={int(k): [int(x) for x in v] for k, v in d["routed"].items()},
            protected=[[int(il), int(e)] for il, e in d["protected"]],
            tokens=int(d["tokens"]),
            factor=float(d["factor"]),
            quantile=float(d["quantile"]),
            of_max=float(d["of_max"]),
        )


def protected_experts(directory: Path | None) -> ProtectedExperts:
    """The protected experts a calibration directory names (none without one, or without this stage)."""
    if directory is None or not (directory / FILE_NAME).exists():
        return ProtectedExperts()
    return SuperExperts.load(directory).protected_experts()


class DownPeaks:
    """A route policy (reads the ids) and a node callback (reads `ffn_moe_down-<il>`) together: per layer and
    expert, the peak and the routed-token count."""

    wants_probs = False
    wants_gate_inp = False

    def __init__(self, layers: Sequence[int], n_expert: int, n_embd: int) -> None:
        self.n_embd = n_embd
        self.peaks = {il: np.zeros(n_expert) for il in layers}
        self.routed = {il: np.zeros(n_expert, np.int64) for il in layers}
        self._ids: dict[int, deque[np.ndarray]] = {}
        self.unmatched = 0  # down-projection nodes with no routing (or of another shape) before them

    @staticmethod
    def wanted(name: str) -> bool:
        return _DOWN.fullmatch(name) is not None

    def on_route(self, route: RouteRecord) -> None:
        self._ids.setdefault(route.layer, deque()).append(route.ids.copy())

    def on_node(self, name: str, values: np.ndarray) -> None:
        m = _DOWN.fullmatch(name)
        assert m is not None  # only wanted() nodes come here
        il = int(m.group(1))
        queue = self._ids.get(il)
        ids = queue.popleft() if queue else None
        if ids is None or il not in self.peaks or values.size != ids.size * self.n_embd:
            self.unmatched += 1
            return
        row_peak = np.abs(values.reshape(ids.shape[0], ids.shape[1], self.n_embd)).max(2)  # (tokens, k)
        ok = ids >= 0
        np.maximum.at(self.peaks[il], ids[ok], row_peak[ok].astype(np.float64))
        np.add.at(self.routed[il], ids[ok], 1)


def measure_super_experts(
    engine: Any,
    chunks: Sequence[Sequence[int]],
    *,
    progress: Callable[[int], None] | None = None,
    **criterion: float,
) -> SuperExperts:
    """Run `chunks` (each one sequence) through a probe context of `engine`'s model and find the super experts."""
    from ..runtime.node_probe import NodeProbe

    info = engine.info
    rec = DownPeaks(list(info.moe_layers), info.n_expert, info.n_embd)
    n_ctx = max(len(c) for c in chunks)
    with NodeProbe(engine, rec.wanted, rec.on_node, policies=[rec], n_ctx=n_ctx) as probe:
        for c in chunks:
            probe.eval(c)
            if progress:
                progress(len(c))
    pairs = find_super_experts(rec.peaks, **criterion)
    return SuperExperts(
        peaks={il: p.tolist() for il, p in rec.peaks.items()},
        routed={il: r.tolist() for il, r in rec.routed.items()},
        protected=[[il, e] for il, e in pairs],
        tokens=sum(len(c) for c in chunks),
        **criterion,
    )


def super_experts_stage(ctx: StageContext) -> dict[str, Any]:
    """Calibration stage `super_experts`: super_experts.json. Options (ctx.options["super_experts"]): tokens
    (default min(budget, 4096), from the start of each corpus' train split), ctx (sequence length, default 256)."""
    from ..analysis.perplexity import chunk_tokens

    opts = ctx.options.get("super_experts", {})
    n_tok = int(opts.get("tokens", min(ctx.tokens, 4096)))
    seq = int(opts.get("ctx", 256))
    with ctx.open_engine() as eng:
        tokens: list[int] = []
        for t in ctx.texts:
            tokens += eng.tokenize(t.data[:200_000].decode("utf-8", errors="replace"), add_special=False)[
                : n_tok // len(ctx.texts)
            ]
        bos = eng.bos_token() if eng.adds_bos() else None
        chunks = chunk_tokens(tokens, seq, bos)
        with ctx.progress(sum(len(c) for c in chunks), "super experts", unit="tok") as advance:
            found = measure_super_experts(eng, chunks, progress=advance)
    found.save(ctx.out_dir)
    return found.summary()
