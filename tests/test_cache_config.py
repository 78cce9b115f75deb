"""The expert cache's config records (edgemoe.runtime.cache_config): one per policy, built from a name by
policy_config, with the rules that refuse a combination; no model, no native library."""
from __future__ import annotations

from pathlib import Path

import pytest

from edgemoe.errors import InvalidConfigError
from edgemoe.policies.registry import policy_names, policy_spec
from edgemoe.runtime.cache_config import (
    CacheConfig,
    DaliConfig,
    DaopConfig,
    LruConfig,
    ManualConfig,
    PromoeConfig,
    StaticConfig,
    calibrated_config,
    policy_config,
    policy_options,
)


def test_every_policy_has_one_config_record() -> None:
    assert set(policy_names()) >= {"static", "lru", "dali", "daop", "manual", "promoe"}
    for name in policy_names():
        cls = policy_spec(name).config
        assert cls.name == name and isinstance(policy_config(name), cls)


def test_policy_config_sets_the_policys_options() -> None:
    assert policy_config("dali", window=8, update=2) == DaliConfig(window=8, update=2)
    assert policy_config("daop", threshold=2.0).threshold == 2.0
    assert policy_config("promoe", distance=1, weights="f32") == PromoeConfig(distance=1, weights="f32")
    assert policy_options("manual") == ()
    assert "assign" in policy_options("lru") and "assign" not in policy_options("static")


def test_policy_config_refuses_unknown_names_and_options() -> None:
    with pytest.raises(InvalidConfigError, match="unknown cache policy 'fifo': use one of static, lru"):
        policy_config("fifo")
    with pytest.raises(InvalidConfigError, match="the lru policy has no option 'window'"):
        policy_config("lru", window=4)
    with pytest.raises(InvalidConfigError, match="manual policy has no option 'blocking' \\(it has none\\)"):
        policy_config("manual", blocking=True)


def test_calibrated_config_gives_the_calibration_where_it_is_read(tmp_path: Path) -> None:
    assert calibrated_config("static", tmp_path) == StaticConfig(calibration=tmp_path)
    assert calibrated_config("daop", tmp_path, blocking=True) == DaopConfig(calibration=tmp_path, blocking=True)
    assert calibrated_config("lru", tmp_path, blocking=True) == LruConfig(blocking=True)
    assert calibrated_config("manual", tmp_path) == ManualConfig()


def test_the_records_refuse_what_their_policy_cannot_run() -> None:
    with pytest.raises(InvalidConfigError, match="`assign` is an option of `policy='lru'` or dali without"):
        LruConfig(blocking=True, assign="ratio")
    with pytest.raises(InvalidConfigError, match="`assign` is an option"):
        DaliConfig(prefetch=2, assign="ratio")
    with pytest.raises(InvalidConfigError, match="`dali_prefetch` is an option of `policy='dali'` without"):
        DaliConfig(prefetch=2, blocking=True)
    with pytest.raises(InvalidConfigError, match="`prefetch_distance=0`: use >= 1"):
        PromoeConfig(distance=0)
    assert DaliConfig(blocking=True).prefetch == 0 and LruConfig(assign="greedy").assign == "greedy"


def test_a_prefetcher_runs_promoe_and_dali_with_a_prefetch_size() -> None:
    assert CacheConfig(4).policy == LruConfig() and not CacheConfig(4).prefetcher
    assert CacheConfig(4, policy=PromoeConfig()).prefetcher
    assert CacheConfig(4, policy=DaliConfig(prefetch=1)).prefetcher and not CacheConfig(4, policy=DaliConfig()).prefetcher
