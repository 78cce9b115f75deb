"""edgemoe.Engine: load a GGUF, tokenize, generate/stream, chat, timings.

Built on llama-cpp-python's low-level bindings (edgemoe.runtime.native.lib). One
sequence, one context; the KV cache keeps the longest common prefix between
calls, so a chat turn only evaluates the new tokens.

The Engine is assembled from one concern per module: loading and evaluation here, the
generation loop (generation.py), chat templates (chat.py) and the routing hook / expert-cache
routing (routing.py), expert predictors in the graph (prediction.py), KV state snapshots (prompt_cache.py);
LoadConfig is in config.py.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import re
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from ..errors import (
    ContextOverflowError,
    EdgeMoeError,
    EngineBusyError,
    EngineClosedError,
    InvalidConfigError,
    ModelLoadError,
    NonFiniteLogitsError,
)
from ..gguf.header import GgufHeader
from ..gguf.info import ModelInfo, check_gguf, model_info
from ..gguf.kv_types import ggml_type
from ..gguf.validate import validate_hparams
from ..policies.gating import GatingPolicy
from ..policies.route import RoutePolicy
from . import native
from .chat import ChatMessage, ChatMixin, ChatSession
from .config import FlashAttn, LoadConfig, default_threads
from .expert_cache import CacheController
from .generation import Generation, GenerationMixin, Timings
from .hooks import HookChain
from .interrupts import deferred_interrupts
from .native import lib
from .prediction import PredictionMixin
from .prompt_cache import StateMixin
from .routing import RoutingMixin
from .vocab_guard import SpmByteGuard

__all__ = ["ChatMessage", "ChatSession", "Engine", "Generation", "LoadConfig", "Timings", "default_threads"]

log = logging.getLogger(__name__)


_GRAPH_LINE = re.compile(r"graph(?: \(pp bs=\d+, tg bs=\d+\))?: nodes = (\d+)(?: / (\d+))?")


def graph_nodes_logged(lines: list[str]) -> tuple[int, int] | None:
    """(prefill, decode) node counts of the graphs llama.cpp reserved for a new context, from its log."""
    for line in reversed(lines):
        m = _GRAPH_LINE.search(line)
        if m:
            return int(m.group(1)), int(m.group(2) or m.group(1))
    return None


_KV_LINE = re.compile(
    r"llama_kv_cache: size = +([\d.]+) MiB .*K \((\w+)\): +([\d.]+) MiB, V \((\w+)\): +([\d.]+) MiB"
)
_FLASH_ATTN_PROBE = re.compile(r"Flash Attention (enabled|not supported)")
_FLASH_ATTN_TYPE: dict[FlashAttn, int] = {
    "auto": lib.LLAMA_FLASH_ATTN_TYPE_AUTO,
    "on": lib.LLAMA_FLASH_ATTN_TYPE_ENABLED,
    "off": lib.LLAMA_FLASH_ATTN_TYPE_DISABLED,
}


@dataclass(frozen=True)
class KvCacheInfo:
    """A context's KV cache as llama.cpp logged it when it made it (its caches together: two with sliding windows)."""

    type_k: str  # ggml's name of the K cache's type, e.g. "q8_0"
    type_v: str
    k_mib: float  # the K cache's size (MiB, to 2 decimals as logged)
    v_mib: float


def kv_cache_logged(lines: list[str]) -> KvCacheInfo | None:
    """The KV cache a new context reported in llama.cpp's log (None: no cache was logged)."""
    found = [m for line in lines if (m := _KV_LINE.search(line))]
    if not found:
        return None
    return KvCacheInfo(
        type_k=found[0].group(2),
        type_v=found[0].group(4),
        k_mib=sum(float(m.group(3)) for m in found),
        v_mib=sum(float(m.group(5)) for m in found),
    )


def flash_attn_resolved(config: LoadConfig, lines: list[str]) -> Literal["on", "off", "unknown"]:
    """Whether a new context runs flash attention: as asked, or with "auto" as llama.cpp resolved it (on with a
    quantized V cache; else on where the backend of every layer's device has the kernel, as its log says)."""
    if config.flash_attn == "off":
        return "off"
    if config.flash_attn_forced:
        return "on"
    for line in reversed(lines):
        if m := _FLASH_ATTN_PROBE.search(line):
            return "on" if m.group(1) == "enabled" else "off"
    return "unknown"


class Engine(RoutingMixin, PredictionMixin, GenerationMixin, ChatMixin, StateMixin):
    """A loaded model with one context. Use as a context manager or call close()."""

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        config: LoadConfig | None = None,
        *,
        header: GgufHeader | None = None,
    ) -> None:
        """`header`: the file's check_gguf(), where the caller has it already (edgemoe.open_engine); else it is
        read here."""
        self.path = Path(model_path)
        self.config = config or LoadConfig()
        # typed, actionable errors before llama.cpp sees the file; the expert cache reads its tensors' offsets
        header = check_gguf(self.path) if header is None else header
        if header.path != self.path:
            raise InvalidConfigError(
                f"the header given is {header.path}'s, not {self.path}'s: give the model's own"
            )
        self.header = header
        native.require_patched()
        native.route_logs_to_python()
        self.info: ModelInfo = model_info(header)
        self.config.validate(n_expert=self.info.n_expert, n_expert_used=self.info.n_expert_used)
        self.config.validate_kv_shape(
            n_embd_head_k=self.info.n_embd_head_k,
            n_embd_head_v=self.info.n_embd_head_v,
            mla=self.info.kv_lora_rank > 0,
        )
        # values llama.cpp would abort on, with the expert_used_count override in place of the file's
        validate_hparams(header, expert_used_count=self.config.expert_used_count)
        lib.llama_backend_init()
        mparams = lib.llama_model_default_params()
        mparams.n_gpu_layers = self.config.n_gpu_layers
        mparams.load_mode = lib.LLAMA_LOAD_MODE_MMAP if self.config.use_mmap else lib.LLAMA_LOAD_MODE_NONE
        mparams.use_extra_bufts = self.config.use_extra_bufts
        self._kv_overrides = self._make_kv_overrides()
        self._buft_overrides = None
        if self.config.cpu_expert_layers:
            layers = "|".join(str(i) for i in sorted(self.config.cpu_expert_layers))
            self._buft_overrides = native.cpu_overrides(
                [rf"^blk\.({layers})\.ffn_(gate_up|up|gate|down)_exps"]
            )
            mparams.tensor_buft_overrides = ctypes.cast(self._buft_overrides, ctypes.c_void_p)  # pyright: ignore[reportAttributeAccessIssue]  # a pointer field the stub types as an array
        if self._kv_overrides is not None:
            mparams.kv_overrides = self._kv_overrides
        mark = native.log_mark()
        self._model_p = lib.llama_model_load_from_file(os.fsencode(self.path), mparams)  # any file name bytes
        if not self._model_p:
            raise ModelLoadError(
                f"llama.cpp could not load {self.path}: {native.recent_error(mark)[-400:]}"
                " (run with --debug for the full log)"
            )
        self._vocab_p = lib.llama_model_get_vocab(self._model_p)
        assert self._vocab_p is not None  # a loaded model always has one
        # a GGUF without a tokenizer (tokenizer.ggml.model "none") loads, but llama.cpp aborts on any text
        self._has_tokenizer = lib.llama_vocab_type(self._vocab_p) != lib.LLAMA_VOCAB_TYPE_NONE
        self._spm_guard: SpmByteGuard | None = None  # built on the first tokenize of an SPM vocabulary
        n_ctx_train = lib.llama_model_n_ctx_train(self._model)
        n_ctx = self.config.n_ctx or min(n_ctx_train, 4096)
        self.n_threads = self.config.n_threads or default_threads()
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = min(self.config.n_batch, n_ctx)
        cparams.n_ubatch = min(self.config.n_ubatch, cparams.n_batch)
        cparams.n_threads = self.n_threads
        cparams.n_threads_batch = self.n_threads
        cparams.flash_attn_type = _FLASH_ATTN_TYPE[self.config.flash_attn]
        cparams.type_k = ggml_type(self.config.cache_type_k)
        cparams.type_v = ggml_type(self.config.cache_type_v)
        cparams.op_offload = self.config.op_offload
        mark = native.log_mark()
        with native.captured_log() as logged:
            self._ctx_p = lib.llama_init_from_model(self._model_p, cparams)
        if not self._ctx_p:
            lib.llama_model_free(self._model_p)
            self._model_p = None
            raise ModelLoadError(
                f"llama.cpp could not create a context of {n_ctx} tokens for {self.path}: "
                f"{native.recent_error(mark)[-300:]}; try a smaller --ctx"
            )
        self.n_ctx = lib.llama_n_ctx(self._ctx)
        if os.environ.get("EDGEMOE_CHECK_IDS", "") not in ("", "0"):
            native.moe_set_ids_check(self._ctx, True)  # doctor, the GPU check: every device id row checked
        self.n_batch = cparams.n_batch
        self.graph_nodes = graph_nodes_logged(logged)
        # what "auto" resolved to ("unknown" only where llama.cpp's log did not say)
        self.flash_attn = flash_attn_resolved(self.config, logged)
        self.kv_cache: KvCacheInfo | None = kv_cache_logged(logged)  # None: the model has no KV cache
        self._kv: list[int] = []  # tokens whose K/V are in the cache, in order
        self.last: Generation | None = None  # the result of the last generate()/stream()
        self._hooks: HookChain | None = None
        self._policies: list[RoutePolicy] = []  # the user's, before the cache controller
        self.cache: CacheController | None = None
        self._gating: GatingPolicy | None = None  # adaptive top-k (set_gating), in the graph or the hook
        self._pred_n_out: dict[int, int] = {}  # target layer -> ids per token of its predictor in the graph

    def _make_kv_overrides(self) -> ctypes.Array[lib.llama_model_kv_override] | None:
        if self.config.expert_used_count is None:
            return None
        arr = (lib.llama_model_kv_override * 2)()  # the last entry (empty key) ends the list
        arr[0].key = f"{self.info.architecture}.expert_used_count".encode()
        arr[0].tag = lib.LLAMA_KV_OVERRIDE_TYPE_INT
        arr[0].value.val_i64 = self.config.expert_used_count
        arr[1].key = b""
        return arr

    # -- lifetime -----------------------------------------------------------------------
    # one thread at a time: llama.cpp's context is not thread-safe (two decodes at once crash it)
    _guard = threading.Lock()  # protects the three fields below of every Engine (held for a few instructions)
    _user: int | None = None  # the thread generating or decoding now
    _depth = 0  # nested _exclusive() of that thread
    _decoding = 0  # of which inside llama_decode (a hook may run)

    @contextmanager
    def _exclusive(self, *, native: bool = False) -> Iterator[None]:
        """The body uses llama.cpp for this thread; another thread's call raises EngineBusyError."""
        me = threading.get_ident()
        with Engine._guard:
            if self._user not in (None, me):
                raise EngineBusyError(
                    f"this Engine of {self.path.name} is generating for another thread: use "
                    "one Engine per thread, or serialize the calls with a lock"
                )
            self._user, self._depth, self._decoding = me, self._depth + 1, self._decoding + native
        try:
            yield
        finally:
            with Engine._guard:
                self._depth -= 1
                self._decoding -= native
                if self._depth == 0:
                    self._user = None

    def close(self) -> None:
        """Free the context and the model; any later use raises EngineClosedError. Closing twice is fine."""
        with Engine._guard:
            busy = self._decoding or self._user not in (None, threading.get_ident())
        if busy:
            raise EngineBusyError(
                f"this Engine of {self.path.name} is decoding (close() came from a routing "
                "hook or another thread): close it after the call returns"
            )
        if getattr(self, "_ctx_p", None) and self.cache is not None:
            self.cache.cache.close()
            self.cache = None
        if ctx_p := getattr(self, "_ctx_p", None):
            lib.llama_free(ctx_p)
            self._ctx_p = None
        if model_p := getattr(self, "_model_p", None):
            lib.llama_model_free(model_p)
            self._model_p = None

    def _handle(self, name: str) -> Any:
        h = getattr(self, name, None)
        if h is None:
            raise EngineClosedError(f"this Engine of {self.path.name} is closed: open a new one")
        return h

    @property
    def _ctx(self) -> Any:
        return self._handle("_ctx_p")

    @property
    def _model(self) -> Any:
        return self._handle("_model_p")

    @property
    def _vocab(self) -> Any:
        self._handle("_ctx_p")  # the vocabulary goes with the model
        return self._handle("_vocab_p")

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- vocabulary ---------------------------------------------------------------------
    @property
    def n_vocab(self) -> int:
        return lib.llama_vocab_n_tokens(self._vocab)

    def _require_tokenizer(self) -> None:
        if not self._has_tokenizer:
            raise EdgeMoeError(
                f"{self.path.name} has no tokenizer (tokenizer.ggml.model none or no_vocab): "
                "it cannot turn text into tokens or back; pass token ids, or use a GGUF with "
                "a vocabulary"
            )

    def _check_spm_bytes(self, text: str) -> None:
        """Refuse text llama.cpp's SentencePiece tokenizer would terminate the process on."""
        if lib.llama_vocab_type(self._vocab) != lib.LLAMA_VOCAB_TYPE_SPM:
            return
        if self._spm_guard is None:
            self._spm_guard = SpmByteGuard(
                lib.llama_vocab_get_text(self._vocab, i) for i in range(self.n_vocab)
            )
        bad = self._spm_guard.unencodable(text)
        if bad:
            shown = ", ".join(repr(c) for c in bad[:5]) + (
                f" and {len(bad) - 5} more" if len(bad) > 5 else ""
            )
            raise EdgeMoeError(
                f"{self.path.name}'s SentencePiece vocabulary has no token for {shown} and no "
                f"byte tokens (<0x00>..<0xFF>) to spell it with ({len(self._spm_guard.missing_bytes)}"
                " of 256 missing), so llama.cpp cannot tokenize this text: use a GGUF converted "
                "with byte fallback, or pass token ids"
            )

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Text -> ids; add_special adds BOS/EOS as the model's metadata says."""
        self._require_tokenizer()
        self._check_spm_bytes(text)
        data = text.encode("utf-8")
        cap = len(data) + 16
        buf = (lib.llama_token * cap)()
        n = lib.llama_tokenize(self._vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            buf = (lib.llama_token * cap)()
            n = lib.llama_tokenize(self._vocab, data, len(data), buf, cap, add_special, parse_special)
        return list(buf[:n])

    def token_piece(self, token: int, *, special: bool = False) -> bytes:
        if not 0 <= token < self.n_vocab:
            raise EdgeMoeError(
                f"token id {token} is not in the vocabulary of {self.path.name} (0..{self.n_vocab - 1})"
            )
        self._require_tokenizer()
        buf = ctypes.create_string_buffer(64)
        n = lib.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = lib.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        return buf.raw[:n]

    def detokenize(self, tokens: Sequence[int]) -> str:
        return b"".join(self.token_piece(t) for t in tokens).decode("utf-8", errors="replace")

    def adds_bos(self) -> bool:
        """Does tokenize(add_special=True) prepend BOS (the model's metadata says)?"""
        return bool(lib.llama_vocab_get_add_bos(self._vocab))

    def bos_token(self) -> int:
        return int(lib.llama_vocab_bos(self._vocab))

    def is_eog(self, token: int) -> bool:
        return bool(lib.llama_vocab_is_eog(self._vocab, token))

    # -- evaluation ---------------------------------------------------------------------
    def reset(self) -> None:
        """Forget the KV cache."""
        lib.llama_memory_clear(lib.llama_get_memory(self._ctx), True)  # pyright: ignore[reportArgumentType]  # takes NULL too
        self._kv = []

    def _decode(self, tokens: Sequence[int], *, all_logits: bool = False) -> None:
        """Append tokens to the sequence, n_batch at a time; logits of the last (or every) token."""
        mem = lib.llama_get_memory(self._ctx)
        for start in range(0, len(tokens), self.n_batch):
            with (
                self._exclusive(native=True),
                deferred_interrupts(),
            ):  # Ctrl-C during the decode is raised after it, never in a hook
                self._decode_chunk(
                    mem,
                    tokens[start : start + self.n_batch],
                    all_logits,
                    last=start + self.n_batch >= len(tokens),
                )

    def _decode_chunk(self, mem: Any, chunk: Sequence[int], all_logits: bool, *, last: bool) -> None:
        """One llama_decode of at most n_batch tokens; on failure the KV cache is as before it."""
        batch = lib.llama_batch_init(len(chunk), 0, 1)
        try:
            batch.n_tokens = len(chunk)
            for i, tok in enumerate(chunk):
                batch.token[i] = tok
                batch.pos[i] = len(self._kv) + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = all_logits or (last and i == len(chunk) - 1)
            rc = lib.llama_decode(self._ctx, batch)
        finally:
            lib.llama_batch_free(batch)
        if rc != 0:
            lib.llama_memory_seq_rm(mem, 0, len(self._kv), -1)
            err = self._hooks.take_error() if self._hooks else None
            if err is not None:
                raise err  # a policy raised inside the hook: llama.cpp aborted the decode
            raise EdgeMoeError(f"llama_decode failed with code {rc} at position {len(self._kv)}")
        if self.cache is not None:
            self.cache.flush()
        self._kv.extend(chunk)

    def feed(self, tokens: Sequence[int], *, all_logits: bool = False) -> None:
        """Append tokens to the current sequence without sampling (prefill, teacher forcing).

        all_logits asks for every token's logits; it also makes the last layer route every
        token (llama.cpp computes the last layer only for tokens whose outputs are kept).
        """
        if len(self._kv) + len(tokens) > self.n_ctx:
            raise ContextOverflowError(
                f"{len(self._kv)} + {len(tokens)} tokens do not fit the context of {self.n_ctx}; raise --ctx"
            )
        self._decode(list(tokens), all_logits=all_logits)

    def _prefill(self, tokens: list[int]) -> int:
        """Make the KV cache hold exactly `tokens`, reusing the common prefix; returns tokens evaluated."""
        if len(tokens) >= self.n_ctx:
            raise ContextOverflowError(
                f"the prompt is {len(tokens)} tokens but the context holds {self.n_ctx}; "
                "shorten the prompt or raise --ctx"
            )
        keep = 0
        for a, b in zip(self._kv, tokens, strict=False):
            if a != b:
                break
            keep += 1
        keep = min(keep, len(tokens) - 1)  # re-evaluate at least one token to get fresh logits
        lib.llama_memory_seq_rm(lib.llama_get_memory(self._ctx), 0, keep, -1)  # pyright: ignore[reportArgumentType]  # takes NULL too
        del self._kv[keep:]
        self._decode(tokens[keep:])
        return len(tokens) - keep

    def check_logits(self, idx: int = -1) -> None:
        """Raise NonFiniteLogitsError when output idx of the last decode has a NaN or inf, or one value for
        every token (what NaN weights give on the CPU); a pass over the row, two when its ends are equal."""
        row = np.ctypeslib.as_array(self.logits(idx))
        bad = "NaN/inf" if not math.isfinite(float(row.sum(dtype=np.float32))) else None  # NaN, inf propagate
        if bad is None and row[0] == row[-1] and row.min() == row.max():
            bad = "identical"  # NaN weights reach the CPU matmuls as all-zero quantized activations
        if bad is not None:
            raise NonFiniteLogitsError(
                f"llama.cpp computed {bad} logits over the vocabulary after {len(self._kv)} tokens of "
                f"{self.path.name}: its weights are not finite numbers (a corrupt or badly converted file?), "
                "or a routing hook wrote bad weights; re-download or re-convert the model"
            )

    def logits(self, idx: int = -1) -> ctypes.Array[ctypes.c_float]:
        """Logits of the idx-th output of the last decode (a float array of n_vocab)."""
        ptr = lib.llama_get_logits_ith(self._ctx, idx)
        return ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float * self.n_vocab)).contents

    def eval_logits(self, tokens: Sequence[int]) -> list[np.ndarray]:
        """Fresh sequence: logits for every position (for perplexity and tests)."""
        self.reset()
        out = []
        for start in range(0, len(tokens), self.n_batch):
            chunk = list(tokens[start : start + self.n_batch])
            self._decode(chunk, all_logits=True)
            for i in range(len(chunk)):
                self.check_logits(i)
                out.append(np.ctypeslib.as_array(self.logits(i)).copy())
        return out
