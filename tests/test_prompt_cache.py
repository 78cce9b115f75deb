"""KV state snapshots on a real Engine: a restored state continues exactly as if it had been computed."""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from edgemoe import GREEDY, Engine, LoadConfig

from helpers.models import FIXTURE_MODELS

PROMPT = "ROMEO: But soft, what light through yonder window breaks? It is the east, and Juliet is the sun."


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    with Engine(FIXTURE_MODELS[0], LoadConfig(n_ctx=512, n_threads=2)) as eng:
        yield eng


def test_a_restored_state_continues_like_a_computed_one(engine: Engine) -> None:
    ids = engine.tokenize(PROMPT)
    engine.reset()
    want = engine.generate(ids, max_tokens=12, sampling=GREEDY)
    snap = engine.snapshot()
    assert snap.tokens == engine.kv_tokens() and len(snap.tokens) == len(ids) + 11 and snap.nbytes > 0
    engine.reset()
    engine.generate(engine.tokenize("JULIET: O Romeo, Romeo!"), max_tokens=4, sampling=GREEDY)  # another talk
    engine.restore(snap)
    assert engine.cached_prefix(ids) == len(ids) - 1
    again = engine.generate(ids, max_tokens=12, sampling=GREEDY)
    assert again.text == want.text and again.timings.prompt_tokens == 1  # only the last token re-evaluated


def test_a_restored_state_is_cut_to_the_shared_prefix(engine: Engine) -> None:
    ids = engine.tokenize(PROMPT)
    engine.reset()
    engine.generate(ids, max_tokens=2, sampling=GREEDY)
    snap = engine.snapshot()
    other = ids[:10] + engine.tokenize(" Wherefore art thou?", add_special=False)
    engine.reset()
    fresh = engine.generate(other, max_tokens=10, sampling=GREEDY)
    engine.reset()
    engine.restore(snap)
    reused = engine.generate(other, max_tokens=10, sampling=GREEDY)
    assert reused.text == fresh.text and reused.timings.prompt_tokens == len(other) - 10
