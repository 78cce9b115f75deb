"""Speculation with a model's MTP (NextN) heads on tiny-deepseek2-mtp (DeepSeek-V3's layout: q_lora and one MTP
block): the library exports the NextN functions by their C names (patch 0015); greedy output equals plain greedy
with and without the expert cache; the MTP context's K/V follows the target's through rejections, restored states
and new prompts (its proposals equal those of a drafter that saw the same tokens in one batch); the refusals."""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from gguf import GGUFReader

from edgemoe import GREEDY, Engine, LoadConfig
from edgemoe.cli.main import cli
from edgemoe.errors import InvalidConfigError
from edgemoe.gguf.info import read_model_info
from edgemoe.gguf.presets import get_preset
from edgemoe.gguf.synth import write_synthetic
from edgemoe.runtime import native
from edgemoe.runtime.cache_config import CacheConfig, LruConfig
from edgemoe.runtime.mtp import MtpDrafter
from edgemoe.runtime.native import lib
from edgemoe.speculation import SpeculationConfig

MTP = "tiny-deepseek2-mtp"
PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks?\nJULIET:\nO Romeo, Romeo,"


def _greedy(eng: Engine, n: int = 32, prompt: str = PROMPT, **kw) -> list[int]:  # type: ignore[no-untyped-def]
    eng.reset()
    return eng.generate(prompt, max_tokens=n, sampling=GREEDY, ignore_eog=True, **kw).tokens


def test_the_nextn_functions_have_c_names() -> None:
    """Without patch 0015 the library exports them C++-mangled only, and ctypes finds none of them."""
    assert native.has_nextn()


def test_the_preset_keeps_its_mtp_block_after_the_trunk(make_tiny_gguf) -> None:  # type: ignore[no-untyped-def]
    for layers, n_trunk in ((None, 3), (2, 2)):
        path = make_tiny_gguf(MTP, layers=layers)
        info = read_model_info(path)
        assert (info.n_layer, info.n_nextn, info.mtp_heads) == (n_trunk + 1, 1, True)
        assert info.moe_layers == tuple(range(1, n_trunk))  # the dense lead layer and the MTP block left out
        names = {t.name for t in GGUFReader(path).tensors}
        assert f"blk.{n_trunk}.nextn.eh_proj.weight" in names and f"blk.{n_trunk}.ffn_up_exps.weight" in names
        assert info.mtp_bytes > 0 and info.dense_bytes + info.expert_bytes_total + info.mtp_bytes == (
            info.total_tensor_bytes)


@pytest.mark.parametrize("cache", [False, True])
def test_greedy_with_mtp_equals_plain_greedy(make_tiny_gguf, cache: bool) -> None:  # type: ignore[no-untyped-def]
    with Engine(make_tiny_gguf(MTP), LoadConfig(n_ctx=256, load_mtp=True)) as eng:
        if cache:
            eng.enable_expert_cache(CacheConfig(2, policy=LruConfig()))
        want = _greedy(eng)
        eng.set_speculation(SpeculationConfig(mode="mtp", draft_max=4))
        got = _greedy(eng)
        spec = eng.last.speculation if eng.last is not None else None
        assert spec is not None and spec.mode == "mtp" and spec.steps > 0 and spec.drafted > 0
        assert got == want, spec
        assert eng.kv_tokens() == tuple(eng.last.prompt_tokens + got[:-1])
        assert _greedy(eng, speculate=False) == want  # the mirror runs, the output is the same
        if cache:
            assert eng.experts is not None and eng.experts.stats()["misses"] > 0


def _proposals(eng: Engine, context: list[int], n: int = 4) -> list[int]:
    assert eng.speculation is not None
    return eng.speculation.source.propose(context, n)


def test_the_mtp_kv_follows_the_target(make_tiny_gguf) -> None:  # type: ignore[no-untyped-def]
    """Proposals after any history equal those after one prefill of the same tokens: the MTP K/V and the hidden
    row it drafts from are the target's, whatever chunks, rejections and restores led there."""
    path = make_tiny_gguf(MTP, qtype="F32")
    with Engine(path, LoadConfig(n_ctx=256, n_batch=16, n_ubatch=16, load_mtp=True, flash_attn="off")) as eng, Engine(
        path, LoadConfig(n_ctx=256, load_mtp=True, flash_attn="off")
    ) as ref:
        for e in (eng, ref):
            e.set_speculation(SpeculationConfig(mode="mtp", draft_max=4))
        tokens = eng.tokenize(PROMPT)
        gen = _greedy(eng, 20)  # chunks of 16, then verification batches with rejections
        context = eng.last.prompt_tokens + gen if eng.last is not None else []
        ref.prefill(context[:-1])
        want = _proposals(ref, context)
        assert len(want) == 4 and _proposals(eng, context) == want
        assert _proposals(eng, context) == want  # proposing leaves the MTP K/V as it was

        base = context[:-1]
        eng.prefill([*base, 5, 6, 7, 8, 9])  # one batch of 5, then 3 of them dropped (as after a rejection)
        eng.truncate(len(base) + 2)
        short = [*base, 5, 6, 10]
        ref.prefill(short[:-1])
        assert len(want := _proposals(ref, short)) == 4 and _proposals(eng, short) == want

        eng.truncate(len(tokens) + 3)  # past the last batch's hidden rows: no proposal until the next decode
        deep = context[: len(tokens) + 4]
        assert _proposals(eng, deep) == []
        snap = eng.snapshot()
        eng.reset()
        assert _proposals(eng, deep) == []  # nothing mirrored: no proposal, not a wrong one
        eng.prefill(tokens[:5])
        eng.restore(snap)  # the MTP K/V keeps the 5 tokens it shares with the state, then starts again
        assert _proposals(eng, deep) == []
        eng.feed([deep[-1]])
        assert len(_proposals(eng, [*deep, 7])) == 4  # from a partial MTP K/V: proposals again, maybe other ones


def _identity_mtp(src: Path, dst: Path, *, keep: str = "hnorm") -> Path:
    """A copy of an F32 tiny-deepseek2-mtp whose MTP block passes one of its inputs through: eh_proj is [I | I]
    and the other input's norm is zeroed (keep "hnorm": the hidden state, "enorm": the token's embedding);
    attention and FFN outputs are zeroed. With the hidden state kept, its logits at position p are the trunk's at
    the position of the hidden row it was given; with the embedding, output(norm(embedding of the token))."""
    shutil.copy(src, dst)
    reader = GGUFReader(dst, "r+")
    il = read_model_info(dst).n_layer - 1
    for t in reader.tensors:
        if not t.name.startswith(f"blk.{il}."):
            continue
        data = t.data
        zeroed = ("attn_output", "ffn_down_exps", "ffn_down_shexp", "hnorm" if keep == "enorm" else "enorm")
        if t.name.removesuffix(".weight").endswith(zeroed):
            data[...] = 0.0
        elif t.name.endswith("eh_proj.weight"):  # (n_embd, 2 n_embd) in numpy order: [I | I]
            n = data.shape[0]
            data[...] = np.hstack([np.eye(n), np.eye(n)])
    del reader
    return dst


def test_each_position_pairs_with_the_previous_hidden_state(make_tiny_gguf, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The MTP input at position p is (token p, the trunk's hidden state at p - 1), in the mirror and in the
    drafts: with a pass-through MTP block its logits at p equal the trunk's at p - 1, and the first proposal after
    a greedy token is that token again."""
    path = _identity_mtp(make_tiny_gguf(MTP, qtype="F32"), tmp_path / "identity-mtp.gguf")
    with Engine(path, LoadConfig(n_ctx=128, load_mtp=True)) as eng:
        spec = eng.set_speculation(SpeculationConfig(mode="mtp", draft_max=3))
        assert spec is not None and isinstance(spec.source, MtpDrafter)
        drafter = spec.source
        tokens = eng.tokenize(PROMPT)[:12]
        mirror_logits: list[np.ndarray] = []
        decode = drafter._decode

        def with_logits(toks, start, h, *, last_logits):  # type: ignore[no-untyped-def]
            ok = decode(toks, start, h, last_logits=True)
            row = lib.llama_get_logits_ith(drafter.ctx, -1)
            mirror_logits.append(np.ctypeslib.as_array(row, shape=(eng.n_vocab,)).copy())
            return ok

        drafter._decode = with_logits  # type: ignore[method-assign]
        eng.feed(tokens, all_logits=True)
        trunk = [np.ctypeslib.as_array(eng.logits(i)).copy() for i in range(len(tokens))]
        mtp = mirror_logits[-1]  # the mirror's last position, len(tokens) - 1
        np.testing.assert_allclose(mtp, trunk[-2], rtol=1e-3, atol=1e-3)
        assert np.abs(mtp - trunk[-1]).max() > 0.1  # the power: the same position's hidden state differs
        drafter._decode = decode  # type: ignore[method-assign]
        nxt = int(np.argmax(trunk[-1]))
        assert drafter.propose([*tokens, nxt], 3) == [nxt] * 3


def test_each_position_reads_its_own_token(make_tiny_gguf, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """With a pass-through of the token's embedding, the MTP logits are output(norm(norm(embedding))) of the token
    at that position (computed here in numpy from the file): in the mirror and in every draft step."""
    path = _identity_mtp(make_tiny_gguf(MTP, qtype="F32"), tmp_path / "embedding-mtp.gguf", keep="enorm")
    weights = {t.name: np.asarray(t.data) for t in GGUFReader(path).tensors}
    embd, out = weights["token_embd.weight"], weights["output.weight"]

    def expected(tok: int) -> np.ndarray:
        e = embd[tok].astype(np.float64)
        for _ in range(2):  # enorm, then shared_head_norm (weights 1)
            e = e / np.sqrt(np.mean(e * e) + 1e-6)
        return out @ e

    with Engine(path, LoadConfig(n_ctx=128, load_mtp=True)) as eng:
        spec = eng.set_speculation(SpeculationConfig(mode="mtp", draft_max=3))
        assert spec is not None and isinstance(spec.source, MtpDrafter)
        tokens = eng.tokenize(PROMPT)[:12]
        eng.feed(tokens)
        nxt = 11
        got = spec.source.propose([*tokens, nxt], 3)
        chain = [int(np.argmax(expected(nxt)))]
        for _ in range(2):
            chain.append(int(np.argmax(expected(chain[-1]))))
        assert got == chain and len(set(chain)) > 1


def test_refusals(make_tiny_gguf, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidConfigError, match="carries no MTP heads"):
        Engine(make_tiny_gguf("tiny-deepseek2"), LoadConfig(load_mtp=True))
    preset = get_preset(MTP)
    assert preset.mla is not None
    no_q_lora = dataclasses.replace(preset, mla=dataclasses.replace(preset.mla, q_lora_rank=0))
    path = write_synthetic(no_q_lora, tmp_path / "no-q-lora.gguf", progress=False)
    with pytest.raises(InvalidConfigError, match="q_lora_rank"):  # llama.cpp would abort in an assert
        Engine(path, LoadConfig(load_mtp=True))
    with Engine(make_tiny_gguf(MTP), LoadConfig(n_ctx=128)) as eng:  # loaded without them
        with pytest.raises(InvalidConfigError, match="load_mtp=True"):
            eng.set_speculation(SpeculationConfig(mode="mtp"))
        assert eng.generate(PROMPT, max_tokens=4, sampling=GREEDY).tokens  # the trunk runs without them


def test_the_drafter_is_a_draft_source(make_tiny_gguf) -> None:  # type: ignore[no-untyped-def]
    with Engine(make_tiny_gguf(MTP), LoadConfig(n_ctx=128, load_mtp=True)) as eng:
        spec = eng.set_speculation(SpeculationConfig(mode="mtp", draft_max=3))
        assert spec is not None and isinstance(spec.source, MtpDrafter) and spec.source.name == "mtp"
        eng.prefill(eng.tokenize(PROMPT))
        tok = int(np.argmax(np.ctypeslib.as_array(eng.logits(-1))))
        assert len(spec.source.propose([*eng.kv_tokens(), tok], 3)) == 3
        assert spec.source.propose([*eng.kv_tokens(), tok, tok], 3) == []  # out of step with the target
        eng.set_speculation(None)
        assert _greedy(eng, 4)  # the mirror is gone with the drafter


def test_generate_and_bench_run_mtp(make_tiny_gguf) -> None:  # type: ignore[no-untyped-def]
    model = str(make_tiny_gguf(MTP))

    def generate(*extra: str) -> dict:
        res = CliRunner().invoke(cli, ["generate", model, "-p", PROMPT, "-n", "16", "--temp", "0", "-t", "1",
                                       "--json", *extra])
        assert res.exit_code == 0, res.output
        return json.loads(res.stdout.strip().splitlines()[-1])

    plain, mtp = generate(), generate("--speculate", "mtp", "--draft-max", "3")
    assert mtp["tokens"] == plain["tokens"] and mtp["speculation"]["mode"] == "mtp"
    assert mtp["speculation"]["steps"] > 0 and mtp["speculation"]["drafted"] > 0
    res = CliRunner().invoke(cli, ["bench", model, "--vram", "518MiB", "--prompt-tokens", "32", "--gen-tokens", "8",
                                   "-t", "1", "--policy", "lru", "--speculate", "mtp", "--profile", "none", "--json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout[res.stdout.index("{"):])["rows"]
    spec = [r for r in rows if r["speculation"] is not None]
    assert len(spec) == 2 and all(r["name"].endswith(" +mtp") and r["decode_tps"] > 0 for r in spec)
    # the +mtp cache row is planned beside the heads: the slots their bytes leave
    lru, lru_mtp = (next(r for r in rows if r["name"] == n) for n in ("edgemoe lru", "edgemoe lru +mtp"))
    assert "beside the MTP heads" in lru_mtp["note"]
    per = [set(r["cache"]["slots_per_layer"].values()) for r in (lru, lru_mtp)]
    assert max(per[1]) < max(per[0]), per


def test_mtp_with_the_cache_on_the_rpc_device(make_tiny_gguf, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from helpers.rpc_child import run_child

    out = run_child("rpc_mtp_check.py", make_tiny_gguf(MTP), tmp_path)
    assert out["device"].startswith("RPC"), out
    assert out["equal"] and out["stats"]["drafted"] > 0, out["stats"]
    assert out["cache"]["hits"] > 0 and out["cache"]["misses"] > 0, out["cache"]
    checks = out["ids_check"]
    assert checks["n_rows"] > 0 and checks["n_negative"] == checks["n_range"] == checks["n_repeat"] == 0, checks


def test_mtp_across_context_tiers(make_tiny_gguf) -> None:  # type: ignore[no-untyped-def]
    """A context re-created at a larger step keeps handing its hidden rows to the MTP context (attach), and the
    MTP K/V is kept across the resize: the output equals plain greedy and proposals go on after each resize."""
    from edgemoe.runtime.context_tiers import ContextTier, ContextTiers

    path = make_tiny_gguf(MTP)
    cfg = LoadConfig(n_ctx=512, n_batch=64, n_ubatch=64, load_mtp=True)
    with Engine(path, cfg) as eng:
        n_expert = eng.info.n_expert
        eng.enable_expert_cache(CacheConfig(n_expert // 2, policy=LruConfig()))
        want = _greedy(eng, 200)
    with Engine(path, cfg) as eng:
        eng.enable_expert_cache(CacheConfig(n_expert // 2, policy=LruConfig()))
        tiers = eng.set_context_tiers(ContextTiers((ContextTier(128, n_expert * 3 // 4), ContextTier(512, n_expert // 2))))
        assert tiers is not None
        eng.set_speculation(SpeculationConfig(mode="mtp", draft_max=4))
        got = _greedy(eng, 200)
        assert [r.to_ctx for r in tiers.resizes][-1] == 512
        spec = eng.last.speculation if eng.last is not None else None
        assert got == want and spec is not None
        # proposals after the resize (the prompt is 22 tokens, the resize comes at 128): about one per step
        assert spec.drafted > spec.steps // 2, spec


def test_the_plan_keeps_the_mtp_heads_out_of_the_slots(make_tiny_gguf) -> None:  # type: ignore[no-untyped-def]
    """With `load_mtp` the budget keeps the MTP heads' weights (but their routed experts), their compute buffer and
    KV cache out of the slots; open_engine plans that way for `mtp` speculation and says so."""
    from edgemoe import open_engine
    from edgemoe.gguf.header import check_gguf
    from edgemoe.plan.planner import Device, plan
    from edgemoe.plan.request import cache_request
    from edgemoe.plan.reserve import mtp_reserve_bytes

    path = make_tiny_gguf(MTP)
    header = check_gguf(path)
    info = read_model_info(path)
    assert 0 < info.mtp_dense_bytes < info.mtp_bytes  # its routed experts are the rest
    vram = info.dense_bytes + 6 * info.slot_bytes + (600 << 20)
    req = cache_request(vram=vram, policy="lru")
    plain = plan(header, req, n_ctx=256, device=Device("CUDA0"))
    mtp = plan(header, req, n_ctx=256, device=Device("CUDA0"), load_mtp=True)
    extra = mtp_reserve_bytes(info, 256, 256, flash_attn=True)
    assert mtp.load.load_mtp and not plain.load.load_mtp and extra > info.mtp_dense_bytes
    assert mtp.reserve_bytes - plain.reserve_bytes == extra
    assert plain.budget is not None and mtp.budget is not None
    assert plain.budget.expert_budget_bytes - mtp.budget.expert_budget_bytes == extra
    assert any("MTP heads take" in n for n in mtp.notes) and not any("MTP" in n for n in plain.notes)
    notes: list[str] = []
    with open_engine(path, vram=vram, n_ctx=256, speculation=SpeculationConfig(mode="mtp"), notify=notes.append) as eng:
        assert eng.config.load_mtp and eng.speculation is not None and eng.speculation.source.name == "mtp"
    assert any("MTP heads take" in n for n in notes)


def test_an_mtp_context_that_cannot_be_made_is_a_typed_error(make_tiny_gguf, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    from edgemoe.errors import EdgeMoeError
    from edgemoe.runtime import mtp

    with Engine(make_tiny_gguf(MTP), LoadConfig(n_ctx=128, load_mtp=True)) as eng:
        made = lib.llama_init_from_model
        monkeypatch.setattr(mtp.lib, "llama_init_from_model", lambda *a: None)  # as when the buffers do not fit
        with pytest.raises(EdgeMoeError, match="could not create the MTP context.*`n_ubatch`"):
            eng.set_speculation(SpeculationConfig(mode="mtp"))
        monkeypatch.setattr(mtp.lib, "llama_init_from_model", made)
        assert eng.speculation is None and eng.generate(PROMPT, max_tokens=4, sampling=GREEDY).tokens


def test_inspect_names_the_mtp_heads(make_tiny_gguf) -> None:  # type: ignore[no-untyped-def]
    out = CliRunner().invoke(cli, ["inspect", str(make_tiny_gguf(MTP))])
    assert out.exit_code == 0, out.output
    assert "MTP heads    1 block(s) after the trunk's 3 layers" in out.output and "`mtp`" in out.output
    plain = CliRunner().invoke(cli, ["inspect", str(make_tiny_gguf("tiny-deepseek2"))])
    assert plain.exit_code == 0 and "MTP" not in plain.output


def test_the_drafter_holds_hidden_rows_and_kv_of_kept_tokens_only(make_tiny_gguf) -> None:  # type: ignore[no-untyped-def]
    """A truncation cuts the hidden rows too (a row of a dropped token never pairs with a later one), and after a
    gap the MTP K/V is kept by position: restoring the state it mirrors keeps it, and proposals go on."""
    with Engine(make_tiny_gguf(MTP), LoadConfig(n_ctx=256, load_mtp=True)) as eng:
        spec = eng.set_speculation(SpeculationConfig(mode="mtp", draft_max=4))
        assert spec is not None and isinstance(spec.source, MtpDrafter)
        drafter = spec.source
        prompt = eng.tokenize(PROMPT)
        p = len(prompt)
        eng.prefill(prompt)
        eng.prefill([*prompt, 5, 6, 7, 8, 9])  # one decode of the five
        eng.truncate(p + 2)
        assert drafter.hidden(p + 1) is not None and drafter.hidden(p + 2) is None
        snap = eng.snapshot()  # prompt + [5, 6]
        eng.reset()
        eng.prefill(prompt[:5])
        eng.restore(snap)  # the mirror keeps the 5 tokens it shares, then a gap
        eng.feed([10])  # mirrored from position p + 2 on
        assert (drafter.first, drafter.next_pos) == (p + 2, p + 3)
        live = eng.snapshot()
        eng.restore(live)  # the same tokens: the MTP K/V after the gap is kept
        assert (drafter.first, drafter.next_pos) == (p + 2, p + 3)
        assert len(drafter.propose([*live.tokens, 11], 4)) == 4
