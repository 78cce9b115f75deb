"""The residency-policy registry (edgemoe.policies.registry): a policy is one module plus its registration.

(a) A FIFO policy written to a module of its own (FIFO_MODULE, nothing else edited) runs through the replays,
the user's request, the engine's cache on a fixture model, and `edgemoe plan`, `simulate` and `bench`. (b) No
module of edgemoe tests a policy's name: no registered name compared or listed in an `in` test, no literal list
of policy names, no isinstance on a policy's config record or class outside its own module, no PolicyKind member.
"""
from __future__ import annotations

import ast
import importlib
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from edgemoe.placement import PlacementError, cache_request
from edgemoe.policies.allocation import replay_curve
from edgemoe.policies.registry import policy_names, policy_spec, unregister
from edgemoe.policies.residency import make_policy, replay_policy

from helpers.models import FIXTURE_MODELS
from helpers.recorders import StepRecorder

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "edgemoe"
DOC = ROOT / "docs" / "adding-a-policy.md"

# the whole of a new policy: its pure class, its config record and its spec (docs/adding-a-policy.md)
FIFO_MODULE = '''"""fifo: on a miss, evict the expert that was loaded first (not the least recently used)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from edgemoe.policies.loads import Load, used_experts
from edgemoe.policies.registry import PolicyInputs, PolicyRecord, PolicySpec, register


@dataclass
class FifoPolicy:
    n_slots: Mapping[int, int]  # layer -> slots
    blocking: bool = False  # load a miss before its layer runs (True) or for its next run (False)
    _queue: dict[int, OrderedDict[int, int]] = field(default_factory=dict)  # layer -> expert -> slot, oldest first

    def initial_loads(self) -> list[Load]:
        return []

    def on_route(self, layer: int, ids: np.ndarray) -> list[Load]:
        n = self.n_slots.get(layer, 0)
        queue = self._queue.setdefault(layer, OrderedDict())
        loads = []
        for e in used_experts(ids) if n > 0 else []:
            if e not in queue:
                free = sorted(set(range(n)) - set(queue.values()))
                queue[e] = free[0] if free else queue.popitem(last=False)[1]
                loads.append(Load(layer, e, queue[e]))
        return [ld for ld in loads if queue.get(ld.expert) == ld.slot]  # more misses than slots: the survivors


@dataclass(frozen=True)
class FifoConfig(PolicyRecord):
    name: ClassVar[str] = "fifo"
    blocking: bool = False  # load a missed expert before its layer runs instead of after the step


SPEC = register(
    PolicySpec(
        name="fifo",
        config=FifoConfig,
        help="first in, first out",
        build=lambda config, inputs: FifoPolicy(dict(inputs.slots), blocking=config.blocking),
    )
)
'''
FIFO_LINES = len(FIFO_MODULE.splitlines())
TEXT = "ROMEO:\nBut soft, what light through yonder window breaks? The list type is mutable. " * 3


@pytest.fixture
def fifo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """The fifo module, imported from a file of its own (which registers it); unregistered afterwards."""
    (tmp_path / "edgemoe_fifo_policy.py").write_text(FIFO_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("edgemoe_fifo_policy")
    try:
        yield module
    finally:
        unregister("fifo")
        sys.modules.pop("edgemoe_fifo_policy", None)


def test_a_new_policy_is_one_module_of_the_documented_size() -> None:
    assert f"{FIFO_LINES} lines" in DOC.read_text(), f"docs/adding-a-policy.md should give the fifo's {FIFO_LINES} lines"


def test_fifo_replays_by_name(fifo: object) -> None:
    assert "fifo" in policy_names() and policy_spec("fifo").loads_misses
    steps = [[(0, np.array([[1, 2]]))], [(0, np.array([[3, 1]]))], [(0, np.array([[4, 1]]))]]
    res = replay_policy(make_policy("fifo", {0: 2}), steps)
    # 1, 2 fill the slots; 3 evicts 1 (the oldest load, though this step uses it: LRU would evict 2), so 1 comes
    # back in place of 2; 4 evicts 3
    assert (res.hits, res.misses, res.loads) == (2, 4, 5)
    curve = replay_curve([s[0][1] for s in steps], "fifo", 4, n_expert=6)  # no all-sizes replay: per t
    assert list(curve.misses) == [6, 5, 4, 4, 4] and list(curve.loads) == [0, 3, 5, 5, 4]


def test_fifo_is_requested_and_checked_like_the_others(fifo: object) -> None:
    req = cache_request(expert_slots=2, policy="fifo", blocking=True)
    assert req.policy == "fifo" and req.config == fifo.FifoConfig(blocking=True)  # type: ignore[attr-defined]
    with pytest.raises(PlacementError, match="options of `policy='dali'`"):
        cache_request(expert_slots=2, policy="fifo", dali_window=8)
    with pytest.raises(PlacementError, match="`policy='lru'` or dali"):
        cache_request(expert_slots=2, policy="fifo", assign="ratio")
    assert cache_request(expert_slots=2).policy == "static"  # the default is unchanged


def test_fifo_reaches_plan_simulate_and_bench(fifo: object, tmp_path: Path) -> None:
    """Registered in a module of its own, fifo is a choice of --policy in plan's projections, simulate and bench,
    and each runs it: no list of names anywhere else to add it to."""
    from click.testing import CliRunner

    from edgemoe.cli import cli

    model = FIXTURE_MODELS[0]
    planned = CliRunner().invoke(cli, ["plan", str(model), "--expert-slots", "2", "--json"], catch_exceptions=False)
    assert planned.exit_code == 0, planned.output
    assert "fifo" in planned.output
    sim = CliRunner().invoke(cli, ["simulate", str(model), "--vram", "600MiB", "--ctx", "256", "--profile",
                                   "rtx4060-laptop", "--policy", "fifo", "--json"], catch_exceptions=False)
    assert sim.exit_code == 0, sim.output
    assert "edgemoe-fifo" in sim.output
    bench = CliRunner().invoke(cli, ["bench", str(model), "--vram", "520MiB", "--prompt-tokens", "32",
                                     "--gen-tokens", "4", "-t", "2", "--alloc", "equal", "--policy", "fifo",
                                     "--profile", "none", "--json"], catch_exceptions=False)
    assert bench.exit_code == 0, bench.output
    import json

    rows = {r["name"]: r for r in json.loads(bench.stdout[bench.stdout.index("{"):])["rows"]}
    assert rows["edgemoe fifo"]["decode_tps"] > 0 and rows["edgemoe fifo"]["cache"]["hits"] >= 0
    for cmd in ("bench", "simulate"):
        assert "fifo" in CliRunner().invoke(cli, [cmd, "--help"]).output, cmd


@pytest.mark.parametrize("blocking", [False, True])
def test_fifo_runs_in_the_engines_cache(fifo: object, blocking: bool) -> None:
    """Stock tokens, and the cache's counters equal the replay of the routes the run recorded."""
    from edgemoe.runtime.cache_config import CacheConfig, policy_config
    from edgemoe.runtime.engine import Engine, LoadConfig
    from edgemoe.runtime.sampling import GREEDY

    plain = LoadConfig(n_ctx=256, n_batch=64, n_ubatch=64, use_extra_bufts=False)
    model = FIXTURE_MODELS[0]
    with Engine(model, plain) as eng:
        want = eng.generate(TEXT[:80], max_tokens=16, sampling=GREEDY, ignore_eog=True).tokens
    recorder = StepRecorder()
    with Engine(model, plain) as eng:
        cache = eng.enable_expert_cache(CacheConfig(4, policy=policy_config("fifo", blocking=blocking)))
        assert cache is not None and type(eng.experts.policy).__name__ == "FifoPolicy"  # type: ignore[union-attr]
        eng.set_policies([recorder])  # runs before the cache controller, sees the same ids
        got = eng.generate(TEXT[:80], max_tokens=16, sampling=GREEDY, ignore_eog=True).tokens
        cache.sync()
        st = cache.stats()
        n_slots = dict(cache.n_slots)
    sim = replay_policy(make_policy("fifo", n_slots, blocking=blocking), recorder.steps)
    assert got == want
    assert (st["hits"], st["misses"], st["loads"]) == (sim.hits, sim.misses, sim.loads)
    assert sim.hits > 0 and sim.loads > 0


# -- (b) no module tests a policy's name --------------------------------------------------------------------------
def name_tests(source: str, module: str, names: set[str], records: dict[str, str]) -> list[str]:
    """The places in `source` (module `module`) that test a policy's identity: a registered name compared (==, !=,
    is, in a literal tuple/list/set), a literal list of two or more registered names (a choice or a default the
    registry should give), isinstance on a policy's config record or class (records: class -> its module) outside
    its module, or a PolicyKind member."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            listed = [e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in names]
            if len(listed) >= 2:
                found.append(f"line {node.lineno}: lists the policy names {', '.join(map(repr, listed))}")
        if isinstance(node, ast.Compare):
            for operand in [node.left, *node.comparators]:
                items = operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [operand]
                hit = [i.value for i in items if isinstance(i, ast.Constant) and i.value in names]
                found += [f"line {node.lineno}: compares the policy name {h!r}" for h in hit]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance":
            classes = node.args[1] if len(node.args) > 1 else None
            elts = classes.elts if isinstance(classes, ast.Tuple) else [classes]
            for c in elts:
                cls = c.id if isinstance(c, ast.Name) else c.attr if isinstance(c, ast.Attribute) else None
                if cls in records and records[cls] != module:
                    found.append(f"line {node.lineno}: isinstance on {cls}")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "PolicyKind":
            found.append(f"line {node.lineno}: PolicyKind.{node.attr}")
    return found


def policy_classes() -> dict[str, str]:
    """The policies' classes (edgemoe/policies' classes named ...Policy that are not protocols) -> their modules."""
    out = {}
    for path in sorted((PKG / "policies").rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name.endswith("Policy"):
                bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
                if "Protocol" not in bases:
                    out[node.name] = module
    return out


def _registered() -> tuple[set[str], dict[str, str]]:
    specs = [policy_spec(n) for n in policy_names()]
    return {s.name for s in specs}, {s.config.__name__: s.config.__module__ for s in specs} | policy_classes()


def test_the_checker_finds_the_old_dispatch_patterns() -> None:
    names, records = _registered()
    old = (
        'if req.policy == "lru":\n    pass\n'
        'if r.blocking and r.policy in ("static", "manual"):\n    pass\n'
        "if isinstance(config, (LruConfig, DaliConfig)):\n    pass\n"
        "if k is PolicyKind.MANUAL:\n    pass\n"
        'x = policy != "promoe"\n'
        "assert isinstance(pol, PromoePolicy)\n"
        'CHOICES = click.Choice(["lru", "dali", "static"])\n'
        'def f(policies=("lru", "static")): pass\n'
    )
    found = name_tests(old, "edgemoe.placement.install", names, records)
    # lru; static, manual (and their tuple); LruConfig, DaliConfig; PolicyKind.MANUAL; promoe; PromoePolicy; the
    # choice's list and the default's tuple
    assert len(found) == 11, found
    assert sum("lists the policy names" in f for f in found) == 3 and any("PromoePolicy" in f for f in found)
    assert not name_tests('MODES = {"lru": 2}\nDEFAULT = "static"\nONE = ("static",)\n', "edgemoe.x", names, records)
    assert not name_tests("isinstance(p, PromoePolicy)\n", "edgemoe.policies.promoe", names, records)  # its own


def test_no_module_tests_a_policys_name() -> None:
    names, records = _registered()
    bad = {}
    for path in sorted(PKG.rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        found = name_tests(path.read_text(), module, names, records)
        if found:
            bad[str(path.relative_to(ROOT))] = found
    assert not bad, f"ask the policy's spec (edgemoe.policies.registry) instead: {bad}"
