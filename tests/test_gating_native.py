"""Adaptive top-k inside llama.cpp's graph (ggml_moe_gate, llama_moe_set_gating).

- The op's decisions equal edgemoe.policies.gating's rules exactly, on routes recorded from the
  fixtures (k = 2, 4, 8), every rule, logits (softmax-weighted models) and threshold ties, on every
  backend the library has (tests/native/test_moe_gate.cpp).
- Gating to the top-1 expert in the graph equals stock llama.cpp run with one expert per token,
  bitwise, on every MoE architecture of the synthetic presets: the kept weights follow each model's
  own rule (normalised, softmax over the selected, scaled, or as they are).
- The graph path decides as the Python hook does, and makes no host sync per MoE layer.
"""
from __future__ import annotations

import json
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest

from edgemoe import GREEDY, Engine, LoadConfig
from edgemoe.policies.gating import GatingPolicy, GatingRule, keep_mask
from edgemoe.policies.route import RouteRecord
from edgemoe.runtime.cache_config import CacheConfig, LruConfig
from edgemoe.runtime.gating import (
    NATIVE_RULE,  # enum ggml_moe_gate_rule, the op's and the API's one numbering
)

from helpers.native_ops import build_native

ROOT = Path(__file__).resolve().parent.parent
QWEN = ROOT / "models" / "edgemoe-tiny-qwen3moe.Q4_K_M.gguf"
MIXTRAL = ROOT / "models" / "edgemoe-tiny-mixtral.Q4_K_M.gguf"
TEXT = "ROMEO:\nBut soft, what light through yonder window breaks?\nIt is the east, and Juliet is the sun."


class _Recorder:
    """Copies every route's weights and ids (a RoutePolicy)."""

    wants_probs = False
    wants_gate_inp = False

    def __init__(self) -> None:
        self.weights: list[np.ndarray] = []
        self.ids: list[np.ndarray] = []

    def on_route(self, route: RouteRecord) -> None:
        self.weights.append(route.weights.copy())
        self.ids.append(route.ids.copy())


def _record(path: Path, k: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    rec = _Recorder()
    with Engine(path, LoadConfig(n_ctx=256, expert_used_count=k)) as eng:
        eng.set_policies([rec])
        eng.feed(eng.tokenize(TEXT), all_logits=True)
    return np.concatenate(rec.weights), np.concatenate(rec.ids)


@pytest.fixture(scope="module")
def recorded_routes() -> list[tuple[np.ndarray, np.ndarray]]:
    routes = [_record(MIXTRAL), _record(QWEN), _record(QWEN, k=8)]
    assert [w.shape[1] for w, _ in routes] == [2, 4, 8]
    return routes


def _ties() -> list[tuple[GatingRule, float, float, np.ndarray]]:
    """Weights summing to 1 exactly in binary, with thresholds that land on a decision boundary."""
    w = np.array([[0.5, 0.25, 0.25], [0.5, 0.375, 0.125]], np.float32)
    return [(GatingRule.SCORE, 0.5, 1.0, w), (GatingRule.SER, 0.5, 1.0, w), (GatingRule.SER, 0.75, 1.0, w),
            (GatingRule.SENSITIVITY, 1.0, 16.0, w), (GatingRule.SENSITIVITY, 1.0, 64.0, w)]


def _cases(routes: list[tuple[np.ndarray, np.ndarray]]) -> list[dict]:
    rng = np.random.default_rng(0)
    grid = {GatingRule.SCORE: [(t, 1.0) for t in (0.3, 0.5, 0.7, 0.9)],
            GatingRule.SER: [(t, 1.0) for t in (0.1, 0.3, 0.5, 0.9)],
            GatingRule.SENSITIVITY: [(t, s) for s in (0.5, 3.0) for t in (0.01, 0.05, 0.2)]}
    cases = []
    for weights, ids in routes:
        for rule, params in grid.items():
            for t, s in params:
                cases.append(dict(rule=rule, logits=False, fill=0.0, threshold=t, sensitivity=s, weights=weights,
                                  ids=ids))
    for rule, t, s, w in _ties():
        ids = np.tile(np.arange(w.shape[1], dtype=np.int32), (len(w), 1))
        cases.append(dict(rule=rule, logits=False, fill=0.0, threshold=t, sensitivity=s, weights=w, ids=ids))
    # softmax-weighted models pass logits; their dropped logits become -inf
    logits = rng.normal(0, 2, (64, 4)).astype(np.float32)
    ids = rng.integers(0, 32, (64, 4)).astype(np.int32)
    for rule, t, s in ((GatingRule.SCORE, 0.6, 1.0), (GatingRule.SER, 0.3, 1.0), (GatingRule.SENSITIVITY, 0.05, 2.0)):
        cases.append(dict(rule=rule, logits=True, fill=float("-inf"), threshold=t, sensitivity=s, weights=logits,
                          ids=ids))
    return cases


def _write_cases(cases: list[dict], path: Path) -> None:
    with path.open("wb") as f:
        for c in cases:
            w = np.ascontiguousarray(c["weights"], np.float32)
            n_rows, n_used = w.shape
            stride = n_used + 3  # ids as a strided view of argsort-like rows
            span = np.full((n_rows, stride), 7777, np.int32)
            span[:, :n_used] = c["ids"]
            f.write(struct.pack("<iifddiii", NATIVE_RULE[c["rule"]], int(c["logits"]), c["fill"], c["threshold"],
                                c["sensitivity"], n_used, n_rows, stride))
            f.write(w.tobytes())
            f.write(span.tobytes())


def test_gate_op_decides_as_the_python_rules(recorded_routes, tmp_path: Path) -> None:
    exe = build_native("test_moe_gate", tmp_path)
    cases = _cases(recorded_routes)
    _write_cases(cases, tmp_path / "cases.bin")
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.run([str(exe), str(tmp_path / "cases.bin"), str(out)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    targets = sorted(out.glob("*.bin"))
    assert targets and "CPU" in proc.stdout
    n_dropped = 0
    for target in targets:
        data = target.read_bytes()
        pos = 0
        for c in cases:
            w = np.asarray(c["weights"], np.float32)
            keep = keep_mask(c["rule"], w, c["threshold"], c["sensitivity"], logits=c["logits"])
            n = w.size
            got_ids = np.frombuffer(data, np.int32, n, pos).reshape(w.shape)
            got_w = np.frombuffer(data, np.float32, n, pos + 4 * n).reshape(w.shape)
            pos += 8 * n
            what = f"{target.name}: {c['rule'].value} t={c['threshold']} s={c['sensitivity']} k={w.shape[1]}"
            np.testing.assert_array_equal(got_ids, np.where(keep, c["ids"], -1), err_msg=what)
            np.testing.assert_array_equal(got_w, np.where(keep, w, np.float32(c["fill"])), err_msg=what)
            n_dropped += int((~keep).sum())
        assert pos == len(data)
    assert n_dropped > 1000  # the grid drops (and keeps) many slots


@pytest.mark.parametrize("where", ["graph", "hook"])
@pytest.mark.parametrize("preset", ["tiny-qwen3moe", "tiny-mixtral", "tiny-qwen2moe", "tiny-deepseek2",
                                    "tiny-olmoe", "tiny-gpt-oss"])
def test_top1_equals_stock_with_one_expert(preset: str, where: str, make_tiny_gguf) -> None:
    """score with threshold 0 keeps only the first selected expert: stock llama.cpp with k = 1, bitwise.

    The kept weight follows each model's rule (normalised, softmax over the selected, scaled or as it
    is), in the graph and in the hook alike.
    """
    path = make_tiny_gguf(preset)
    toks = list(range(1, 40))
    policy = GatingPolicy(GatingRule.SCORE, 0.0, decode_only=False)
    with Engine(path, LoadConfig(n_ctx=128, expert_used_count=4)) as eng:
        if where == "graph":
            assert eng.set_gating(policy) == "graph"
        else:
            eng.set_policies([policy])
        gated = np.stack(eng.eval_logits(toks))
        stats = eng.control_stats()
    with Engine(path, LoadConfig(n_ctx=128, expert_used_count=1)) as eng:
        top1 = np.stack(eng.eval_logits(toks))
    np.testing.assert_array_equal(gated, top1)
    if where == "graph":
        assert stats["n_dropped"] * 4 == stats["n_routed"] * 3 and stats["n_host_syncs"] == 0
    else:
        assert policy.n_dropped * 4 == policy.n_routed * 3 and stats["n_host_syncs"] > 0


@pytest.mark.parametrize("path", [QWEN, MIXTRAL], ids=["qwen3moe", "mixtral"])
@pytest.mark.parametrize("rule,threshold", [(GatingRule.SER, 0.4), (GatingRule.SCORE, 0.6),
                                            (GatingRule.SENSITIVITY, 0.05)])
def test_graph_gating_decides_as_the_hook(path: Path, rule: GatingRule, threshold: float) -> None:
    sens = {il: 1.0 + 0.25 * il for il in range(8)} if rule is GatingRule.SENSITIVITY else None
    with Engine(path, LoadConfig(n_ctx=256)) as eng:
        hook = GatingPolicy(rule, threshold, sensitivity=sens)
        eng.set_policies([hook])
        by_hook = eng.generate("ROMEO:", max_tokens=48, sampling=GREEDY, ignore_eog=True).tokens
        eng.set_policies(None)
        eng.reset()
        assert eng.set_gating(GatingPolicy(rule, threshold, sensitivity=sens)) == "graph"
        in_graph = eng.generate("ROMEO:", max_tokens=48, sampling=GREEDY, ignore_eog=True).tokens
        report = eng.gating_report()
        stats = eng.control_stats()
    assert in_graph == by_hook
    assert stats["n_dropped"] == hook.n_dropped > 0 and stats["n_routed"] == hook.n_routed
    assert report["path"] == "graph" and report["activation_reduction"] == hook.activation_reduction


def test_graph_gating_makes_no_host_sync_per_layer() -> None:
    n_moe = 8
    with Engine(QWEN, LoadConfig(n_ctx=256)) as eng:
        eng.set_gating(GatingPolicy(GatingRule.SER, 0.4))
        eng.generate("ROMEO:", max_tokens=16, sampling=GREEDY, ignore_eog=True)
        graph = eng.control_stats()
        # a Python policy needs the callback: gating moves into the hook, which syncs at every MoE layer
        rec = _Recorder()
        eng.set_policies([rec])
        assert eng.gating_path == "hook"
        eng.reset()
        eng.control_stats()
        before = eng.control_stats()["n_ubatch"]
        eng.generate("ROMEO:", max_tokens=16, sampling=GREEDY, ignore_eog=True)
        hooked = eng.control_stats()
    assert graph["n_ubatch"] == 16 and graph["n_host_syncs"] == 0 and graph["n_routed"] > 0
    n_ub = hooked["n_ubatch"] - before
    assert hooked["n_host_syncs"] == n_moe * n_ub and len(rec.ids) == n_moe * n_ub


def test_set_gating_off_and_with_the_expert_cache() -> None:
    with Engine(QWEN, LoadConfig(n_ctx=256)) as eng:
        plain = eng.generate("ROMEO:", max_tokens=24, sampling=GREEDY, ignore_eog=True).tokens
        eng.set_gating(GatingPolicy(GatingRule.SER, 0.9))
        eng.reset()
        gated = eng.generate("ROMEO:", max_tokens=24, sampling=GREEDY, ignore_eog=True).tokens
        assert gated != plain
        assert eng.set_gating(None) is None and eng.gating_report() is None
        eng.reset()
        assert eng.generate("ROMEO:", max_tokens=24, sampling=GREEDY, ignore_eog=True).tokens == plain
        assert eng.control_stats()["n_routed"] == 0
        # with the expert cache's tables in the graph, gating stays there
        eng.enable_expert_cache(CacheConfig(policy=LruConfig(), slots_per_layer=8))
        assert eng.set_gating(GatingPolicy(GatingRule.SER, 0.9)) == "graph"
        eng.reset()
        assert eng.generate("ROMEO:", max_tokens=24, sampling=GREEDY, ignore_eog=True).tokens == gated
        # blocking loads need the routing callback: gating runs there, with the same decisions
        eng.enable_expert_cache(CacheConfig(policy=LruConfig(blocking=True), slots_per_layer=8))
        assert eng.gating_path == "hook"
        eng.reset()
        assert eng.generate("ROMEO:", max_tokens=24, sampling=GREEDY, ignore_eog=True).tokens == gated
        assert eng.gating_report()["path"] == "hook" and eng.gating_report()["activation_reduction"] > 0


def test_generate_json_reports_gating_and_control_counters() -> None:
    from click.testing import CliRunner

    from edgemoe.cli import cli

    res = CliRunner().invoke(cli, ["generate", str(QWEN), "-p", "ROMEO:", "-n", "12", "--temp", "0",
                                   "--gating", "ser", "--threshold", "0.5", "--json"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["gating"]["rule"] == "ser" and out["gating"]["threshold"] == 0.5
    assert out["gating"]["path"] == "graph" and 0 < out["gating"]["activation_reduction"] < 1
    assert out["control"]["n_host_syncs"] == 0 and out["control"]["n_ubatch"] == 12
    assert out["control"]["n_dropped"] / out["control"]["n_routed"] == out["gating"]["activation_reduction"]
