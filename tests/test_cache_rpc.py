"""The expert cache on a device that is not the CPU: llama.cpp's RPC backend on loopback (no GPU needed).

Runs tests/helpers/rpc_cache_check.py in a subprocess, because a registered RPC device is seen by every model
loaded afterwards in the process.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.models import FIXTURE_MODELS
from helpers.rpc_child import run_child

HERE = Path(__file__).resolve().parent
HELPERS = HERE / "helpers"  # the scripts run in processes of their own
sys.path.insert(0, str(HERE.parent / "tools"))
import arch_models  # noqa: E402


def holds(check: dict, mode: str) -> bool:
    """The id-row checker's counts keep the mode's contract: no id past the last row and no repeat; fill also no -1."""
    return check["n_range"] == check["n_repeat"] == 0 and (mode == "raw" or check["n_negative"] == 0)


# architectures whose graph never routes through build_moe_ffn: nothing is cached, nothing overlaps
NO_MOE_GRAPH = {"refact": "llama.cpp's refact graph (src/models/refact.cpp) runs a dense FFN, never build_moe_ffn"}


def test_cache_on_rpc_device_equals_stock(tmp_path: Path) -> None:
    for path in FIXTURE_MODELS:
        out = run_child("rpc_cache_check.py", path, tmp_path)
        assert out["device"].startswith("RPC"), out
        assert out["sync_loads_equal"], (path.name, out)
        assert out["async_loads_equal"], (path.name, out)
        assert out["lru_generate_equal"], (path.name, out)
        # speculation's verification batches through the cache on the device: the same greedy tokens
        assert out["lookup_generate_equal"] and out["lookup_stats"]["drafted"] > 0, (path.name, out["lookup_stats"])
        # the CLI's GPU layout: all layers on the device, routed experts in CPU memory, cache on the device
        assert out["gpu_layout_equal"] and out["gpu_layout_nmse_vs_cpu"] < 1e-9, (path.name, out)
        for key in ("sync_stats", "async_stats", "lru_stats", "gpu_layout_stats"):
            assert out[key]["hits"] > 0 and out[key]["misses"] > 0, (key, out[key])
        assert out["async_stats"]["chunks"] > out["async_stats"]["loads"] > 0  # some copies were left unfinished
        # the native LRU's loads on the device: queued by the host, waited for by the compute stream
        assert out["lru_stats"]["issue_s"] > 0 and 0 < out["lru_stats"]["load_waits"] <= out["lru_stats"]["loads"]
        # overlap: one device split per cached layer and ubatch runs on while the CPU computes, none without
        # it; no host sync, the same logits either way
        for layout in ("standin", "gpu_layout"):
            on, off = out[f"overlap_{layout}_True"], out[f"overlap_{layout}_False"]
            assert on["equal"] and off["equal"], (path.name, layout, on, off)
            assert on["n_overlap"] == on["n_ubatch"] * out["n_moe_layers"], (path.name, layout, on)
            assert off["n_overlap"] == 0, (path.name, layout, off)
            assert on["n_host_syncs"] == 0 == off["n_host_syncs"], (path.name, layout, on, off)
        # the load worker: with it every chunk of the native LRU is issued by llama.cpp's worker thread,
        # without it none; the same logits, no host sync either way
        on, off = out["worker_True"], out["worker_False"]
        assert on["equal"] and off["equal"], (path.name, on, off)
        assert on["chunks"] == on["worker_chunks"] > 0 and off["worker_chunks"] == 0 < off["chunks"], (on, off)
        # the policy on the load worker: the worker ran the LRU on routes while the caller paused (the caller runs the rest: every ubatch's
        # routes are processed once, as the same hit and miss total shows) and timed every wait of the compute
        assert on["worker_policy_steps"] > 0 == off["worker_policy_steps"], (on, off)
        assert on["hits"] + on["misses"] == off["hits"] + off["misses"], (on, off)
        assert on["load_waits_timed"] == on["load_waits"] > 0 and on["load_wait_s"] is not None, on
        assert off["load_waits_timed"] == 0 and off["load_wait_s"] is None, off
        assert on["n_host_syncs"] == 0 == off["n_host_syncs"], (on, off)
        # by default not on the RPC device, whose one connection carries copies and graph runs in one FIFO
        assert out["lru_stats"]["worker_chunks"] == 0 < out["lru_stats"]["chunks"], out["lru_stats"]
        # staging (staging buffers): none where the device has no host buffer type, every chunk through one when forced
        assert out["staging_0"]["equal"] and out["staging_0"]["staged_chunks"] == 0, out["staging_0"]
        for n in (1, 4):
            st = out[f"staging_{n}"]
            assert st["equal"] and st["staged_chunks"] == st["chunks"] > 0, (n, st)
        churn = out["worker_churn"]
        assert churn["equal"] and churn["states"] == ["absent", "resident"], churn
        assert churn["worker_chunks"] > 0 and churn["preempted"] > 0 and churn["staged_chunks"] > 0, churn
        # native promoe on the device (predicted prefetch): stock logits, predictions queued and used, no Python hook (the
        # context's own callback stops at each cached layer), the worker issuing the chunks when on
        for async_loads in (True, False):
            pm = out[f"promoe_worker_{async_loads}"]
            assert pm["equal"] and not pm["hook"] and pm["n_host_syncs"] > 0, (path.name, async_loads, pm)
            assert pm["prefetch"]["path"] == "native" and pm["prefetch"]["issued"] > 0 < pm["hits"], pm
            assert (pm["worker_chunks"] > 0) == async_loads, pm
            # the scheduler overlap: the scheduler hands the CPU its inputs after the callback's stop and runs the device's experts
            # beside the CPU's, at every cached layer of every ubatch (the last layer's too: it routes its outputs)
            assert pm["n_overlap"] == pm["n_ubatch"] * out["n_moe_layers"], pm
        off = out["promoe_no_overlap"]
        assert off["equal"] and off["n_overlap"] == 0, off
        # prefill on the device: stock logits; the prompt's ubatch (48 tokens) stops at each cached layer and
        # runs its other experts on the device (its only CPU split is the fill of the device's skipped ids, which the
        # device's remaining routing work overlaps), the 8 decode tokens as before
        n_moe = out["n_moe_layers"]
        for key in ("prefill_all_True", "prefill_all_False", "prefill_routed_True"):
            pf = out[key]
            st = pf["prefill"]
            assert pf["equal"], (path.name, key, pf)
            assert pf["n_host_syncs"] == n_moe and pf["n_overlap"] == (1 + 8) * n_moe, (key, pf)
            assert st["ubatches"] == 1 and st["layers"] == n_moe and st["needed"] > 0 and st["bytes"] > 0, (key, st)
            assert st["needed"] == st["ahead_used"] + st["late"], (key, st)
            if key.startswith("prefill_all"):  # everything outside the slots was copied ahead: the prompt's first
                assert st["late"] == 0 and st["ahead"] >= st["needed"], (key, st)  # ubatch finds no expert resident
            else:
                assert st["ahead"] == 0 and st["late"] == st["needed"], (key, st)
        st = out["prefill_promoe_predicted"]["prefill"]
        assert out["prefill_promoe_predicted"]["equal"] and st["needed"] == st["ahead_used"] + st["late"] > 0, st
        # at most all (a 48-token ubatch's predictions name nearly every expert of these small layers)
        assert 0 < st["ahead"] <= out["prefill_all_True"]["prefill"]["ahead"], st
        # pre-calculation with the cache on the device: the CPU stand-in's logits (layers on the device here, on
        # the CPU there) and the same experts taken early in the 8 decode steps
        pc = out["precalc"]
        dev_st = {k: v for k, v in pc["stats_device"].items() if k != "n_overlap"}
        assert pc["nmse"] < 1e-9 and dev_st == {k: v for k, v in pc["stats_standin"].items() if k != "n_overlap"}, pc
        assert dev_st["layers"] == 8 * (n_moe - 2) and dev_st["used"] > 0, (path.name, pc)
        # the early experts' CPU split runs while the device computes the target layer's attention and routing: one
        # more overlapped split per target layer and decode step
        assert pc["stats_device"]["n_overlap"] == pc["n_overlap_without"] + 8 * (n_moe - 2), (path.name, pc)
        # gating in the graph on both branches of the overlapped layers: the gated logits without a cache
        g = out["gated_overlap_stats"]
        assert out["gated_overlap_equal"] and g["n_dropped"] > 0 and g["n_overlap"] > 0, (path.name, g)
        # bench on a device: the best --n-cpu-moe for about 3 layers of experts leaves 5 of 8 on the CPU
        assert out["bench_n_cpu_moe"] == 5
        assert [r[0] for r in out["bench_rows"]] == ["stock -ot exps=CPU", "stock --n-cpu-moe 5", "edgemoe lru",
                                                     "edgemoe lru no-overlap"]  # --compare-overlap
        assert all(ok for _, ok, _ in out["bench_rows"]), out["bench_rows"]


@pytest.mark.parametrize("mode", ["fill", "raw"])
def test_every_cache_path_hands_the_device_the_ids_of_its_mode(tmp_path: Path, mode: str) -> None:
    """rpc_cache_check.py once more with the id-row checker on in every engine (EDGEMOE_CHECK_IDS=1, tests/
    test_ids_check.py), in each id-row mode: manual loads, lru, the CLI's GPU layout, staging, ProMoE's predictor
    and prefetch, device prefill, pre-calculation and gating in the graph hand the RPC device only valid, distinct
    ids (raw: and -1 where skipped), and every run still equals its reference (the checker stops the graph at every
    device MUL_MAT_ID, so the counts of host syncs and overlapped splits are left to the test above)."""
    path = FIXTURE_MODELS[0]
    result = tmp_path / "checked.json"
    proc = subprocess.run([sys.executable, str(HELPERS / "rpc_cache_check.py"), str(path), str(result)],
                          capture_output=True, text=True, timeout=900, cwd=HERE,
                          env={**os.environ, "EDGEMOE_CHECK_IDS": "1", "EDGEMOE_DEVICE_IDS": mode})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(result.read_text())
    ids = out["ids_check"]
    assert ids["n_nodes"] > 0 and ids["n_rows"] > 0, ids
    assert holds(ids, mode) and (ids["n_negative"] > 0) == (mode == "raw"), ids
    equal = {k: v for k, v in out.items() if k.endswith("_equal")}
    equal |= {k: v["equal"] for k, v in out.items() if isinstance(v, dict) and "equal" in v}
    assert len(equal) > 10 and all(equal.values()), equal
    assert out["precalc"]["nmse"] < 1e-9, out["precalc"]

@pytest.mark.long  # a minute and more on 2 cores; borrowing on the CPU stays in the default suite
def test_borrowed_slots_on_rpc_device_equal_stock(tmp_path: Path) -> None:
    """Device prefill whose buffers borrow the slots (tests/test_device_prefill_borrow.py) on the RPC device,
    ubatches of 512, 1024 and 2048 tokens, the CLI's GPU layout: a session of two prompts over several ubatches,
    decode, a cut KV cache and a restored snapshot == stock bitwise, with and without the id-row checker (no
    device reads a lent slot's bytes as an expert: every id row valid and distinct), lent and refilled twice."""
    for path in FIXTURE_MODELS:
        out = run_child("rpc_borrow_check.py", path, tmp_path, timeout=900)
        assert out["device"].startswith("RPC"), out
        for n_ubatch in ("512", "1024", "2048"):
            r = out[n_ubatch]
            assert r["equal_plain"] and r["equal_checked"], (path.name, n_ubatch, r)
            ids = r["ids_check"]
            assert ids["n_nodes"] > 0 and ids["n_negative"] == ids["n_range"] == ids["n_repeat"] == 0, ids
            b = r["prefill"]["borrow"]
            assert b["lends"] == 2 and b["refilled"] > 0 and b["evicted"] > 0 and b["refused"] > 0, (n_ubatch, b)
            assert r["prefill"]["ubatches"] == 5 and r["prefill"]["late"] == 0, r["prefill"]


@pytest.mark.long  # every MoE architecture, both modes: minutes (`make test-long`)
@pytest.mark.parametrize("mode", ["fill", "raw"])
def test_overlap_on_every_moe_architecture(tmp_path: Path, mode: str) -> None:
    """The CPU/GPU overlap on each architecture's random-weight model (test-llama-archs' writer), cache on the RPC
    device: logits bitwise = stock with overlap on and off, an overlapped device split at least for every
    cached layer and ubatch when on (deepseek4 has more device-to-CPU hand-overs), none when off. In both id-row
    modes (EDGEMOE_DEVICE_IDS): the device's skipped ids filled and masked, or handed over as -1."""
    try:
        manifest = arch_models.ensure()
    except Exception as err:  # noqa: BLE001 - the sweep's own test reports a failed build
        pytest.skip(f"no random-weight models: {type(err).__name__}: {err}")
    paths = [str(arch_models.DEFAULT_OUT / e["file"]) for e in arch_models.moe_entries(manifest)]
    result = tmp_path / "overlap.json"
    proc = subprocess.run([sys.executable, str(HELPERS / "rpc_overlap_archs.py"), str(result), *paths],
                          capture_output=True, text=True, timeout=900, cwd=HERE,
                          env={**os.environ, "EDGEMOE_DEVICE_IDS": mode})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(result.read_text())
    assert len(out) == len(paths) > 40
    for name, r in out.items():
        assert "error" not in r, (name, r)
        assert r["equal_on"] and r["equal_off"] and r["n_overlap_off"] == 0, (name, r)
        assert r["equal_prefill"], (name, r)  # device prefill: the prompt's other experts from the prefill buffers
        # every id row handed to the device as its mode promises (tests/test_ids_check.py): no id past the last row,
        # no repeat, and with fill no -1
        ids = r["ids_check"]
        assert r["equal_checked"] and holds(ids, mode), (name, ids)
        # the prefill buffers borrowing the slots: bitwise, valid ids, lent and refilled at each prompt; a model
        # with one cached layer has too few slots to lend
        if r["equal_borrow"] is None:
            assert r["n_moe_layers"] < 2 and "prefill_borrow" in r["borrow_refused"], (name, r)
        else:
            bc, b = r["borrow_ids_check"], r["borrow"]
            assert r["equal_borrow"] and holds(bc, mode), (name, r)
            assert b["lends"] == 2 and (b["refilled"] > 0 or name.removesuffix(".gguf") in NO_MOE_GRAPH), (name, b)
        if name.removesuffix(".gguf") in NO_MOE_GRAPH:
            assert r["n_overlap_on"] == 0 == r["prefill_layers"], (name, r)
        else:
            assert r["n_overlap_on"] >= r["n_ubatch"] * r["n_moe_layers"], (name, r)
            assert r["prefill_layers"] > 0 and ids["n_nodes"] > 0, (name, r)
