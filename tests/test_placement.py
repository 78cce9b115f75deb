"""edgemoe.placement: the cache request's rules and open_engine, the library path behind chat/generate/serve."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from edgemoe.cli.flags import as_flags, flag_table
from edgemoe.cli.main import cli
from edgemoe.placement import PlacementError, cache_request, open_engine
from edgemoe.runtime.sampling import GREEDY

MODEL = Path(__file__).resolve().parents[1] / "models" / "edgemoe-tiny-qwen3moe.Q4_K_M.gguf"


@pytest.mark.parametrize(("given", "words"), [
    ({"vram": 1 << 30, "expert_slots": 2}, "not both"),
    ({"expert_slots": 2, "policy": "static", "prefetch_distance": 1}, "--policy promoe"),
    ({"expert_slots": 2, "policy": "static", "assign": "ratio"}, "--policy lru or dali"),
    ({"expert_slots": 2, "policy": "lru", "assign": "ratio", "blocking": True}, "without --blocking-loads"),
    ({"assign": "ratio"}, "give --vram or --expert-slots"),
    ({"expert_slots": 2, "profile": "rtx4060-laptop"}, "add --assign"),
    ({"device_prefill": 32}, "--device-prefill runs prefill"),
    ({"expert_slots": 2, "device_prefill_ahead": "routed"}, "add --device-prefill N"),
    ({"expert_slots": 2, "precalc_from": 2, "degrade": 0.8}, "--degrade runs the cache from the routing hook"),
    ({"expert_slots": 2, "policy": "nope"}, "unknown policy"),
    ({"expert_slots": 2, "policy": "static", "blocking": True}, "--policy static loads no miss"),
    ({"expert_slots": 2, "policy": "manual", "blocking": True}, "--policy manual loads no miss"),
    ({"expert_slots": 2, "policy": "lru", "dali_window": 8}, "options of --policy dali"),
    ({"expert_slots": 2, "policy": "promoe", "prefetch_distance": 0}, "--prefetch-distance 0: use >= 1"),
    ({"expert_slots": 2, "policy": "dali", "dali_window": 0}, "--dali-window 0: at least 1"),
])
def test_each_refused_combination_names_what_to_change(given: dict, words: str) -> None:
    """The library's refusal names the API's parameters; the CLI shows it with its flags (`words`)."""
    with pytest.raises(PlacementError) as err:
        cache_request(**given)
    assert "--" not in str(err.value)
    assert re.search(words, as_flags(str(err.value), flag_table(cli))), str(err.value)


def test_a_request_without_budget_is_not_enabled() -> None:
    req = cache_request()
    assert not req.enabled and req.policy == "static"


def test_open_engine_runs_the_requested_cache_and_keeps_stock_tokens() -> None:
    notes: list[str] = []
    with open_engine(MODEL, n_ctx=256) as stock:
        assert stock.experts is None
        want = stock.generate("ROMEO:", max_tokens=8, sampling=GREEDY).tokens
    with open_engine(MODEL, expert_slots=2, policy="lru", n_ctx=256, notify=notes.append) as eng:
        assert eng.experts is not None and type(eng.experts.policy).__name__ == "LruPolicy"
        assert eng.generate("ROMEO:", max_tokens=8, sampling=GREEDY).tokens == want
    assert any(n.startswith("expert cache:") and "policy lru" in n for n in notes), notes


def test_open_engine_parses_a_size_and_refuses_two_ways_of_asking() -> None:
    notes: list[str] = []
    with open_engine(MODEL, vram="64GiB", n_ctx=256, notify=notes.append) as eng:
        assert eng.experts is None  # 64 GiB holds the whole tiny model: stock layout, no cache
    assert any("holds the whole model" in n for n in notes), notes
    with pytest.raises(TypeError, match="not both"):
        open_engine(MODEL, cache=cache_request(expert_slots=2), policy="lru")


def test_open_engine_parses_the_header_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """One open with a --vram budget that leaves a cache reads the GGUF header once: the load config, the engine
    and the expert cache share it."""
    from edgemoe.gguf import header
    from edgemoe.gguf.info import read_model_info
    from edgemoe.plan.reserve import budget_for_slots

    budget = budget_for_slots(read_model_info(MODEL), 2, 256)
    parses: list[Path] = []
    parse = header._parse_header

    def counted(path: Path, cur: object) -> header.GgufHeader:
        parses.append(path)
        return parse(path, cur)  # type: ignore[arg-type]

    monkeypatch.setattr(header, "_parse_header", counted)
    with open_engine(MODEL, vram=budget, policy="lru", n_ctx=256) as eng:
        assert eng.experts is not None and eng.experts.n_slots  # a cache, not the whole model on the GPU
    assert parses == [MODEL]
    # --assign's cost model reads the shape from the same header
    parses.clear()
    req = cache_request(vram=budget, policy="lru", assign="ratio", profile="rtx4060-laptop")
    with open_engine(MODEL, cache=req, n_ctx=256) as eng:
        assert eng.experts is not None
    assert parses == [MODEL]


def test_gating_calibration_defaults_to_the_models(tmp_path: Path) -> None:
    """gating_for: the one place --gating's calibration directory defaults (install_gating, perplexity)."""
    from edgemoe.calibration.adaptive import GatingOptions, default_calibration_dir
    from edgemoe.placement import gating_for

    opts = GatingOptions(mode="score", threshold=0.5)
    assert gating_for(opts, MODEL) == GatingOptions(mode="score", threshold=0.5,
                                                    calibration=default_calibration_dir(MODEL))
    given = GatingOptions(mode="score", threshold=0.5, calibration=tmp_path)
    assert gating_for(given, MODEL) is given


def test_an_engine_refuses_another_files_header() -> None:
    from edgemoe.errors import InvalidConfigError
    from edgemoe.gguf.header import check_gguf
    from edgemoe.runtime.engine import Engine

    other = MODEL.with_name("edgemoe-tiny-mixtral.Q4_K_M.gguf")
    with pytest.raises(InvalidConfigError, match="not .*edgemoe-tiny-qwen3moe"):
        Engine(MODEL, header=check_gguf(other))
