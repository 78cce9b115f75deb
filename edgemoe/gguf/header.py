"""A cheap, strict walk over a GGUF header: metadata and tensor records, no tensor data.

`check_gguf(path)` runs before every model load: it turns a missing, truncated,
corrupt or unsupported file into one actionable `ModelLoadError` instead of a
llama.cpp abort. It memory-maps the file and touches only the header pages.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.constants import GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, Keys

from ..errors import ModelLoadError, UnsupportedArchitectureError

# Parsed once from the LLM_ARCH_NAMES table in the vendored
# vendor/llama.cpp/src/llama-arch.cpp of llama-cpp-python 0.3.36. Left out:
# "clip" (a vision projector, "only used by llama-quantize") and "(unknown)".
KNOWN_ARCHITECTURES: tuple[str, ...] = (
    "llama",
    "llama4",
    "deci",
    "falcon",
    "grok",
    "gpt2",
    "gptj",
    "gptneox",
    "mpt",
    "baichuan",
    "starcoder",
    "refact",
    "bert",
    "modern-bert",
    "nomic-bert",
    "nomic-bert-moe",
    "neo-bert",
    "jina-bert-v2",
    "jina-bert-v3",
    "eurobert",
    "bloom",
    "stablelm",
    "qwen",
    "qwen2",
    "qwen2moe",
    "qwen2vl",
    "qwen3",
    "qwen3moe",
    "qwen3next",
    "qwen3vl",
    "qwen3vlmoe",
    "qwen35",
    "qwen35moe",
    "qwen4exp",
    "phi2",
    "phi3",
    "phimoe",
    "plamo",
    "plamo2",
    "plamo3",
    "codeshell",
    "orion",
    "internlm2",
    "minicpm",
    "minicpm3",
    "gemma",
    "gemma2",
    "gemma3",
    "gemma3n",
    "gemma4",
    "gemma4-assistant",
    "gemma-embedding",
    "starcoder2",
    "mamba",
    "mamba2",
    "maple",
    "jamba",
    "falcon-h1",
    "xverse",
    "command-r",
    "cohere2",
    "cohere2moe",
    "dbrx",
    "olmo",
    "olmo2",
    "olmoe",
    "muse-glimmer",
    "openelm",
    "arctic",
    "deepseek",
    "deepseek2",
    "deepseek2-ocr",
    "deepseek32",
    "deepseek4",
    "chatglm",
    "glm4",
    "glm4moe",
    "glm-dsa",
    "bitnet",
    "t5",
    "t5encoder",
    "jais",
    "jais2",
    "nemotron",
    "nemotron_h",
    "nemotron_h_moe",
    "exaone",
    "exaone4",
    "exaone-moe",
    "rwkv6",
    "rwkv6qwen2",
    "rwkv7",
    "arwkv7",
    "granite",
    "granitemoe",
    "granitehybrid",
    "graniteswitch",
    "granite_swa",
    "chameleon",
    "wavtokenizer-dec",
    "plm",
    "bailingmoe",
    "bailingmoe2",
    "bailingmoe3",
    "dots1",
    "dots3note",
    "arcee",
    "afmoe",
    "laguna",
    "ernie4_5",
    "ernie4_5-moe",
    "hunyuan-moe",
    "hunyuan-dense",
    "hunyuan_vl",
    "hy_v3",
    "hy_v4",
    "smollm3",
    "gpt-oss",
    "lfm2",
    "lfm2moe",
    "dream",
    "smallthinker",
    "llada",
    "llada-moe",
    "seed_oss",
    "grovemoe",
    "apertus",
    "minimax-01",
    "hrm_text",
    "minimax-m2",
    "minimax-m3",
    "cogvlm",
    "rnd1",
    "pangu-embedded",
    "mistral3",
    "eagle3",
    "dflash",
    "mistral4",
    "paddleocr",
    "mimo2",
    "step35",
    "spark2_5",
    "llama-embed",
    "maincoder",
    "kimi-linear",
    "kimi-k3",
    "glm5-next",
    "talkie",
    "mellum",
    "nanbeige",
    "qwen3tts",
    "pockettts",
)

_LLAMA_CPP_VERSION = "llama.cpp of llama-cpp-python 0.3.36"
_SUPPORTED_GGUF_VERSIONS = (2, 3)
_GGML_MAX_DIMS = 4
_REDOWNLOAD = "download it again (or re-run the conversion)"


@dataclass(frozen=True)
class GgufArray:
    """An array value whose items are not kept (strings, or too many numbers)."""

    item_type: GGUFValueType
    count: int


@dataclass(frozen=True)
class TensorRecord:
    name: str
    shape: tuple[int, ...]  # ggml order, ne0 first
    qtype: GGMLQuantizationType
    offset: int  # relative to GgufHeader.data_offset
    nbytes: int


@dataclass(frozen=True)
class GgufHeader:
    """What `check_gguf` learns from the header, without touching tensor data."""

    path: Path
    file_size: int
    version: int
    architecture: str
    alignment: int
    data_offset: int  # first byte of the tensor data section
    data_end: int  # one past the last byte any tensor needs
    # scalars and strings as Python values, numeric arrays up to _MAX_KEPT_ARRAY items as
    # tuples, other arrays as GgufArray
    metadata: Mapping[str, Any]
    tensors: tuple[TensorRecord, ...]


class _Truncated(Exception):
    def __init__(self, needed: int) -> None:
        self.needed = needed


class _Corrupt(Exception):
    pass


_SCALAR_FORMATS: dict[int, str] = {
    GGUFValueType.UINT8: "B",
    GGUFValueType.INT8: "b",
    GGUFValueType.BOOL: "?",
    GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I",
    GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f",
    GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT64: "d",
}
_MAX_KEPT_ARRAY = 4096  # per-layer arrays are kept; token scores and types are skipped


class _Cursor:
    """Little-endian reads from a memory map; only the pages of the header are touched."""

    def __init__(self, buf: mmap.mmap, size: int) -> None:
        self.buf, self.size, self.pos = buf, size, 0

    def take(self, fmt: str, count: int = 1) -> Any:
        n = struct.calcsize(f"<{count}{fmt}")
        if self.pos + n > self.size:
            raise _Truncated(self.pos + n)
        values = struct.unpack_from(f"<{count}{fmt}", self.buf, self.pos)
        self.pos += n
        return values[0] if count == 1 else values

    def skip(self, n: int) -> None:
        if self.pos + n > self.size:
            raise _Truncated(self.pos + n)
        self.pos += n

    def string(self) -> str:
        n = self.take("Q")
        start = self.pos
        self.skip(n)
        try:
            return bytes(self.buf[start : self.pos]).decode("utf-8")
        except UnicodeDecodeError as err:
            raise _Corrupt(f"a string at byte {start} is not valid UTF-8") from err

    def value(self, vtype: int, key: str) -> Any:
        if vtype in _SCALAR_FORMATS:
            return self.take(_SCALAR_FORMATS[vtype])
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype != GGUFValueType.ARRAY:
            raise _Corrupt(f"key {key!r} has unknown value type {vtype}")
        item_type, count = self.take("I"), self.take("Q")
        if item_type in _SCALAR_FORMATS:
            fmt = _SCALAR_FORMATS[item_type]
            if count <= _MAX_KEPT_ARRAY:
                values = self.take(fmt, count) if count else ()
                return values if isinstance(values, tuple) else (values,)  # take() gives one item bare
            self.skip(struct.calcsize(fmt) * count)
        elif item_type in (GGUFValueType.STRING, GGUFValueType.ARRAY):
            if count > self.size:  # every item needs at least one byte
                raise _Corrupt(f"key {key!r} claims an array of {count} items")
            for _ in range(count):
                if item_type == GGUFValueType.STRING:
                    self.skip(self.take("Q"))
                else:
                    self.value(item_type, key)
        else:
            raise _Corrupt(f"key {key!r} is an array of unknown value type {item_type}")
        return GgufArray(GGUFValueType(item_type), count)


def _not_gguf_message(path: Path, head: bytes) -> str:
    if head.startswith(b"version https://git-lfs"):
        return f"{path} is a Git LFS pointer, not the model: run `git lfs pull` or download the file itself"
    if head.lstrip()[:1] == b"<":
        return f"{path} looks like an HTML/XML page, not a GGUF (a failed download?): {_REDOWNLOAD}"
    return (
        f"{path} is not a GGUF file (it starts with {head[:4]!r}, not b'GGUF'): pass a .gguf model "
        "(convert safetensors with llama.cpp's convert_hf_to_gguf.py)"
    )


def check_gguf(path: str | Path) -> GgufHeader:
    """Validate a GGUF file cheaply (header only) before handing it to llama.cpp.

    Raises ModelLoadError (missing, directory, not GGUF, truncated, corrupt) or
    UnsupportedArchitectureError, each with a one-line message saying what to do.
    """
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(f"model file not found: {path} (check the path, or download the GGUF first)")
    if path.is_dir():
        raise ModelLoadError(
            f"{path} is a directory, not a GGUF file: pass the path of the .gguf file inside it"
        )
    if not path.is_file():  # a FIFO or a device would block the read below, or never end
        raise ModelLoadError(
            f"{path} is not a regular file (a pipe or a device?): pass the path of a .gguf file"
        )
    try:
        with path.open("rb") as f:
            head = f.read(64)
            if head[:4] != struct.pack("<I", GGUF_MAGIC):
                raise ModelLoadError(_not_gguf_message(path, head))
            file_size = path.stat().st_size
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                header = _walk_header(path, _Cursor(buf, file_size))
    except OSError as err:
        raise ModelLoadError(
            f"cannot read {path}: {err.strerror or err}; check the file's permissions"
        ) from err
    if header.architecture not in KNOWN_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"{path}: architecture {header.architecture!r} is not supported by {_LLAMA_CPP_VERSION}; "
            "use a GGUF of a supported architecture (e.g. qwen3moe, llama/mixtral, deepseek2, gpt-oss, olmoe)"
        )
    return header


def _walk_header(path: Path, cur: _Cursor) -> GgufHeader:
    try:
        return _parse_header(path, cur)
    except _Truncated as err:
        raise ModelLoadError(
            f"{path} is truncated or corrupt: its header needs byte {err.needed} but the file has only "
            f"{cur.size} bytes; {_REDOWNLOAD}"
        ) from None
    except _Corrupt as err:
        raise ModelLoadError(f"{path} has corrupt metadata: {err}; {_REDOWNLOAD}") from None


def _parse_header(path: Path, cur: _Cursor) -> GgufHeader:
    cur.skip(4)  # magic, checked by the caller
    version = cur.take("I")
    if version & 0xFFFF == 0 and version != 0:
        raise _Corrupt("it is a big-endian GGUF; convert it for little-endian machines")
    if version not in _SUPPORTED_GGUF_VERSIONS:
        raise _Corrupt(f"GGUF version {version} is not supported (expected 2 or 3)")
    n_tensors, n_kv = cur.take("Q"), cur.take("Q")
    # A key needs >= 13 bytes and a tensor info >= 24: larger counts are garbage.
    if n_kv * 13 > cur.size or n_tensors * 24 > cur.size:
        raise _Corrupt(f"the header claims {n_kv} keys and {n_tensors} tensors, more than the file can hold")

    metadata: dict[str, Any] = {}
    for i in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.take("I"), key if key.isprintable() else f"#{i}")
    architecture = metadata.get(Keys.General.ARCHITECTURE)
    if not isinstance(architecture, str) or not architecture:
        raise _Corrupt(f"there is no string key {Keys.General.ARCHITECTURE!r}")
    alignment = metadata.get(Keys.General.ALIGNMENT, GGUF_DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise _Corrupt(f"general.alignment is {alignment!r}, not a power of two")

    tensors = tuple(_tensor_record(cur, alignment) for _ in range(n_tensors))
    data_offset = -(-cur.pos // alignment) * alignment
    last = max(tensors, key=lambda t: t.offset + t.nbytes, default=None)
    data_end = data_offset + (last.offset + last.nbytes if last else 0)
    if last is not None and data_end > cur.size:
        raise ModelLoadError(
            f"{path} is truncated: tensor {last.name!r} ends at byte {data_end} but the file has only "
            f"{cur.size} bytes ({data_end - cur.size} missing); {_REDOWNLOAD}"
        )
    return GgufHeader(
        path=path,
        file_size=cur.size,
        version=version,
        architecture=architecture,
        alignment=alignment,
        data_offset=data_offset,
        data_end=data_end,
        metadata=MappingProxyType(metadata),
        tensors=tensors,
    )


def _tensor_record(cur: _Cursor, alignment: int) -> TensorRecord:
    name = cur.string()
    n_dims = cur.take("I")
    if not 1 <= n_dims <= _GGML_MAX_DIMS:
        raise _Corrupt(f"tensor {name!r} has {n_dims} dimensions")
    ne = tuple(cur.take("Q") for _ in range(n_dims))
    type_id, offset = cur.take("I"), cur.take("Q")
    try:
        qtype = GGMLQuantizationType(type_id)
    except ValueError:
        raise _Corrupt(f"tensor {name!r} has unknown ggml type id {type_id}") from None
    block, type_size = GGML_QUANT_SIZES[qtype]
    if ne[0] % block:
        raise _Corrupt(
            f"tensor {name!r} row size ({ne[0]}) is not a multiple of {qtype.name} block size ({block})"
        )
    if offset % alignment:
        raise _Corrupt(f"tensor {name!r} starts at offset {offset}, not a multiple of {alignment}")
    n = 1
    for d in ne:
        n *= d
    return TensorRecord(name=name, shape=ne, qtype=qtype, offset=offset, nbytes=n // block * type_size)
