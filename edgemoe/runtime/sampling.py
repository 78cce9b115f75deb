"""Sampling parameters and llama.cpp's sampler chain built from them.

temperature <= 0 means greedy (argmax), exactly like stock llama.cpp. Otherwise
the chain is llama.cpp's usual order: penalties -> top-k -> top-p -> min-p ->
temperature -> seeded draw.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import EdgeMoeError
from .native import lib

DEFAULT_SEED = 0xFFFFFFFF  # llama.cpp's LLAMA_DEFAULT_SEED: a random seed


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.8  # <= 0: greedy
    top_k: int = 40  # 0: off
    top_p: float = 0.95  # 1.0: off
    min_p: float = 0.05  # 0.0: off
    repeat_penalty: float = 1.0  # 1.0: off
    repeat_last_n: int = 64
    seed: int = DEFAULT_SEED
    # GBNF with a `root` rule: only text it accepts is sampled (structured output, forced tool calls)
    grammar: str | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


GREEDY = SamplingParams(temperature=0.0)


class Sampler:
    """Owns one llama_sampler chain; close() frees it."""

    def __init__(self, params: SamplingParams, vocab: Any, n_vocab: int) -> None:
        chain_params = lib.llama_sampler_chain_default_params()
        self._chain = chain = lib.llama_sampler_chain_init(chain_params)
        add = lambda s: lib.llama_sampler_chain_add(chain, s)  # noqa: E731
        if params.grammar is not None:  # first: the others then choose among the tokens it allows
            grammar = lib.llama_sampler_init_grammar(vocab, params.grammar.encode(), b"root")
            if not grammar:
                lib.llama_sampler_free(chain)
                self._chain = None
                raise EdgeMoeError("llama.cpp could not parse the sampling grammar (its log says where)")
            add(grammar)
        if params.repeat_penalty != 1.0:
            add(
                lib.llama_sampler_init_penalties(
                    n_vocab, params.repeat_last_n, params.repeat_penalty, 0.0, 0.0
                )
            )
        if params.greedy:
            add(lib.llama_sampler_init_greedy())
            return
        if params.top_k > 0:
            add(lib.llama_sampler_init_top_k(params.top_k))
        if params.top_p < 1.0:
            add(lib.llama_sampler_init_top_p(params.top_p, 1))
        if params.min_p > 0.0:
            add(lib.llama_sampler_init_min_p(params.min_p, 1))
        add(lib.llama_sampler_init_temp(params.temperature))
        add(lib.llama_sampler_init_dist(params.seed & 0xFFFFFFFF))

    def sample(self, ctx: Any, idx: int = -1) -> int:
        """Sample from the logits of output idx of the last decode and accept the token."""
        assert self._chain is not None, "the sampler is closed"
        return int(lib.llama_sampler_sample(self._chain, ctx, idx))

    def close(self) -> None:
        if self._chain:
            lib.llama_sampler_free(self._chain)
            self._chain = None
