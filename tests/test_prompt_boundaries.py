"""Chunked prefill of long prompts with the prompt cache: the state at a prefill's deepest chunk boundary is stored while
the prefill runs, one state per conversation, and a prompt restored from a boundary gives the logits a fresh full
prefill gives, bitwise."""
from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest

from edgemoe import GREEDY, Engine, LoadConfig
from edgemoe.runtime.prompt_cache import PromptCache, chunk_boundary
from edgemoe.serve.prefix_cache import PrefixReuse

from helpers.fake_engine import FakeEngine
from helpers.models import FIXTURE_MODELS

CHUNK = 64


@pytest.mark.parametrize("start, n, want", [
    (0, 64, None), (0, 65, 64), (0, 128, 64), (0, 129, 128), (10, 200, 138), (100, 164, None), (0, 5, None),
])
def test_the_deepest_boundary_a_prefill_passes(start: int, n: int, want: int | None) -> None:
    assert chunk_boundary(start, n, CHUNK) == want
    assert chunk_boundary(start, n, 0) is None


class ChunkedFake(FakeEngine):
    """Engine's KV-state part (test_serve_parts' fake) with a prefill in chunks that calls the watcher between
    them."""

    def __init__(self) -> None:
        super().__init__()
        self.watch: Callable[[int], None] | None = None

    def watch_prefill(self, on_chunk: Callable[[int], None] | None) -> None:
        self.watch = on_chunk

    def run(self, prompt: list[int], reply: list[int]) -> None:
        keep = self.cached_prefix(prompt)
        del self.kv[keep:]
        rest = prompt[keep:]
        for i in range(0, len(rest), CHUNK):
            self.kv += rest[i:i + CHUNK]
            if i + CHUNK < len(rest) and self.watch is not None:
                self.watch(len(self.kv))
        self.kv += reply[:-1]


def _reuse(capacity: int = 1 << 20) -> tuple[ChunkedFake, PrefixReuse]:
    eng = ChunkedFake()
    return eng, PrefixReuse(eng, PromptCache(capacity, min_prefix=4), chunk=CHUNK)


def test_a_long_prefill_leaves_its_deepest_boundary_and_one_state_per_conversation() -> None:
    eng, reuse = _reuse()
    a1 = list(range(300))
    reuse.prepare("k", a1)
    eng.run(a1, [7, 8])
    assert reuse.store is not None
    assert [(len(s.tokens), s.boundary) for s in reuse.store.scoped("k")] == [(256, True)]
    a2 = a1 + [7, 1000] + list(range(2000, 2200))  # the next turn: live reuse, its own deeper boundary
    assert reuse.prepare("k", a2) == 301
    eng.run(a2, [9])
    assert [len(s.tokens) for s in reuse.store.scoped("k")] == [301 + (len(a2) - 1 - 301) // CHUNK * CHUNK]
    b = list(range(5000, 5010))  # another conversation: the live state is kept, its boundary dropped
    reuse.prepare("k", b)
    assert [(len(s.tokens), s.boundary) for s in reuse.store.scoped("k")] == [(len(eng.kv), False)]
    assert reuse.stats("k")["boundary_stored"] == 2


def test_a_branch_keeps_its_own_boundary_beside_the_state_it_diverged_from() -> None:
    eng, reuse = _reuse()
    a = list(range(300))
    reuse.prepare("k", a)
    eng.run(a, [1])
    reuse.prepare("k", list(range(900, 910)))  # a switch keeps a's whole state (and drops its boundary)
    eng.run(list(range(900, 910)), [1])
    c = a[:280] + [5] * 100  # diverges in the middle of a's prompt
    assert reuse.prepare("k", c) == 280  # a's state restored, cut to the shared prefix
    eng.run(c, [1])
    assert reuse.store is not None
    held = sorted((len(s.tokens), s.boundary) for s in reuse.store.scoped("k"))
    # the 10-token talk kept at the switch back; a and its branch c: neither extends the other, both kept
    assert held == [(10, False), (300, False), (344, True)]
    assert reuse.prepare("k", c[:300] + [6] * 10) == 300  # the live state covers it: a prefill of 10 tokens...
    assert eng.watch is None  # ...passes no boundary: none is watched for


def test_a_boundary_serves_the_next_turn_where_the_whole_state_does_not_fit() -> None:
    a1 = list(range(300))
    eng, reuse = _reuse(capacity=4 * 300)  # holds the 256-token boundary (4 bytes a token), not the whole state
    reuse.prepare("k", a1)
    eng.run(a1, list(range(700, 740)))
    reuse.prepare("other", list(range(5000, 5010)))  # another key: the live state is emptied, too big to keep
    eng.run(list(range(5000, 5010)), [1])
    a2 = a1 + list(range(700, 740)) + [1001]
    assert reuse.prepare("k", a2) == 256  # the boundary restored
    st = reuse.stats("k")
    assert st["hits"] == 1 and st["restored_tokens"] == 256 and st["boundary_stored"] == 1


# -- on the fixture ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    config = LoadConfig(n_ctx=512, n_batch=CHUNK, n_ubatch=CHUNK, n_threads=2)
    with Engine(FIXTURE_MODELS[0], config) as eng:
        yield eng


def _last_logits(eng: Engine, ids: list[int]) -> tuple[np.ndarray, list[int]]:
    g = eng.generate(ids, max_tokens=6, sampling=GREEDY, ignore_eog=True)
    return np.ctypeslib.as_array(eng.logits(-1)).copy(), g.tokens


def test_a_prompt_restored_from_a_boundary_equals_a_fresh_prefill_bitwise(engine: Engine) -> None:
    rng = np.random.default_rng(0)
    a = [int(t) for t in rng.integers(16, engine.n_vocab, 200)]
    reuse = PrefixReuse(engine, PromptCache(64 << 20, min_prefix=4), chunk=CHUNK)
    engine.reset()
    reuse.prepare("k", a)
    engine.generate(a, max_tokens=2, sampling=GREEDY, ignore_eog=True)
    reuse.done()
    assert reuse.store is not None
    (snap,) = reuse.store.scoped("k")
    assert snap.boundary and len(snap.tokens) == 192 and snap.tokens == tuple(a[:192])
    b = a[:192] + [int(t) for t in rng.integers(16, engine.n_vocab, 150)]  # diverges after the boundary
    engine.reset()
    fresh, fresh_tokens = _last_logits(engine, b)
    engine.reset()
    engine.generate([5, 6, 7], max_tokens=2, sampling=GREEDY)  # another conversation ran in between
    engine.restore(snap)
    assert engine.cached_prefix(b) == 192
    got, got_tokens = _last_logits(engine, b)
    assert engine.last is not None and engine.last.timings.prompt_tokens == len(b) - 192
    assert got_tokens == fresh_tokens
    assert np.array_equal(got.view(np.uint32), fresh.view(np.uint32))


def test_a_streamed_chunked_prefill_pings_and_stores_its_boundary() -> None:
    """Through the app: a 64-token chunk, a prompt of several chunks, keep-alives every 5 ms: pings come before the
    first token (while the prompt is evaluated, a chunk at a time) and the reply's stats count the boundary."""
    import asyncio
    import json

    import httpx

    from edgemoe.runtime.sampling import GREEDY as T0
    from edgemoe.serve.app import ServerConfig, create_app
    from edgemoe.serve.worker import EngineWorker

    config = LoadConfig(n_ctx=1024, n_batch=CHUNK, n_ubatch=CHUNK, n_threads=2)
    with Engine(FIXTURE_MODELS[0], config) as eng:
        worker = EngineWorker(eng, 2, prompt_cache=PromptCache(64 << 20))
        app = create_app(worker, ServerConfig(model_id="m", sampling=T0, max_tokens=4, ping_s=0.005))
        worker.start()
        prompt = " ".join(f"line {i} of the file" for i in range(80))

        async def stream() -> str:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
                r = await client.post("/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 2,
                                                                "stream": True, "temperature": 0})
                return r.text

        try:
            body = asyncio.run(stream())
        finally:
            worker.stop()
    events = [e for e in body.split("\n\n") if e]
    first_data = next(i for i, e in enumerate(events) if e.startswith("data: {"))
    assert any(e == ": ping" for e in events[:first_data]), events[:first_data + 1]
    last = json.loads(next(e for e in reversed(events) if e.startswith("data: {"))[6:])
    assert last["edgemoe"]["prompt_cache"]["boundary_stored"] == 1, last["edgemoe"]["prompt_cache"]
