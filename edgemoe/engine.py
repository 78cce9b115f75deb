"""edgemoe.Engine: load a GGUF, tokenize, generate/stream, chat, timings.

Built on llama-cpp-python's low-level bindings (edgemoe.native.lib). One
sequence, one context; the KV cache keeps the longest common prefix between
calls, so a chat turn only evaluates the new tokens.
"""
from __future__ import annotations

import ctypes
import logging
import os
import time
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import native
from .errors import ContextOverflowError, EdgeMoeError, ModelLoadError
from .gguf_info import ModelInfo, check_gguf, read_model_info
from .expert_cache import CacheConfig, CacheController, ExpertCache
from .hooks import HookChain, RoutePolicy
from .native import lib
from .residency import make_policy
from .sampling import SamplingParams, Sampler

log = logging.getLogger(__name__)


def default_threads() -> int:
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return n if n <= 4 else n // 2  # llama.cpp runs best on physical cores


@dataclass(frozen=True)
class LoadConfig:
    n_ctx: int = 0  # context length; 0 = the model's training context, capped at 4096
    n_batch: int = 512  # tokens per llama_decode call during prefill
    n_ubatch: int = 512  # physical micro-batch
    n_threads: int = 0  # 0 = default_threads()
    n_gpu_layers: int = 0  # layers offloaded by stock llama.cpp (experts handled by later patches)
    use_mmap: bool = True
    flash_attn: bool = False  # off, as llama-cpp-python's default (llama.cpp's own default is "auto")
    expert_used_count: int | None = None  # override the model's top-k (stock llama.cpp's --override-kv)
    # CPU weight repacking (llama.cpp's default); equality tests of the expert cache load both sides
    # with False, so that the CPU and the stand-in cache run the same kernels
    use_extra_bufts: bool = True
    # MoE layers whose routed experts stay in CPU memory while n_gpu_layers offloads the rest
    # (llama.cpp's -ot exps=CPU for all of them, --n-cpu-moe N for the first N); None: llama.cpp decides
    cpu_expert_layers: tuple[int, ...] | None = None
    op_offload: bool = True  # llama.cpp moves big-batch ops on host weights to a GPU (its default)


@dataclass(frozen=True)
class Timings:
    prompt_tokens: int  # tokens evaluated in prefill (after prefix reuse)
    prompt_s: float
    decode_tokens: int
    decode_s: float
    ttft_s: float  # request start -> first generated token

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_s if self.prompt_s > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        # the first token comes out of prefill; decode speed counts the steps after it
        steps = self.decode_tokens - 1
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else 0.0

    def to_dict(self) -> dict[str, float]:
        return {"prompt_tokens": self.prompt_tokens, "prompt_s": self.prompt_s,
                "prompt_tps": self.prompt_tps, "decode_tokens": self.decode_tokens,
                "decode_s": self.decode_s, "decode_tps": self.decode_tps, "ttft_s": self.ttft_s}


@dataclass
class Generation:
    text: str
    prompt_tokens: list[int]
    tokens: list[int]  # generated ids (the stop token included when one ended generation)
    stop_reason: str  # "eog" | "length" | "context"
    timings: Timings


@dataclass
class ChatMessage:
    role: str
    content: str


class _Utf8Stream:
    """Turns token pieces (bytes) into text without splitting multi-byte characters."""

    def __init__(self) -> None:
        self.buf = b""

    def push(self, piece: bytes) -> str:
        self.buf += piece
        for cut in range(len(self.buf), max(len(self.buf) - 4, -1), -1):
            try:
                text = self.buf[:cut].decode("utf-8")
            except UnicodeDecodeError:
                continue
            self.buf = self.buf[cut:]
            return text
        text, self.buf = self.buf.decode("utf-8", errors="replace"), b""
        return text

    def flush(self) -> str:
        text, self.buf = self.buf.decode("utf-8", errors="replace"), b""
        return text


class Engine:
    """A loaded model with one context. Use as a context manager or call close()."""

    def __init__(self, model_path: str | os.PathLike[str], config: LoadConfig | None = None) -> None:
        self.path = Path(model_path)
        self.config = config or LoadConfig()
        check_gguf(self.path)  # typed, actionable errors before llama.cpp sees the file
        native.require_patched()
        native.route_logs_to_python()
        self.info: ModelInfo = read_model_info(self.path)
        lib.llama_backend_init()
        mparams = lib.llama_model_default_params()
        mparams.n_gpu_layers = self.config.n_gpu_layers
        mparams.load_mode = lib.LLAMA_LOAD_MODE_MMAP if self.config.use_mmap else lib.LLAMA_LOAD_MODE_NONE
        mparams.use_extra_bufts = self.config.use_extra_bufts
        self._kv_overrides = self._make_kv_overrides()
        self._buft_overrides = None
        if self.config.cpu_expert_layers:
            layers = "|".join(str(i) for i in sorted(self.config.cpu_expert_layers))
            self._buft_overrides = native.cpu_overrides([rf"^blk\.({layers})\.ffn_(gate_up|up|gate|down)_exps"])
            mparams.tensor_buft_overrides = ctypes.cast(self._buft_overrides, ctypes.c_void_p)
        if self._kv_overrides is not None:
            mparams.kv_overrides = self._kv_overrides
        self._model = lib.llama_model_load_from_file(str(self.path).encode(), mparams)
        if not self._model:
            raise ModelLoadError(f"llama.cpp could not load {self.path}: {native.recent_log()[-400:].strip()}"
                                 " (run with --debug for the full log)")
        self._vocab = lib.llama_model_get_vocab(self._model)
        n_ctx_train = lib.llama_model_n_ctx_train(self._model)
        n_ctx = self.config.n_ctx or min(n_ctx_train, 4096)
        self.n_threads = self.config.n_threads or default_threads()
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = min(self.config.n_batch, n_ctx)
        cparams.n_ubatch = min(self.config.n_ubatch, cparams.n_batch)
        cparams.n_threads = self.n_threads
        cparams.n_threads_batch = self.n_threads
        cparams.flash_attn_type = (lib.LLAMA_FLASH_ATTN_TYPE_ENABLED if self.config.flash_attn
                                   else lib.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        cparams.op_offload = self.config.op_offload
        self._ctx = lib.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            lib.llama_model_free(self._model)
            self._model = None
            raise ModelLoadError(f"llama.cpp could not create a context of {n_ctx} tokens for {self.path}: "
                                 f"{native.recent_log()[-300:].strip()}; try a smaller --ctx")
        self.n_ctx = lib.llama_n_ctx(self._ctx)
        self.n_batch = cparams.n_batch
        self._kv: list[int] = []  # tokens whose K/V are in the cache, in order
        self.last: Generation | None = None  # the result of the last generate()/stream()
        self._hooks: HookChain | None = None
        self._policies: list[RoutePolicy] = []  # the user's, before the cache controller
        self.cache: CacheController | None = None

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
    def close(self) -> None:
        if getattr(self, "_ctx", None) and self.cache is not None:
            self.cache.cache.close()
            self.cache = None
        if getattr(self, "_ctx", None):
            lib.llama_free(self._ctx)
            self._ctx = None
        if getattr(self, "_model", None):
            lib.llama_model_free(self._model)
            self._model = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- vocabulary ---------------------------------------------------------------------
    @property
    def n_vocab(self) -> int:
        return lib.llama_vocab_n_tokens(self._vocab)

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Text -> ids; add_special adds BOS/EOS as the model's metadata says."""
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

    # -- MoE routing hook -----------------------------------------------------------------
    def set_policies(self, policies: Sequence[RoutePolicy] | None) -> HookChain | None:
        """Route every MoE layer of every ubatch through these policies (None or [] removes the hook)."""
        self._policies = list(policies or [])
        chain = self._policies + ([self.cache] if self.cache is not None and self.cache.needs_routes else [])
        if chain:
            self._hooks = HookChain(chain)
            native.moe_set_hook(self._ctx, self._hooks.c_callback, self._hooks.flags)
        else:
            native.moe_set_hook(self._ctx, None, 0)
            self._hooks = None
        return self._hooks

    def enable_expert_cache(self, config: CacheConfig | None, *, device: object = None) -> ExpertCache | None:
        """Give every MoE layer config.slots_per_layer expert slots run by config.policy (None removes it).

        device None uses the CPU buffer that stands in for a GPU (the split logic without one).
        """
        if self.cache is not None:
            self.cache.cache.close()
            self.cache = None
        if config is not None:
            policy = make_policy(config.policy, {il: config.slots_per_layer for il in self.info.moe_layers},
                                 blocking=config.blocking, calibration=config.calibration)
            cache = ExpertCache(self._ctx, self.path, list(self.info.moe_layers), self.info.n_layer,
                                self.info.n_expert, config.slots_per_layer, device)
            try:
                self.cache = CacheController(cache, policy)
            except BaseException:
                cache.close()
                raise
        self.set_policies(self._policies)
        return self.cache.cache if self.cache is not None else None

    # -- evaluation ---------------------------------------------------------------------
    def reset(self) -> None:
        """Forget the KV cache."""
        lib.llama_memory_clear(lib.llama_get_memory(self._ctx), True)
        self._kv = []

    def _decode(self, tokens: Sequence[int], *, all_logits: bool = False) -> None:
        """Append tokens to the sequence, n_batch at a time; logits of the last (or every) token."""
        mem = lib.llama_get_memory(self._ctx)
        for start in range(0, len(tokens), self.n_batch):
            chunk = tokens[start:start + self.n_batch]
            batch = lib.llama_batch_init(len(chunk), 0, 1)
            try:
                batch.n_tokens = len(chunk)
                last = start + len(chunk) == len(tokens)
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
                f"{len(self._kv)} + {len(tokens)} tokens do not fit the context of {self.n_ctx}; raise --ctx")
        self._decode(list(tokens), all_logits=all_logits)

    def _prefill(self, tokens: list[int]) -> int:
        """Make the KV cache hold exactly `tokens`, reusing the common prefix; returns tokens evaluated."""
        if len(tokens) >= self.n_ctx:
            raise ContextOverflowError(
                f"the prompt is {len(tokens)} tokens but the context holds {self.n_ctx}; "
                "shorten the prompt or raise --ctx")
        keep = 0
        for a, b in zip(self._kv, tokens):
            if a != b:
                break
            keep += 1
        keep = min(keep, len(tokens) - 1)  # re-evaluate at least one token to get fresh logits
        lib.llama_memory_seq_rm(lib.llama_get_memory(self._ctx), 0, keep, -1)
        del self._kv[keep:]
        self._decode(tokens[keep:])
        return len(tokens) - keep

    def logits(self, idx: int = -1) -> ctypes.Array[ctypes.c_float]:
        """Logits of the idx-th output of the last decode (a float array of n_vocab)."""
        ptr = lib.llama_get_logits_ith(self._ctx, idx)
        return ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float * self.n_vocab)).contents

    def eval_logits(self, tokens: Sequence[int]) -> list[np.ndarray]:
        """Fresh sequence: logits for every position (for perplexity and tests)."""
        self.reset()
        out = []
        for start in range(0, len(tokens), self.n_batch):
            chunk = list(tokens[start:start + self.n_batch])
            self._decode(chunk, all_logits=True)
            for i in range(len(chunk)):
                out.append(np.ctypeslib.as_array(self.logits(i)).copy())
        return out

    # -- generation ---------------------------------------------------------------------
    def stream(self, prompt: str | Sequence[int], *, max_tokens: int = 128,
               sampling: SamplingParams | None = None, parse_special: bool = False,
               ignore_eog: bool = False) -> Iterator[tuple[int, str]]:
        """Yield (token id, text piece) as they are generated; the Generation is then in self.last.

        The id is -1 for a final piece flushed from an incomplete UTF-8 sequence.
        ignore_eog keeps generating past end-of-generation tokens (benchmarks).
        """
        gen = self._run(prompt, max_tokens, sampling or SamplingParams(), parse_special, ignore_eog)
        try:
            while True:
                yield next(gen)
        except StopIteration as stop:
            self.last = stop.value

    def generate(self, prompt: str | Sequence[int], *, max_tokens: int = 128,
                 sampling: SamplingParams | None = None, parse_special: bool = False,
                 ignore_eog: bool = False) -> Generation:
        for _ in self.stream(prompt, max_tokens=max_tokens, sampling=sampling, parse_special=parse_special,
                             ignore_eog=ignore_eog):
            pass
        assert self.last is not None
        return self.last

    def _run(self, prompt: str | Sequence[int], max_tokens: int, sampling: SamplingParams,
             parse_special: bool, ignore_eog: bool) -> Generator[tuple[int, str], None, Generation]:
        t0 = time.perf_counter()
        ids = self.tokenize(prompt, parse_special=parse_special) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise EdgeMoeError("the prompt is empty after tokenization; give some text")
        n_eval = self._prefill(ids)
        t_prefill = time.perf_counter()
        sampler = Sampler(sampling, self._vocab, self.n_vocab)
        out: list[int] = []
        text = _Utf8Stream()
        stop = "length"
        t_first = t_prefill
        try:
            for i in range(max_tokens):
                tok = sampler.sample(self._ctx)
                out.append(tok)
                if i == 0:
                    t_first = time.perf_counter()
                if self.is_eog(tok) and not ignore_eog:
                    stop = "eog"
                    break
                yield tok, text.push(self.token_piece(tok))
                if i + 1 < max_tokens:
                    if len(self._kv) >= self.n_ctx:  # no room to decode it: the context is full
                        stop = "context"
                        break
                    self._decode([tok])
        finally:
            sampler.close()
        tail = text.flush()
        if tail:
            yield -1, tail
        t_end = time.perf_counter()
        gen_ids = [t for t in out if not self.is_eog(t)]
        timings = Timings(prompt_tokens=n_eval, prompt_s=t_prefill - t0, decode_tokens=len(out),
                          decode_s=t_end - t_first, ttft_s=t_first - t0)
        return Generation(text=self.detokenize(gen_ids), prompt_tokens=ids, tokens=out,
                          stop_reason=stop, timings=timings)

    # -- chat -----------------------------------------------------------------------------
    def chat_template(self) -> str | None:
        ptr = lib.llama_model_chat_template(self._model, None)
        return ptr.decode("utf-8") if ptr else None

    def format_chat(self, messages: Sequence[ChatMessage], *, add_assistant: bool = True) -> str:
        """Apply the model's chat template (llama.cpp's built-in template engine)."""
        tmpl = self.chat_template()
        if tmpl is None:
            raise EdgeMoeError(f"{self.path.name} has no chat template in its metadata; use "
                               "`edgemoe generate` for plain completion")
        arr = (lib.llama_chat_message * len(messages))()
        keep = []  # keep the encoded strings alive during the call
        for i, m in enumerate(messages):
            role, content = m.role.encode(), m.content.encode()
            keep += [role, content]
            arr[i].role, arr[i].content = role, content
        size = 256 + 2 * sum(len(k) for k in keep)
        buf = ctypes.create_string_buffer(size)
        n = lib.llama_chat_apply_template(tmpl.encode(), arr, len(messages), add_assistant, buf, size)
        if n > size:
            buf = ctypes.create_string_buffer(n)
            n = lib.llama_chat_apply_template(tmpl.encode(), arr, len(messages), add_assistant, buf, n)
        if n < 0:
            raise EdgeMoeError(f"llama.cpp does not recognise the chat template of {self.path.name}; "
                               "use `edgemoe generate` for plain completion")
        return buf.raw[:n].decode("utf-8")


@dataclass
class ChatSession:
    """A conversation on an Engine: history + template; only new tokens are evaluated per turn."""

    engine: Engine
    system: str | None = None
    history: list[ChatMessage] = field(default_factory=list)

    def reset(self) -> None:
        self.history.clear()

    def messages(self) -> list[ChatMessage]:
        head = [ChatMessage("system", self.system)] if self.system else []
        return head + self.history

    def send(self, user_text: str, *, max_tokens: int = 256,
             sampling: SamplingParams | None = None) -> Iterator[str]:
        """Stream the assistant's reply to user_text; the full Generation is in engine.last."""
        self.history.append(ChatMessage("user", user_text))
        prompt = self.engine.format_chat(self.messages())
        reply: list[str] = []
        try:
            for _, piece in self.engine.stream(prompt, max_tokens=max_tokens, sampling=sampling,
                                               parse_special=True):
                reply.append(piece)
                yield piece
        except BaseException:
            self.history.pop()
            raise
        self.history.append(ChatMessage("assistant", "".join(reply).strip()))
