"""The MoE hook against stock llama.cpp: identity, drops, edits, traces, errors."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edgemoe.analysis.verify import (
    FnPolicy,
    _logits,
    _swap_experts_in_file,
    check_drop_last,
    check_identity,
    check_swap,
)
from edgemoe.policies.route import RouteRecord
from edgemoe.runtime import native
from edgemoe.runtime.engine import Engine, LoadConfig
from edgemoe.runtime.sampling import GREEDY

MOE_PRESETS = ["tiny-qwen3moe", "tiny-mixtral", "tiny-qwen2moe", "tiny-deepseek2", "tiny-olmoe"]
TEXT = "ROMEO:\nBut soft, what light through yonder window breaks? The list type is mutable. " * 3


def _tokens(path: Path, n: int = 96) -> list[int]:
    with Engine(path, LoadConfig(n_ctx=256)) as eng:
        return eng.tokenize(TEXT)[:n]


def _all_models(make_tiny_gguf) -> list[Path]:  # type: ignore[no-untyped-def]
    from helpers.models import FIXTURE_MODELS

    return list(FIXTURE_MODELS) + [make_tiny_gguf(p) for p in MOE_PRESETS]


@pytest.mark.parametrize("which", ["fixture-0", "fixture-1", *MOE_PRESETS])
def test_verify_checks(which: str, make_tiny_gguf) -> None:  # type: ignore[no-untyped-def]
    from helpers.models import FIXTURE_MODELS

    path = FIXTURE_MODELS[int(which[-1])] if which.startswith("fixture") else make_tiny_gguf(which)
    toks = _tokens(path)
    base = _logits(path, toks)
    for res in (check_identity(path, toks, base), check_drop_last(path, toks), check_swap(path, toks)):
        assert res.ok, res


def test_swap_in_file_moves_only_stacked_experts(arctic_like_gguf: Path, tmp_path: Path) -> None:
    """verify's GGUF swap exchanges the experts' slices, not entries of arctic's ffn_norm_exps ([n_embd])."""
    import gguf

    out = tmp_path / "swapped.gguf"
    _swap_experts_in_file(arctic_like_gguf, out, 0, 0, 1)
    before = {t.name: np.array(t.data) for t in gguf.GGUFReader(arctic_like_gguf).tensors}
    after = {t.name: np.array(t.data) for t in gguf.GGUFReader(out).tensors}
    for name in ("blk.0.ffn_up_exps.weight", "blk.0.ffn_down_exps.weight"):
        np.testing.assert_array_equal(after[name], before[name][::-1])  # (n_expert, ...): 2 experts
    for name in ("blk.0.ffn_norm_exps.weight", "blk.0.ffn_gate_inp.weight"):
        np.testing.assert_array_equal(after[name], before[name])


def test_hook_called_once_per_moe_layer_per_ubatch(fixture_model: Path) -> None:
    calls: list[tuple[int, int]] = []
    with Engine(fixture_model, LoadConfig(n_ctx=256, n_batch=64, n_ubatch=16)) as eng:
        eng.set_policies([FnPolicy(lambda r: calls.append((r.layer, r.n_tokens)))])
        eng.feed(list(range(40, 80)), all_logits=True)  # 40 tokens -> ubatches of 16, 16, 8
        n_moe = len(eng.info.moe_layers)
    assert [n for _, n in calls] == [16] * n_moe + [16] * n_moe + [8] * n_moe
    assert [il for il, _ in calls[:n_moe]] == list(eng.info.moe_layers)
    # without outputs for a ubatch, the last layer routes no token and the hook is not called for it
    calls.clear()
    with Engine(fixture_model, LoadConfig(n_ctx=256, n_batch=64, n_ubatch=16)) as eng:
        eng.set_policies([FnPolicy(lambda r: calls.append((r.layer, r.n_tokens)))])
        eng.feed(list(range(40, 80)))  # only the very last token's logits
    assert [n for _, n in calls] == [16] * (n_moe - 1) + [16] * (n_moe - 1) + [8] * (n_moe - 1) + [1]


def test_route_record_contents(fixture_model: Path) -> None:
    seen: list[RouteRecord] = []

    class Grab:
        wants_probs = True
        wants_gate_inp = True

        def on_route(self, r: RouteRecord) -> None:
            seen.append(RouteRecord(r.layer, r.ids.copy(), r.weights.copy(), r.probs.copy(), r.gate_inp.copy(),
                                    r.n_expert))

    with Engine(fixture_model, LoadConfig(n_ctx=256)) as eng:
        eng.set_policies([Grab()])
        eng.feed(eng.tokenize(TEXT)[:20], all_logits=True)
        k, n_embd = eng.info.n_expert_used, eng.info.n_embd
    r = seen[0]
    assert r.ids.shape == (20, k) and r.weights.shape == (20, k)
    assert r.probs.shape == (20, r.n_expert) and r.gate_inp.shape == (20, n_embd)
    np.testing.assert_allclose(r.probs.sum(1), 1.0, rtol=1e-5)  # softmax router
    top = np.argsort(-r.probs, axis=1, kind="stable")[:, :k]
    assert (np.sort(top, 1) == np.sort(r.ids, 1)).all()  # ids are the top-k of probs
    np.testing.assert_allclose(r.weights.sum(1), 1.0, rtol=1e-5)  # renormalised top-k


def test_trace_ids_equal_stock_topk(fixture_model: Path) -> None:
    """Read ffn_moe_topk-<il> through llama.cpp's own eval callback (no hook) and compare."""
    from edgemoe.analysis.trace import record_trace

    with Engine(fixture_model, LoadConfig(n_ctx=128, n_batch=128, n_ubatch=128)) as eng:
        toks = eng.tokenize(TEXT)[:64]
        tr = record_trace(eng, toks, ctx=128)

    from helpers.stock import eval_callback_tensors

    flat = eval_callback_tensors(fixture_model, toks, "ffn_moe_argsort-", np.int32)
    stock = {il: a.reshape(len(toks), -1) for il, a in flat.items()}
    k = tr.ids.shape[2]
    for j, il in enumerate(tr.layers):
        assert np.array_equal(tr.ids[:, j, :], stock[int(il)][:, :k]), f"layer {il}"


def test_policy_exception_is_reraised_and_engine_recovers(fixture_model: Path) -> None:
    class Boom(RuntimeError):
        pass

    def explode(r: RouteRecord) -> None:
        if r.layer == 3:
            raise Boom("policy failed in layer 3")

    with Engine(fixture_model, LoadConfig(n_ctx=256)) as eng:
        ref = eng.generate("KING:", max_tokens=8, sampling=GREEDY).tokens
        eng.reset()
        eng.set_policies([FnPolicy(explode)])
        with pytest.raises(Boom, match="layer 3"):
            eng.generate("KING:", max_tokens=8, sampling=GREEDY)
        eng.set_policies(None)
        assert eng.generate("KING:", max_tokens=8, sampling=GREEDY).tokens == ref


def test_invalid_expert_id_aborts_cleanly(fixture_model: Path) -> None:
    def bad(r: RouteRecord) -> None:
        r.ids[0, 0] = r.n_expert + 5

    from edgemoe.errors import EdgeMoeError

    with Engine(fixture_model, LoadConfig(n_ctx=256)) as eng:
        eng.set_policies([FnPolicy(bad)])
        with pytest.raises(EdgeMoeError, match="llama_decode failed"):
            eng.feed([5, 6, 7])


def test_no_hook_means_patch_level_only(fixture_model: Path) -> None:
    # clearing the hook restores the stock graph: logits equal a fresh engine without hook
    toks = _tokens(fixture_model, 32)
    with Engine(fixture_model, LoadConfig(n_ctx=256)) as eng:
        eng.set_policies([FnPolicy(lambda r: None)])
        eng.eval_logits(toks)
        eng.set_policies(None)
        after = np.array(eng.eval_logits(toks))
    assert np.array_equal(after, _logits(fixture_model, toks))
    assert native.patch_level() >= 2


def test_new_hook_is_set_before_the_old_one_is_freed(monkeypatch: pytest.MonkeyPatch) -> None:
    """llama.cpp holds the hook's C function pointer: the chain that owns it must outlive the switch. A chain is
    a reference cycle (its C callback holds its bound method), so a cyclic GC pass at the wrong moment frees it:
    the spy runs one where llama.cpp still holds the old pointer."""
    import gc
    import weakref

    from helpers.models import FIXTURE_MODELS

    with Engine(FIXTURE_MODELS[0], LoadConfig(n_ctx=128)) as eng:
        eng.set_policies([FnPolicy(lambda r: None)])
        old = weakref.ref(eng.routing.hooks)
        alive_at_switch: list[bool] = []
        real = native.moe_set_hook

        def spy(ctx, fn, flags):  # type: ignore[no-untyped-def]
            gc.collect()
            alive_at_switch.append(old() is not None)
            real(ctx, fn, flags)

        monkeypatch.setattr(native, "moe_set_hook", spy)
        eng.set_policies([FnPolicy(lambda r: None)])
        assert alive_at_switch == [True]
        gc.collect()
        assert old() is None  # and freed after it
        toks = eng.tokenize("ROMEO:")
        assert len(eng.generate(toks, max_tokens=2, sampling=GREEDY).tokens) == 2
