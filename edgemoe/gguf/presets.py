"""Shapes of real (and tiny test) MoE models, and the tensor list llama.cpp expects for them.

Dimensions come from each model's Hugging Face config.json; tensor names and shapes
mirror `load_arch_tensors` in vendor/llama.cpp/src/models/<arch>.cpp (llama.cpp of
llama-cpp-python 0.3.36). Shapes are in ggml order: ne0 (the row length) first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from gguf import GGML_QUANT_SIZES, MODEL_TENSOR, TENSOR_NAMES, GGMLQuantizationType

Q = GGMLQuantizationType
T = MODEL_TENSOR


@dataclass(frozen=True)
class MlaConfig:
    """DeepSeek multi-head latent attention (config.json names in comments)."""

    kv_lora_rank: int  # kv_lora_rank
    q_lora_rank: int  # q_lora_rank (0: plain wq, as in V2-Lite)
    qk_rope_head_dim: int  # qk_rope_head_dim
    qk_nope_head_dim: int  # qk_nope_head_dim
    v_head_dim: int  # v_head_dim


@dataclass(frozen=True)
class SynthPreset:
    name: str
    arch: str  # GGUF general.architecture
    source: str  # the model whose shapes these are
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int  # per attention head (q, k and v)
    n_vocab: int
    n_ctx_train: int
    n_ff: int  # dense feed-forward length (llama arch: also each expert's)
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0  # routed expert feed-forward length
    n_expert_shared: int = 0  # deepseek2: shared experts of n_ff_exp each
    n_ff_shexp: int = 0  # qwen2moe: shared expert feed-forward length
    n_layer_dense_lead: int = 0  # deepseek2: leading layers with a dense FFN
    qkv_bias: bool = False  # q/k/v projection biases (qwen2moe, gpt-oss)
    mla: MlaConfig | None = None
    n_nextn: int = 0  # MTP (NextN) blocks after the trunk (deepseek2: nextn_predict_layers)
    sliding_window: int = 0  # gpt-oss: every other layer
    rope_freq_base: float = 10000.0
    rms_eps: float = 1e-6
    tiny: bool = False  # a test model, a few MB

    @property
    def is_moe(self) -> bool:
        return self.n_expert > 0


_V2_LITE_MLA = MlaConfig(
    kv_lora_rank=512, q_lora_rank=0, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128
)
_TINY: dict[str, Any] = {
    "n_embd": 256,
    "n_head": 4,
    "n_head_kv": 2,
    "head_dim": 64,
    "n_vocab": 1024,
    "n_ctx_train": 2048,
    "tiny": True,
}

_TINY_DEEPSEEK2: dict[str, Any] = {  # both tiny deepseek2 presets: one dense lead layer, then MoE
    "n_layer": 3,
    "n_ff": 512,
    "n_expert": 8,
    "n_expert_used": 2,
    "n_ff_exp": 256,
    "n_layer_dense_lead": 1,
    **_TINY,
    "n_head_kv": 1,
    "head_dim": 96,
}

PRESETS: dict[str, SynthPreset] = {
    p.name: p
    for p in (
        SynthPreset(
            "qwen3-30b-a3b",
            "qwen3moe",
            "Qwen/Qwen3-30B-A3B",
            n_layer=48,
            n_embd=2048,
            n_head=32,
            n_head_kv=4,
            head_dim=128,
            n_vocab=151936,
            n_ctx_train=40960,
            n_ff=6144,
            n_expert=128,
            n_expert_used=8,
            n_ff_exp=768,
            rope_freq_base=1e6,
        ),
        SynthPreset(
            "mixtral-8x7b",
            "llama",
            "mistralai/Mixtral-8x7B-v0.1",
            n_layer=32,
            n_embd=4096,
            n_head=32,
            n_head_kv=8,
            head_dim=128,
            n_vocab=32000,
            n_ctx_train=32768,
            n_ff=14336,
            n_expert=8,
            n_expert_used=2,
            rope_freq_base=1e6,
            rms_eps=1e-5,
        ),
        SynthPreset(
            "gpt-oss-20b",
            "gpt-oss",
            "openai/gpt-oss-20b",
            n_layer=24,
            n_embd=2880,
            n_head=64,
            n_head_kv=8,
            head_dim=64,
            n_vocab=201088,
            n_ctx_train=131072,
            n_ff=2880,
            n_expert=32,
            n_expert_used=4,
            n_ff_exp=2880,
            qkv_bias=True,
            sliding_window=128,
            rope_freq_base=150000.0,
            rms_eps=1e-5,
        ),
        SynthPreset(
            "deepseek-v2-lite",
            "deepseek2",
            "deepseek-ai/DeepSeek-V2-Lite",
            n_layer=27,
            n_embd=2048,
            n_head=16,
            n_head_kv=1,
            head_dim=192,
            n_vocab=102400,
            n_ctx_train=163840,
            n_ff=10944,
            n_expert=64,
            n_expert_used=6,
            n_ff_exp=1408,
            n_expert_shared=2,
            n_layer_dense_lead=1,
            mla=_V2_LITE_MLA,
        ),
        SynthPreset(
            "olmoe-1b-7b",
            "olmoe",
            "allenai/OLMoE-1B-7B-0924",
            n_layer=16,
            n_embd=2048,
            n_head=16,
            n_head_kv=16,
            head_dim=128,
            n_vocab=50304,
            n_ctx_train=4096,
            n_ff=1024,
            n_expert=64,
            n_expert_used=8,
            rms_eps=1e-5,
        ),
        SynthPreset(
            "tiny-qwen3moe",
            "qwen3moe",
            "test",
            n_layer=2,
            n_ff=512,
            n_expert=8,
            n_expert_used=2,
            n_ff_exp=256,
            **_TINY,
        ),
        SynthPreset(
            "tiny-mixtral", "llama", "test", n_layer=2, n_ff=256, n_expert=4, n_expert_used=2, **_TINY
        ),
        SynthPreset(
            "tiny-qwen2moe",
            "qwen2moe",
            "test",
            n_layer=2,
            n_ff=512,
            n_expert=8,
            n_expert_used=2,
            n_ff_exp=256,
            n_ff_shexp=512,
            qkv_bias=True,
            **_TINY,
        ),
        SynthPreset(
            "tiny-deepseek2",
            "deepseek2",
            "test",
            n_expert_shared=2,
            mla=MlaConfig(
                kv_lora_rank=128, q_lora_rank=0, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64
            ),
            **_TINY_DEEPSEEK2,
        ),
        SynthPreset(  # DeepSeek-V3's layout: q_lora and one MTP (NextN) block, which llama.cpp's MTP graph needs
            "tiny-deepseek2-mtp",
            "deepseek2",
            "test",
            n_expert_shared=1,
            mla=MlaConfig(
                kv_lora_rank=128, q_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64
            ),
            n_nextn=1,
            **_TINY_DEEPSEEK2,
        ),
        SynthPreset("tiny-llama-dense", "llama", "test", n_layer=2, n_ff=512, **_TINY),
        SynthPreset(
            "tiny-gpt-oss",
            "gpt-oss",
            "test",
            n_layer=2,
            n_ff=256,
            n_expert=8,
            n_expert_used=2,
            n_ff_exp=256,
            qkv_bias=True,
            sliding_window=128,
            **_TINY,
        ),
        SynthPreset(
            "tiny-olmoe",
            "olmoe",
            "test",
            n_layer=2,
            n_ff=256,
            n_expert=8,
            n_expert_used=2,
            **{**_TINY, "n_head_kv": 4},
        ),
    )
}


def get_preset(name: str) -> SynthPreset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}: choose one of {', '.join(PRESETS)}") from None


# --------------------------------------------------------------------------- tensor plan


class Role(Enum):
    """What a tensor is, which decides its ggml type and initial values."""

    NORM = "norm"  # F32 ones
    SMALL = "small"  # 1-D biases, attention sinks, the router: F32, random
    EMBED = "embed"
    OUTPUT = "output"
    ATTN = "attn"
    DENSE_FFN = "dense_ffn"
    SHARED = "shared"  # shared-expert matrices
    EXPERT = "expert"  # stacked routed experts (*_exps)
    SCALE = "scale"  # per-expert output scales (*_exps.scale): F32 around 1


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    shape: tuple[int, ...]  # ggml order, ne0 first
    qtype: GGMLQuantizationType
    role: Role

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        block, type_size = GGML_QUANT_SIZES[self.qtype]
        return self.n_elements // block * type_size


QTYPES: tuple[str, ...] = ("Q4_K", "Q5_K", "Q6_K", "Q8_0", "F16", "F32", "MXFP4")

# (token_embd, output) per --type, as llama-quantize's *_M mixes do; MXFP4 follows the
# gpt-oss release: MXFP4 experts, Q8_0 for every other matrix.
_EMBED_OUTPUT = {
    "Q4_K": (Q.Q4_K, Q.Q6_K),
    "Q5_K": (Q.Q5_K, Q.Q6_K),
    "Q6_K": (Q.Q6_K, Q.Q6_K),
    "Q8_0": (Q.Q8_0, Q.Q8_0),
    "F16": (Q.F16, Q.F16),
    "F32": (Q.F32, Q.F32),
    "MXFP4": (Q.Q8_0, Q.Q8_0),
}
# llama-quant.cpp tensor_type_fallback: rows not divisible by 256 get a 32-block type
_FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}


def normalize_qtype(qtype: str) -> str:
    q = qtype.upper()
    if q not in QTYPES:
        raise ValueError(f"unsupported --type {qtype!r}: choose one of {', '.join(QTYPES)}")
    return q


def tensor_type(role: Role, shape: tuple[int, ...], qtype: str) -> GGMLQuantizationType:
    """ggml type of one tensor when the model is written with --type `qtype`."""
    if role in (Role.NORM, Role.SMALL) or len(shape) == 1:
        return Q.F32
    embed, output = _EMBED_OUTPUT[qtype]
    if role is Role.EMBED:
        want = embed
    elif role is Role.OUTPUT:
        want = output
    elif qtype == "MXFP4":
        want = Q.MXFP4 if role is Role.EXPERT else Q.Q8_0
    else:
        want = Q[qtype]
    if shape[0] % GGML_QUANT_SIZES[want][0]:
        want = _FALLBACK.get(want, Q.F16)
    if shape[0] % GGML_QUANT_SIZES[want][0]:
        want = Q.F16
    return want


def _tn(tensor: MODEL_TENSOR, il: int | None = None, suffix: str = "weight") -> str:
    return TENSOR_NAMES[tensor].format(bid=il) + "." + suffix


_Spec = tuple[str, tuple[int, ...], Role]


def _attn_qkv(p: SynthPreset, il: int) -> list[_Spec]:
    q, kv = p.n_head * p.head_dim, p.n_head_kv * p.head_dim
    specs: list[_Spec] = [
        (_tn(T.ATTN_Q, il), (p.n_embd, q), Role.ATTN),
        (_tn(T.ATTN_K, il), (p.n_embd, kv), Role.ATTN),
        (_tn(T.ATTN_V, il), (p.n_embd, kv), Role.ATTN),
        (_tn(T.ATTN_OUT, il), (q, p.n_embd), Role.ATTN),
    ]
    if p.qkv_bias:
        specs += [
            (_tn(T.ATTN_Q, il, "bias"), (q,), Role.SMALL),
            (_tn(T.ATTN_K, il, "bias"), (kv,), Role.SMALL),
            (_tn(T.ATTN_V, il, "bias"), (kv,), Role.SMALL),
        ]
    return specs


def _experts(p: SynthPreset, il: int, n_ff: int) -> list[_Spec]:
    return [
        (_tn(T.FFN_GATE_INP, il), (p.n_embd, p.n_expert), Role.SMALL),
        (_tn(T.FFN_GATE_EXP, il), (p.n_embd, n_ff, p.n_expert), Role.EXPERT),
        (_tn(T.FFN_UP_EXP, il), (p.n_embd, n_ff, p.n_expert), Role.EXPERT),
        (_tn(T.FFN_DOWN_EXP, il), (n_ff, p.n_embd, p.n_expert), Role.EXPERT),
    ]


def _ffn(p: SynthPreset, il: int, n_ff: int, gate: T, up: T, down: T, role: Role) -> list[_Spec]:
    return [
        (_tn(gate, il), (p.n_embd, n_ff), role),
        (_tn(up, il), (p.n_embd, n_ff), role),
        (_tn(down, il), (n_ff, p.n_embd), role),
    ]


def _block_qwen3moe(p: SynthPreset, il: int) -> list[_Spec]:
    return [
        (_tn(T.ATTN_NORM, il), (p.n_embd,), Role.NORM),
        *_attn_qkv(p, il),
        (_tn(T.ATTN_K_NORM, il), (p.head_dim,), Role.NORM),
        (_tn(T.ATTN_Q_NORM, il), (p.head_dim,), Role.NORM),
        (_tn(T.FFN_NORM, il), (p.n_embd,), Role.NORM),
        *_experts(p, il, p.n_ff_exp),
    ]


def _block_llama(p: SynthPreset, il: int) -> list[_Spec]:
    specs = [
        (_tn(T.ATTN_NORM, il), (p.n_embd,), Role.NORM),
        *_attn_qkv(p, il),
        (_tn(T.FFN_NORM, il), (p.n_embd,), Role.NORM),
    ]
    if p.is_moe:  # Mixtral: the experts use feed_forward_length
        return specs + _experts(p, il, p.n_ff)
    return specs + _ffn(p, il, p.n_ff, T.FFN_GATE, T.FFN_UP, T.FFN_DOWN, Role.DENSE_FFN)


def _block_qwen2moe(p: SynthPreset, il: int) -> list[_Spec]:
    return [
        (_tn(T.ATTN_NORM, il), (p.n_embd,), Role.NORM),
        *_attn_qkv(p, il),
        (_tn(T.FFN_NORM, il), (p.n_embd,), Role.NORM),
        *_experts(p, il, p.n_ff_exp),
        (_tn(T.FFN_GATE_INP_SHEXP, il), (p.n_embd,), Role.SMALL),
        *_ffn(p, il, p.n_ff_shexp, T.FFN_GATE_SHEXP, T.FFN_UP_SHEXP, T.FFN_DOWN_SHEXP, Role.SHARED),
    ]


def _block_olmoe(p: SynthPreset, il: int) -> list[_Spec]:
    return [
        (_tn(T.ATTN_NORM, il), (p.n_embd,), Role.NORM),
        *_attn_qkv(p, il),
        (_tn(T.ATTN_Q_NORM, il), (p.n_embd,), Role.NORM),
        (_tn(T.ATTN_K_NORM, il), (p.n_embd,), Role.NORM),
        (_tn(T.FFN_NORM, il), (p.n_embd,), Role.NORM),
        *_experts(p, il, p.n_ff),
    ]


def _block_gpt_oss(p: SynthPreset, il: int) -> list[_Spec]:
    n_ff = p.n_ff_exp
    return [
        (_tn(T.ATTN_NORM, il), (p.n_embd,), Role.NORM),
        (_tn(T.ATTN_POST_NORM, il), (p.n_embd,), Role.NORM),
        *_attn_qkv(p, il),
        (_tn(T.ATTN_SINKS, il), (p.n_head,), Role.SMALL),
        *_experts(p, il, n_ff),
        (_tn(T.ATTN_OUT, il, "bias"), (p.n_embd,), Role.SMALL),
        (_tn(T.FFN_GATE_INP, il, "bias"), (p.n_expert,), Role.SMALL),
        (_tn(T.FFN_GATE_EXP, il, "bias"), (n_ff, p.n_expert), Role.SMALL),
        (_tn(T.FFN_DOWN_EXP, il, "bias"), (p.n_embd, p.n_expert), Role.SMALL),
        (_tn(T.FFN_UP_EXP, il, "bias"), (n_ff, p.n_expert), Role.SMALL),
    ]


def _block_deepseek2(p: SynthPreset, il: int) -> list[_Spec]:
    mla = p.mla
    assert mla is not None, "deepseek2 presets need an MlaConfig"
    k_mla = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    specs: list[_Spec] = [(_tn(T.ATTN_NORM, il), (p.n_embd,), Role.NORM)]
    if mla.q_lora_rank:
        specs += [(_tn(T.ATTN_Q_A_NORM, il), (mla.q_lora_rank,), Role.NORM)]
    specs += [(_tn(T.ATTN_KV_A_NORM, il), (mla.kv_lora_rank,), Role.NORM)]
    if mla.q_lora_rank:
        specs += [
            (_tn(T.ATTN_Q_A, il), (p.n_embd, mla.q_lora_rank), Role.ATTN),
            (_tn(T.ATTN_Q_B, il), (mla.q_lora_rank, p.n_head * k_mla), Role.ATTN),
        ]
    else:
        specs += [(_tn(T.ATTN_Q, il), (p.n_embd, p.n_head * k_mla), Role.ATTN)]
    specs += [
        (_tn(T.ATTN_KV_A_MQA, il), (p.n_embd, mla.kv_lora_rank + mla.qk_rope_head_dim), Role.ATTN),
        (_tn(T.ATTN_K_B, il), (mla.qk_nope_head_dim, mla.kv_lora_rank, p.n_head), Role.ATTN),
        (_tn(T.ATTN_V_B, il), (mla.kv_lora_rank, mla.v_head_dim, p.n_head), Role.ATTN),
        (_tn(T.ATTN_OUT, il), (p.n_head * mla.v_head_dim, p.n_embd), Role.ATTN),
        (_tn(T.FFN_NORM, il), (p.n_embd,), Role.NORM),
    ]
    if il < p.n_layer_dense_lead:
        return specs + _ffn(p, il, p.n_ff, T.FFN_GATE, T.FFN_UP, T.FFN_DOWN, Role.DENSE_FFN)
    n_sh = p.n_ff_exp * p.n_expert_shared
    return (
        specs
        + _experts(p, il, p.n_ff_exp)
        + _ffn(p, il, n_sh, T.FFN_GATE_SHEXP, T.FFN_UP_SHEXP, T.FFN_DOWN_SHEXP, Role.SHARED)
    )


def _nextn(p: SynthPreset, il: int) -> list[_Spec]:
    """What an MTP (NextN) block adds to an ordinary block: the projection of [embedding; hidden state] and
    its norms. The optional vocabulary-sized tensors are left out: llama.cpp then uses token_embd and output."""
    return [
        (_tn(T.NEXTN_EH_PROJ, il), (2 * p.n_embd, p.n_embd), Role.ATTN),
        (_tn(T.NEXTN_ENORM, il), (p.n_embd,), Role.NORM),
        (_tn(T.NEXTN_HNORM, il), (p.n_embd,), Role.NORM),
        (_tn(T.NEXTN_SHARED_HEAD_NORM, il), (p.n_embd,), Role.NORM),
    ]


_BLOCKS: dict[str, Callable[[SynthPreset, int], list[_Spec]]] = {
    "qwen3moe": _block_qwen3moe,
    "llama": _block_llama,
    "qwen2moe": _block_qwen2moe,
    "olmoe": _block_olmoe,
    "gpt-oss": _block_gpt_oss,
    "deepseek2": _block_deepseek2,
}


def n_layers_for(preset: SynthPreset, layers: int | None) -> int:
    if layers is None:
        return preset.n_layer
    if not 1 <= layers <= preset.n_layer:
        raise ValueError(f"`layers={layers}` is out of range: {preset.name} has 1..{preset.n_layer} layers")
    return layers


def plan_tensors(
    preset: SynthPreset | str, *, layers: int | None = None, qtype: str = "Q4_K", expert_scales: bool = False
) -> tuple[PlannedTensor, ...]:
    """Every tensor of the synthetic file, in file order, with its ggml type. Writes nothing.

    expert_scales: each stacked expert tensor gets a per-expert scale `<name>.scale` [n_expert], which
    llama.cpp loads for any architecture (llama_model::load_tensors' generic pass, as NVFP4 files have).
    """
    p = get_preset(preset) if isinstance(preset, str) else preset
    q = normalize_qtype(qtype)
    specs: list[_Spec] = [
        (_tn(T.TOKEN_EMBD), (p.n_embd, p.n_vocab), Role.EMBED),
        (_tn(T.OUTPUT_NORM), (p.n_embd,), Role.NORM),
        (_tn(T.OUTPUT), (p.n_embd, p.n_vocab), Role.OUTPUT),
    ]
    n_trunk = n_layers_for(p, layers)
    for il in range(n_trunk + p.n_nextn):  # MTP blocks follow the trunk, numbered after its last layer
        block = _BLOCKS[p.arch](p, il) + (_nextn(p, il) if il >= n_trunk else [])
        specs += block
        if expert_scales:
            specs += [
                (name.removesuffix(".weight") + ".scale", (shape[-1],), Role.SCALE)
                for name, shape, role in block
                if role is Role.EXPERT
            ]
    return tuple(PlannedTensor(name, shape, tensor_type(role, shape, q), role) for name, shape, role in specs)
