"""Text table and bar chart of a simulation (`edgemoe simulate`); every number is labelled projected."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .simulate import SimResult


def format_simulation(res: SimResult) -> str:
    budget = f"{res.vram / 2**30:.1f} GiB" if res.vram > 0 else "CPU only"
    head = (
        f"PROJECTED · {res.model} · profile {res.profile} · {budget} · {res.slots_per_layer} slots/layer"
        + (f" · best --n-cpu-moe {res.n_cpu_moe}" if res.n_cpu_moe is not None else "")
    )
    lines = [
        head,
        f"{'configuration':<26} {'decode t/s':>10} {'prefill t/s':>11} {'TTFT ms':>8} {'hit rate':>8} "
        f"{'PCIe MB/tok':>11}  bottleneck",
    ]
    for c in res.configs:
        hit = f"{c.hit_rate:.3f}" if c.hit_rate is not None else "-"
        lines.append(
            f"{c.name:<26} {c.decode_tps:>10.2f} {c.prefill_tps:>11.1f} {c.ttft_s * 1e3:>8.0f} {hit:>8} "
            f"{c.pcie_bytes_per_token / 1e6:>11.2f}  {c.bottleneck}"
        )
    if res.workload_note:
        lines.append(f"note: {res.workload_note}")
    return "\n".join(lines)


def plot_speeds(rows: Sequence[Any], title: str, out: Path, *, suffix: str = "") -> None:
    """Decode and prefill tok/s of `rows` (each with name, kind, decode_tps, prefill_tps) as two bar charts
    side by side, stock grey, saved to `out` (bench's measured rows and simulate's projected ones)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for ax, key, label in (
        (axes[0], "decode_tps", "decode tokens/s"),
        (axes[1], "prefill_tps", "prefill tokens/s"),
    ):
        ax.barh(
            [r.name for r in rows],
            [getattr(r, key) for r in rows],
            color=["#888" if r.kind == "stock" else "#2a7" for r in rows],
        )
        ax.set_xlabel(label + suffix)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def plot_simulation(res: SimResult, out: Path) -> None:
    title = f"PROJECTED · {res.model} · {res.profile} · {res.vram / 2**30:.1f} GiB"
    plot_speeds(res.configs, title, out, suffix=" (projected)")
