"""The one sequence of an Engine's context: the tokens whose K/V are cached, decoding more, logits, KV snapshots.

KVSequence is a part of Engine (edgemoe.runtime.engine). It decodes n_batch tokens per llama_decode on the
thread that holds the engine's ThreadGuard, keeps the longest common prefix between prompts (prefill), and
after each decode asks the routing for what a policy raised in the hook and for the expert cache's loads.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from ..errors import ContextOverflowError, EdgeMoeError, NonFiniteLogitsError
from .exclusive import ThreadGuard
from .handle import NativeHandle
from .interrupts import deferred_interrupts
from .native import lib
from .prompt_cache import KVSnapshot, common_prefix
from .routing import Routing
from .vocab import Vocabulary


class SequenceMirror(Protocol):
    """What follows the sequence's K/V decode by decode (edgemoe.runtime.mtp: the MTP heads' context)."""

    def decoded(self, tokens: Sequence[int], start: int) -> None:
        """Right after the llama_decode of tokens at positions start.. (its outputs still readable)."""
        ...

    def truncated(self, n: int) -> None:
        """The first n tokens were kept."""
        ...

    def restored(self, tokens: Sequence[int]) -> None:
        """The K/V was replaced by a restored state of these tokens."""
        ...

    def cleared(self) -> None:
        """The K/V was emptied."""
        ...


class KVSequence:
    """Sequence 0 of the context: its tokens in order, decoded n_batch at a time."""

    def __init__(self, handle: NativeHandle, vocab: Vocabulary, guard: ThreadGuard, routing: Routing) -> None:
        self.handle = handle
        self.vocab = vocab
        self.guard = guard
        self.routing = routing
        self.n_ctx = handle.n_ctx
        self.n_batch = handle.n_batch
        self.tokens: list[int] = []  # tokens whose K/V are in the cache, in order
        # context tiers (Engine.set_context_tiers): called with (tokens needed, tokens kept) before the cache grows
        self.fit: Callable[[int, int], None] | None = None
        # called between a prefill's chunks (n_batch tokens each, from where it starts) with the tokens then
        # held: a chunk boundary, where serve's prompt cache may take a snapshot (None: nobody watches)
        self.on_chunk: Callable[[int], None] | None = None
        self.mirror: SequenceMirror | None = None  # told of every decode, truncation and clearing

    def reset(self) -> None:
        """Forget the KV cache."""
        lib.llama_memory_clear(lib.llama_get_memory(self.handle.ctx), True)  # pyright: ignore[reportArgumentType]  # takes NULL too
        self.tokens = []
        if self.mirror is not None:
            self.mirror.cleared()

    def decode(
        self,
        tokens: Sequence[int],
        *,
        all_logits: bool = False,
        on_chunk: Callable[[int], None] | None = None,
    ) -> None:
        """Append tokens to the sequence, n_batch at a time; logits of the last (or every) token. `on_chunk` is
        called after each chunk but the last with the tokens then held (outside the native call)."""
        if self.fit is not None:
            self.fit(len(self.tokens) + len(tokens), len(self.tokens))
        mem = lib.llama_get_memory(self.handle.ctx)
        for start in range(0, len(tokens), self.n_batch):
            last = start + self.n_batch >= len(tokens)
            with (
                self.guard.hold(native=True),
                deferred_interrupts(),
            ):  # Ctrl-C during the decode is raised after it, never in a hook
                self.decode_chunk(mem, tokens[start : start + self.n_batch], all_logits, last=last)
            if on_chunk is not None and not last:
                on_chunk(len(self.tokens))

    def decode_chunk(self, mem: Any, chunk: Sequence[int], all_logits: bool, *, last: bool) -> None:
        """One llama_decode of at most n_batch tokens; on failure the KV cache is as before it."""
        batch = lib.llama_batch_init(len(chunk), 0, 1)
        try:
            batch.n_tokens = len(chunk)
            for i, tok in enumerate(chunk):
                batch.token[i] = tok
                batch.pos[i] = len(self.tokens) + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = all_logits or (last and i == len(chunk) - 1)
            rc = lib.llama_decode(self.handle.ctx, batch)
        finally:
            lib.llama_batch_free(batch)
        if rc != 0:
            lib.llama_memory_seq_rm(mem, 0, len(self.tokens), -1)
            err = self.routing.take_error()
            if err is not None:
                raise err  # a policy raised inside the hook: llama.cpp aborted the decode
            raise EdgeMoeError(f"llama_decode failed with code {rc} at position {len(self.tokens)}")
        if self.mirror is not None:
            self.mirror.decoded(chunk, len(self.tokens))
        self.routing.flush_loads()
        self.tokens.extend(chunk)

    def feed(self, tokens: Sequence[int], *, all_logits: bool = False) -> None:
        """Append tokens without sampling (Engine.feed); ContextOverflowError when they do not fit."""
        if len(self.tokens) + len(tokens) > self.n_ctx:
            raise ContextOverflowError(
                f"{len(self.tokens)} + {len(tokens)} tokens do not fit the context of {self.n_ctx}; raise `n_ctx`"
            )
        self.decode(list(tokens), all_logits=all_logits)

    def prefill(self, tokens: list[int]) -> int:
        """Make the KV cache hold exactly `tokens`, reusing the common prefix; returns tokens evaluated."""
        if len(tokens) >= self.n_ctx:
            raise ContextOverflowError(
                f"the prompt is {len(tokens)} tokens but the context holds {self.n_ctx}; "
                "shorten the prompt or raise `n_ctx`"
            )
        keep = min(common_prefix(self.tokens, tokens), len(tokens) - 1)  # re-evaluate one for fresh logits
        self.truncate(keep)
        if self.fit is not None and keep == 0:
            self.fit(len(tokens), 0)  # nothing kept: the smallest context tier that holds the prompt
        self.decode(tokens[keep:], on_chunk=self.on_chunk)
        return len(tokens) - keep

    def truncate(self, n: int) -> None:
        """Keep the first n tokens' K/V and forget the rest (speculation's rejected proposals)."""
        lib.llama_memory_seq_rm(lib.llama_get_memory(self.handle.ctx), 0, n, -1)  # pyright: ignore[reportArgumentType]  # takes NULL too
        del self.tokens[n:]
        if self.mirror is not None:
            self.mirror.truncated(n)

    def check_logits(self, idx: int = -1) -> None:
        """Raise NonFiniteLogitsError when output idx of the last decode has a NaN or inf, or one value for
        every token (what NaN weights give on the CPU); a pass over the row, two when its ends are equal."""
        row = np.ctypeslib.as_array(self.logits(idx))
        bad = "NaN/inf" if not math.isfinite(float(row.sum(dtype=np.float32))) else None  # NaN, inf propagate
        if bad is None and row[0] == row[-1] and row.min() == row.max():
            bad = "identical"  # NaN weights reach the CPU matmuls as all-zero quantized activations
        if bad is not None:
            raise NonFiniteLogitsError(
                f"llama.cpp computed {bad} logits over the vocabulary after {len(self.tokens)} tokens of "
                f"{self.handle.name}: its weights are not finite numbers (a corrupt or badly converted file?), "
                "or a routing hook wrote bad weights; re-download or re-convert the model"
            )

    def logits(self, idx: int = -1) -> ctypes.Array[ctypes.c_float]:
        """Logits of the idx-th output of the last decode (a float array of n_vocab)."""
        ptr = lib.llama_get_logits_ith(self.handle.ctx, idx)
        return ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float * self.vocab.n_vocab)).contents

    def eval_logits(self, tokens: Sequence[int]) -> list[np.ndarray]:
        """Fresh sequence: logits for every position (for perplexity and tests)."""
        self.reset()
        out = []
        for start in range(0, len(tokens), self.n_batch):
            chunk = list(tokens[start : start + self.n_batch])
            self.decode(chunk, all_logits=True)
            for i in range(len(chunk)):
                self.check_logits(i)
                out.append(np.ctypeslib.as_array(self.logits(i)).copy())
        return out

    # -- KV state to and from host memory (the serve's prompt cache, edgemoe.runtime.prompt_cache) ----------------
    def cached_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of a prompt the KV cache holds now (prefill evaluates at least one)."""
        return min(common_prefix(self.tokens, tokens), max(0, len(tokens) - 1))

    def snapshot(self) -> KVSnapshot:
        """A copy of the KV state of the tokens evaluated so far."""
        with self.guard.hold(native=True):
            ctx = self.handle.ctx
            size = lib.llama_state_seq_get_size(ctx, lib.llama_seq_id(0))
            buf = (ctypes.c_uint8 * size)()
            n = lib.llama_state_seq_get_data(ctx, buf, size, lib.llama_seq_id(0))
        if n != size:
            raise EdgeMoeError(f"llama.cpp wrote {n} bytes of KV state where it announced {size}")
        return KVSnapshot(tuple(self.tokens), buf)

    def restore(self, snap: KVSnapshot) -> None:
        """Make the KV cache hold snap's tokens again (the next prompt then reuses what it shares)."""
        if self.fit is not None:
            # the tier that holds them and the next token (a state of the whole context: the last tier)
            self.fit(min(len(snap.tokens) + 1, self.n_ctx), 0)
        self.load(snap)

    # -- CarryKV (edgemoe.runtime.context_tiers): the K/V across a re-created context -------------------------------
    def save(self, n: int) -> KVSnapshot:
        """The first n tokens' KV state in host memory (the rest forgotten)."""
        self.truncate(n)
        return self.snapshot()

    def cleared(self) -> None:
        """The context was re-created: its KV cache is empty (until load(): the mirror is told then)."""
        self.tokens = []

    def load(self, snap: KVSnapshot) -> None:
        """restore() within the context as it is."""
        with self.guard.hold(native=True):
            ctx = self.handle.ctx
            lib.llama_memory_clear(lib.llama_get_memory(ctx), True)  # pyright: ignore[reportArgumentType]  # takes NULL too
            self.tokens = []
            n = lib.llama_state_seq_set_data(ctx, snap.data, snap.nbytes, lib.llama_seq_id(0))
        if n == 0:
            raise EdgeMoeError(
                f"llama.cpp could not restore a KV state of {len(snap.tokens)} tokens "
                f"({snap.nbytes} bytes): the cache was cleared instead"
            )
        self.tokens = list(snap.tokens)
        if self.mirror is not None:
            self.mirror.restored(self.tokens)
