"""Device prefill whose two buffers borrow the slots of the last cached layers, on the CPU stand-in.

With `prefill_borrow` the buffers lie over the slots of the last cached layers: a prefill ubatch (at least
`prefill_min_tokens` tokens) evicts those layers' experts and runs all their routed experts from the
buffers; the first smaller ubatch (decode) zeroes the slots and refills them with the experts the prefill
routed most in each layer. Nothing is lost (the slots are a cache), so every logit of a session (a prompt
over several ubatches, decode steps, a second prompt after truncating the KV cache, a restored snapshot and
its decode) must equal stock's bitwise, at ubatches of 512, 1024 and 2048 tokens. The RPC device runs the
same session in tests/test_cache_rpc.py (tests/helpers/rpc_borrow_check.py); every architecture in
tests/test_arch_sweep.py (the cache-borrow check).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edgemoe.gguf.info import read_model_info
from edgemoe.runtime import native
from edgemoe.runtime.cache_config import CacheConfig, LruConfig, ManualConfig
from edgemoe.runtime.engine import Engine
from edgemoe.runtime.expert_cache import ExpertCacheError

from helpers.borrow_session import MIN_TOKENS, load_config, session


def run(path: Path, n_ubatch: int, cache: CacheConfig | None) -> tuple[list[np.ndarray], dict | None]:
    with Engine(path, load_config(n_ubatch)) as eng:
        c = eng.enable_expert_cache(cache) if cache is not None else None
        logits = session(eng, n_ubatch)
        return logits, (c.prefill_stats() if c is not None else None)


def check_borrowed(path: Path, n_ubatch: int, blocking: bool) -> dict:
    """The session with borrowing == stock bitwise; the counters of the lent slots."""
    info = read_model_info(path)
    ref, _ = run(path, n_ubatch, None)
    cfg = CacheConfig(max(1, info.n_expert // 2), policy=LruConfig(blocking=blocking),
                      prefill_min_tokens=MIN_TOKENS, prefill_borrow=True)
    got, st = run(path, n_ubatch, cfg)
    assert len(got) == len(ref) and all(np.array_equal(a, b) for a, b in zip(got, ref, strict=False)), (path.name, n_ubatch)
    assert st is not None and "borrow" in st, st
    b = st["borrow"]
    n_prompt_ubatches = 3 + 2  # 2.5 and 1.5 ubatches (the restored snapshot's step is decode)
    assert st["ubatches"] == n_prompt_ubatches, st
    # lent at each prompt, refilled after it; the second prompt evicts what the first one's refill loaded
    assert b["lent_layers"] >= 1 and b["lent_slots"] >= b["lent_layers"] and b["lent_bytes"] >= st["buf_bytes"], b
    assert b["lends"] == 2 and b["refilled"] > 0 and b["evicted"] > 0, b
    assert b["refill_bytes"] > 0 and b["refused"] > 0, b  # the lru asked for the lent slots in the prompts
    return b


@pytest.mark.parametrize("n_ubatch,blocking", [(512, False), (1024, True), (2048, False)])
def test_borrowed_slots_equal_stock(fixture_model: Path, n_ubatch: int, blocking: bool) -> None:
    """Tables (lru) and the routing callback (blocking lru) over prompts of several ubatches."""
    check_borrowed(fixture_model, n_ubatch, blocking)


def test_lent_slots_are_empty_then_refilled_with_the_most_routed(fixture_model: Path) -> None:
    """While lent, the last cached layers hold no expert (their slots are a buffer's bytes: no graph reads them);
    given back, they hold the experts the prompt routed most, each once."""
    info = read_model_info(fixture_model)
    n_slots = max(1, info.n_expert // 2)
    with Engine(fixture_model, load_config(512)) as eng:
        c = eng.enable_expert_cache(CacheConfig(n_slots, policy=ManualConfig(), prefill_min_tokens=MIN_TOKENS,
                                                prefill_borrow=True))
        assert c is not None
        b = c.borrow_stats()
        assert b is not None and b["lends"] == 0
        lent = list(info.moe_layers)[-b["lent_layers"]:]
        kept = [il for il in info.moe_layers if il not in lent]
        rng = np.random.default_rng(0)
        eng.feed([int(t) for t in rng.integers(10, eng.n_vocab - 10, 512 * 2)])
        assert all(max(c.slots(il) or [-1]) < 0 for il in lent)  # lent: evicted, nothing loaded
        queued = c.prefill_return()
        c.sync()
        b = c.borrow_stats()
        assert b is not None and queued == b["refilled"] > 0 and b["lends"] == 1, b
        for il in lent:
            slots = c.slots(il) or []
            resident = [s for s in slots if s >= 0]
            assert 0 < len(resident) <= n_slots and len(set(resident)) == len(resident), (il, slots)
        assert all(max(c.slots(il) or [-1]) < 0 for il in kept)  # the manual policy loads nothing elsewhere
        assert c.prefill_return() == 0  # nothing lent now


def test_borrowing_refusals(fixture_model: Path) -> None:
    """Too few slots for the buffers: a typed error that names the way out; without a cache: -1."""
    with Engine(fixture_model, load_config(512)) as eng:
        assert native.moe_cache_set_prefill_borrow(eng.handle.ctx, True) == -1  # no cache
        c = eng.enable_expert_cache(CacheConfig(1, policy=ManualConfig()))
        assert c is not None
        with pytest.raises(ExpertCacheError, match="prefill_borrow"):
            c.set_prefill(MIN_TOKENS, borrow=True)
        assert c.prefill_stats() is None and c.borrow_stats() is None
        c.set_prefill(MIN_TOKENS)  # its own buffers still work
        st = c.prefill_stats()
        assert st is not None and "borrow" not in st
        with pytest.raises(ExpertCacheError, match="prefill_borrow"):  # refused: llama.cpp turned prefill off
            c.set_prefill(MIN_TOKENS, borrow=True)
        assert c.prefill_stats() is None and c.prefill_min_tokens == 0


def test_cli_borrows_the_slots(fixture_model: Path) -> None:
    """--device-prefill-borrow: the buffers in borrowed slots, the slots lent once and refilled; without
    --device-prefill it is a usage error that says what to add."""
    import json

    from click.testing import CliRunner

    from edgemoe.cli.main import cli

    runner = CliRunner()
    slots = str(read_model_info(fixture_model).n_expert // 2)
    res = runner.invoke(cli, ["generate", str(fixture_model), "-p", "hello " * 40, "-n", "4", "--expert-slots", slots,
                              "--device-prefill-borrow"])
    assert res.exit_code != 0 and "add --device-prefill N" in res.output
    res = runner.invoke(cli, ["generate", str(fixture_model), "-p", "hello " * 40, "-n", "4", "--expert-slots", slots,
                              "--device-prefill", "8", "--device-prefill-borrow", "--json"])
    assert res.exit_code == 0, res.output
    pf = json.loads(res.stdout.strip().splitlines()[-1])["cache"]["prefill"]
    assert pf["ubatches"] >= 1 and pf["borrow"]["lends"] == 1 and pf["borrow"]["refilled"] > 0, pf
    assert "buffers in borrowed slots" in res.stderr


def test_plan_gives_the_buffers_bytes_to_the_slots() -> None:
    """With borrowing the budget keeps the two buffers' bytes for slots; too few slots to hold them: refused."""
    from edgemoe.gguf.header import check_gguf
    from edgemoe.plan.budget import borrow_fits, prefill_buffer_bytes
    from edgemoe.plan.planner import plan
    from edgemoe.plan.request import PlacementError, cache_request
    from edgemoe.plan.reserve import VRAM_RESERVE

    path = sorted((Path(__file__).resolve().parent.parent / "models").glob("*qwen3moe*.gguf"))[0]
    header, info = check_gguf(path), read_model_info(path)
    vram = info.dense_bytes + VRAM_RESERVE + 2 * 2**20 + 16 * info.slot_bytes  # about 16 slots per layer
    plans = {}
    for borrow in (False, True):
        req = cache_request(vram=vram, policy="lru", device_prefill=32, device_prefill_borrow=borrow)
        plans[borrow] = plan(header, req, n_ctx=512, device=None)
    slots = {b: p.slots_per_layer or 0 for b, p in plans.items()}
    assert plans[False].reserve_bytes - plans[True].reserve_bytes == prefill_buffer_bytes(info)
    assert slots[True] > slots[False] > 0 and borrow_fits(info, slots[True]), slots
    with pytest.raises(PlacementError, match="device_prefill_borrow"):
        plan(header, cache_request(expert_slots=1, policy="lru", device_prefill=32, device_prefill_borrow=True),
             n_ctx=512, device=None)
