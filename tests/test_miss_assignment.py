"""Per-route CPU/GPU assignment of a residency policy's misses (edgemoe.policies.miss_assignment; docs/research/assignment.md):
the pure policy on hand-made routes and traces, then through the engine (tokens = stock, live counters =
the replay) and the CLI."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from edgemoe.cli.main import cli
from edgemoe.errors import EdgeMoeError
from edgemoe.perf.model.costmodel import ModelShape, expert_costs
from edgemoe.perf.model.profile import load_profile
from edgemoe.policies.assignment import CostModel, make_assigner
from edgemoe.policies.miss_assignment import AssignedPolicy
from edgemoe.policies.residency import DaliPolicy, LruPolicy, replay_policy
from edgemoe.runtime.cache_config import CacheConfig, LruConfig, policy_config
from edgemoe.runtime.engine import Engine, LoadConfig
from edgemoe.runtime.sampling import GREEDY

from helpers.recorders import StepRecorder

TEXT = "ROMEO:\nBut soft, what light through yonder window breaks? The list type is mutable. " * 3
PLAIN = dict(n_ctx=256, n_batch=64, n_ubatch=64, use_extra_bufts=False)


def _costs(layers: list[int], *, cpu: float, gpu: float, copy: float) -> dict[int, CostModel]:
    return {il: CostModel.affine(cpu_fixed_s=0.0, cpu_per_token_s=cpu, gpu_fixed_s=0.0, gpu_per_token_s=gpu,
                                 transfer_s=copy) for il in layers}


def _trace(n_layers: int = 3, n_expert: int = 16, k: int = 2, seed: int = 0) -> list[list[tuple[int, np.ndarray]]]:
    """A prefill ubatch of 24 tokens, then 30 decode steps, Zipf-skewed routing."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, n_expert + 1) ** 1.2
    p /= p.sum()

    def ids(n: int) -> np.ndarray:
        return np.stack([rng.choice(n_expert, size=k, replace=False, p=p) for _ in range(n)])
    return [[(il, ids(n)) for il in range(n_layers)] for n in [24] + [1] * 30]


def test_cheap_copies_load_every_miss_now_and_dear_ones_none() -> None:
    """Copies that cost nothing make every miss the inner LRU loads a load before the layer (= blocking
    LRU); copies dearer than any CPU time leave them all for the next step (= plain LRU)."""
    steps, slots = _trace(), {0: 4, 1: 4, 2: 4}
    assign = make_assigner("ratio")
    cheap = AssignedPolicy(LruPolicy(slots), _costs([0, 1, 2], cpu=1.0, gpu=0.1, copy=0.0), assign)
    dear = AssignedPolicy(LruPolicy(slots), _costs([0, 1, 2], cpu=1.0, gpu=0.1, copy=1e6), assign)
    assert replay_policy(cheap, steps) == replay_policy(LruPolicy(slots, blocking=True), steps)
    assert replay_policy(dear, steps) == replay_policy(LruPolicy(slots), steps)
    assert cheap.deferred == 0 < cheap.loaded_now and dear.loaded_now == 0 < dear.deferred


def test_a_prefill_ubatch_loads_its_busiest_misses() -> None:
    """CPU 1 s per token, GPU 0.1 s, a copy 4 s: the two experts with 10 tokens are worth copying (makespan
    10 against 22 all on the CPU), the two with one token are not; and only a miss the LRU loads can be
    loaded now (with three slots the LRU's fourth miss, 4, evicts its first, 7)."""
    ids = np.array([[7, 3]] * 10 + [[9, 4]])  # 7 and 3: 10 tokens each; 9 and 4: one each
    four = AssignedPolicy(LruPolicy({0: 4}), _costs([0], cpu=1.0, gpu=0.1, copy=4.0), make_assigner("ratio"))
    assert {ld.expert for ld in four.on_route(0, ids)} == {7, 3, 9, 4}
    assert four.load_now == {7, 3}
    assert four.report() == {"assigner": "ratio", "routes": 1, "loaded_now": 2, "deferred": 2}
    three = AssignedPolicy(LruPolicy({0: 3}), _costs([0], cpu=1.0, gpu=0.1, copy=4.0), make_assigner("ratio"))
    assert {ld.expert for ld in three.on_route(0, ids)} == {3, 9, 4} and three.load_now == {3}
    # the next step: 7 is a miss again, 3 a hit (resident); a layer without a cost model loads nothing now
    assert 3 in three.resident(0)
    bare = AssignedPolicy(LruPolicy({1: 3}), {}, make_assigner("ratio"))
    assert bare.on_route(1, ids) and bare.load_now == set() and bare.report()["routes"] == 0


def test_the_greedy_assigner_and_dali_replay_like_the_live_rule() -> None:
    """Any inner policy with `resident` (dali) and either assigner: the loads made now are a subset of the
    inner policy's, and the replayed hits are at least the plain policy's."""
    steps, slots = _trace(seed=3), {0: 4, 1: 4, 2: 4}
    for inner, plain in ((DaliPolicy(slots, 16, window=4, update=2), DaliPolicy(slots, 16, window=4, update=2)),
                         (LruPolicy(slots), LruPolicy(slots))):
        pol = AssignedPolicy(inner, _costs([0, 1, 2], cpu=1.0, gpu=0.2, copy=0.5), make_assigner("greedy"),
                             name="greedy")
        got, base = replay_policy(pol, steps), replay_policy(plain, steps)
        assert got.loads == base.loads and got.hits >= base.hits
        assert pol.loaded_now + pol.deferred == base.loads  # every load is one or the other


def test_engine_runs_the_assignment_as_stock_and_as_replayed(fixture_model: Path) -> None:
    """Through the routing hook on the CPU stand-in: tokens = stock; hits, misses and loads = the policy
    replayed on the routes it saw; the report counts the loads made now."""
    with Engine(fixture_model, LoadConfig(**PLAIN)) as eng:
        want = eng.generate(TEXT[:80], max_tokens=24, sampling=GREEDY, ignore_eog=True).tokens
    costs = expert_costs(ModelShape.read(fixture_model), load_profile("rtx4060-laptop"))
    recorder = StepRecorder()
    with Engine(fixture_model, LoadConfig(**PLAIN)) as eng:
        cache = eng.enable_expert_cache(CacheConfig(6, policy=LruConfig(assign="ratio", assign_costs=costs)))
        eng.set_policies([recorder])
        got = eng.generate(TEXT[:80], max_tokens=24, sampling=GREEDY, ignore_eog=True).tokens
        cache.sync()
        st, report = cache.stats(), eng.experts.report()
        n_slots = dict(cache.n_slots)
    assert got == want
    pol = AssignedPolicy(LruPolicy(n_slots), costs, make_assigner("ratio"))
    sim = replay_policy(pol, recorder.steps)
    assert (st["hits"], st["misses"], st["loads"]) == (sim.hits, sim.misses, sim.loads)
    assert report["assign"] == pol.report() and report["assign"]["loaded_now"] > 0


def test_assignment_is_refused_where_it_cannot_act(fixture_model: Path) -> None:
    costs = {0: CostModel.affine(cpu_fixed_s=0, cpu_per_token_s=1, gpu_fixed_s=0, gpu_per_token_s=1, transfer_s=1)}
    with Engine(fixture_model, LoadConfig(**PLAIN)) as eng:
        with pytest.raises(EdgeMoeError, match="the static policy has no option 'assign'"):
            eng.enable_expert_cache(CacheConfig(4,
                                                policy=policy_config("static", assign="ratio",
                                                                     assign_costs=costs)))
        with pytest.raises(EdgeMoeError, match="blocking"):
            eng.enable_expert_cache(CacheConfig(4, policy=LruConfig(blocking=True, assign="ratio",
                                                                    assign_costs=costs)))
        with pytest.raises(EdgeMoeError, match="cost model"):
            eng.enable_expert_cache(CacheConfig(4, policy=LruConfig(assign="ratio")))
    with pytest.raises(EdgeMoeError, match="no GPU"):
        expert_costs(ModelShape.read(fixture_model), load_profile(str(_cpu_profile())))


def _cpu_profile() -> Path:
    import dataclasses
    import tempfile

    from edgemoe.perf.model.profile import profile_from_dict

    prof = load_profile("rtx4060-laptop")
    path = Path(tempfile.mkdtemp()) / "cpu.json"
    path.write_text(json.dumps(profile_from_dict(dataclasses.replace(prof, gpu=None, link=None).to_dict()).to_dict()))
    return path


def test_cli_generate_assigns_and_reports(fixture_model: Path) -> None:
    r = CliRunner().invoke(cli, ["generate", str(fixture_model), "-p", "ROMEO:", "-n", "8", "--expert-slots", "4",
                                 "--assign", "ratio", "--profile", "rtx4060-laptop", "--json"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["cache"]["assign"]["assigner"] == "ratio" and out["cache"]["assign"]["routes"] > 0
    r = CliRunner().invoke(cli, ["generate", str(fixture_model), "-p", "x", "--expert-slots", "4", "--policy",
                                 "static", "--assign", "ratio"])
    assert r.exit_code != 0 and "--assign is an option of --policy lru or dali" in r.output
    r = CliRunner().invoke(cli, ["generate", str(fixture_model), "-p", "x", "--expert-slots", "4", "--profile",
                                 "rtx4060-laptop"])
    assert r.exit_code != 0 and "add --assign" in r.output
