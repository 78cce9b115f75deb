"""Draft sources that run a model: a small GGUF with the target's vocabulary (`--draft-model`), and the factory
that builds an Engine's draft source from its SpeculationConfig.

The draft model has its own Engine (its own context and KV cache, on the CPU unless its LoadConfig offloads
layers). Each proposal makes the draft's KV cache hold the context (reusing the common prefix, so only the tokens
since the last proposal are evaluated) and decodes greedily from there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from ..errors import ContextOverflowError, InvalidConfigError
from ..speculation.config import SpeculationConfig
from ..speculation.lookup import PromptLookup
from ..speculation.source import DraftSource
from .config import LoadConfig

if TYPE_CHECKING:
    from .engine import Engine

VOCAB_PROBE = 4096  # token pieces compared between the target and the draft (spread over the vocabulary)


class DraftModel:
    """Greedy proposals from a second model that shares the target's vocabulary."""

    name = "draft"

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def propose(self, context: Sequence[int], n: int) -> list[int]:
        eng = self.engine
        if n <= 0 or len(context) + n > eng.n_ctx:
            return []
        try:
            eng.prefill(context)
        except ContextOverflowError:
            return []
        out: list[int] = []
        while True:
            tok = int(np.argmax(np.ctypeslib.as_array(eng.logits(-1))))
            out.append(tok)
            if len(out) == n or eng.is_eog(tok):
                return out
            eng.feed([tok])

    def close(self) -> None:
        self.engine.close()


def check_same_vocab(target: Engine, draft: Engine) -> None:
    """Raise InvalidConfigError unless both models give every token id the same text (sampled over the
    vocabulary: the first and last pieces and an even spread)."""
    if target.n_vocab != draft.n_vocab:
        raise InvalidConfigError(
            f"the draft model {draft.path.name} has {draft.n_vocab} tokens and the model {target.n_vocab}: "
            "speculation needs a draft with the same vocabulary (a smaller model of the same family)"
        )
    ids = np.unique(np.linspace(0, target.n_vocab - 1, min(VOCAB_PROBE, target.n_vocab)).astype(int))
    for t in ids:
        a, b = target.token_piece(int(t), special=True), draft.token_piece(int(t), special=True)
        if a != b:
            raise InvalidConfigError(
                f"token {t} is {a!r} in {target.path.name} but {b!r} in the draft {draft.path.name}: speculation "
                "needs a draft with the same vocabulary (a smaller model of the same family)"
            )


def make_source(config: SpeculationConfig, target: Engine) -> DraftSource:
    """The draft source config.mode names, for `target` (an opened Engine)."""
    if config.mode == "lookup":
        return PromptLookup(config.ngram_max, config.ngram_min)
    if config.mode == "draft":
        from .engine import Engine  # the engine module imports this one

        assert config.draft_model is not None  # SpeculationConfig refuses draft without a path
        draft = Engine(
            config.draft_model,
            LoadConfig(n_ctx=target.n_ctx, n_threads=target.n_threads, n_batch=target.n_batch),
        )
        try:
            check_same_vocab(target, draft)
        except BaseException:
            draft.close()
            raise
        return DraftModel(draft)
    if config.mode == "mtp":
        raise InvalidConfigError(MTP_BLOCKER)
    raise InvalidConfigError(f"speculation mode {config.mode!r} has no draft source")


MTP_BLOCKER = "speculation with MTP heads is not available yet: use `lookup` or `draft`"
