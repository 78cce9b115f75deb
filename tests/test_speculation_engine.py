"""Speculative decoding on the fixtures: greedy output equals one-token-per-decode greedy with every draft
source, with the expert cache and adaptive top-k on; the KV cache keeps exactly the accepted tokens; sampled
tokens are distributed as without speculation (chi-square, fixed seeds)."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

import edgemoe.runtime.speculative as speculative
from edgemoe import GREEDY, Engine, LoadConfig
from edgemoe.errors import InvalidConfigError
from edgemoe.policies.gating import GatingPolicy, GatingRule
from edgemoe.runtime.cache_config import CacheConfig, LruConfig
from edgemoe.runtime.sampling import SamplingParams
from edgemoe.speculation import SpeculationConfig
from edgemoe.speculation.accept import Verdict

ROOT = Path(__file__).resolve().parent.parent
QWEN = ROOT / "models" / "edgemoe-tiny-qwen3moe.Q4_K_M.gguf"
MIXTRAL = ROOT / "models" / "edgemoe-tiny-mixtral.Q4_K_M.gguf"
# repeats itself, so prompt lookup has tails to find
PROMPT = ("ROMEO:\nBut soft, what light through yonder window breaks?\nJULIET:\nO Romeo, Romeo, wherefore art "
          "thou Romeo?\nROMEO:\nBut soft, what light through yonder window breaks?\nJULIET:\nO Romeo,")


def _greedy(eng: Engine, n: int = 48, prompt: str = PROMPT, **kw) -> list[int]:  # type: ignore[no-untyped-def]
    eng.reset()
    return eng.generate(prompt, max_tokens=n, sampling=GREEDY, ignore_eog=True, **kw).tokens


def _modes(path: Path) -> list[SpeculationConfig]:
    """Lookup; the model drafting for itself; the other fixture (same tokenizer) drafting for it."""
    other = MIXTRAL if path == QWEN else QWEN
    return [SpeculationConfig(mode="lookup", draft_max=6, ngram_min=1),
            SpeculationConfig(mode="draft", draft_max=4, draft_model=str(path)),
            SpeculationConfig(mode="draft", draft_max=4, draft_model=str(other))]


@pytest.mark.parametrize("setup", ["plain", "cache", "gating", "cache+gating"])
def test_greedy_equals_one_token_per_decode(fixture_model: Path, setup: str) -> None:
    with Engine(fixture_model, LoadConfig(n_ctx=256)) as eng:
        if "cache" in setup:
            eng.enable_expert_cache(CacheConfig(eng.info.n_expert // 4, policy=LruConfig()))
        if "gating" in setup:
            eng.set_gating(GatingPolicy(GatingRule.SCORE, 0.6))
        want = _greedy(eng)
        for cfg in _modes(fixture_model):
            eng.set_speculation(cfg)
            got = _greedy(eng)
            spec = eng.last.speculation if eng.last is not None else None
            assert spec is not None and spec.steps > 0 and spec.mode == cfg.mode
            assert got == want, (cfg.mode, spec)
            assert eng.kv_tokens() == tuple(eng.last.prompt_tokens + got[:-1])  # the last one is not decoded
            if cfg.draft_model == str(fixture_model) and "gating" not in setup:  # itself, ungated: all stand
                assert spec.accepted == spec.drafted > 0
            assert _greedy(eng, speculate=False) == want and eng.last.speculation is None
            eng.set_speculation(None)
        if "gating" in setup:
            st = eng.control_stats()
            assert st["n_dropped"] > 0
        if "cache" in setup:
            assert eng.experts is not None and eng.experts.stats()["misses"] > 0


def test_lookup_accepts_on_a_copy(fixture_model: Path) -> None:
    """Where the model continues a span of its context, lookup's proposals are accepted: fewer verification
    steps than tokens."""
    with Engine(fixture_model, LoadConfig(n_ctx=512)) as eng:
        text = eng.detokenize(_greedy(eng, 60, "ROMEO:"))
        prompt = "ROMEO:" + text + "\n\nROMEO:"
        want = _greedy(eng, 40, prompt)
        eng.set_speculation(SpeculationConfig(mode="lookup", draft_max=8))
        got = _greedy(eng, 40, prompt)
        spec = eng.last.speculation
    assert got == want
    assert spec is not None and spec.accepted > 0 and spec.steps < len(got)


def test_context_fills_as_without_speculation() -> None:
    with Engine(QWEN, LoadConfig(n_ctx=96)) as eng:
        n_prompt, n_ctx = len(eng.tokenize(PROMPT)), eng.n_ctx  # llama.cpp pads the context to 256
        eng.reset()
        plain = eng.generate(PROMPT, max_tokens=200, sampling=GREEDY, ignore_eog=True)
        eng.set_speculation(SpeculationConfig(mode="lookup", draft_max=8, ngram_min=1))
        eng.reset()
        spec = eng.generate(PROMPT, max_tokens=200, sampling=GREEDY, ignore_eog=True)
    assert plain.stop_reason == spec.stop_reason == "context"
    assert len(plain.tokens) == n_ctx - n_prompt + 1
    assert spec.tokens == plain.tokens


def test_draft_with_another_vocabulary_is_refused(make_tiny_gguf) -> None:  # type: ignore[no-untyped-def]
    with Engine(QWEN, LoadConfig(n_ctx=128)) as eng:
        with pytest.raises(InvalidConfigError, match="same vocabulary"):
            eng.set_speculation(SpeculationConfig(mode="draft", draft_model=str(make_tiny_gguf("tiny-qwen3moe"))))
        assert eng.speculation is None


SAMPLING = SamplingParams(temperature=1.0, top_k=40, top_p=0.95, min_p=0.05)
N_DRAWS = 300


def _sampled(eng: Engine, n: int = 3) -> Counter[tuple[int, ...]]:
    """The third token of N_DRAWS generations, one seed each (its two predecessors came through
    verification steps)."""
    seen: Counter[tuple[int, ...]] = Counter()
    for seed in range(N_DRAWS):
        g = eng.generate(PROMPT, max_tokens=n, sampling=SamplingParams(**{**SAMPLING.__dict__, "seed": seed}),
                         ignore_eog=True)
        seen[tuple(g.tokens[2:3])] += 1
    return seen


def _pvalue(a: Counter[tuple[int, ...]], b: Counter[tuple[int, ...]]) -> float:
    """Two-sample chi-square over the tokens seen, those seen fewer than 10 times in all pooled."""
    keys = sorted(set(a) | set(b), key=lambda k: -(a[k] + b[k]))
    big = [k for k in keys if a[k] + b[k] >= 10]
    rows = [[a[k] for k in big] + [sum(a[k] for k in keys if k not in big)],
            [b[k] for k in big] + [sum(b[k] for k in keys if k not in big)]]
    table = np.array(rows)
    table = table[:, table.sum(0) > 0]
    return float(stats.chi2_contingency(table).pvalue)


def test_sampling_distribution_matches(monkeypatch: pytest.MonkeyPatch) -> None:
    with Engine(QWEN, LoadConfig(n_ctx=256)) as eng:
        plain = _sampled(eng)
        eng.set_speculation(SpeculationConfig(mode="lookup", draft_max=4, ngram_min=1))
        spec = _sampled(eng)
        assert _pvalue(plain, spec) > 1e-3, (plain.most_common(8), spec.most_common(8))
        # the test has power: accepting every proposal (no rejection sampling) is caught
        monkeypatch.setattr(speculative, "accept_sampled", lambda probs, proposals, rng: Verdict(
            len(proposals), int(np.argmax(probs(len(proposals), proposals)))))
        wrong = _sampled(eng)
    assert _pvalue(plain, wrong) < 1e-3, (plain.most_common(8), wrong.most_common(8))


NEAR_TIE = 0.1  # logits: several times the largest batch-vs-one-token difference measured on the fixtures (0.017)


def _plain_with_gaps(eng: Engine, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy one token per decode, as Engine.generate does, with each step's top-2 logit gap."""
    eng.reset()
    eng.feed(prompt)
    out, gaps = [], []
    for _ in range(n):
        row = np.sort(np.array(eng.logits(-1)))
        tok = int(np.argmax(np.array(eng.logits(-1))))
        out.append(tok)
        gaps.append(float(row[-1] - row[-2]))
        eng.feed([tok])
    return out, gaps


def test_greedy_divergence_only_at_a_near_tie() -> None:
    """Past 256 tokens of context, llama.cpp's CPU flash attention computes one query another way than a batch
    of queries (up to 0.017 apart in the fixture's logits), so a verification batch may flip a near-tie. Where
    the speculative output leaves the one-token-per-decode output, the gap between the two best logits there
    was tiny, and the speculation's reported smallest gap says so."""
    text = (ROOT.parent / "shared" / "corpus" / "python-docs.txt")
    corpus = text.read_text() if text.exists() else PROMPT * 8
    with Engine(QWEN, LoadConfig(n_ctx=1024, flash_attn="on")) as eng:
        ids = eng.tokenize(corpus[-20000:], add_special=False)[:300]
        plain, gaps = _plain_with_gaps(eng, ids, 120)
        eng.reset()
        assert eng.generate(ids, max_tokens=120, sampling=GREEDY, ignore_eog=True).tokens == plain
        eng.set_speculation(SpeculationConfig(mode="lookup", draft_max=8, ngram_min=1))
        eng.reset()
        g = eng.generate(ids, max_tokens=120, sampling=GREEDY, ignore_eog=True)
    spec = g.speculation
    assert spec is not None and spec.steps < 120
    diff = next((i for i, (a, b) in enumerate(zip(plain, g.tokens, strict=False)) if a != b), None)
    if diff is not None:
        assert gaps[diff] < NEAR_TIE, (diff, gaps[diff])
        assert spec.min_top2_gap is not None and spec.min_top2_gap < NEAR_TIE
