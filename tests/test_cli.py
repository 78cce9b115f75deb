"""CLI behaviour with click's CliRunner, bad inputs included."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import pytest
from click.testing import CliRunner

from edgemoe.cli import cli

from helpers.models import FIXTURE_MODELS
from helpers.stock import stock_greedy

MODEL = FIXTURE_MODELS[0]


def run(*args: str, input: str | None = None):  # type: ignore[no-untyped-def]
    return CliRunner().invoke(cli, list(args), input=input, catch_exceptions=False)


def test_version_and_help() -> None:
    assert run("--version").output.startswith("edgemoe, version")
    out = run("--help").output
    for cmd in ("inspect", "generate", "chat"):
        assert cmd in out


def test_inspect_json_matches_gguf(fixture_model: Path) -> None:
    res = run("inspect", str(fixture_model), "--json", "--vram", "4MiB")
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)
    r = gguf.GGUFReader(str(fixture_model))
    total = sum(int(t.n_bytes) for t in r.tensors)
    experts = sum(int(t.n_bytes) for t in r.tensors if "_exps" in t.name)
    assert d["expert_bytes_total"] == experts
    assert d["dense_bytes"] == total - experts
    assert d["architecture"] in ("qwen3moe", "llama")
    assert d["n_layer"] == 8 and d["n_expert"] >= 8 and d["n_expert_used"] >= 2
    assert d["vram_plan"]["budget_bytes"] == 4 * 2**20


def test_inspect_text(fixture_model: Path) -> None:
    res = run("inspect", str(fixture_model), "--vram", "520MiB")
    assert res.exit_code == 0
    assert "MoE layers   8" in res.output and "vram 520.0 MiB" in res.output
    assert "512.0 MiB compute reserve" in res.output  # as generate/chat --vram plan it
    assert "experts per layer" in res.output  # ctx defaults to the model's 512: experts fit
    assert "does not fit" in run("inspect", str(fixture_model), "--vram", "8MiB").output


def test_inspect_points_to_a_plan_command_that_runs(tmp_path: Path) -> None:
    """inspect --vram ends with an `edgemoe plan` line to paste: the path as given (quoted), the budget and the
    context inspect used, and that command plans the same budget."""
    import shlex

    model = tmp_path / "my model.gguf"  # a space: the command must quote it
    shutil.copy(MODEL, model)
    res = run("inspect", str(model), "--vram", "1536MiB", "--ctx", "256")
    assert res.exit_code == 0, res.output
    cmd = res.output.strip().splitlines()[-1].split("`")[1]
    argv = shlex.split(cmd)
    assert argv[:3] == ["edgemoe", "plan", str(model)]
    assert argv[3:] == ["--vram", "1536MiB", "--ctx", "256"]
    plan = run(*argv[1:], "--json")
    assert plan.exit_code == 0, plan.output
    assert json.loads(plan.output)["budget_bytes"] == 1536 * 2**20


def test_generate_json_greedy_equals_stock(fixture_model: Path) -> None:
    prompt = "def main():\n"
    res = run("generate", str(fixture_model), "-p", prompt, "-n", "20", "--temp", "0", "--json",
              "--ctx", "512")
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)
    stock_prompt, stock_tokens = stock_greedy(fixture_model, prompt, 20)
    assert d["prompt_tokens"] == stock_prompt
    assert d["tokens"] == stock_tokens
    assert d["timings"]["prompt_tps"] > 0 and d["timings"]["decode_tps"] > 0
    assert isinstance(d["text"], str)


def test_generate_plain_text_streams() -> None:
    res = run("generate", str(MODEL), "-p", "KING:", "-n", "8", "--temp", "0")
    assert res.exit_code == 0
    assert "tok/s" in res.output  # the stats line (stderr is mixed into output by CliRunner)


def test_chat_reads_a_pipe_and_keeps_history() -> None:
    res = run("chat", str(MODEL), "-n", "16", "--temp", "0", input="Hello there\n/reset\nWho are you?\n")
    assert res.exit_code == 0, res.output
    assert res.output.count("[prompt ") == 2  # two replies, each with a stats line
    assert "(history cleared)" in res.output


def test_chat_default_model_is_bundled() -> None:
    res = run("chat", "-n", "4", "--temp", "0", input="hi\n")
    assert res.exit_code == 0, res.output
    assert "[prompt " in res.output


def test_dense_model_note(make_tiny_gguf) -> None:  # type: ignore[no-untyped-def]
    res = run("generate", str(make_tiny_gguf("tiny-llama-dense")), "-p", "hi", "-n", "2", "--temp", "0")
    assert res.exit_code == 0
    assert "dense model" in res.output


# ---- bad input: one line, non-zero exit, no traceback ---------------------------------------

def _assert_clean_error(res, needle: str) -> None:  # type: ignore[no-untyped-def]
    assert res.exit_code != 0
    assert "Traceback" not in res.output
    assert needle in res.output, res.output


def test_missing_file(tmp_path: Path) -> None:
    res = run("inspect", str(tmp_path / "nope.gguf"))
    _assert_clean_error(res, "not found")
    assert res.output.count("\n") == 1  # one line


def test_not_a_gguf(tmp_path: Path) -> None:
    p = tmp_path / "notes.gguf"
    p.write_text("hello, I am not a model\n" * 10)
    _assert_clean_error(run("generate", str(p), "-p", "x"), "not a GGUF")


def test_truncated_gguf(tmp_path: Path) -> None:
    p = tmp_path / "cut.gguf"
    data = MODEL.read_bytes()
    p.write_bytes(data[: len(data) // 2])
    _assert_clean_error(run("generate", str(p), "-p", "x"), "truncated")


def test_unknown_architecture(tmp_path: Path, make_tiny_gguf) -> None:  # type: ignore[no-untyped-def]
    src = make_tiny_gguf("tiny-llama-dense")
    p = tmp_path / "weird.gguf"
    shutil.copy(src, p)
    data = bytearray(p.read_bytes())
    i = data.find(b"general.architecture")
    j = data.find(b"llama", i)
    data[j:j + 5] = b"zzzzz"
    p.write_bytes(bytes(data))
    _assert_clean_error(run("inspect", str(p)), "zzzzz")


def test_prompt_longer_than_context() -> None:
    # llama.cpp rounds the context up to a multiple of 256
    _assert_clean_error(run("generate", str(MODEL), "-p", "word " * 400, "--ctx", "256"), "context holds 256")


@pytest.mark.parametrize("bad", ["6 gigs", "-1GiB", "GiB", ""])
def test_vram_unparsable(bad: str) -> None:
    _assert_clean_error(run("inspect", str(MODEL), "--vram", bad), "--vram")


def test_unexpected_error_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import edgemoe.gguf.info as gi

    def boom(*a, **k):  # type: ignore[no-untyped-def]
        raise RuntimeError("kaboom")

    monkeypatch.setattr(gi, "model_info", boom)  # inspect reads the header once, for its plan too
    res = CliRunner().invoke(cli, ["inspect", str(MODEL)])
    _assert_clean_error(res, "kaboom")
    assert "--debug" in res.output


def _half_the_experts() -> str:
    """A --vram (bytes) whose expert slots hold half of each MoE layer's experts at generate's context."""
    from edgemoe.gguf.info import read_model_info
    from edgemoe.plan.reserve import budget_for_slots
    from edgemoe.runtime.config import planned_ctx

    info = read_model_info(MODEL)
    return str(budget_for_slots(info, info.n_expert // 2, planned_ctx(0, info.n_ctx_train)))


@pytest.mark.parametrize("flags", [["--expert-slots", "4"], ["--vram", "HALF", "--policy", "lru", "--alloc", "equal"],
                                   ["--expert-slots", "2", "--blocking-loads"]])
def test_generate_with_expert_cache_reports_it(flags: list[str]) -> None:
    flags = [_half_the_experts() if f == "HALF" else f for f in flags]
    res = CliRunner().invoke(cli, ["generate", str(MODEL), "-p", "ROMEO:", "-n", "12", "--temp", "0", "--json",
                                   *flags], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.splitlines()[-1])
    cache = out["cache"]
    for key in ("hits", "misses", "hit_rate", "bytes_uploaded", "gpu_expert_share", "loads", "slots_per_layer"):
        assert key in cache
    assert cache["hits"] + cache["misses"] > 0 and cache["bytes_uploaded"] > 0
    pre, dec = cache["prefill_hit_rate"], cache["decode_hit_rate"]  # the generation's two phases apart
    assert pre is not None and dec is not None
    assert min(pre, dec) - 1e-9 <= cache["hit_rate"] <= max(pre, dec) + 1e-9  # the total is their weighted mean
    plain = json.loads(run("generate", str(MODEL), "-p", "ROMEO:", "-n", "12", "--temp", "0", "--json").stdout)
    assert out["tokens"] == plain["tokens"]  # any residency: the same greedy tokens
    if "--vram" in flags:
        from edgemoe.gguf.info import read_model_info

        n_expert = read_model_info(MODEL).n_expert
        assert set(cache["slots_per_layer"].values()) == {n_expert // 2}  # the budget's slots, equal
        assert cache["policy"] == "lru"


def test_a_budget_that_holds_the_whole_model_runs_it_without_a_cache() -> None:
    """--vram that holds every expert: the model runs as stock does (on a GPU build: every layer on the GPU), no
    expert cache; --expert-slots still makes one."""
    from edgemoe.gguf.info import read_model_info

    args = ["generate", str(MODEL), "-p", "ROMEO:", "-n", "8", "--temp", "0", "--json"]
    res = run(*args, "--vram", "1GiB", "--policy", "lru")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.splitlines()[-1])
    assert "cache" not in out and "holds the whole model" in res.output
    assert out["tokens"] == json.loads(run(*args).stdout)["tokens"]
    n_expert = read_model_info(MODEL).n_expert
    slots = json.loads(run(*args, "--expert-slots", str(n_expert)).stdout.splitlines()[-1])["cache"]["slots_per_layer"]
    assert set(slots.values()) == {n_expert}
    tight = run(*args, "--vram", _half_the_experts())
    assert "cache" in json.loads(tight.stdout.splitlines()[-1]) and "holds the whole model" not in tight.output


@pytest.mark.parametrize(("options", "policy"), [
    ({}, "static"), ({"assign": "ratio"}, "lru"), ({"blocking": True}, "lru"), ({"dali_window": 8}, "dali"),
    ({"dali_prefetch": 1}, "dali"), ({"prefetch_extra": 0}, "promoe"), ({"policy": "lru"}, "lru"),
    ({"policy": "daop"}, "daop")])
def test_default_policy_is_static_or_the_one_the_options_belong_to(options: dict, policy: str) -> None:
    from edgemoe.placement import cache_request

    assert cache_request(expert_slots=2, **options).policy == policy


def test_alloc_dp_is_the_default_with_a_routing_trace(tmp_path: Path) -> None:
    from edgemoe.gguf.info import read_model_info

    info = read_model_info(MODEL)
    args = ["generate", str(MODEL), "-p", "ROMEO:", "-n", "6", "--temp", "0", "--json", "--expert-slots", "2"]
    plain = json.loads(run(*args[:-2]).stdout)
    dp = run(*args)
    cache = json.loads(dp.stdout.splitlines()[-1])["cache"]
    assert cache["alloc"] == "dp" and cache["slots_total"] == 2 * len(info.moe_layers)
    assert "expert cache: dp: 16 slots over 8 MoE layers" in dp.output
    eq = json.loads(run(*args, "--alloc", "equal").stdout.splitlines()[-1])["cache"]
    assert eq["alloc"] == "equal" and set(eq["slots_per_layer"].values()) == {2}
    res = run(*args, "--policy", "dali", "--dali-window", "16", "--dali-update", "1")
    dali = json.loads(res.stdout.splitlines()[-1])
    assert dali["cache"]["policy"] == "dali" and dali["cache"]["alloc"] == "dp" and dali["cache"]["hits"] > 0
    assert dali["control"]["n_host_syncs"] == 0  # dali runs inside llama.cpp (window replacement)
    res = run(*args, "--policy", "dali", "--dali-prefetch", "1")
    pre = json.loads(res.stdout.splitlines()[-1])
    assert pre["cache"]["prefetch"]["predictor"] == "residual-d1" and pre["cache"]["prefetch"]["issued"] > 0
    assert pre["control"]["n_host_syncs"] > 0  # with its prefetcher, in the routing hook
    bad = run(*args, "--policy", "lru", "--dali-prefetch", "1")
    assert bad.exit_code != 0 and "--dali-prefetch is an option of --policy dali" in bad.output
    n_moe = len(info.moe_layers)  # one stop per MoE layer and ubatch (the last layer skips none here)
    c = pre["control"]
    assert c["host_syncs_per_ubatch"] == c["n_host_syncs"] / c["n_ubatch"]
    assert 0 < c["host_syncs_per_ubatch"] <= n_moe and dali["control"]["host_syncs_per_ubatch"] == 0
    assert json.loads(dp.stdout.splitlines()[-1])["control"]["host_syncs_per_ubatch"] == 0  # lru: in the graph
    assert json.loads(dp.stdout.splitlines()[-1])["tokens"] == dali["tokens"] == pre["tokens"] == plain["tokens"]

    # a calibration without the routing trace: dp says what it needs and falls back to equal
    own = Path(__file__).resolve().parents[1] / "calibrations" / MODEL.name.removesuffix(".gguf")
    cal = tmp_path / "cal"
    shutil.copytree(own, cal)
    (cal / "routing_trace.npz").unlink()
    for extra in ([], ["--alloc", "dp"]):
        res = run(*args, "--calibration", str(cal), *extra)
        assert res.exit_code == 0, res.output
        assert "routing_trace.npz" in res.output and "--stage routing" in res.output
        assert json.loads(res.stdout.splitlines()[-1])["cache"]["alloc"] == "equal"


def test_cache_option_errors() -> None:
    res = CliRunner().invoke(cli, ["generate", str(MODEL), "-p", "x", "--vram", "1GiB", "--expert-slots", "2"])
    assert res.exit_code == 2 and "not both" in res.output
    res = CliRunner().invoke(cli, ["generate", str(MODEL), "-p", "x", "--expert-slots", "99"])
    assert res.exit_code == 1 and "--expert-slots 99" in res.output


@pytest.mark.parametrize("args", [["--temp", "nan"], ["--temp", "inf"], ["--top-p", "2"], ["--top-k", "-5"],
                                  ["--min-p", "-1"], ["--repeat-penalty", "nan"],
                                  ["--gating", "ser", "--threshold", "nan"], ["--gating", "ser", "--threshold", "-1"]])
def test_sampling_and_gating_values_are_checked(args: list[str]) -> None:
    res = CliRunner().invoke(cli, ["generate", str(MODEL), "-p", "hi", "-n", "2", *args])
    assert res.exit_code == 2 and "Invalid value" in res.output and "Traceback" not in res.output


def test_repeat_penalty_runs() -> None:
    res = run("generate", str(MODEL), "-p", "ROMEO:", "-n", "8", "--temp", "0", "--repeat-penalty", "1.3", "--json")
    assert res.exit_code == 0 and len(json.loads(res.stdout.strip().splitlines()[-1])["tokens"]) == 8


def test_a_fifo_as_the_model_is_refused_not_read(tmp_path: Path) -> None:
    import os

    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    res = CliRunner().invoke(cli, ["inspect", str(fifo)])  # reading it would block forever
    assert res.exit_code == 1 and "not a regular file" in res.output


def _sigint_default() -> None:
    """In the child: Ctrl-C as at a terminal. A test run started in the background (`cmd &` in a
    script) ignores SIGINT, children inherit that, and Python then installs no KeyboardInterrupt."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_exits_130_with_one_line() -> None:
    import signal
    import subprocess
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-m", "edgemoe", "chat", str(MODEL)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_sigint_default)
    try:
        time.sleep(3)  # loaded and waiting for a line on stdin
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130 and err.decode().strip().splitlines()[-1] == "Interrupted."


def test_chat_survives_bad_lines_and_keeps_going() -> None:
    """Invalid UTF-8 is replaced, a message longer than the context is refused with one line, and the
    lines after both are still answered (chat used to exit 1 and drop the rest of the input)."""
    import subprocess
    import sys

    huge = ("word " * 20000).encode()  # 100 KB, far over the context
    stdin = b"hello \xff\xfe there\n" + huge + b"\nlast question\n"
    proc = subprocess.run([sys.executable, "-m", "edgemoe", "chat", str(MODEL), "--ctx", "256", "-n", "4",
                           "--temp", "0"], input=stdin, capture_output=True, timeout=120)
    err = proc.stderr.decode()
    assert proc.returncode == 0, err
    assert err.count("[prompt ") == 2  # the first and the last message were answered
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "raise --ctx" in errors[0]
    assert "Traceback" not in err


@pytest.mark.long  # a chat that fills its context: the long suite (`make test-long`)
def test_chat_drops_oldest_turns_when_the_context_is_full() -> None:
    question = "tell me about the python standard library and its many modules, please"
    res = run("chat", str(MODEL), "--ctx", "256", "-n", "24", "--temp", "0", input=(question + "\n") * 6)
    assert res.exit_code == 0, res.output
    assert res.output.count("[prompt ") == 6  # every message answered
    assert "oldest turn" in res.output and "dropped to fit the context of 256 tokens" in res.output


def test_ctx_rounded_up_is_said() -> None:
    res = run("generate", str(MODEL), "-p", "hi", "-n", "2", "--temp", "0", "--ctx", "1")
    assert res.exit_code == 0, res.output
    assert "the context is 256 tokens" in res.output


@pytest.mark.parametrize("command", [
    ["trace", "--out", "{tmp}/t.npz", "--max-tokens", "1000000"],  # the Python route hook
    ["perplexity", "--gating", "ser", "--threshold", "0.4"],  # hook counting, gating in the graph
])
def test_ctrl_c_during_native_work_with_a_hook_exits_130(tmp_path: Path, command: list[str]) -> None:
    """Ctrl-C while llama.cpp calls a Python hook: it used to be swallowed ("Exception ignored") and the
    run went on. Three trials each, since the signal lands at a random point of the decode."""
    import signal
    import subprocess
    import sys
    import time

    text = tmp_path / "long.txt"
    text.write_text("ROMEO: What light through yonder window breaks? It is the east.\n" * 20000)
    args = [a.format(tmp=tmp_path) for a in command]
    for trial in range(3):
        proc = subprocess.Popen([sys.executable, "-m", "edgemoe", args[0], str(MODEL), "--input", str(text),
                                 *args[1:]], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                preexec_fn=_sigint_default)
        try:
            time.sleep(2.5 + 0.4 * trial)  # loaded, in the middle of the decodes
            assert proc.poll() is None, "finished before the signal: make the input longer"
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=30)
        finally:
            proc.kill()
        text_err = err.decode()
        assert proc.returncode == 130, text_err[-1500:]
        assert "Exception ignored" not in text_err and text_err.strip().splitlines()[-1] == "Interrupted."


@pytest.mark.parametrize("tensor", ["blk.3.ffn_norm.weight", "output_norm.weight"])
def test_nan_weights_fail_every_command_with_one_line(tmp_path: Path, tensor: str) -> None:
    """A model with NaN weights used to print control bytes, `nll nan` and pass verify, all with exit 0."""
    import numpy as np

    bad = tmp_path / "nan.gguf"
    shutil.copyfile(MODEL, bad)
    t = next(t for t in gguf.GGUFReader(str(MODEL)).tensors if t.name == tensor)
    with bad.open("r+b") as f:
        f.seek(t.data_offset)
        f.write(np.full(int(t.n_bytes) // 4, np.nan, np.float32).tobytes())
    text = tmp_path / "in.txt"
    text.write_text("ROMEO: What light through yonder window breaks?\n" * 20)
    for args in (["generate", str(bad), "-p", "hi", "-n", "4"], ["perplexity", str(bad), "--input", str(text)],
                 ["verify", str(bad)]):
        res = run(*args)
        assert res.exit_code == 1, (args[0], res.output)
        assert "logits over the vocabulary" in res.output and "re-convert the model" in res.output


@pytest.mark.parametrize("args", [
    ["--gating", "fisher", "--threshold", "0.1"],
    ["--gating", "ser", "--target-reduction", "0.2"],
    ["--expert-slots", "4", "--policy", "static"],
])
def test_calibration_of_another_model_is_refused(args: list[str]) -> None:
    """The other fixture's calibration (32 experts vs 8) used to run."""
    other = Path(__file__).resolve().parents[1] / "calibrations" / FIXTURE_MODELS[1].name.removesuffix(".gguf")
    res = run("generate", str(MODEL), "-p", "hi", "-n", "2", "--calibration", str(other), *args)
    assert res.exit_code == 1, res.output
    assert "another model" in res.output and "edgemoe calibrate" in res.output


def test_target_reduction_on_too_few_validation_tokens_is_refused(tmp_path: Path) -> None:
    import numpy as np

    own = Path(__file__).resolve().parents[1] / "calibrations" / MODEL.name.removesuffix(".gguf")
    cal = tmp_path / "cal"
    shutil.copytree(own, cal)
    (cal / "thresholds.json").unlink(missing_ok=True)
    np.save(cal / "gating_validation_tokens.npy", np.zeros(0, np.int32))
    res = run("generate", str(MODEL), "-p", "hi", "-n", "2", "--calibration", str(cal),
              "--gating", "ser", "--target-reduction", "0.2")
    assert res.exit_code == 1, res.output
    assert "holds 0 tokens" in res.output


def test_non_utf8_file_name_loads(tmp_path: Path) -> None:
    import os

    odd = os.fsdecode(os.fsencode(str(tmp_path)) + b"/bad\xffname.gguf")
    shutil.copyfile(MODEL, odd)
    res = run("generate", odd, "-p", "hi", "-n", "2", "--temp", "0")
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize("args", [
    ["trace", str(MODEL), "--input", str(MODEL), "--out", "{missing}/t.npz"],
    ["calibrate", str(MODEL), "--corpus", str(MODEL), "--out", "{missing}/cal"],
    ["bench", str(MODEL), "--plot", "{missing}/b.png"],
])
def test_unwritable_output_fails_before_the_work(tmp_path: Path, args: list[str]) -> None:
    res = run(*[a.format(missing=tmp_path / "nope") for a in args])
    assert res.exit_code == 2 and "does not exist" in res.output, res.output
