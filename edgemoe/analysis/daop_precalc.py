"""DAOP's prediction-based pre-calculation (§IV-C), measured on a decode trace with router inputs.

DAOP predicts layer l+1's experts by gate reuse (layer l+1's router on layer l's router input, the
`gate` predictor kind) and starts the predicted experts that sit on the CPU one layer early, on layer
l's hidden state. Two things decide whether that pays:

- **Accuracy** (`precalc_accuracy`): given the residency DAOP has at each decode token (the policy
  replayed on the trace), the predicted CPU experts of layer l+1 are the predicted top-k that are not
  resident, the true ones the selected experts that are not resident. Precision: the predicted CPU
  experts that are selected (the rest is CPU work thrown away); recall: the selected CPU experts that
  were predicted, i.e. the share of the CPU's expert executions that could start one layer early.
- **Quality** (`precalc_quality`): a pre-calculated expert runs on the wrong input. llama.cpp's hook can
  edit ids and weights but cannot feed a layer's experts another layer's hidden state, so this is a
  numpy reference of one MoE layer's experts from the GGUF (edgemoe.gguf.experts) on the recorded router
  inputs: y = sum_s w_s E_s(x_{l+1}) with the recorded ids and weights, and y' the same with the
  pre-calculated experts (selected, not resident, predicted) computed on layer l's input instead, either
  as recorded (x_l, normalised by layer l's ffn_norm) or renormalised for layer l+1 (x_l / g_l * g_{l+1}
  = RMSNorm_{l+1} of layer l's residual stream, what layer l+1's own norm would give DAOP's hidden state).
  Reported: the relative error ||y' - y|| / ||y|| of the MoE layer output, averaged over tokens, and as a
  yardstick the error of skipping those experts instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import EdgeMoeError
from ..gguf.experts import load_expert_layer
from ..gguf.routers import load_routers
from ..policies.allocation import decode_steps, layer_steps
from ..policies.loads import Load
from ..policies.residency import ResidencyPolicy
from .trace import DECODE, Trace


@dataclass(frozen=True)
class PrecalcAccuracy:
    layer: int  # target MoE layer (model index); the prediction comes from the MoE layer before it
    topk_recall: float  # gate reuse: share of the selected experts in the predicted top-k
    precision: float  # predicted CPU experts that were selected
    recall: float  # selected CPU experts that were predicted (CPU work that could start a layer early)
    cpu_per_token: float  # selected experts not resident (CPU executions) per decode token
    predicted_cpu_per_token: float  # predicted experts not resident (pre-calculations) per decode token
    wasted_per_token: (
        float  # predicted CPU experts not selected per decode token (pre-calculated for nothing)
    )


@dataclass(frozen=True)
class PrecalcQuality:
    layer: int
    tokens: int  # decode tokens evaluated
    precalc_per_token: float  # pre-calculated experts (selected, on the CPU, predicted) per token
    rel_err: float  # mean ||y' - y|| / ||y||, x_l as recorded
    rel_err_renorm: float  # the same with x_l renormalised by layer l+1's ffn_norm
    rel_err_skip: float  # yardstick: the pre-calculated experts left out instead
    expert_rel_err: float  # mean ||E(x_l) - E(x_{l+1})|| / ||E(x_{l+1})|| over pre-calculated experts


def decode_residency(trace: Trace, policy: ResidencyPolicy) -> np.ndarray:
    """(n_decode_tokens, L, n_expert) bool: what was resident when each decode token's layers ran, the
    policy replayed on the trace's steps as `replay_policy` does (blocking loads before the layer, others after
    the step)."""
    ubatch = int(trace.meta.get("n_batch", 512))
    layers = [int(x) for x in trace.layers]
    by_layer = layer_steps(trace.ids, layers, trace.phase, trace.seq, ubatch=ubatch)
    is_decode = decode_steps(trace.phase, trace.seq, ubatch=ubatch)
    n_expert = trace.n_expert
    slots: dict[int, dict[int, int]] = {}  # layer -> expert -> slot

    def apply(loads: Sequence[Load]) -> None:
        for ld in loads:
            per = slots.setdefault(ld.layer, {})
            for e in [e for e, s in per.items() if s == ld.slot or e == ld.expert]:
                del per[e]
            per[ld.expert] = ld.slot

    def row(il: int) -> np.ndarray:
        m = np.zeros(n_expert, bool)
        m[list(slots.get(il, {}))] = True
        return m

    apply(policy.initial_loads())
    out = []
    for s, dec in enumerate(is_decode):
        pending: list[Load] = []
        snap = np.array([row(il) for il in layers])
        for j, il in enumerate(layers):
            loads = policy.on_route(il, by_layer[il][s])
            if policy.blocking:
                apply(loads)
                snap[j] = row(il)
            else:
                pending += loads
        if dec:
            out.append(snap)
        apply(pending)
    return np.array(out, bool).reshape(-1, len(layers), n_expert)


def _predicted(trace: Trace, routers: Mapping[int, np.ndarray], j: int, rows: np.ndarray) -> np.ndarray:
    """(n_rows, k) gate reuse: MoE layer j's router on MoE layer j-1's recorded router input."""
    x = trace.gate_inputs[rows, j - 1].astype(np.float32)  # type: ignore[index]
    logits = x @ routers[int(trace.layers[j])].T
    k = trace.ids.shape[2]
    return np.argsort(-logits, axis=1, kind="stable")[:, :k]


def _require_gate_inputs(trace: Trace) -> np.ndarray:
    if trace.gate_inputs is None:
        raise EdgeMoeError(
            "the trace has no router inputs: record it with `edgemoe trace MODEL --input FILE "
            "--mode decode --gate-inputs`"
        )
    return np.flatnonzero(trace.phase == DECODE)


def precalc_accuracy(
    trace: Trace, routers: Mapping[int, np.ndarray], residency: np.ndarray
) -> list[PrecalcAccuracy]:
    """Per target MoE layer 1..L-1; routers: layer -> (n_expert, n_embd) (edgemoe.gguf.routers.load_routers);
    residency from decode_residency (one row per decode token)."""
    rows = _require_gate_inputs(trace)
    layers = [int(x) for x in trace.layers]
    out = []
    for j in range(1, len(layers)):
        pred = _predicted(trace, routers, j, rows)
        true = trace.ids[rows, j]
        res = residency[:, j]
        t_idx = np.arange(len(rows))[:, None]
        pred_cpu = ~res[t_idx, pred]
        true_cpu = (true >= 0) & ~res[t_idx, np.maximum(true, 0)]
        in_true = (pred[:, :, None] == true[:, None, :]).any(2)  # predicted expert was selected
        in_pred = (true[:, :, None] == pred[:, None, :]).any(2)
        hit = int((pred_cpu & in_true).sum())
        n = max(len(rows), 1)
        out.append(
            PrecalcAccuracy(
                layer=layers[j],
                topk_recall=float(in_pred[true >= 0].mean()),
                precision=hit / max(int(pred_cpu.sum()), 1),
                recall=hit / max(int(true_cpu.sum()), 1),
                cpu_per_token=float(true_cpu.sum()) / n,
                predicted_cpu_per_token=float(pred_cpu.sum()) / n,
                wasted_per_token=float((pred_cpu & ~in_true).sum()) / n,
            )
        )
    return out


def precalc_quality(
    trace: Trace,
    model: Path,
    residency: np.ndarray,
    *,
    max_tokens: int = 512,
    layers: Sequence[int] | None = None,
) -> list[PrecalcQuality]:
    """The numpy reference of the module docstring, on up to max_tokens evenly spaced decode tokens."""
    rows_all = _require_gate_inputs(trace)
    pick = np.unique(np.linspace(0, len(rows_all) - 1, min(max_tokens, len(rows_all))).astype(int))
    rows, res = rows_all[pick], residency[pick]
    moe = [int(x) for x in trace.layers]
    routers = load_routers(str(model), moe)
    targets = range(1, len(moe)) if layers is None else [moe.index(il) for il in layers]
    out = []
    for j in targets:
        cur, prev = load_expert_layer(model, moe[j]), load_expert_layer(model, moe[j - 1])
        if cur.ffn_norm is None or prev.ffn_norm is None:
            raise EdgeMoeError(
                f"layers {moe[j - 1]} and {moe[j]} need an ffn_norm for the renormalised input"
            )
        x = trace.gate_inputs[rows, j].astype(np.float64)  # type: ignore[index]
        x_src = trace.gate_inputs[rows, j - 1].astype(np.float64)  # type: ignore[index]
        x_ren = x_src / prev.ffn_norm.astype(np.float64) * cur.ffn_norm.astype(np.float64)
        ids, w = trace.ids[rows, j], trace.weights[rows, j].astype(np.float64)
        pred = _predicted(trace, routers, j, rows)
        t_idx = np.arange(len(rows))[:, None]
        pre = (
            (ids >= 0) & ~res[:, j][t_idx, np.maximum(ids, 0)] & (ids[:, :, None] == pred[:, None, :]).any(2)
        )
        y = np.zeros_like(x)
        d_raw, d_ren, skipped = np.zeros_like(x), np.zeros_like(x), np.zeros_like(x)
        exp_err = []
        for e in np.unique(ids[ids >= 0]):
            t, s = np.nonzero(ids == e)
            true_out = cur.expert(int(e), x[t]) * w[t, s][:, None]
            np.add.at(y, t, true_out)
            m = pre[t, s]
            if not m.any():
                continue
            tt, ws = t[m], w[t[m], s[m]][:, None]
            raw, ren = cur.expert(int(e), x_src[tt]) * ws, cur.expert(int(e), x_ren[tt]) * ws
            np.add.at(d_raw, tt, raw - true_out[m])
            np.add.at(d_ren, tt, ren - true_out[m])
            np.add.at(skipped, tt, true_out[m])
            exp_err += list(np.linalg.norm(raw - true_out[m], axis=1) / np.linalg.norm(true_out[m], axis=1))
        norm = np.maximum(np.linalg.norm(y, axis=1), 1e-30)
        out.append(
            PrecalcQuality(
                layer=moe[j],
                tokens=len(rows),
                precalc_per_token=float(pre.sum()) / len(rows),
                rel_err=float((np.linalg.norm(d_raw, axis=1) / norm).mean()),
                rel_err_renorm=float((np.linalg.norm(d_ren, axis=1) / norm).mean()),
                rel_err_skip=float((np.linalg.norm(skipped, axis=1) / norm).mean()),
                expert_rel_err=float(np.mean(exp_err)) if exp_err else 0.0,
            )
        )
    return out
