"""Refuse GGUFs whose header parses but whose hyper-parameters are impossible, before llama.cpp sees them.

llama.cpp checks many hyper-parameters with GGML_ASSERT, which aborts the whole process
(SIGABRT and a backtrace) instead of failing the load: an expert_used_count above
expert_count, a block_count of 0, a NaN epsilon, a rope dimension that is not the head size
of architectures that need it to be. `validate_hparams(header)` mirrors those checks (and a
few impossible values that llama.cpp lets through into garbage output) in pure Python and
raises one `InvalidHyperparameterError` naming the key, its value and what is allowed.

It reads metadata as llama.cpp does: a key that is absent counts as llama.cpp's default (0
for expert_count, even when the expert tensors say otherwise), not as `read_model_info`'s
best guess. The limits are those of the vendored llama.cpp (llama-cpp-python 0.3.36).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf.constants import Keys

from ..errors import InvalidHyperparameterError
from .header import GgufArray, GgufHeader, check_gguf

__all__ = [
    "LLAMA_MAX_EXPERTS",
    "LLAMA_MAX_LAYERS",
    "ROPE_IS_HEAD_ARCHITECTURES",
    "check_model",
    "validate_hparams",
]

LLAMA_MAX_LAYERS = 512  # llama-hparams.h
LLAMA_MAX_EXPERTS = 1024  # llama-hparams.h
ROPE_SCALING_TYPES = ("none", "linear", "yarn", "longrope")  # LLAMA_ROPE_SCALING_TYPES, llama-model.cpp

# Architectures whose graph builder (src/models/<arch>.cpp) asserts n_embd_head == n_rot and
# that the key and value heads have the same size: rope.dimension_count must be the head size.
# Taken from the vendored sources: every llama_model_X whose file has
# GGML_ASSERT(n_embd_head == n_rot), mapped to its names through llama-model.cpp and llama-arch.cpp.
ROPE_IS_HEAD_ARCHITECTURES: frozenset[str] = frozenset(
    (
        "apertus",
        "arcee",
        "arctic",
        "baichuan",
        "chameleon",
        "codeshell",
        "cogvlm",
        "cohere2moe",
        "dbrx",
        "deci",
        "deepseek",
        "dots1",
        "dream",
        "ernie4_5",
        "ernie4_5-moe",
        "exaone",
        "exaone-moe",
        "exaone4",
        "falcon",
        "granite",
        "granite_swa",
        "graniteswitch",
        "grok",
        "grovemoe",
        "hunyuan-moe",
        "hunyuan_vl",
        "hy_v3",
        "internlm2",
        "jais2",
        "llada",
        "llada-moe",
        "llama",
        "llama4",
        "maincoder",
        "mellum",
        "minimax-01",
        "minimax-m2",
        "mistral3",
        "nemotron",
        "olmo",
        "olmo2",
        "olmoe",
        "orion",
        "paddleocr",
        "pangu-embedded",
        "plamo",
        "pockettts",
        "qwen2",
        "qwen2moe",
        "qwen2vl",
        "qwen3",
        "qwen3moe",
        "qwen3vl",
        "qwen3vlmoe",
        "rnd1",
        "seed_oss",
        "smallthinker",
        "smollm3",
        "starcoder2",
        "talkie",
        "xverse",
    )
)
# hunyuan-vl and hunyuan-dense treat expert_count <= 1 as "no experts" (llama-model.cpp)
_EXPERTS_OFF_BELOW_2 = frozenset(("hunyuan_vl", "hunyuan-dense"))
_LAYER_RE = re.compile(r"^blk\.(\d+)\.")
# keys llama.cpp reads with get_key_or_arr: one value, or an array of exactly block_count values
_PER_LAYER_KEYS = (
    Keys.LLM.FEED_FORWARD_LENGTH,
    Keys.Attention.HEAD_COUNT,
    Keys.Attention.HEAD_COUNT_KV,
    Keys.LLM.EXPERT_USED_COUNT,
    Keys.LLM.EXPERT_FEED_FORWARD_LENGTH,
)
_FIX = "re-convert the model, or fix the key with gguf-py's gguf_set_metadata.py"

Value = int | tuple[int, ...]


@dataclass(frozen=True)
class _Meta:
    """Typed reads of one architecture's keys; a wrong type is an error, not a guess."""

    path: Path
    arch: str
    meta: Mapping[str, Any]

    def name(self, template: str) -> str:
        return template.format(arch=self.arch)

    def fail(self, template: str, value: object, why: str) -> InvalidHyperparameterError:
        return InvalidHyperparameterError(f"{self.path}: {self.name(template)} is {_show(value)}{why}")

    def int_(self, template: str, *, per_layer: bool = False) -> Value | None:
        """An unsigned integer key (or, per_layer, an array of them); None if absent."""
        value = self.meta.get(self.name(template))
        if value is None:
            return None
        items = value if per_layer and isinstance(value, tuple) else (value,)
        if not items or not all(isinstance(v, int) and not isinstance(v, bool) for v in items):
            kind = "a whole number or one per layer" if per_layer else "a whole number"
            raise self.fail(template, value, f"; it must be {kind}: {_FIX}")
        if min(items) < 0:
            raise self.fail(template, value, f"; it cannot be negative: {_FIX}")
        return value

    def scalar(self, template: str) -> int | None:
        value = self.int_(template)  # a tuple is not a whole number: int_ raised
        return value if isinstance(value, int) else None

    def required(self, template: str) -> int:
        value = self.scalar(template)
        if value is None:
            raise InvalidHyperparameterError(
                f"{self.path}: the key {self.name(template)} is missing; llama.cpp needs it to load a "
                f"{self.arch} model: {_FIX}"
            )
        return value

    def float_(self, template: str) -> float | None:
        value = self.meta.get(self.name(template))
        if value is None:
            return None
        if not isinstance(value, float):
            raise self.fail(template, value, f"; it must be a number: {_FIX}")
        return value


def _show(value: object) -> str:
    if isinstance(value, str):
        return f"the string {value[:40]!r}"
    if isinstance(value, tuple):
        return f"[{', '.join(str(v) for v in value[:8])}{', ...' if len(value) > 8 else ''}]"
    if not isinstance(value, (int, float)):
        return "an array" if isinstance(value, GgufArray) else f"a {type(value).__name__}"
    return str(value)


def _max(value: Value | None) -> int:
    if value is None:
        return 0
    return max(value) if isinstance(value, tuple) else value


def validate_hparams(header: GgufHeader, *, expert_used_count: int | None = None) -> None:
    """Raise InvalidHyperparameterError for the first impossible hyper-parameter of `header`.

    `expert_used_count` is an override (LoadConfig.expert_used_count): it replaces the file's
    value, as llama.cpp's kv override does, so the file's own value is then not checked.
    """
    m = _Meta(header.path, header.architecture, header.metadata)
    llm, attn, rope = Keys.LLM, Keys.Attention, Keys.Rope
    n_layer = _check_layers(m, header)
    for template in _PER_LAYER_KEYS:
        value = m.int_(template, per_layer=True)
        if isinstance(value, tuple) and len(value) != n_layer:
            raise m.fail(
                template,
                value,
                f", {len(value)} values for {n_layer} blocks; a per-layer value "
                f"has one entry per block: {_FIX}",
            )
    if m.required(llm.EMBEDDING_LENGTH) < 1:
        raise m.fail(llm.EMBEDDING_LENGTH, 0, f"; a model's hidden size is at least 1: {_FIX}")
    if m.required(llm.CONTEXT_LENGTH) < 1:
        raise m.fail(llm.CONTEXT_LENGTH, 0, f"; the training context is at least 1 token: {_FIX}")
    _check_heads(m)
    for template in (attn.LAYERNORM_RMS_EPS, attn.LAYERNORM_EPS):
        eps = m.float_(template)
        # 0 is allowed: llama.cpp's own model saver writes 0 for the epsilon an architecture never reads
        if eps is not None and not (math.isfinite(eps) and eps >= 0):
            raise m.fail(
                template, eps, f"; a normalization epsilon is a small positive number such as 1e-6: {_FIX}"
            )
    base = m.float_(rope.FREQ_BASE)
    if base is not None and not (math.isfinite(base) and base > 0):
        raise m.fail(
            rope.FREQ_BASE, base, f"; a rope base frequency is a positive number such as 10000: {_FIX}"
        )
    scaling = m.meta.get(m.name(rope.SCALING_TYPE))
    if scaling is not None and scaling not in ROPE_SCALING_TYPES:
        raise m.fail(rope.SCALING_TYPE, scaling, f"; llama.cpp knows {', '.join(ROPE_SCALING_TYPES)}: {_FIX}")
    _check_experts(m, header, expert_used_count)


def _check_layers(m: _Meta, header: GgufHeader) -> int:
    """block_count within llama.cpp's limit and matching the blk.N tensors in the file."""
    key = Keys.LLM.BLOCK_COUNT
    n_layer = m.required(key)
    if not 1 <= n_layer <= LLAMA_MAX_LAYERS:
        raise m.fail(key, n_layer, f"; llama.cpp loads 1..{LLAMA_MAX_LAYERS} layers: {_FIX}")
    nextn = m.scalar(Keys.LLM.NEXTN_PREDICT_LAYERS) or 0
    if nextn > n_layer:
        raise m.fail(
            Keys.LLM.NEXTN_PREDICT_LAYERS,
            nextn,
            f" but block_count is {n_layer}; the MTP layers are among the blocks: {_FIX}",
        )
    blocks = [int(match.group(1)) for t in header.tensors if (match := _LAYER_RE.match(t.name))]
    if blocks:
        top = max(blocks) + 1
        if top > n_layer:
            raise m.fail(
                key,
                n_layer,
                f" but the file has tensors of block {top - 1} (blk.{top - 1}.*), so "
                f"{top} blocks; the header and the tensors disagree: {_FIX}",
            )
        if top < n_layer - nextn:
            raise m.fail(
                key,
                n_layer,
                f" but the file has tensors of blocks 0..{top - 1} only; "
                f"the file is incomplete or its header is wrong: {_FIX}",
            )
    return n_layer


def _check_heads(m: _Meta) -> None:
    llm, attn, rope = Keys.LLM, Keys.Attention, Keys.Rope
    n_head = _max(m.int_(attn.HEAD_COUNT, per_layer=True))
    m.int_(attn.HEAD_COUNT_KV, per_layer=True)
    key_length, value_length = m.scalar(attn.KEY_LENGTH), m.scalar(attn.VALUE_LENGTH)
    n_rot = m.scalar(rope.DIMENSION_COUNT)
    needs_rope_head = m.arch in ROPE_IS_HEAD_ARCHITECTURES
    if n_head == 0:
        if needs_rope_head:  # attention in every layer: no heads is no model
            raise m.fail(attn.HEAD_COUNT, 0, f"; a {m.arch} model has at least one attention head: {_FIX}")
        return  # recurrent models (mamba, rwkv) have none; llama.cpp then ignores the head keys
    n_embd = m.required(llm.EMBEDDING_LENGTH)
    head_k = n_embd // n_head if key_length is None else key_length
    head_v = n_embd // n_head if value_length is None else value_length
    if head_k < 1:
        why = "" if key_length is not None else f" (embedding_length {n_embd} / head_count {n_head})"
        raise m.fail(attn.KEY_LENGTH, head_k, f"{why}; an attention head has at least 1 dimension: {_FIX}")
    if n_rot is not None and n_rot > head_k:
        raise m.fail(
            rope.DIMENSION_COUNT,
            n_rot,
            f" but the key head size is {head_k}; rope rotates at most the whole head: {_FIX}",
        )
    if needs_rope_head:
        if (n_rot if n_rot is not None else head_k) != head_k:
            raise m.fail(
                rope.DIMENSION_COUNT,
                n_rot,
                f" but the head size is {head_k}; {m.arch} models rotate the whole head: {_FIX}",
            )
        if head_k != head_v:
            raise m.fail(
                attn.VALUE_LENGTH,
                head_v,
                f" but the key length is {head_k}; {m.arch} models have "
                f"key and value heads of one size: {_FIX}",
            )


def _check_experts(m: _Meta, header: GgufHeader, override: int | None) -> None:
    llm = Keys.LLM
    count_key, used_key = llm.EXPERT_COUNT, llm.EXPERT_USED_COUNT
    n_expert = m.scalar(count_key) or 0  # absent: llama.cpp's 0, whatever the tensors hold
    used_value = m.int_(used_key, per_layer=True) if override is None else override
    used = _max(used_value)
    groups = m.scalar(llm.EXPERT_GROUP_COUNT) or 0
    if m.arch in _EXPERTS_OFF_BELOW_2 and n_expert <= 1:
        return
    if n_expert > LLAMA_MAX_EXPERTS:
        raise m.fail(count_key, n_expert, f"; llama.cpp supports at most {LLAMA_MAX_EXPERTS} experts: {_FIX}")
    # the override's own range (1..n_expert) is LoadConfig.validate's; here it meets the file
    source, fix = (
        ("", _FIX)
        if override is None
        else (" (the expert_used_count override)", f"pass 1..{n_expert} or leave it unset")
    )
    if n_expert == 0:
        if used > 0:
            count = "missing" if m.name(count_key) not in m.meta else "0"
            raise m.fail(
                used_key,
                used_value,
                f"{source} but {m.name(count_key)} is {count}; "
                f"a model without routed experts routes to none: {_FIX}",
            )
        if groups:
            raise m.fail(llm.EXPERT_GROUP_COUNT, groups, f" but the model has no routed experts: {_FIX}")
        return
    if used > n_expert:
        raise m.fail(
            used_key,
            used_value,
            f"{source} but expert_count is {n_expert}; a model uses at most "
            f"expert_count experts per token: {fix}",
        )
    if used == 0:
        raise InvalidHyperparameterError(
            f"{m.path}: {m.name(used_key)} is {'missing' if used_value is None else _show(used_value)} "
            f"but expert_count is {n_expert}; a mixture-of-experts model routes each token to at least "
            f"1 expert: {_FIX}"
        )
    if groups >= n_expert:
        raise m.fail(
            llm.EXPERT_GROUP_COUNT,
            groups,
            f" but expert_count is {n_expert}; there are fewer groups than experts: {_FIX}",
        )
    if groups > 1:
        group_used = m.scalar(llm.EXPERT_GROUP_USED_COUNT) or 0
        if n_expert % groups:
            raise m.fail(
                llm.EXPERT_GROUP_COUNT,
                groups,
                f" but expert_count {n_expert} is not a multiple of it: {_FIX}",
            )
        if not 0 < group_used < groups:
            raise m.fail(
                llm.EXPERT_GROUP_USED_COUNT,
                group_used,
                f"; with {groups} expert groups a token uses 1..{groups - 1} of them: {_FIX}",
            )


def check_model(path: str | Path, *, expert_used_count: int | None = None) -> GgufHeader:
    """`check_gguf` and then `validate_hparams`: everything edgemoe checks before llama.cpp opens a file."""
    header = check_gguf(path)
    validate_hparams(header, expert_used_count=expert_used_count)
    return header
