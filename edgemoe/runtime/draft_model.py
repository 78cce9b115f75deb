"""Draft sources that run a model: a small GGUF with the target's vocabulary (`--draft-model`), and the factory
that builds an Engine's draft source from its SpeculationConfig (the model's own MTP heads: edgemoe.runtime.mtp).

The draft model has its own Engine (its own context and KV cache, on the CPU: Engine._open_draft). Each proposal
makes the draft's KV cache hold the context (reusing the common prefix, so only the tokens since the last
proposal are evaluated) and decodes greedily from there.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from ..errors import InvalidConfigError
from ..speculation.config import SpeculationConfig
from ..speculation.lookup import PromptLookup
from ..speculation.source import DraftSource

SAME_VOCAB = "speculation needs a draft with the same vocabulary (a smaller model of the same family)"
VOCAB_PROBE = 4096  # token pieces compared between the target and the draft (spread over the vocabulary)


class DraftEngine(Protocol):
    """What the draft sources use of an Engine (edgemoe.runtime.engine.Engine)."""

    path: Path
    n_ctx: int

    @property
    def n_vocab(self) -> int: ...
    def token_piece(self, token: int, *, special: bool = False) -> bytes: ...
    def is_eog(self, token: int) -> bool: ...
    def prefill(self, tokens: Sequence[int]) -> int: ...
    def feed(self, tokens: Sequence[int], *, all_logits: bool = False) -> None: ...
    def logits(self, idx: int = -1) -> ctypes.Array[ctypes.c_float]: ...
    def close(self) -> None: ...


class DraftModel:
    """Greedy proposals from a second model that shares the target's vocabulary."""

    name = "draft"

    def __init__(self, engine: DraftEngine) -> None:
        self.engine = engine

    def propose(self, context: Sequence[int], n: int) -> list[int]:
        eng = self.engine
        if n <= 0 or len(context) + n > eng.n_ctx:  # no room for the context and the proposals
            return []
        eng.prefill(context)
        out: list[int] = []
        while True:
            tok = int(np.argmax(np.ctypeslib.as_array(eng.logits(-1))))
            out.append(tok)
            if len(out) == n or eng.is_eog(tok):
                return out
            eng.feed([tok])

    def close(self) -> None:
        self.engine.close()


def check_same_vocab(target: DraftEngine, draft: DraftEngine) -> None:
    """Raise InvalidConfigError unless both models give every token id the same text (sampled over the
    vocabulary: the first and last pieces and an even spread)."""
    if target.n_vocab != draft.n_vocab:
        raise InvalidConfigError(
            f"the draft model {draft.path.name} has {draft.n_vocab} tokens and the model {target.n_vocab}: "
            + SAME_VOCAB
        )
    ids = np.unique(np.linspace(0, target.n_vocab - 1, min(VOCAB_PROBE, target.n_vocab)).astype(int))
    for t in ids:
        a, b = target.token_piece(int(t), special=True), draft.token_piece(int(t), special=True)
        if a != b:
            raise InvalidConfigError(
                f"token {t} is {a!r} in {target.path.name} but {b!r} in the draft {draft.path.name}: "
                + SAME_VOCAB
            )


def make_source(
    config: SpeculationConfig,
    target: DraftEngine,
    open_draft: Callable[[str], DraftEngine],
    open_mtp: Callable[[], DraftSource],
) -> DraftSource:
    """The draft source config.mode names, for `target` (an opened Engine); `open_draft(path)` opens a draft
    model's Engine, `open_mtp()` the target's MTP heads (edgemoe.runtime.mtp)."""
    if config.mode == "lookup":
        return PromptLookup(config.ngram_max, config.ngram_min)
    if config.mode == "draft":
        assert config.draft_model is not None  # SpeculationConfig refuses draft without a path
        draft = open_draft(config.draft_model)
        try:
            check_same_vocab(target, draft)
        except BaseException:
            draft.close()
            raise
        return DraftModel(draft)
    if config.mode == "mtp":
        return open_mtp()
    raise InvalidConfigError(f"speculation mode {config.mode!r} has no draft source")
