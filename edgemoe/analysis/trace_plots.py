"""PNG figures of TraceStats (matplotlib, imported only when plots are asked for)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .trace_stats import TraceStats

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def write_plots(st: TraceStats, out_dir: Path, title: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    figures = (
        ("frequency.png", _frequency),
        ("per_layer.png", _per_layer),
        ("lru.png", _lru),
        ("workload.png", _workload),
        ("adjacency.png", _adjacency),
    )
    for name, draw in figures:
        fig = draw(plt, st, title)
        p = out_dir / name
        fig.tight_layout()
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)
    return paths


def _frequency(plt: Any, st: TraceStats, title: str) -> Figure:
    """Expert frequency heatmap, experts sorted by share within each layer."""
    fig, ax = plt.subplots(figsize=(8, 3.5))
    im = ax.imshow(np.sort(st.frequency, axis=1)[:, ::-1] * st.n_expert, aspect="auto", cmap="viridis")
    ax.set(
        xlabel="expert rank (hottest first)", ylabel="MoE layer", title=f"{title}: expert share x n_expert"
    )
    ax.set_yticks(range(len(st.layers)), [str(x) for x in st.layers])
    fig.colorbar(im, ax=ax, label="share x n_expert (1 = uniform)")
    return fig


def _per_layer(plt: Any, st: TraceStats, title: str) -> Figure:
    """Per-layer scalars."""
    fig, ax = plt.subplots(figsize=(10.5, 3.5))
    x = np.arange(len(st.layers))
    ax.plot(x, st.entropy, "o-", label="normalised entropy")
    ax.plot(x, st.temporal_locality, "s-", label="temporal locality P(reuse at t+1)")
    ax.plot(
        x, st.high_workload_adjacency, "^-", label=f"high-workload adjacency (window {st.adjacency_window})"
    )
    if st.prefill_decode_similarity is not None:
        ax.plot(x, st.prefill_decode_similarity, "d-", label="prefill/decode similarity")
    if st.gate_input_cosine is not None:
        ax.plot(x[:-1] + 0.5, st.gate_input_cosine, "x--", label="gate-input cosine l, l+1")
    if st.gate_reuse_recall is not None:
        ax.plot(x[1:], st.gate_reuse_recall, "v--", label="gate-reuse recall (l from l-1)")
    ax.set(
        xlabel="MoE layer index (position)", ylim=(0, 1.05), title=f"{title}: routing statistics per layer"
    )
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    return fig


def _lru(plt: Any, st: TraceStats, title: str) -> Figure:
    """LRU hit rate vs cache size."""
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for j, il in enumerate(st.layers):
        ax.plot(
            st.lru_sizes,
            st.lru_hit_rate[j],
            color=plt.cm.viridis(j / max(len(st.layers) - 1, 1)),
            label=f"layer {il}" if j in (0, len(st.layers) - 1) else None,
        )
    ax.plot(st.lru_sizes, st.lru_sizes / st.n_expert, "k:", label="random routing")
    ax.set(xlabel="experts cached per layer", ylabel="hit rate", ylim=(0, 1.02), title=f"{title}: LRU cache")
    ax.legend(fontsize=7)
    return fig


def _workload(plt: Any, st: TraceStats, title: str) -> Figure:
    """DALI-style workload heatmap of the middle layer over windows."""
    j = len(st.layers) // 2
    fig, ax = plt.subplots(figsize=(8, 3.5))
    im = ax.imshow(st.workload_windows[j].T, aspect="auto", cmap="magma", interpolation="nearest")
    ax.set(
        xlabel=f"window of {st.adjacency_window} tokens",
        ylabel="expert",
        title=f"{title}: tokens per expert per window, layer {st.layers[j]}",
    )
    fig.colorbar(im, ax=ax, label="tokens")
    return fig


def _adjacency(plt: Any, st: TraceStats, title: str) -> Figure:
    """DALI-style adjacency of the middle layer: busiest experts of one window (rows) vs the next (columns)."""
    j = len(st.layers) // 2
    fig, ax = plt.subplots(figsize=(4.8, 4.2))
    im = ax.imshow(st.adjacency_matrix[j], cmap="Blues", interpolation="nearest")
    ax.set(
        xlabel="top-k busiest expert, next window",
        ylabel="top-k busiest expert, window",
        title=f"high-workload adjacency, layer {st.layers[j]}",
    )
    fig.colorbar(im, ax=ax, label="window pairs")
    return fig
