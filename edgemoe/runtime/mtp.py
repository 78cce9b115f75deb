"""Drafting with the model's own MTP (multi-token prediction, NextN) heads.

A GGUF with `{arch}.nextn_predict_layers = N` keeps its MTP block(s) as the last N `blk.*` blocks; llama.cpp loads
them with `load_mtp` and runs one in a second context of type LLAMA_CONTEXT_TYPE_MTP on the same model (no weights
copied). The block's input at position p is the trunk's last hidden state at p - 1 with the token at p; its logits
guess the token at p + 1. So:

- every target decode (prompt chunks, verification batches) is mirrored into the MTP context, each token paired
  with the hidden row of the token before it (KVSequence.mirror); that writes the MTP block's K/V from the true
  hidden states;
- a proposal decodes the last sampled token with the last kept hidden row, takes the argmax, and goes on from the
  block's own output row, one token per decode; its K/V is removed afterwards;
- when the target keeps fewer tokens (a rejected proposal), the MTP context drops the same positions.

The MTP block runs without edgemoe's hook, cache or gating (they are set on the target context only); its routed
experts stay in CPU memory (handle.buft_overrides). Greedy output with MTP drafting equals plain greedy: drafts only
decide how many tokens a verification batch holds.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import EdgeMoeError, InvalidConfigError
from ..gguf.header import GgufHeader
from ..gguf.info import ModelInfo
from . import native
from .config import LoadConfig
from .handle import NativeHandle, context_params
from .native import lib
from .prompt_cache import common_prefix

# GGUF architectures whose llama.cpp graph builds an MTP (DECODER_MTP) graph (llama-cpp-python 0.3.36's
# src/models/*.cpp); glm5-next dispatches one but throws "not implemented".
MTP_ARCHS = frozenset(
    {
        "deepseek2",
        "deepseek32",
        "deepseek4",
        "glm4moe",
        "glm-dsa",
        "qwen3next",
        "qwen35moe",
        "qwen35",
        "step35",
        "bailingmoe3",
        "cohere2moe",
        "nemotron_h_moe",
        "hy_v3",
        "mimo2",
    }
)
MULTI_HEAD_ARCHS = frozenset({"step35", "hy_v3"})  # the rest assert exactly one NextN block
NO_MTP = "use `lookup` or `draft` speculation instead"


def mtp_refusal(header: GgufHeader, info: ModelInfo) -> str | None:
    """Why llama.cpp cannot draft with this file's MTP heads (it would abort in an assert), or None."""
    arch, meta = header.architecture, header.metadata
    if not info.mtp_heads:
        return (
            f"{header.path.name} carries no MTP heads ({arch}.nextn_predict_layers is "
            f"{info.n_nextn}{'' if not info.n_nextn else ' but its MTP blocks have no tensors'})"
        )
    if arch not in MTP_ARCHS:
        return f"llama.cpp runs no MTP graph for the {arch} architecture"
    if info.n_nextn != 1 and arch not in MULTI_HEAD_ARCHS:
        return f"llama.cpp's {arch} MTP graph runs one MTP block, and {header.path.name} has {info.n_nextn}"
    if info.n_nextn != 1:
        return f"{header.path.name} has {info.n_nextn} chained MTP heads; edgemoe drafts with one head only"
    if arch == "deepseek2" and not meta.get(f"{arch}.attention.q_lora_rank"):
        return "llama.cpp's deepseek2 MTP graph needs q_lora_rank > 0 (DeepSeek-V3's layout)"
    if f"{arch}.attention.temperature_scale" in meta:
        return f"llama.cpp's {arch} MTP graph does not take attention.temperature_scale"
    if not native.has_nextn():
        return "this libllama lacks the C names of the NextN functions (patch 0015): run `make install`"
    return None


def check_mtp(header: GgufHeader, info: ModelInfo) -> None:
    """InvalidConfigError where mtp_refusal gives a reason."""
    refusal = mtp_refusal(header, info)
    if refusal is not None:
        raise InvalidConfigError(f"`mtp` speculation cannot run: {refusal}; {NO_MTP}")


class MtpDrafter:
    """A DraftSource (edgemoe.speculation.source) over the MTP context, and the target sequence's mirror
    (KVSequence.mirror): decoded/truncated/cleared keep the MTP block's K/V in step with the target's."""

    name = "mtp"

    def __init__(self, handle: NativeHandle, config: LoadConfig, n_ctx: int) -> None:
        """An MTP context beside handle's (n_ctx: the whole context, every context tier included)."""
        self.handle = handle
        self.n_embd = int(lib.llama_model_n_embd_out(handle.model))
        self.n_vocab = int(lib.llama_vocab_n_tokens(handle.vocab))
        cparams = context_params(config, n_ctx, handle.n_threads)
        cparams.ctx_type = lib.LLAMA_CONTEXT_TYPE_MTP
        cparams.n_rs_seq = 0
        mark = native.log_mark()
        self._ctx: Any = lib.llama_init_from_model(handle.model, cparams)
        if not self._ctx:
            raise EdgeMoeError(
                f"llama.cpp could not create the MTP context of {handle.name} ({n_ctx} tokens): "
                f"{native.recent_error(mark)[-300:]}; try a smaller `n_ctx` or `n_ubatch`"
            )
        native.set_embeddings_nextn(self._ctx, True, masked=True)  # the draft's own row, for its outputs only
        self.attach()
        # the tokens whose MTP K/V is held, from position `first` (0, or where the mirror started again after a gap)
        self.first = 0
        self.tokens: list[int] = []
        # the last target decode's hidden rows and its first position, cut to the tokens the target kept
        self.rows: tuple[int, np.ndarray] | None = None

    def attach(self) -> None:
        """Make the target context keep every batch token's hidden row (again after a context tier's resize)."""
        native.set_embeddings_nextn(self.handle.ctx, True, masked=False)

    @property
    def ctx(self) -> Any:
        if not self._ctx:
            raise EdgeMoeError("the MTP drafter is closed")
        return self._ctx

    @property
    def next_pos(self) -> int:
        """The position the MTP K/V continues at."""
        return self.first + len(self.tokens)

    def hidden(self, pos: int) -> np.ndarray | None:
        """The target's hidden row at position pos, which the token at pos + 1 pairs with: zeros before the first
        token (pos -1); None where it is gone (a truncation deeper than the last decode, a restored state)."""
        if pos == -1:
            return np.zeros(self.n_embd, np.float32)
        if self.rows is not None and 0 <= pos - self.rows[0] < len(self.rows[1]):
            return self.rows[1][pos - self.rows[0]]
        return None

    # -- the mirror of the target's sequence ---------------------------------------------------------------------
    def decoded(self, tokens: Sequence[int], start: int) -> None:
        """The target decoded tokens at positions start..: write their MTP K/V, each token with the hidden row
        of the one before it (zeros where that row is gone: after a restored KV state)."""
        rows = native.embeddings_nextn(self.handle.ctx, len(tokens), self.n_embd)
        prev = self.hidden(start - 1)
        if self.next_pos != start:  # a gap (a restored KV state): start over from here
            self._forget(0)
            self.first = start
        h = np.empty((len(tokens), self.n_embd), np.float32)
        h[0] = prev if prev is not None else 0.0
        h[1:] = rows[:-1]
        self.rows = (start, rows)
        if self._decode(tokens, start, h, last_logits=False):
            self.tokens.extend(tokens)
        else:
            self._forget(0)

    def truncated(self, n: int) -> None:
        """The target kept its first n tokens: so do the MTP K/V and the hidden rows."""
        if self.next_pos > n:
            self._forget(n)
        if self.rows is not None:
            start, rows = self.rows
            self.rows = (start, rows[: max(0, n - start)])

    def restored(self, tokens: Sequence[int]) -> None:
        """The target's K/V was replaced by a state of these tokens (serve's prompt cache, a context tier's
        resize): the MTP K/V keeps what it shares with them; past that, the mirror starts again at the next
        decode, its first token paired with zeros."""
        self.truncated(self.first + common_prefix(self.tokens, tokens[self.first :]))

    def cleared(self) -> None:
        """The target's KV cache was emptied."""
        self._forget(0)
        self.rows = None

    def _forget(self, n: int) -> None:
        """Keep the MTP K/V of the positions before n (none at or before the first held)."""
        mem: Any = lib.llama_get_memory(self.ctx)
        if n <= self.first:
            lib.llama_memory_clear(mem, True)
            self.first, self.tokens = 0, []
        else:
            lib.llama_memory_seq_rm(mem, 0, n, -1)
            del self.tokens[n - self.first :]

    # -- drafting ------------------------------------------------------------------------------------------------
    def propose(self, context: Sequence[int], n: int) -> list[int]:
        """Up to n greedy guesses after context (its last token sampled, not yet decoded by the target); [] where
        the MTP K/V is not in step with the target (after a restored KV state, until the next prompt)."""
        pos0 = len(context) - 1
        h = self.hidden(pos0 - 1)
        if n <= 0 or self.next_pos != pos0 or h is None:
            return []
        tok = context[-1]
        out: list[int] = []
        try:
            for i in range(n):
                if not self._decode([tok], pos0 + i, h[None, :], last_logits=True):
                    break
                logits = lib.llama_get_logits_ith(self.ctx, -1)
                row = np.ctypeslib.as_array(
                    ctypes.cast(logits, ctypes.POINTER(ctypes.c_float)), (self.n_vocab,)
                )
                tok = int(np.argmax(row))
                out.append(tok)
                h = native.embeddings_nextn_ith(self.ctx, -1, self.n_embd)
        finally:
            self._forget(pos0)  # the guesses' K/V go; the verification batch's mirror writes the true ones
        return out

    def _decode(self, tokens: Sequence[int], start: int, h: np.ndarray, *, last_logits: bool) -> bool:
        """One llama_decode of the MTP context: tokens at start.., with their hidden rows h (n, n_embd)."""
        h = np.ascontiguousarray(h, dtype=np.float32)
        batch = lib.llama_batch_init(len(tokens), 0, 1)
        try:
            batch.n_tokens = len(tokens)
            batch.embd = h.ctypes.data_as(ctypes.POINTER(ctypes.c_float))  # pyright: ignore[reportAttributeAccessIssue]  # a pointer field the stub types as an array
            for i, tok in enumerate(tokens):
                batch.token[i] = tok
                batch.pos[i] = start + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = last_logits and i == len(tokens) - 1
            rc = lib.llama_decode(self.ctx, batch)
        finally:
            batch.embd = ctypes.POINTER(ctypes.c_float)()  # pyright: ignore[reportAttributeAccessIssue]  # ours: llama_batch_free must not free it
            lib.llama_batch_free(batch)
        return rc == 0

    def close(self) -> None:
        if self._ctx:
            lib.llama_free(self._ctx)
            self._ctx = None
