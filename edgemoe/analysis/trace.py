"""Routing traces: record, per token and MoE layer, what the router chose; save/load as .npz.

File format (docs/traces.md): ``tokens`` [T] int32, ``layers`` [L] int32,
``ids`` [T, L, k] int32, ``weights`` [T, L, k] float32, optional ``probs``
[T, L, n_expert] float32 and ``gate_inputs`` [T, L, n_embd] float16,
``phase`` [T] uint8 (0 prefill, 1 decode), ``seq`` [T] int32, and ``meta``
(a JSON string: model, mode, context, counts).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np

from ..errors import EdgeMoeError
from ..policies.route import RouteRecord

PREFILL, DECODE = 0, 1
FORMAT_VERSION = 1


@dataclass
class Trace:
    tokens: np.ndarray  # (T,) int32
    layers: np.ndarray  # (L,) int32 MoE layer indices
    ids: np.ndarray  # (T, L, k) int32
    weights: np.ndarray  # (T, L, k) float32
    phase: np.ndarray  # (T,) uint8: PREFILL or DECODE
    seq: np.ndarray  # (T,) int32 sequence (chunk) id
    probs: np.ndarray | None = None  # (T, L, n_expert) float32
    gate_inputs: np.ndarray | None = None  # (T, L, n_embd) float16
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def n_expert(self) -> int:
        return int(self.meta.get("n_expert", int(self.ids.max()) + 1))

    def save(self, path: str | Path) -> Path:
        """Write atomically: a temp file renamed into place, so an interrupted save leaves nothing."""
        path = Path(path)
        arrays: dict[str, np.ndarray] = dict(
            tokens=self.tokens,
            layers=self.layers,
            ids=self.ids,
            weights=self.weights,
            phase=self.phase,
            seq=self.seq,
            meta=np.array(json.dumps({**self.meta, "format": FORMAT_VERSION})),
        )
        if self.probs is not None:
            arrays["probs"] = self.probs
        if self.gate_inputs is not None:
            arrays["gate_inputs"] = self.gate_inputs
        tmp = path.with_name(path.name + ".tmp")
        try:
            with tmp.open("wb") as f:
                np.savez_compressed(f, **cast("dict[str, Any]", arrays))  # the stub's allow_pickle: bool
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return path

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        try:
            with np.load(path, allow_pickle=False) as z:
                d = {k: z[k] for k in z.files}
        except (OSError, ValueError, EOFError) as err:
            raise EdgeMoeError(
                f"cannot read trace {path}: {err}; record it again with `edgemoe trace`"
            ) from err
        missing = {"tokens", "layers", "ids", "weights", "phase", "seq"} - d.keys()
        if missing:
            raise EdgeMoeError(f"{path} is not an edgemoe trace (missing {sorted(missing)})")
        meta = json.loads(str(d.pop("meta"))) if "meta" in d else {}
        return cls(meta=meta, **d)


class TraceRecorder:
    """A route policy that copies every route record; `build()` assembles the Trace."""

    def __init__(self, *, probs: bool = False, gate_inputs: bool = False) -> None:
        self.wants_probs = probs
        self.wants_gate_inp = gate_inputs
        self._routes: dict[int, list[tuple[np.ndarray, ...]]] = {}
        self.tokens: list[int] = []
        self.phase: list[int] = []
        self.seq: list[int] = []

    def feed(self, tokens: Sequence[int], phase: int, seq: int) -> None:
        """Say which tokens the next decode evaluates (the hook sees only routes)."""
        self.tokens.extend(tokens)
        self.phase.extend([phase] * len(tokens))
        self.seq.extend([seq] * len(tokens))

    def on_route(self, route: RouteRecord) -> None:
        rec = (
            route.ids.copy(),
            route.weights.copy(),
            route.probs.copy() if route.probs is not None else None,
            route.gate_inp.astype(np.float16) if route.gate_inp is not None else None,
        )
        self._routes.setdefault(route.layer, []).append(rec)  # type: ignore[arg-type]

    def build(self, meta: dict[str, Any]) -> Trace:
        layers = sorted(self._routes)
        if not layers:
            raise EdgeMoeError("no MoE routes were recorded: is this a MoE model?")

        def stack(i: int) -> np.ndarray | None:
            per_layer = [
                np.concatenate([r[i] for r in self._routes[il]])
                if self._routes[il][0][i] is not None
                else None
                for il in layers
            ]
            return None if per_layer[0] is None else np.stack(cast("list[np.ndarray]", per_layer), axis=1)

        ids, weights = stack(0), stack(1)
        assert ids is not None and weights is not None
        if ids.shape[0] != len(self.tokens):
            raise EdgeMoeError(f"recorded {ids.shape[0]} routed tokens for {len(self.tokens)} fed tokens")
        return Trace(
            tokens=np.array(self.tokens, np.int32),
            layers=np.array(layers, np.int32),
            ids=ids.astype(np.int32),
            weights=weights.astype(np.float32),
            phase=np.array(self.phase, np.uint8),
            seq=np.array(self.seq, np.int32),
            probs=stack(2),
            gate_inputs=stack(3),
            meta=meta,
        )


def join_traces(traces: Sequence[Trace]) -> Trace:
    """One trace of the given traces' sequences in order (sequence ids renumbered after each other), e.g. a
    warm-up before a measured run; they must route the same MoE layers. Meta: the last trace's."""
    if not traces:
        raise EdgeMoeError("no traces to join")
    if any(not np.array_equal(t.layers, traces[0].layers) for t in traces):
        raise EdgeMoeError("the traces route different MoE layers: record them on the same model")
    seqs, offset = [], 0
    for t in traces:
        seqs.append(t.seq + offset)
        offset += int(t.seq.max()) + 1 if t.n_tokens else 0

    def cat(name: str) -> np.ndarray | None:
        parts = [getattr(t, name) for t in traces]
        return None if any(p is None for p in parts) else np.concatenate(parts)

    def req(name: str) -> np.ndarray:  # a field every trace has
        return np.concatenate([getattr(t, name) for t in traces])

    return Trace(
        tokens=req("tokens"),
        layers=traces[0].layers,
        ids=req("ids"),
        weights=req("weights"),
        phase=req("phase"),
        seq=np.concatenate(seqs).astype(np.int32),
        probs=cat("probs"),
        gate_inputs=cat("gate_inputs"),
        meta=dict(traces[-1].meta),
    )


def record_trace(
    engine: Any,
    tokens: Sequence[int],
    *,
    ctx: int,
    mode: str = "prefill",
    prefill_tokens: int = 32,
    probs: bool = False,
    gate_inputs: bool = False,
    progress: Callable[[int], None] | None = None,
) -> Trace:
    """Run `tokens` through the engine in chunks of `ctx` (one fresh sequence each) and record routing.

    mode "prefill": each chunk is one prefill (in n_batch pieces). mode "decode": the first
    `prefill_tokens` of each chunk are prefilled, the rest fed one token per decode (teacher forcing).
    """
    if mode not in ("prefill", "decode"):
        raise EdgeMoeError(f"unknown trace mode {mode!r}: use prefill or decode")
    rec = TraceRecorder(probs=probs, gate_inputs=gate_inputs)
    engine.set_policies([rec])
    try:
        for seq, start in enumerate(range(0, len(tokens), ctx)):
            chunk = list(tokens[start : start + ctx])
            engine.reset()
            head = chunk if mode == "prefill" else chunk[:prefill_tokens]
            rec.feed(head, PREFILL, seq)
            engine.feed(head, all_logits=True)  # all outputs: the last layer routes every token
            if mode == "decode":
                for tok in chunk[len(head) :]:
                    rec.feed([tok], DECODE, seq)
                    engine.feed([tok], all_logits=True)
            if progress:
                progress(len(chunk))
    finally:
        engine.set_policies(None)
    info = engine.info
    return rec.build(
        {
            "model": str(engine.path),
            "architecture": info.architecture,
            "mode": mode,
            "ctx": ctx,
            "prefill_tokens": prefill_tokens if mode == "decode" else None,
            "n_expert": info.n_expert,
            "n_expert_used": info.n_expert_used,
            "n_embd": info.n_embd,
            "n_batch": engine.n_batch,
            "graph_nodes": list(engine.graph_nodes) if engine.graph_nodes else None,
        }
    )


def route_steps(
    trace: Trace, n_ubatch: int = 512
) -> tuple[list[list[tuple[int, np.ndarray, np.ndarray | None]]], list[bool]]:
    """The trace as the engine routed it, for edgemoe.policies.replay: per sequence its prefill tokens in
    ubatches of n_ubatch, then one step per decode token; each step [(layer, ids, router input or None)] in
    layer order. Also one flag per step: is it a decode token."""
    steps: list[list[tuple[int, np.ndarray, np.ndarray | None]]] = []
    decode: list[bool] = []
    layers = [int(il) for il in trace.layers]
    for seq in np.unique(trace.seq):
        rows = np.flatnonzero(trace.seq == seq)
        pre = rows[trace.phase[rows] == PREFILL]
        groups = [pre[i : i + n_ubatch] for i in range(0, len(pre), n_ubatch)]
        groups += [rows[i : i + 1] for i in np.flatnonzero(trace.phase[rows] == DECODE)]
        for g in groups:
            hidden = trace.gate_inputs[g] if trace.gate_inputs is not None else None
            steps.append(
                [
                    (il, trace.ids[g, j], hidden[:, j] if hidden is not None else None)
                    for j, il in enumerate(layers)
                ]
            )
            decode.append(bool(trace.phase[g[0]] == DECODE))
    return steps, decode
