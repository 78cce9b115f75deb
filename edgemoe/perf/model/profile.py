"""Machine profiles for the performance model: what a CPU, a GPU and the link between them cost.

A profile is a JSON file (format in docs/research/performance-model.md). `edgemoe profile` measures one on
this machine (`edgemoe.perf.measure.profiling`); the bundled ones (edgemoe/perf/profiles/*.json) describe
machines we do not have from published specifications, each naming its sources.

Matrix work is described per ggml type by a `Curve`: the time of a matrix product over c tokens is
``fixed_s(c) + s_per_byte(c) * weight_bytes``, with the per-byte rate for weights streamed from
memory (cold) and for weights that stay in the last-level cache (hot). A measured profile holds
curves at token counts 1, 2, 4, ... 512; a specification holds a roofline (memory bandwidth,
multiply-add throughput) from which curves are drawn.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any, cast

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ...errors import EdgeMoeError
from .profile_checks import CheckNote

PROFILE_FORMAT = 1
TOKEN_GRID = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class ProfileError(EdgeMoeError):
    """A profile file that cannot be used."""


def weights_per_byte(qtype: str) -> float:
    """Weights stored in one byte of a ggml type (Q4_K: 256 per 144 bytes)."""
    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    except KeyError:
        raise ProfileError(f"unknown ggml type {qtype!r}") from None
    return block / size


@dataclass(frozen=True)
class RatePoint:
    tokens: int
    fixed_s: float  # per product, independent of the weights' size
    s_per_byte: float  # per byte of weights read from memory
    s_per_byte_hot: float  # per byte of weights already in the last-level cache


@dataclass(frozen=True)
class Curve:
    """One ggml type on one device: seconds of a product of `nbytes` of weights by `tokens` tokens."""

    points: tuple[RatePoint, ...]  # ascending tokens

    def rate(self, tokens: int) -> RatePoint:
        """The point at `tokens`: log-linear between measured points; past the last one the per-byte
        cost grows in proportion to the tokens (compute-bound), below the first it is the first's."""
        pts = self.points
        c = max(1, int(tokens))
        if c <= pts[0].tokens:
            return pts[0]
        if c >= pts[-1].tokens:
            last = pts[-1]
            f = c / last.tokens
            return RatePoint(c, last.fixed_s, last.s_per_byte * f, last.s_per_byte_hot * f)
        for lo, hi in zip(pts, pts[1:], strict=False):
            if lo.tokens <= c <= hi.tokens:
                w = (math.log(c) - math.log(lo.tokens)) / (math.log(hi.tokens) - math.log(lo.tokens))
                return RatePoint(
                    c,
                    *(
                        a + w * (b - a)
                        for a, b in (
                            (lo.fixed_s, hi.fixed_s),
                            (lo.s_per_byte, hi.s_per_byte),
                            (lo.s_per_byte_hot, hi.s_per_byte_hot),
                        )
                    ),
                )
        raise AssertionError("unreachable")

    def seconds(self, nbytes: float, tokens: int, *, hot: bool = False) -> float:
        p = self.rate(tokens)
        return p.fixed_s + nbytes * (p.s_per_byte_hot if hot else p.s_per_byte)


@dataclass(frozen=True)
class Roofline:
    """A device's limits: the product is bound by reading the weights or by the multiply-adds."""

    mem_bw: float  # bytes/s from memory (DRAM, VRAM)
    flops: float  # multiply-add throughput of the matrix kernels, 2 flops each, per second
    cache_bw: float = 0.0  # bytes/s from the last-level cache (0: as mem_bw)
    fixed_s: float = 0.0  # per product (kernel launch, thread wake-up)
    # the routed experts' products (mul_mat_id) and the attention's (flash attention's QK^T and PV), where they
    # run at another rate than the dense products (0: at `flops`)
    expert_flops: float = 0.0
    attn_flops: float = 0.0

    def curve(self, qtype: str) -> Curve:
        """The dense products of a type."""
        return self._curve(qtype, self.flops)

    def expert_curve(self, qtype: str) -> Curve:
        """The routed experts' products of a type."""
        return self._curve(qtype, self.expert_flops or self.flops)

    @functools.lru_cache(maxsize=64)  # noqa: B019 - a frozen, hashable value object
    def _curve(self, qtype: str, flops: float) -> Curve:
        wpb = weights_per_byte(qtype)

        def point(c: int) -> RatePoint:
            compute = 2.0 * c * wpb / flops
            return RatePoint(
                c,
                self.fixed_s,
                max(1.0 / self.mem_bw, compute),
                max(1.0 / (self.cache_bw or self.mem_bw), compute),
            )

        return Curve(tuple(point(c) for c in TOKEN_GRID))


@dataclass(frozen=True)
class AttentionTimes:
    """One layer's attention of one decode token on the CPU, measured by `edgemoe profile` at a few lengths of
    the graph's KV view for one head shape: with flash attention (ggml_flash_attn_ext) and without (K^T q,
    softmax, V p and a copy: llama.cpp's mul_mat path)."""

    n_head: int  # query heads of the measured shape
    n_head_kv: int
    head_dim: int
    n_kv: tuple[int, ...]  # ascending KV lengths
    flash_s: tuple[float, ...]  # seconds at each length with flash attention
    plain_s: tuple[float, ...]  # and without
    # the bytes of the pool of caches the timed calls rotated over (a model's layers': each read from memory);
    # 0: one cache, read again from a cache (a tiny model's, as the host fit's probes have)
    pool_bytes: int = 0

    def __post_init__(self) -> None:
        n = len(self.n_kv)
        if not n or len(self.flash_s) != n or len(self.plain_s) != n:
            raise ValueError("decode attention needs one flash and one plain time per KV length")
        if any(b <= a for a, b in zip(self.n_kv, self.n_kv[1:], strict=False)) or self.n_kv[0] < 1:
            raise ValueError("decode attention's KV lengths must be positive and ascending")
        if min(self.flash_s + self.plain_s) <= 0 or min(self.n_head, self.n_head_kv, self.head_dim) < 1:
            raise ValueError("decode attention's times and head counts must be positive")

    def seconds(self, n_kv: int, *, flash: bool, heads: int, head_dim: int) -> float:
        """At a graph's KV length n_kv, for `heads` query heads of head_dim values: linear between the measured
        lengths (past the last one, the last two's slope; below the first, the first's time), scaled by the
        query heads times the head size (the work per cached token)."""
        ts = self.flash_s if flash else self.plain_s
        xs = self.n_kv
        if n_kv <= xs[-1] or len(xs) == 1:
            t = float(np.interp(n_kv, xs, ts))
        else:
            t = ts[-1] + (n_kv - xs[-1]) * (ts[-1] - ts[-2]) / (xs[-1] - xs[-2])
        return t * heads * head_dim / (self.n_head * self.head_dim)


def nearest_attention(
    measured: tuple[AttentionTimes, ...], heads: int, kv_heads: int, head_dim: int
) -> AttentionTimes | None:
    """The measured shape to price a model's attention by: its own, else the one whose query heads times head
    size is nearest (by ratio), one measured with its caches from memory first (another model's layers read
    theirs so); None when nothing was measured."""
    exact = [a for a in measured if (a.n_head, a.n_head_kv, a.head_dim) == (heads, kv_heads, head_dim)]
    if exact or not measured:
        return exact[0] if exact else None
    work = max(1, heads * head_dim)
    return min(measured, key=lambda a: (a.pool_bytes == 0, abs(math.log(a.n_head * a.head_dim / work))))


@dataclass(frozen=True)
class DeviceProfile:
    """A CPU (with its thread count) or a GPU."""

    name: str
    mem_bytes: int  # RAM or VRAM
    cache_bytes: int  # last-level cache: weights below this stay hot between tokens
    node_s: float  # dispatch cost of one graph node (CPU: the threads' barrier; GPU: a kernel launch)
    roofline: Roofline
    matmul: Mapping[str, Curve] = field(default_factory=dict)  # measured dense products per ggml type
    expert: Mapping[str, Curve] = field(default_factory=dict)  # measured expert FFNs (gate+up+down) per type
    threads: int = 0  # CPU threads the figures were measured with (0 for a GPU)
    attention: Curve | None = None  # F16 products with head-sized rows, per row (not per byte): K^T q and V p
    # one decode token's attention per layer, with and without flash attention, for a few head shapes (absent
    # before 2026-11-27: the attention curve prices it)
    decode_attention: tuple[AttentionTimes, ...] = ()
    # a GPU that takes ops on host weights for large batches (llama.cpp's op offload: CUDA does, the RPC
    # backend has no offload_op)
    op_offload: bool = True

    def matmul_curve(self, qtype: str) -> Curve:
        return self.matmul.get(qtype) or self.roofline.curve(qtype)

    def expert_curve(self, qtype: str) -> Curve:
        """Measured expert curve of the type, else its measured dense one (mul_mat_id reads weights as mul_mat
        does), else the roofline's experts."""
        return self.expert.get(qtype) or self.matmul.get(qtype) or self.roofline.expert_curve(qtype)


@dataclass(frozen=True)
class LinkProfile:
    """Host-to-device copies (PCIe)."""

    h2d_pageable: float  # bytes/s from ordinary (mmap'd) host memory
    h2d_pinned: float  # bytes/s from pinned staging buffers
    latency_s: float  # per copy or CPU<->GPU hand-off (a synchronisation)
    # bytes/s of the expert cache's loader: chunk-sized async copies on a copy stream from the device's host
    # buffers (measured by `edgemoe profile`); None (specification profiles): h2d_pinned, since the loader
    # sends through pinned staging buffers
    h2d_loads: float | None = None

    @property
    def loads_bw(self) -> float:
        """Bytes/s at which the expert cache's loads cross the link."""
        return self.h2d_loads if self.h2d_loads is not None else self.h2d_pinned


@dataclass(frozen=True)
class HostProfile:
    """What each llama_decode call costs outside the graph's nodes (Python, graph setup, sampling)."""

    call_s: float  # per call
    vocab_s: float  # per vocabulary entry per call (logits copy, finiteness check, argmax)
    node_elem_s: float = 0.0  # per graph node, per token beyond the first and per embedding element: the
    #                           elementwise work (norms, adds, rope, softmax) of a ubatch's nodes on the CPU


@dataclass(frozen=True)
class MachineProfile:
    name: str
    kind: str  # "measured" | "spec"
    cpu: DeviceProfile
    host: HostProfile
    gpu: DeviceProfile | None = None
    link: LinkProfile | None = None
    sources: tuple[str, ...] = ()  # where the numbers come from (specifications, the build that measured)
    notes: str = ""
    # timings `edgemoe profile`'s checks questioned: reproduced and kept, or repaired (absent before 2026-11-27)
    checks: tuple[CheckNote, ...] = ()

    @property
    def has_gpu(self) -> bool:
        return self.gpu is not None and self.link is not None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["format"] = PROFILE_FORMAT
        return d

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        tmp.replace(path)
        return path


# --------------------------------------------------------------------------- reading


def _curve(d: Mapping[str, Any]) -> Curve:
    pts = tuple(
        sorted(
            (
                RatePoint(
                    int(p["tokens"]),
                    float(p["fixed_s"]),
                    float(p["s_per_byte"]),
                    float(p.get("s_per_byte_hot", p["s_per_byte"])),
                )
                for p in d["points"]
            ),
            key=lambda p: p.tokens,
        )
    )
    if not pts or any(p.tokens < 1 or p.s_per_byte <= 0 or p.fixed_s < 0 for p in pts):
        raise ValueError("a curve needs points with tokens >= 1, s_per_byte > 0 and fixed_s >= 0")
    return Curve(pts)


def _attention_times(d: Mapping[str, Any]) -> AttentionTimes:
    return AttentionTimes(
        n_head=int(d["n_head"]),
        n_head_kv=int(d["n_head_kv"]),
        head_dim=int(d["head_dim"]),
        n_kv=tuple(int(x) for x in d["n_kv"]),
        flash_s=tuple(float(x) for x in d["flash_s"]),
        plain_s=tuple(float(x) for x in d["plain_s"]),
        pool_bytes=int(d.get("pool_bytes", 0)),
    )


def _device(d: Mapping[str, Any]) -> DeviceProfile:
    r = d["roofline"]
    roof = Roofline(
        float(r["mem_bw"]),
        float(r["flops"]),
        float(r.get("cache_bw", 0.0)),
        float(r.get("fixed_s", 0.0)),
        float(r.get("expert_flops", 0.0)),
        float(r.get("attn_flops", 0.0)),
    )
    if roof.mem_bw <= 0 or roof.flops <= 0 or roof.expert_flops < 0 or roof.attn_flops < 0:
        raise ValueError("roofline mem_bw and flops must be positive (expert_flops, attn_flops: 0 or more)")
    return DeviceProfile(
        name=str(d["name"]),
        mem_bytes=int(d["mem_bytes"]),
        cache_bytes=int(d["cache_bytes"]),
        node_s=float(d["node_s"]),
        roofline=roof,
        matmul={q: _curve(c) for q, c in d.get("matmul", {}).items()},
        expert={q: _curve(c) for q, c in d.get("expert", {}).items()},
        threads=int(d.get("threads", 0)),
        attention=_curve(d["attention"]) if d.get("attention") else None,
        decode_attention=tuple(_attention_times(a) for a in d.get("decode_attention", ())),
        op_offload=bool(d.get("op_offload", True)),
    )


def with_kind_rates(prof: MachineProfile, *, dense: float, expert: float, attention: float) -> MachineProfile:
    """`prof` with its GPU's dense products at `dense` times its roofline's flops, the routed experts' at `expert`
    times and the attention's at `attention` times (the prefill backtest's fitted rates, docs/research/
    performance-model.md); the name and notes say so. A profile without a GPU is returned as it is."""
    if prof.gpu is None:
        return prof
    roof = prof.gpu.roofline
    scaled = replace(
        roof, flops=dense * roof.flops, expert_flops=expert * roof.flops, attn_flops=attention * roof.flops
    )
    rates = f"dense products {dense:g}x, experts {expert:g}x, attention {attention:g}x the roofline's flops"
    return replace(
        prof,
        name=f"{prof.name}; {rates}",
        gpu=replace(prof.gpu, roofline=scaled),
        notes=f"{prof.notes} Scaled: {rates}.".strip(),
    )


def profile_from_dict(d: Mapping[str, Any]) -> MachineProfile:
    if int(d.get("format", PROFILE_FORMAT)) != PROFILE_FORMAT:
        raise ProfileError(
            f"profile format {d.get('format')} is not {PROFILE_FORMAT}: measure it again "
            "with `edgemoe profile`"
        )
    try:
        gpu = _device(d["gpu"]) if d.get("gpu") else None
        link = (
            LinkProfile(
                **cast(
                    "dict[str, Any]", {k: float(v) if v is not None else None for k, v in d["link"].items()}
                )
            )
            if d.get("link")
            else None
        )
        return MachineProfile(
            name=str(d["name"]),
            kind=str(d["kind"]),
            cpu=_device(d["cpu"]),
            host=HostProfile(**{k: float(v) for k, v in d["host"].items()}),
            gpu=gpu,
            link=link,
            sources=tuple(d.get("sources", ())),
            notes=str(d.get("notes", "")),
            checks=tuple(
                CheckNote(**{**c, "readings_s": tuple(float(r) for r in c["readings_s"])})
                for c in d.get("checks", ())
            ),
        )
    except (KeyError, TypeError, ValueError) as err:
        raise ProfileError(
            f"not a valid edgemoe profile ({type(err).__name__}: {err}); measure one with "
            "`edgemoe profile --out FILE` or pick a bundled one (`edgemoe simulate --help`)"
        ) from err


def bundled_profiles() -> dict[str, Path]:
    """Name -> file of the profiles shipped with edgemoe."""
    root = resources.files("edgemoe.perf") / "profiles"
    return {p.name.removesuffix(".json"): Path(str(p)) for p in root.iterdir() if p.name.endswith(".json")}


def load_profile(name_or_path: str | Path) -> MachineProfile:
    """A profile file, or the name of a bundled profile (e.g. ``rtx4060-laptop``)."""
    path = Path(name_or_path)
    bundled = bundled_profiles()
    if not path.exists() and str(name_or_path) in bundled:
        path = bundled[str(name_or_path)]
    if not path.exists():
        raise ProfileError(
            f"no profile {str(name_or_path)!r}: give a file written by `edgemoe profile` or one of "
            f"the bundled profiles: {', '.join(sorted(bundled))}"
        )
    try:
        d = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ProfileError(f"cannot read profile {path}: {err}") from err
    if not isinstance(d, dict):
        raise ProfileError(f"{path} is not an edgemoe profile (a JSON object is expected)")
    return profile_from_dict(d)
