"""What one layer of a model costs on a device: the shapes of a GGUF priced by a machine profile.

`ModelShape.read(path)` takes from the header alone (no weights read) what the timing model needs
per layer: the bytes and types of the matrices every token multiplies (attention, router, shared
experts, a dense FFN), the slices one routed expert occupies, the KV bytes and attention work per
cached token, and the output head. `LayerCosts` turns them into seconds on one device.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ...gguf.header import GgufHeader, check_gguf
from ...gguf.info import ModelInfo, is_expert_tensor, model_info
from ...plan.budget import estimate_kv_cache_bytes
from ...policies.assignment import CostModel, TransferMode
from .profile import Curve, DeviceProfile, LinkProfile, MachineProfile, ProfileError, nearest_attention

_BLOCK = re.compile(r"^blk\.(\d+)\.")
KV_PAD = 256  # llama.cpp pads the KV length its attention graph reads to a multiple of this
FA_SPLIT_KV = (
    512  # ggml's CPU flash attention splits one token's keys between its threads from this length on
)


@dataclass(frozen=True)
class Weights:
    qtype: str  # ggml type name
    nbytes: int


@dataclass(frozen=True)
class LayerShape:
    il: int
    dense: tuple[Weights, ...]  # matrices every token of the layer multiplies
    expert: tuple[
        Weights, ...
    ]  # one routed expert's slices of the stacked *_exps matrices (empty: dense layer)
    kv_bytes_per_token: int  # K and V (f16) one cached token adds
    attn_flops_per_pair: int  # flops of one (query, cached key) pair: QK^T and the V product


@dataclass(frozen=True)
class ModelShape:
    name: str  # the file's
    layers: tuple[LayerShape, ...]
    head: Weights  # the output projection (token_embd when the model ties them)
    info: ModelInfo

    @property
    def architecture(self) -> str:
        return self.info.architecture

    @property
    def n_vocab(self) -> int:
        return self.info.n_vocab

    @property
    def n_expert(self) -> int:
        return self.info.n_expert

    @property
    def n_expert_used(self) -> int:
        return self.info.n_expert_used

    @property
    def total_bytes(self) -> int:
        """Every tensor: decides whether weights stay in a cache between tokens."""
        return self.info.total_tensor_bytes

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(ly.il for ly in self.layers if ly.expert)

    def expert_bytes(self, il: int) -> int:
        return sum(w.nbytes for w in self.layer(il).expert)

    def layer(self, il: int) -> LayerShape:
        return self.layers[il]

    @classmethod
    def read(cls, path: str | Path) -> ModelShape:
        return cls.from_header(check_gguf(path))

    @classmethod
    def from_header(cls, header: GgufHeader) -> ModelShape:
        """The shape from a header already parsed (an open Engine's `header`)."""
        path = header.path
        info = model_info(header)
        n_trunk = info.n_layer - info.n_nextn  # MTP blocks run in a draft context, not in a decode step
        dense: dict[int, list[Weights]] = {il: [] for il in range(n_trunk)}
        expert: dict[int, list[Weights]] = {il: [] for il in range(n_trunk)}
        head = embd = None
        for t in header.tensors:
            m = _BLOCK.match(t.name)
            if m is None:
                if t.name == "output.weight":
                    head = Weights(t.qtype.name, t.nbytes)
                elif t.name == "token_embd.weight":
                    embd = Weights(t.qtype.name, t.nbytes)
                continue
            il = int(m.group(1))
            if il not in dense or len(t.shape) < 2 or t.shape[1] == 1:
                continue  # norms, biases, per-expert scales: no matrix product
            if is_expert_tensor(t.name):
                if len(t.shape) == 3:
                    expert[il].append(Weights(t.qtype.name, t.nbytes // t.shape[-1]))
            else:
                dense[il].append(Weights(t.qtype.name, t.nbytes))
        kv_token = estimate_kv_cache_bytes(info, 1) // max(1, n_trunk)
        heads = info.n_head * (info.n_embd_head_k + info.n_embd_head_v)
        layers = tuple(
            LayerShape(il, tuple(dense[il]), tuple(expert[il]), kv_token, 2 * heads) for il in range(n_trunk)
        )
        out = head or embd or Weights("F16", 2 * info.n_vocab * info.n_embd)
        return cls(name=Path(path).name, layers=layers, head=out, info=info)


def _matmul_s(dev: DeviceProfile, ws: tuple[Weights, ...], tokens: int, hot: bool) -> float:
    return sum(dev.matmul_curve(w.qtype).seconds(w.nbytes, tokens, hot=hot) for w in ws)


def graph_kv_length(cached: int) -> int:
    """The KV length of llama.cpp's attention over `cached` tokens (the step's own included): padded to
    KV_PAD so the graph stays the same between steps (llama_kv_cache::get_n_kv; the cache's size caps it)."""
    return max(KV_PAD, -(-cached // KV_PAD) * KV_PAD)


@dataclass(frozen=True)
class LayerCosts:
    """Seconds of a model's pieces on one device. hot: the weights stay in its last-level cache. flash_attn:
    the attention runs llama.cpp's flash-attention kernel (its default, "auto", on the CPU and CUDA)."""

    dev: DeviceProfile
    shape: ModelShape
    hot: bool
    flash_attn: bool = True
    _memo: dict[tuple[str, int, int], float] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(
        cls,
        dev: DeviceProfile,
        shape: ModelShape,
        *,
        resident_bytes: int | None = None,
        flash_attn: bool = True,
    ) -> LayerCosts:
        """resident_bytes: the weights this device reads each token (default: the whole model)."""
        size = shape.total_bytes if resident_bytes is None else resident_bytes
        return cls(dev, shape, hot=size <= dev.cache_bytes, flash_attn=flash_attn)

    def dense(self, il: int, tokens: int) -> float:
        key = ("dense", il, tokens)
        if key not in self._memo:
            self._memo[key] = _matmul_s(self.dev, self.shape.layers[il].dense, tokens, self.hot)
        return self._memo[key]

    def attention(self, il: int, tokens: int, kv_len: int) -> float:
        """The attention of `tokens` new tokens over `kv_len` cached ones. One decode token on a device whose
        profile measured it (`decode_attention`): the measured layer, with or without flash attention, at the
        graph's padded KV length. Else measured products (a profile's attention curve): K^T q and V p as F16
        products of one head-sized row per (head, key), the causal mask saving nothing. Else a roofline: read
        the cache once, and the multiply-adds of the (query, key) pairs, each query seeing about half of the
        new tokens."""
        info = self.shape.info
        head_dim = (info.n_embd_head_k + info.n_embd_head_v) // 2
        measured = nearest_attention(self.dev.decode_attention, info.n_head, info.n_head_kv, head_dim)
        if tokens == 1 and measured is not None and info.n_head > 0:
            n_kv = graph_kv_length(kv_len + 1)
            t = measured.seconds(n_kv, flash=self.flash_attn, heads=info.n_head, head_dim=head_dim)
            # below FA_SPLIT_KV each thread takes whole rows and skips the masked (not yet cached) keys; from it
            # on the threads split the keys, and the first thread's share is all cached
            return t * (kv_len + 1) / n_kv if self.flash_attn and n_kv < FA_SPLIT_KV else t
        if self.dev.attention is not None:
            rows = self.shape.info.n_head * (kv_len + tokens)
            return 2 * self.dev.attention.seconds(rows, tokens, hot=True)
        ly = self.shape.layers[il]
        pairs = tokens * kv_len + tokens * (tokens + 1) // 2
        roof = self.dev.roofline
        bw = (roof.cache_bw or roof.mem_bw) if self.hot else roof.mem_bw
        flops = roof.attn_flops or roof.flops
        return (kv_len + tokens) * ly.kv_bytes_per_token / bw + pairs * ly.attn_flops_per_pair / flops

    def expert(self, il: int, tokens: int) -> float:
        """What one routed expert adds to its layer's expert products over `tokens` tokens routed to it (the
        products' fixed cost is the layer's, paid once: `experts`)."""
        key = ("expert", il, tokens)
        if key not in self._memo:
            ws = self.shape.layers[il].expert
            self._memo[key] = (
                sum(w.nbytes * expert_per_byte(self.dev, w.qtype, tokens, self.hot) for w in ws)
                if ws and tokens > 0
                else 0.0
            )
        return self._memo[key]

    def expert_fixed(self, il: int, tokens: int) -> float:
        """The fixed cost of a layer's expert products (gate, up, down: one mul_mat_id each, whatever the number
        of experts), at the largest token count an expert gets."""
        ws = self.shape.layers[il].expert
        if not ws or tokens <= 0:
            return 0.0
        return self.dev.expert_curve(max(ws, key=lambda w: w.nbytes).qtype).rate(tokens).fixed_s

    def experts(self, il: int, token_counts: Mapping[int, int] | list[int]) -> float:
        counts = list(token_counts.values() if isinstance(token_counts, Mapping) else token_counts)
        if not counts:
            return 0.0
        return self.expert_fixed(il, max(counts)) + sum(self.expert(il, c) for c in counts)

    def head(self, tokens: int) -> float:
        return _matmul_s(self.dev, (self.shape.head,), tokens, self.hot)

    def prefill_ubatch(self, tokens: int) -> float:
        """A fresh sequence's ubatch of `tokens` with the routed slots spread evenly over the experts (a random
        router's, as the profiling probes have): matrices, attention and experts, all on this device."""
        e, k = max(1, self.shape.n_expert), self.shape.n_expert_used
        per = max(1, round(tokens * k / e))
        used = min(e, tokens * k)
        t = self.head(1)
        for ly in self.shape.layers:
            t += self.dense(ly.il, tokens) + self.attention(ly.il, tokens, 0)
            t += self.experts(ly.il, [per] * used) if ly.expert else 0.0
        return t

    def decode_step(self, kv_len: int, experts_per_layer: int | None = None) -> float:
        """The matrix and attention work of one decode token with every layer's experts on this device, each
        of `experts_per_layer` (default: the model's top-k) experts taking the token."""
        k = self.shape.n_expert_used if experts_per_layer is None else experts_per_layer
        t = self.head(1)
        for ly in self.shape.layers:
            t += (
                self.dense(ly.il, 1)
                + self.attention(ly.il, 1, kv_len)
                + (self.experts(ly.il, [1] * k) if ly.expert else 0.0)
            )
        return t


def expert_costs(shape: ModelShape, prof: MachineProfile) -> dict[int, CostModel]:
    """Each MoE layer's cost model for the CPU/GPU assigner (edgemoe.policies.assignment), priced by `prof`:
    one expert's CPU and GPU time over n tokens, its copy at the cache loader's rate (the copy, then the
    compute: llama.cpp runs a layer's cached experts after their loads), and a hand-off of the activations
    each way plus the CPU products' fixed cost when any expert of the layer runs on the CPU."""
    if prof.gpu is None or prof.link is None:
        raise ProfileError(
            f"profile {prof.name!r} has no GPU: `assign` weighs CPU against GPU time; give a "
            "GPU machine's profile (a bundled one, or `edgemoe profile` on a CUDA build)"
        )
    cpu, gpu = LayerCosts.of(prof.cpu, shape), LayerCosts.of(prof.gpu, shape)
    return {il: layer_cost_model(cpu, gpu, prof.link, il) for il in shape.moe_layers}


def layer_cost_model(
    cpu: LayerCosts, gpu: LayerCosts, link: LinkProfile, il: int, *, handoff_tokens: int = 1
) -> CostModel:
    """Layer il's assigner costs: an expert's CPU and GPU time over n tokens, its copy at the cache loader's
    rate then its compute (SERIAL), and a hand-off of two link latencies plus the CPU products' fixed cost at
    `handoff_tokens` (the most tokens an expert of the ubatch gets)."""
    copy = cpu.shape.expert_bytes(il) / link.loads_bw
    return CostModel(
        cpu_s=lambda n: cpu.expert(il, n),
        gpu_s=lambda n: gpu.expert(il, n),
        transfer_s=lambda: copy,
        transfer_mode=TransferMode.SERIAL,
        cpu_handoff_s=2 * link.latency_s + cpu.expert_fixed(il, handoff_tokens),
    )


# token counts at which an expert's product streams its weights from memory as a dense matmul does (the profile
# checks' memory-bound counts, edgemoe.perf.model.profile_checks.Tolerances.type_order_max_tokens)
MEMORY_BOUND_TOKENS = 2


def expert_per_byte(dev: DeviceProfile, qtype: str, tokens: int, hot: bool) -> float:
    """Seconds per weight byte of a routed expert's products over `tokens` tokens. Cold at a memory-bound count
    it is at least the same type's cold dense matmul's: both read their weights once from memory, so an expert
    reading faster either read its microbenchmark's pool from a cache (a VM's cores on two L3 slices hold twice
    the L3 it reports) or has a cost per expert that the slope between the two sizes leaves out (on a Zen 5 VM,
    whose 512 MiB pools time as 3 GiB ones do, eight experts in one mul_mat_id took what the matmul's rate
    prices); that rate contradicts the others and the matmul's is used (profile_checks.expert_reads_cached)."""
    rate = _per_byte(dev.expert_curve(qtype), tokens, hot)
    if hot or tokens > MEMORY_BOUND_TOKENS or qtype not in dev.matmul:
        return rate
    return max(rate, _per_byte(dev.matmul[qtype], tokens, hot=False))


def cached_expert_reads(dev: DeviceProfile) -> list[str]:
    """A note for each expert rate that contradicts its type's dense matmul (expert_per_byte prices it at the
    matmul's): cold, at a memory-bound token count, faster per byte."""
    out = []
    for q, curve in sorted(dev.expert.items()):
        for t in range(1, MEMORY_BOUND_TOKENS + 1):
            if q in dev.matmul and (m := _per_byte(dev.matmul[q], t, False)) > (
                e := _per_byte(curve, t, False)
            ):
                out.append(
                    f"{q} experts read {1e-9 / e:.0f} GB/s cold at {t} token(s), faster than {q} matmuls' "
                    f"{1e-9 / m:.0f} GB/s (a pool read from a cache, or a two-size slope short of the per-expert cost); "
                    "priced at the matmuls' rate"
                )
    return out


def _per_byte(curve: Curve, tokens: int, hot: bool) -> float:
    p = curve.rate(tokens)
    return p.s_per_byte_hot if hot else p.s_per_byte
