"""Super experts: found by calibration, never dropped by adaptive top-k nor swapped by graceful degradation.

The fixtures have none (their largest down-projection peak is about 3x the median); a copy of the qwen3moe
fixture with one expert's output channel scaled up (tools/plant_super_expert.py) has exactly one, and the guard keeps
it."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from edgemoe.analysis.perplexity import chunk_tokens
from edgemoe.calibration.adaptive import GatingOptions, build_gating
from edgemoe.calibration.run import CalibrationConfig, run_calibration
from edgemoe.calibration.super_experts import FILE_NAME, find_super_experts, measure_super_experts
from edgemoe.policies.degrade import GracefulDegradation, degrade
from edgemoe.policies.gating import GatingPolicy, GatingRule
from edgemoe.policies.protected import ProtectedExperts
from edgemoe.policies.route import RouteRecord
from edgemoe.runtime.cache_config import CacheConfig
from edgemoe.runtime.engine import Engine, LoadConfig

from helpers.models import FIXTURE_MODELS

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from plant_super_expert import plant_super_expert  # noqa: E402

QWEN = next(m for m in FIXTURE_MODELS if "qwen3moe" in m.name)
LAYER, EXPERT, CHANNEL, SCALE = 0, 5, 7, 200.0
TEXT = (
    "ROMEO:\nBut soft, what light through yonder window breaks? It is the east, and Juliet is the sun.\n"
    "The list type is a mutable sequence; tuples are immutable sequences.\n"
) * 12


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("planted") / "tiny-qwen3moe-planted.gguf"
    plant_super_expert(QWEN, out, layer=LAYER, expert=EXPERT, channel=CHANNEL, scale=SCALE)
    return out


def _route(
    ids: list[list[int]],
    weights: list[list[float]],
    layer: int = 0,
    n_expert: int = 8,
    probs: np.ndarray | None = None,
) -> RouteRecord:
    return RouteRecord(layer, np.array(ids, np.int32), np.array(weights, np.float32), probs, None, n_expert)


def test_find_super_experts_asks_for_orders_of_magnitude() -> None:
    rng = np.random.default_rng(0)
    flat = {il: rng.uniform(5, 15, 128) for il in range(8)}  # 1024 experts: the 99.5th percentile leaves ~5
    assert find_super_experts(flat) == []  # the paper's two conditions alone would name the largest
    spiked = {il: p.copy() for il, p in flat.items()}
    spiked[2][9] = 900.0
    spiked[3][1] = 300.0
    spiked[5][7] = 80.0  # 8x the median: not orders of magnitude
    assert find_super_experts(spiked) == [(2, 9), (3, 1)]
    spiked[6][2] = 89.0  # 10x the median but under a tenth of the largest
    assert find_super_experts(spiked) == [(2, 9), (3, 1)]
    spiked[0][:100] = 0.0  # experts never routed count for nothing
    assert find_super_experts(spiked) == [(2, 9), (3, 1)]


def test_gating_never_drops_a_protected_expert() -> None:
    prot = ProtectedExperts.of([(0, 3)])
    assert (
        prot.mask(0, np.array([[3, -1]])).tolist() == [[True, False]]
        and not prot.mask(1, np.array([[3]])).any()
    )
    r = _route([[1, 3, 2], [3, 1, 2], [1, 2, 0]], [[0.8, 0.1, 0.1]] * 3)
    GatingPolicy(GatingRule.SCORE, 0.5, decode_only=False, protected=prot).on_route(r)
    assert r.ids.tolist() == [[1, 3, -1], [3, -1, -1], [1, -1, -1]]
    np.testing.assert_allclose(r.weights[0], [8 / 9, 1 / 9, 0], rtol=1e-6)  # renormalised over the kept
    other = _route([[1, 3, 2]], [[0.8, 0.1, 0.1]], layer=1)
    GatingPolicy(GatingRule.SCORE, 0.5, decode_only=False, protected=prot).on_route(other)
    assert other.ids.tolist() == [[1, -1, -1]]  # protection is per layer


def test_degradation_never_swaps_a_protected_expert_out_or_in() -> None:
    scores = np.array([[0.30, 0.25, 0.20, 0.15, 0.10]])
    resident = np.array([True, False, False, False, True])
    ids = np.array([[1, 2]])  # both on the CPU: slot 1 (expert 2) is replaced by the best resident, expert 0
    assert degrade(ids, scores, resident, ratio=0.6)[0].tolist() == [[1, 0]]
    fixed = np.zeros(5, bool)
    fixed[2] = True  # expert 2 protected: kept
    assert degrade(ids, scores, resident, ratio=0.6, protected=fixed)[0].tolist() == [[1, 2]]
    fixed = np.zeros(5, bool)
    fixed[0] = True  # expert 0 protected: never brought in; the next resident, 4, is too far below (0.10 < 0.12)
    assert degrade(ids, scores, resident, ratio=0.6, protected=fixed)[0].tolist() == [[1, 2]]

    class Res:
        def resident(self, layer: int) -> set[int]:
            return {0, 4}

    probs = np.array([[0.30, 0.25, 0.20, 0.15, 0.10]], np.float32)
    r = _route([[1, 2]], [[0.55, 0.45]], n_expert=5, probs=probs)
    deg = GracefulDegradation(Res(), ratio=0.6, decode_only=False, protected=ProtectedExperts.of([(0, 2)]))
    deg.on_route(r)
    assert r.ids.tolist() == [[1, 2]] and deg.n_replaced == 0 and deg.n_cpu == 2


def _chunks(eng: Engine) -> list[list[int]]:
    return chunk_tokens(
        eng.tokenize(TEXT, add_special=False), 128, eng.bos_token() if eng.adds_bos() else None
    )


def test_the_fixtures_have_no_super_expert() -> None:
    for model in FIXTURE_MODELS:
        with Engine(model, LoadConfig(n_ctx=128, n_threads=2)) as eng:
            found = measure_super_experts(eng, _chunks(eng))
        assert found.protected == [], (model.name, found.summary())
        assert found.summary()["max_over_median"] < 5  # far from the factor of 10


class _Count:
    """Counts the slots routed to EXPERT in LAYER, as the chain hands them on."""

    wants_probs = False
    wants_gate_inp = False

    def __init__(self) -> None:
        self.n = 0
        self.dropped = 0

    def on_route(self, r: RouteRecord) -> None:
        if r.layer == LAYER:
            self.n += int((r.ids == EXPERT).sum())
            self.dropped += int((r.ids < 0).sum())


def test_the_planted_super_expert_is_found_and_never_dropped(planted: Path, tmp_path: Path) -> None:
    with Engine(planted, LoadConfig(n_ctx=128, n_threads=2)) as eng:
        found = measure_super_experts(eng, _chunks(eng))
        assert found.protected == [[LAYER, EXPERT]], found.summary()
        assert found.summary()["max_over_median"] > 50
        prot = found.protected_experts()
        toks = _chunks(eng)[0]
        counts = {}
        for name, gate in (
            ("none", None),
            ("unprotected", GatingPolicy(GatingRule.SCORE, 0.0, decode_only=False)),
            ("protected", GatingPolicy(GatingRule.SCORE, 0.0, decode_only=False, protected=prot)),
        ):
            count = _Count()
            eng.set_gating(gate)
            eng.set_policies([count])  # after the gating in the hook chain
            assert eng.gating_path == (None if gate is None else "hook")
            eng.eval_logits(toks)
            counts[name] = count
        # score 0: top-1 only, every token; layer 0 routes the same text each time (nothing before it is gated):
        # the protected run keeps every slot routed to the super expert, the unprotected one drops some
        assert counts["none"].dropped == 0 and counts["none"].n > 0
        assert counts["protected"].n == counts["none"].n and counts["protected"].dropped > 0
        assert counts["unprotected"].n < counts["none"].n
        eng.set_policies(None)
        eng.set_gating(GatingPolicy(GatingRule.SER, 0.5, protected=prot))
        assert eng.gating_path == "hook"  # the graph's gate cannot keep protected experts
        eng.set_gating(GatingPolicy(GatingRule.SER, 0.5))
        assert eng.gating_path == "graph"
        eng.set_gating(None)
        eng.enable_expert_cache(CacheConfig(8, degrade=0.5, protected=prot))
        assert eng.experts is not None and eng.experts.degradation is not None
        assert eng.experts.degradation.protected == prot


def test_calibration_stage_records_them_and_gating_reads_them(planted: Path, tmp_path: Path) -> None:
    corpus = tmp_path / "c.txt"
    corpus.write_text(TEXT * 20)
    cal = run_calibration(
        CalibrationConfig(
            model=planted,
            corpora=(corpus,),
            stages=("super_experts",),
            options={"super_experts": {"tokens": 512, "ctx": 128}},
        ),
        tmp_path / "cal",
    )
    assert (cal.path / FILE_NAME).exists() and cal.card["super_experts"]["protected"] == [[LAYER, EXPERT]]
    with Engine(planted, LoadConfig(n_ctx=128, n_threads=2)) as eng:
        policy = build_gating(eng, GatingOptions("ser", threshold=0.5, calibration=cal.path))
    assert policy is not None and policy.protected == ProtectedExperts.of([(LAYER, EXPERT)])
