"""Inspect and validate GGUF Mixture-of-Experts models in pure Python (no llama.cpp).

- `check_gguf(path)`: a cheap header walk (mmap, no tensor data read) that turns a
  missing, truncated, corrupt or unsupported file into one actionable error.
- `read_model_info(path)`: hyperparameters and a byte budget split into routed
  experts / everything else, from the same header walk (gguf-py's GGUFReader is
  exact but takes seconds on a 150k-token vocabulary; the tests cross-check with it).
- `parse_size("6GiB")`: sizes as typed on the command line.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeGuard

from gguf.constants import MODEL_TENSOR, TENSOR_NAMES, Keys

from ..errors import InvalidSizeError, ModelLoadError
from .header import KNOWN_ARCHITECTURES, GgufArray, GgufHeader, TensorRecord, check_gguf

__all__ = [
    "KNOWN_ARCHITECTURES",
    "ExpertTensorInfo",
    "GgufHeader",
    "ModelInfo",
    "TensorRecord",
    "check_gguf",
    "format_size",
    "info_to_dict",
    "is_expert_tensor",
    "model_info",
    "parse_size",
    "read_model_info",
]

_LAYER_RE = re.compile(r"^blk\.(\d+)\.")
# the stacked routed experts build_moe_ffn reads, with their biases and per-expert scales (last dim
# n_expert); not arctic's ffn_norm_exps (the MoE branch's norm, [n_embd]) nor grovemoe's ffn_*_chexps
_EXPERT_KINDS = (
    MODEL_TENSOR.FFN_GATE_UP_EXP,
    MODEL_TENSOR.FFN_UP_EXP,
    MODEL_TENSOR.FFN_GATE_EXP,
    MODEL_TENSOR.FFN_DOWN_EXP,
)
_EXPERT_RE = re.compile(
    r"^blk\.\d+\.(?:{})\.".format("|".join(TENSOR_NAMES[k].removeprefix("blk.{bid}.") for k in _EXPERT_KINDS))
)
_TOKEN_EMBD = TENSOR_NAMES[MODEL_TENSOR.TOKEN_EMBD] + ".weight"


# --------------------------------------------------------------------------- records


@dataclass(frozen=True)
class ExpertTensorInfo:
    """One stacked routed-expert tensor of one layer (e.g. blk.3.ffn_up_exps.weight)."""

    name: str
    qtype: str  # ggml type name, e.g. "Q4_K"
    shape: tuple[int, ...]  # ggml order (ne0 first); the last dim is n_expert
    nbytes: int
    bytes_per_expert: int  # nbytes / n_expert: the slice one expert occupies


@dataclass(frozen=True)
class ModelInfo:
    """Hyperparameters and byte accounting of a GGUF model. Mappings are read-only."""

    path: Path
    file_size: int
    architecture: str
    name: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_embd_head_k: int  # key length per head (for MLA: kv_lora_rank + rope dim)
    n_embd_head_v: int
    n_rot: int
    kv_lora_rank: int  # MLA latent size (deepseek2 family), 0 otherwise
    n_ctx_train: int
    n_vocab: int
    n_expert: int
    n_expert_used: int
    n_expert_shared: int  # 0 if the model has no shared expert
    n_ff_exp: int  # feed-forward length of one routed expert, 0 if dense
    moe_layers: tuple[int, ...]  # trunk layers holding routed-expert tensors (MTP blocks left out)
    expert_tensors: Mapping[int, tuple[ExpertTensorInfo, ...]]  # per MoE layer
    bytes_per_expert: int  # one expert of the first MoE layer (all its _exps slices)
    bytes_per_expert_by_layer: Mapping[int, int]
    expert_bytes_total: int  # all routed-expert tensors (is_expert_tensor)
    shared_expert_bytes: int  # "_shexp" tensors (also counted in dense_bytes)
    dense_bytes: int  # everything that is not a routed expert (nor in an MTP block)
    total_tensor_bytes: int
    bytes_by_type: Mapping[str, int]
    sliding_window: int  # 0 if no sliding-window attention
    n_nextn: int = 0  # MTP (NextN) blocks after the trunk, counted in n_layer (nextn_predict_layers)
    # the file carries the MTP blocks' tensors (a trunk-only conversion keeps the key only)
    mtp_heads: bool = False
    # the MTP blocks' tensors, in neither expert_bytes_total nor dense_bytes (loaded for MTP only)
    mtp_bytes: int = 0
    mtp_dense_bytes: int = 0  # those of them that are not routed experts: what MTP drafting puts on a GPU

    @property
    def is_moe(self) -> bool:
        return self.n_expert > 0 and bool(self.moe_layers)

    @property
    def slot_bytes(self) -> int:
        """One expert in each MoE layer: what one cache slot per layer holds."""
        return sum(self.bytes_per_expert_by_layer.values())


# --------------------------------------------------------------------------- read_model_info


def _is_int(v: object) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(meta: Mapping[str, Any], key: str, default: int = 0) -> int:
    """An integer key; per-layer arrays (e.g. head_count_kv) give their maximum. A value of another
    type (a string, a float) gives the default: `validate_hparams` is the one that reports it."""
    value = meta.get(key)
    if isinstance(value, tuple) and value and all(_is_int(v) for v in value):
        return max(value)
    return value if _is_int(value) else default


def read_model_info(path: str | Path) -> ModelInfo:
    """Hyperparameters and per-expert byte counts, from the header alone (fast: ~0.1 s).

    It reports what the header says and does not judge it: `edgemoe.gguf.validate.check_model`
    refuses impossible values.
    """
    return model_info(check_gguf(path))


def model_info(header: GgufHeader) -> ModelInfo:
    """`read_model_info` of a header already read by `check_gguf`."""
    meta, arch = header.metadata, header.architecture
    llm, attn = Keys.LLM, Keys.Attention

    def key(template: str) -> str:
        return template.format(arch=arch)

    n_embd = _int(meta, key(llm.EMBEDDING_LENGTH))
    n_head = _int(meta, key(attn.HEAD_COUNT))
    head = n_embd // n_head if n_head else 0
    n_embd_head_k = _int(meta, key(attn.KEY_LENGTH), head)

    n_layer = _int(meta, key(llm.BLOCK_COUNT))
    n_nextn = _int(meta, key(llm.NEXTN_PREDICT_LAYERS))
    expert_tensors: dict[int, list[ExpertTensorInfo]] = {}
    by_type: dict[str, int] = {}
    expert_total = shared_total = total = embd_rows = 0
    mtp = _MtpTally(n_layer, n_nextn)
    for t in header.tensors:
        total += t.nbytes
        by_type[t.qtype.name] = by_type.get(t.qtype.name, 0) + t.nbytes
        if t.name == _TOKEN_EMBD:
            embd_rows = t.shape[-1]
        if mtp.add(t.name, t.nbytes):
            continue  # loaded only for MTP drafting (edgemoe.runtime.mtp)
        if is_expert_tensor(t.name):
            expert_total += t.nbytes
            expert_tensors.setdefault(_layer_of(t.name), []).append(
                ExpertTensorInfo(
                    name=t.name,
                    qtype=t.qtype.name,
                    shape=t.shape,
                    nbytes=t.nbytes,
                    bytes_per_expert=t.nbytes // max(1, t.shape[-1]),
                )
            )
        elif "_shexp" in t.name:
            shared_total += t.nbytes

    moe_layers = tuple(sorted(expert_tensors))
    per_layer = {il: sum(e.bytes_per_expert for e in expert_tensors[il]) for il in moe_layers}
    first = expert_tensors[moe_layers[0]] if moe_layers else []
    tokens = meta.get(Keys.Tokenizer.LIST)

    return ModelInfo(
        path=header.path,
        file_size=header.file_size,
        architecture=arch,
        name=str(meta.get(Keys.General.NAME, "")),
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=_int(meta, key(attn.HEAD_COUNT_KV), n_head),
        n_embd_head_k=n_embd_head_k,
        n_embd_head_v=_int(meta, key(attn.VALUE_LENGTH), head),
        n_rot=_int(meta, key(Keys.Rope.DIMENSION_COUNT), n_embd_head_k),
        kv_lora_rank=_int(meta, key(attn.KV_LORA_RANK)),
        n_ctx_train=_int(meta, key(llm.CONTEXT_LENGTH)),
        n_vocab=tokens.count if isinstance(tokens, GgufArray) else _int(meta, key(llm.VOCAB_SIZE), embd_rows),
        n_expert=_int(meta, key(llm.EXPERT_COUNT), first[0].shape[-1] if first else 0),
        n_expert_used=_int(meta, key(llm.EXPERT_USED_COUNT)),
        n_expert_shared=_int(meta, key(llm.EXPERT_SHARED_COUNT), 1 if shared_total else 0),
        n_ff_exp=_n_ff_exp(first) or _int(meta, key(llm.EXPERT_FEED_FORWARD_LENGTH)),
        moe_layers=moe_layers,
        expert_tensors=MappingProxyType({il: tuple(expert_tensors[il]) for il in moe_layers}),
        bytes_per_expert=per_layer[moe_layers[0]] if moe_layers else 0,
        bytes_per_expert_by_layer=MappingProxyType(per_layer),
        expert_bytes_total=expert_total,
        shared_expert_bytes=shared_total,
        dense_bytes=total - expert_total - mtp.nbytes,
        total_tensor_bytes=total,
        bytes_by_type=MappingProxyType(dict(sorted(by_type.items()))),
        sliding_window=_int(meta, key(attn.SLIDING_WINDOW)),
        n_nextn=n_nextn,
        mtp_bytes=mtp.nbytes,
        mtp_dense_bytes=mtp.dense_bytes,
        mtp_heads=mtp.heads,
    )


@dataclass
class _MtpTally:
    """The MTP (NextN) blocks' tensors, the last n_nextn of n_layer blocks: their bytes, those outside their
    routed experts, and whether the tensor llama.cpp requires of the last one is there."""

    n_layer: int
    n_nextn: int
    nbytes: int = 0
    dense_bytes: int = 0
    heads: bool = False

    def add(self, name: str, nbytes: int) -> bool:
        """Count the tensor if an MTP block holds it; whether one does."""
        m = _LAYER_RE.match(name) if self.n_nextn else None
        if m is None or int(m.group(1)) < self.n_layer - self.n_nextn:
            return False
        self.nbytes += nbytes
        self.dense_bytes += 0 if is_expert_tensor(name) else nbytes
        self.heads = self.heads or name == f"blk.{self.n_layer - 1}.nextn.eh_proj.weight"
        return True


def is_expert_tensor(name: str) -> bool:
    """Whether `name` is a stacked routed-expert tensor (blk.N.ffn_{gate_up,up,gate,down}_exps.*)."""
    return _EXPERT_RE.match(name) is not None


def _layer_of(name: str) -> int:
    m = _LAYER_RE.match(name)
    if m is None:
        raise ModelLoadError(f"expert tensor {name!r} is not inside a block (blk.N.*); the file is malformed")
    return int(m.group(1))


def _n_ff_exp(tensors: list[ExpertTensorInfo]) -> int:
    """Expert FFN length from the stacked shapes: down is (n_ff_exp, n_embd, n_expert)."""
    for t in tensors:
        if ".ffn_down_exps.weight" in t.name:
            return t.shape[0]
        if ".ffn_gate_up_exps.weight" in t.name:
            return t.shape[1] // 2
    return 0


def info_to_dict(info: ModelInfo) -> dict[str, Any]:
    """A JSON-ready view of `ModelInfo` (layer keys become strings)."""
    return {
        "path": str(info.path),
        "file_size": info.file_size,
        "architecture": info.architecture,
        "name": info.name,
        "n_layer": info.n_layer,
        "n_embd": info.n_embd,
        "n_head": info.n_head,
        "n_head_kv": info.n_head_kv,
        "n_embd_head_k": info.n_embd_head_k,
        "n_embd_head_v": info.n_embd_head_v,
        "n_rot": info.n_rot,
        "kv_lora_rank": info.kv_lora_rank,
        "n_ctx_train": info.n_ctx_train,
        "n_vocab": info.n_vocab,
        "n_expert": info.n_expert,
        "n_expert_used": info.n_expert_used,
        "n_expert_shared": info.n_expert_shared,
        "n_ff_exp": info.n_ff_exp,
        "sliding_window": info.sliding_window,
        "is_moe": info.is_moe,
        "moe_layers": list(info.moe_layers),
        "bytes_per_expert": info.bytes_per_expert,
        "bytes_per_expert_by_layer": {str(k): v for k, v in info.bytes_per_expert_by_layer.items()},
        "expert_bytes_total": info.expert_bytes_total,
        "shared_expert_bytes": info.shared_expert_bytes,
        "dense_bytes": info.dense_bytes,
        "total_tensor_bytes": info.total_tensor_bytes,
        "n_nextn": info.n_nextn,
        "mtp_heads": info.mtp_heads,
        "mtp_bytes": info.mtp_bytes,
        "mtp_dense_bytes": info.mtp_dense_bytes,
        "bytes_by_type": dict(info.bytes_by_type),
        "expert_tensors": {
            str(layer): [
                {
                    "name": t.name,
                    "type": t.qtype,
                    "shape": list(t.shape),
                    "nbytes": t.nbytes,
                    "bytes_per_expert": t.bytes_per_expert,
                }
                for t in tensors
            ]
            for layer, tensors in info.expert_tensors.items()
        },
    }


# --------------------------------------------------------------------------- sizes

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)
_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    # bare letters follow the binary convention of docker and ulimit
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
}


def parse_size(text: str | int, *, option: str = "size") -> int:
    """Parse '6GiB', '8 GB', '1.5gib', '512MiB', '4096' (bytes) into a byte count.

    KB/MB/GB/TB are decimal (10**3...), KiB/MiB/GiB/TiB and bare K/M/G/T binary
    (2**10...). Case-insensitive. `option` names the flag in the error message.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise InvalidSizeError(f"cannot parse {option} {text}: a size cannot be negative")
        return text
    hint = f"cannot parse {option} {str(text)!r}: use a size such as 6GiB, 8GB or 512MiB"
    m = _SIZE_RE.match(str(text))
    if m is None or m.group(2).lower() not in _UNITS:
        raise InvalidSizeError(hint)
    try:
        value = Decimal(m.group(1)) * _UNITS[m.group(2).lower()]
    except InvalidOperation as err:
        raise InvalidSizeError(hint) from err
    if value != value.to_integral_value() and _UNITS[m.group(2).lower()] == 1:
        raise InvalidSizeError(f"{hint} (a byte count must be a whole number)")
    return int(value)


def size_arg(n: int) -> str:
    """A byte count as a size option to type back (--vram): the largest binary unit that divides it, else bytes.
    parse_size(size_arg(n)) == n."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20)):
        if n and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def format_size(n: int) -> str:
    """Binary units with one decimal: 17.3 GiB."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
