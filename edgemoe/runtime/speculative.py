"""Speculative decoding on an Engine's sequence: propose, verify in one llama_decode, keep what was accepted.

Each step decodes the last sampled token and up to draft_max proposed ones in one batch with every position's
logits, decides with edgemoe.speculation.accept which proposals stand, and removes the K/V of the rejected
ones (llama_memory_seq_rm through KVSequence.truncate). The expert cache sees the batch as one ubatch: each
expert it routes to is read once for all the positions. While the steps run, the decode-only routing rules
(adaptive top-k, degradation) apply to every ubatch (Routing.decode_rules_for_batches), so each position is
gated as a one-token decode would be.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass

import numpy as np

from ..speculation.accept import Verdict, accept_greedy, accept_sampled, draw
from ..speculation.config import SpeculationConfig, SpeculationStats
from ..speculation.distribution import TokenDistribution
from ..speculation.source import DraftSource
from .routing import Routing
from .sampling import DEFAULT_SEED, SamplingParams
from .sequence import KVSequence


@dataclass(frozen=True)
class Speculation:
    """An Engine's speculation: what was asked and the draft source built for it."""

    config: SpeculationConfig
    source: DraftSource


def next_length(length: int, draft_max: int, proposed: int, accepted: int) -> int:
    """How many proposals to ask for next: every one accepted, twice as many (at most draft_max); one rejected,
    half (one at the least), so a run of wrong guesses costs ever smaller batches. No proposal: unchanged."""
    if proposed == 0:
        return length
    if accepted == proposed:
        return min(draft_max, 2 * length)
    return max(1, length // 2)


class Speculator:
    """One generation's speculative token stream (Generation.speculation holds its stats)."""

    def __init__(
        self,
        seq: KVSequence,
        routing: Routing,
        source: DraftSource,
        sampling: SamplingParams,
        *,
        draft_max: int,
    ) -> None:
        self.seq = seq
        self.routing = routing
        self.source = source
        self.sampling = sampling
        self.draft_max = draft_max
        # proposals asked for next: halved past a rejection, doubled after a full accept
        self.length = draft_max
        self.dist = TokenDistribution(sampling)
        seed = None if sampling.seed == DEFAULT_SEED else sampling.seed
        self.rng = np.random.default_rng(seed)
        self.stats = SpeculationStats(source.name)

    def tokens(self, prompt: Sequence[int], max_tokens: int) -> Generator[int, None, None]:
        """The generated tokens, the first from the prefill's logits; ends when the context is full. The
        consumer takes at most max_tokens (drafting stops short of that)."""
        context = list(prompt)  # the prompt, then every token generated, in order
        generated: list[int] = []
        with self.routing.decode_rules_for_batches():
            tok = self.first_token(generated)
            context.append(tok)
            generated.append(tok)
            yield tok
            while True:
                room = self.seq.n_ctx - len(self.seq.tokens)
                if room < 1:
                    return
                n = min(self.length, room - 1, max_tokens - len(generated) - 1)
                proposals = self.source.propose(context, n)[:n] if n > 0 else []
                verdict = self.verify(tok, proposals, generated)
                for t in [*proposals[: verdict.accepted], verdict.token]:
                    context.append(t)
                    generated.append(t)
                    yield t
                tok = verdict.token

    def first_token(self, generated: list[int]) -> int:
        self.seq.check_logits(-1)
        p = self.dist.probs(np.ctypeslib.as_array(self.seq.logits(-1)), generated)
        return int(np.argmax(p)) if self.sampling.greedy else draw(p, self.rng)

    def verify(self, tok: int, proposals: list[int], generated: list[int]) -> Verdict:
        """Decode tok and the proposals in one batch, decide, and drop the rejected proposals' K/V."""
        base = len(self.seq.tokens)
        self.seq.decode([tok, *proposals], all_logits=True)
        for i in range(len(proposals) + 1):
            self.seq.check_logits(i)
        rows = [np.ctypeslib.as_array(self.seq.logits(i)) for i in range(len(proposals) + 1)]
        if self.sampling.greedy and self.sampling.repeat_penalty == 1.0:
            verdict = accept_greedy(rows, proposals, self.stats.note_gap)
        else:
            verdict = accept_sampled(
                lambda i, acc: self.dist.probs(rows[i], [*generated, *acc]), proposals, self.rng
            )
        self.seq.truncate(base + 1 + verdict.accepted)
        self.length = next_length(self.length, self.draft_max, len(proposals), verdict.accepted)
        st = self.stats
        st.steps += 1
        st.drafted += len(proposals)
        st.accepted += verdict.accepted
        st.emitted += verdict.accepted + 1
        return verdict
