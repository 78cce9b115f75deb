"""Speculation's pure parts: prompt lookup, the acceptance rules and the sampling distribution (no model)."""
from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from edgemoe.errors import InvalidConfigError
from edgemoe.runtime.sampling import SamplingParams
from edgemoe.speculation import (
    PromptLookup,
    SpeculationConfig,
    TokenDistribution,
    accept_greedy,
    accept_sampled,
)
from edgemoe.speculation.lookup import latest_match


def test_lookup_proposes_what_followed_the_latest_occurrence_of_the_longest_tail() -> None:
    ctx = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    # tail [2, 3] occurs at 1 and 6; the latest (6) is followed by 7, 8, 5
    assert PromptLookup(ngram_max=2, ngram_min=2).propose(ctx, 3) == [7, 8, 5]
    # a 3-gram tail [5, 2, 3] occurs nowhere earlier: the 2-gram decides
    assert PromptLookup(ngram_max=3, ngram_min=2).propose(ctx, 2) == [7, 8]
    assert PromptLookup(ngram_max=3, ngram_min=3).propose(ctx, 2) == []
    # proposals stop at the context's end
    assert PromptLookup(ngram_max=1, ngram_min=1).propose([4, 5, 4], 5) == [5, 4]


def test_latest_match_needs_a_token_after_the_occurrence() -> None:
    assert latest_match(np.array([7, 7]), 1) == 0
    assert latest_match(np.array([7]), 1) == -1
    assert latest_match(np.array([1, 2, 3]), 2) == -1
    assert latest_match(np.array([5, 6, 5, 6, 5, 6]), 2) == 2


def test_config_refusals() -> None:
    with pytest.raises(InvalidConfigError, match="unknown"):
        SpeculationConfig(mode="medusa")
    with pytest.raises(InvalidConfigError, match="draft_max"):
        SpeculationConfig(mode="lookup", draft_max=0)
    with pytest.raises(InvalidConfigError, match="draft_model"):
        SpeculationConfig(mode="draft")
    with pytest.raises(InvalidConfigError, match="ngram"):
        SpeculationConfig(mode="lookup", ngram_min=3, ngram_max=2)


def _row(best: int, n: int = 6, gap: float = 1.0) -> np.ndarray:
    r = np.zeros(n, dtype=np.float32)
    r[best] = gap
    return r


def test_accept_greedy_keeps_the_agreeing_prefix_and_takes_the_first_disagreement() -> None:
    rows = [_row(3), _row(4), _row(1), _row(2)]
    v = accept_greedy(rows, [3, 4, 5])
    assert (v.accepted, v.token) == (2, 1)
    v = accept_greedy(rows, [3, 4, 1])
    assert (v.accepted, v.token) == (3, 2)  # all accepted: the last row gives the next token
    gaps: list[float] = []
    v = accept_greedy(rows[:1], [], gaps.append)
    assert (v.accepted, v.token) == (0, 3) and gaps == [1.0]
    with pytest.raises(ValueError):
        accept_greedy(rows[:2], [3, 4])


def test_accept_sampled_keeps_the_distribution_exact() -> None:
    """Whatever the proposal, the first token out of a verification is distributed as p (chi-square, fixed
    seed): a point-mass draft accepted with p(d), else drawn from the residual."""
    p = np.array([0.5, 0.2, 0.15, 0.1, 0.05, 0.0])
    rng = np.random.default_rng(1234)
    n = 20000
    for proposal in (0, 3, 5):  # likely, unlikely, impossible
        counts = np.zeros(len(p))
        for _ in range(n):
            v = accept_sampled(lambda i, acc: p, [proposal, proposal], rng)
            first = proposal if v.accepted > 0 else v.token
            counts[first] += 1
        assert counts[5] == 0
        res = stats.chisquare(counts[:5], p[:5] * n)
        assert res.pvalue > 1e-3, (proposal, counts, res)


def test_accept_sampled_point_mass_is_deterministic() -> None:
    rng = np.random.default_rng(0)
    p = np.zeros(4)
    p[2] = 1.0
    assert accept_sampled(lambda i, acc: p, [2, 2, 1], rng) == accept_sampled(lambda i, acc: p, [2, 2, 1], rng)
    v = accept_sampled(lambda i, acc: p, [2, 2, 1], rng)
    assert (v.accepted, v.token) == (2, 2)


def test_distribution_follows_the_chain_order() -> None:
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.06, 0.04]))
    # top-k 3, then top-p 0.6 keeps 0.4 + 0.3 of the renormalised three (0.44, 0.33, ...), min-p off
    d = TokenDistribution(SamplingParams(temperature=1.0, top_k=3, top_p=0.6, min_p=0.0)).probs(logits)
    np.testing.assert_allclose(d, [0.4 / 0.7, 0.3 / 0.7, 0, 0, 0], rtol=1e-9)
    # min-p 0.6 keeps tokens at least 0.6 times as likely as the best; the temperature only rescales them
    d = TokenDistribution(SamplingParams(temperature=0.5, top_k=0, top_p=1.0, min_p=0.6)).probs(logits)
    w = np.array([0.4, 0.3]) ** 2
    np.testing.assert_allclose(d[:2], w / w.sum(), rtol=1e-9)
    assert d[2:].sum() == 0
    g = TokenDistribution(SamplingParams(temperature=0.0)).probs(logits)
    assert g.tolist() == [1.0, 0, 0, 0, 0]


def test_distribution_repetition_penalty() -> None:
    logits = np.array([2.0, -1.0, 1.0])
    d = TokenDistribution(SamplingParams(temperature=0.0, repeat_penalty=4.0, repeat_last_n=2))
    assert d.probs(logits, [0]).tolist() == [0, 0, 1.0]  # 2/4 < 1
    assert d.probs(logits, [0, 2, 2]).tolist() == [1.0, 0, 0]  # the window is the last 2: token 0 unpenalised


def test_next_length_backs_off_after_a_rejection_and_grows_after_a_full_accept() -> None:
    from edgemoe.runtime.speculative import next_length

    assert next_length(8, 8, 8, 8) == 8  # capped at draft_max
    assert next_length(2, 8, 2, 2) == 4
    assert next_length(8, 8, 8, 3) == 4
    assert next_length(1, 8, 1, 0) == 1  # never below one
    assert next_length(4, 8, 0, 0) == 4  # nothing proposed: nothing learned
