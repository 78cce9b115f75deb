"""The weight rule each architecture's MoE layers apply, as llama.cpp reports it through the route."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from edgemoe.analysis.rules import describe_rules, routing_rules
from edgemoe.cli import cli

# llama.cpp's build_moe_ffn arguments per architecture (src/models/*.cpp)
EXPECTED = {
    "tiny-qwen3moe": "norm",  # norm_w = true
    "tiny-mixtral": "norm",  # llama with experts: norm_w = true
    "tiny-qwen2moe": "as_is",  # norm_w = false
    "tiny-olmoe": "as_is",  # norm_w = false
    "tiny-deepseek2": "as_is",  # expert_weights_norm false in the synthetic metadata (V2-Lite)
    "tiny-gpt-oss": "softmax",  # softmax over the selected logits
}


@pytest.mark.parametrize("preset", sorted(EXPECTED))
def test_every_layer_reports_its_architectures_rule(make_tiny_gguf, preset: str) -> None:  # type: ignore[no-untyped-def]
    rules = routing_rules(make_tiny_gguf(preset))
    assert rules, "no MoE layer routed"
    assert {r.rule for r in rules.values()} == {EXPECTED[preset]}
    assert all(r.scale == 1.0 for r in rules.values())
    assert describe_rules(rules).startswith(EXPECTED[preset])


def test_inspect_shows_the_weight_rule(make_tiny_gguf) -> None:  # type: ignore[no-untyped-def]
    path = str(make_tiny_gguf("tiny-gpt-oss"))
    res = CliRunner().invoke(cli, ["inspect", path])
    assert res.exit_code == 0, res.output
    assert "weights      softmax, scale 1 (2 layers)" in res.output
    d = json.loads(CliRunner().invoke(cli, ["inspect", path, "--json"]).output)
    assert d["weight_rules"]["0"] == {"rule": "softmax", "scale": 1.0}
