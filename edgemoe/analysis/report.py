"""Human-readable text for `edgemoe inspect` (the numbers come from edgemoe.gguf.info)."""

from __future__ import annotations

from typing import Any

from ..gguf.info import ModelInfo, format_size


def format_info(info: ModelInfo) -> str:
    lines = [
        f"model        {info.name or info.path.name} ({info.path.name}, {format_size(info.file_size)})",
        f"architecture {info.architecture}",
        f"layers       {info.n_layer} (n_embd {info.n_embd}, heads {info.n_head}/{info.n_head_kv} kv, "
        f"vocab {info.n_vocab}, train ctx {info.n_ctx_train})",
    ]
    if info.n_nextn:
        lines.append(_mtp_line(info))
    if not info.is_moe:
        lines.append("experts      none: dense model (edgemoe's MoE features are off)")
    else:
        moe = info.moe_layers
        span = f"{moe[0]}..{moe[-1]}" if len(moe) == moe[-1] - moe[0] + 1 else ",".join(map(str, moe))
        lines += [
            f"MoE layers   {len(moe)} (layers {span})",
            f"experts      {info.n_expert} routed, {info.n_expert_used} used per token, "
            f"{info.n_expert_shared} shared; expert n_ff {info.n_ff_exp}",
            f"per expert   {format_size(info.bytes_per_expert)} (one layer); "
            f"per layer {format_size(info.bytes_per_expert * info.n_expert)}",
        ]
        first = info.expert_tensors[moe[0]]
        for t in first:
            lines.append(
                f"  {t.name:<36} {t.qtype:<6} {'x'.join(map(str, t.shape)):<18} "
                f"{format_size(t.bytes_per_expert)}/expert"
            )
    total = info.total_tensor_bytes
    lines += [
        f"bytes        experts {format_size(info.expert_bytes_total)} "
        f"({100 * info.expert_bytes_total / max(total, 1):.1f}%), dense {format_size(info.dense_bytes)} "
        f"(shared experts {format_size(info.shared_expert_bytes)}), total {format_size(total)}",
        "by type      "
        + ", ".join(
            f"{k} {format_size(v)}" for k, v in sorted(info.bytes_by_type.items(), key=lambda kv: -kv[1])
        ),
    ]
    return "\n".join(lines)


def _mtp_line(info: ModelInfo) -> str:
    """The MTP (NextN) blocks: counted in the layers above, loaded only for speculation with them."""
    if not info.mtp_heads:
        return f"MTP heads    {info.n_nextn} announced but without tensors (a trunk-only conversion): none to draft with"
    return (
        f"MTP heads    {info.n_nextn} block(s) after the trunk's {info.n_layer - info.n_nextn} layers, "
        f"{format_size(info.mtp_bytes)} ({format_size(info.mtp_dense_bytes)} outside their routed experts); "
        "speculation mode `mtp` drafts with them (docs/speculation.md)"
    )


def format_stats(d: dict[str, Any]) -> str:
    """Text table of TraceStats.to_dict() (plus its "trace" and "plots" entries)."""

    def row(name: str, vals: list[float] | None, offset: int = 0) -> str:
        if vals is None:
            return f"{name:<28} n/a"
        cells = [" " * 6] * offset + [f"{v:6.3f}" for v in vals]
        return f"{name:<28} " + " ".join(cells)

    t = d["trace"]
    lines = [
        f"trace {t['path']}: {t['tokens']} tokens ({t['mode']}), {len(d['layers'])} MoE layers, "
        f"{d['n_expert']} experts, top-{d['k']}"
        + (f"; synthetic routing {t['routing']}" if t.get("routing") else ""),
        f"{'MoE layer':<28} " + " ".join(f"{il:>6}" for il in d["layers"]),
        row("normalised entropy", d["entropy"]),
        row("skew (hottest x E)", d["skew"]),
        row("temporal locality", d["temporal_locality"]),
        row(f"high-workload adj. (w={d['adjacency_window']})", d["high_workload_adjacency"]),
        row("gate-input cos (l-1, l)", d["gate_input_cosine"], 1),
        row("gate-reuse recall (l from l-1)", d["gate_reuse_recall"], 1),
        row("prefill/decode similarity", d["prefill_decode_similarity"]),
        row("reuse by the next token", d.get("reuse_next_per_layer")),
        row("reuse within 8 tokens", d.get("reuse_within_8_per_layer")),
    ]
    if d.get("coverage_top40_in_prompt") is not None:
        other = d.get("coverage_top40_other_prompts")
        lines.append(
            f"top 40% of experts cover {d['coverage_top40_in_prompt']:.3f} of a sequence's selections"
            + (f" (chosen on the other sequences: {other:.3f})" if other is not None else "")
        )
    lines.append(
        "LRU hit rate (mean over layers): "
        + ", ".join(f"{s}: {h:.3f}" for s, h in zip(d["lru_sizes"], d["lru_hit_rate_mean"], strict=False))
    )
    lines.append("means: " + ", ".join(f"{k} {v}" for k, v in d["mean"].items() if v is not None))
    if d.get("plots"):
        lines.append("plots: " + ", ".join(d["plots"]))
    return "\n".join(lines)
