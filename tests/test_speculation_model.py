"""Speculation in the performance model: the verification step in the workload and the projection."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from edgemoe.analysis.routing_profile import routing_for_model
from edgemoe.analysis.trace import DECODE
from edgemoe.cli.main import cli
from edgemoe.perf.model.profile import load_profile
from edgemoe.perf.model.simulate import SimSpec
from edgemoe.perf.model.speculation import break_even, expected_tokens, project_speculation, speculation_rows
from edgemoe.perf.model.workload import build_workload

ROOT = Path(__file__).resolve().parent.parent
QWEN = ROOT / "models" / "edgemoe-tiny-qwen3moe.Q4_K_M.gguf"


def test_expected_tokens_and_break_even() -> None:
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert break_even(0.9, 4) == 0.0  # a step cheaper than a token: pays at any acceptance
    assert break_even(5.0, 4) is None  # costs as much as 5 plain steps: never
    a = break_even(1.75, 2)
    assert a is not None and a == pytest.approx(0.5, abs=1e-9)


def test_speculation_rows_from_two_simulations() -> None:
    # plain 10 tok/s (0.1 s a step); the verification of 4 proposals runs 25 positions/s: a step 0.2 s
    rows = speculation_rows([("a", 10.0), ("gone", 0.0)], [("a", 25.0)], 4, (0.5, 0.9))
    assert [r.name for r in rows] == ["a"]
    r = rows[0]
    assert r.step_cost == pytest.approx(2.0)
    assert r.tps[0.5] == pytest.approx(expected_tokens(0.5, 4) / 0.2)
    assert r.break_even == pytest.approx(break_even(2.0, 4))


def test_workload_groups_decode_tokens_into_verification_steps() -> None:
    tr = routing_for_model(32, 4, 8, name="fixture-qwen3moe", n_seq=1, prefill=16, decode=10).trace
    moe = tuple(range(8))
    one = build_workload(tr, moe, 32, 4)
    five = build_workload(tr, moe, 32, 4, verify=5)
    dec1 = [s for s in one.steps if s.phase == DECODE]
    dec5 = [s for s in five.steps if s.phase == DECODE]
    assert len(dec1) == 10 and [s.n_tokens for s in dec5] == [5, 5]
    np.testing.assert_array_equal(np.concatenate([s.ids for s in dec5]), np.concatenate([s.ids for s in dec1]))
    assert [s.kv_len for s in dec5] == [16, 21]


def test_verification_costs_more_than_a_step_and_less_than_its_tokens() -> None:
    """On the fixture's routing, a step verifying 4 proposals reads the union of 5 tokens' experts: dearer
    than one plain step, cheaper than five."""
    tr = routing_for_model(32, 4, 8, name="fixture-qwen3moe", n_seq=4, prefill=32, decode=64).trace
    rows = project_speculation(QWEN, tr, load_profile("rtx4060-laptop"), SimSpec(vram=2**30, n_ctx=512), 4)
    assert rows
    for r in rows:
        assert 1.0 < r.step_cost < 5.0, r
        assert r.tps[0.9] > r.tps[0.5]


def test_simulate_cli_projects_speculation() -> None:
    res = CliRunner().invoke(
        cli, ["simulate", str(QWEN), "--profile", "rtx4060-laptop", "--vram", "1GiB", "--ctx", "512",
              "--draft-max", "4", "--acceptance", "0.7"])
    assert res.exit_code == 0, res.output
    assert "PROJECTED decode tok/s with speculation (4 proposals per step)" in res.output
    assert "a=0.7" in res.output

