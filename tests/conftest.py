"""Shared test fixtures: the bundled fixture models and a stock llama-cpp-python reference."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

# the suite's devices other than the CPU (the RPC stand-in) take skipped ids filled and masked, whatever a self-test
# or the caller's environment would pick, so that their checks of splits and id rows hold; the raw mode, the
# self-test that picks a mode and both modes on every architecture are tested explicitly (tests/test_device_ids.py,
# tests/test_ids_check.py, tests/test_cache_rpc.py), each setting EDGEMOE_DEVICE_IDS for its own processes
os.environ["EDGEMOE_DEVICE_IDS"] = "fill"

ROOT = Path(__file__).resolve().parent.parent
FIXTURE_MODELS = sorted((ROOT / "models").glob("*.gguf"))


@pytest.fixture(params=FIXTURE_MODELS, ids=lambda p: p.name.split(".")[0])
def fixture_model(request: pytest.FixtureRequest) -> Path:
    """Each bundled fixture GGUF in models/."""
    return request.param


def stock_greedy(path: Path, prompt: str, n: int, n_ctx: int = 512,
                 n_threads: int = 2, flash_attn: bool = True) -> tuple[list[int], list[int]]:
    """(prompt ids, generated ids) from stock llama-cpp-python's high-level Llama at temperature 0. Flash
    attention on: what llama.cpp's default "auto" (the Engine's) resolves to on the CPU backend; llama-cpp-python's
    own default is off."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_threads=n_threads, verbose=False, seed=0,
                          flash_attn=flash_attn)
    try:
        prompt_ids = llm.tokenize(prompt.encode("utf-8"))  # add_bos as the model's metadata says
        vocab = llama_cpp.llama_model_get_vocab(llm.model)
        out: list[int] = []
        for tok in llm.generate(prompt_ids, temp=0.0, top_k=1, repeat_penalty=1.0):
            out.append(tok)
            if llama_cpp.llama_vocab_is_eog(vocab, tok) or len(out) >= n:
                break
        return prompt_ids, out
    finally:
        llm.close()


def eval_callback_tensors(path: Path, toks: list[int], prefix: str, dtype: type, *,
                          hook: object = None) -> dict[int, np.ndarray]:
    """Decode toks (every one an output) with llama.cpp's own eval callback and return, per layer,
    the flat contents of the nodes named `<prefix><il>`; `hook` (a native.MoeHookFn) is set if given."""
    from edgemoe.perf.measure import ggml_graph as ggml
    from edgemoe.runtime import native
    from edgemoe.runtime.native import lib

    out: dict[int, np.ndarray] = {}

    @lib.ggml_backend_sched_eval_callback
    def cb(t: int, ask: bool, ud: int) -> bool:
        name = ggml.ggml_get_name(t)
        if not name.startswith(prefix):
            return False
        if not ask:
            buf = np.empty(ggml.ggml_nbytes(t) // np.dtype(dtype).itemsize, dtype)
            ggml.tensor_get(t, buf.ctypes.data, 0, buf.nbytes)
            out[int(name[len(prefix):])] = buf
        return True

    model = lib.llama_model_load_from_file(str(path).encode(), lib.llama_model_default_params())
    cparams = lib.llama_context_default_params()
    cparams.n_ctx = cparams.n_batch = cparams.n_ubatch = 128
    cparams.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_AUTO  # as the Engine (llama.cpp's default)
    cparams.cb_eval = cb
    cparams.cb_eval_user_data = None
    ctx = lib.llama_init_from_model(model, cparams)
    if hook is not None:
        native.moe_set_hook(ctx, hook, 0)
    batch = lib.llama_batch_init(len(toks), 0, 1)
    batch.n_tokens = len(toks)
    for i, tok in enumerate(toks):  # every token an output, so the last layer routes all of them
        batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = tok, i, 1, True
        batch.seq_id[i][0] = 0
    try:
        assert lib.llama_decode(ctx, batch) == 0
    finally:
        lib.llama_batch_free(batch)
        lib.llama_free(ctx)
        lib.llama_model_free(model)
    return out


class StepRecorder:
    """A route policy that groups each ubatch's routes into a step: [(layer, ids copy), ...] in layer order,
    as edgemoe.policies.residency.simulate replays them."""

    wants_probs = False
    wants_gate_inp = False

    def __init__(self) -> None:
        self.steps: list[list[tuple[int, np.ndarray]]] = []

    def on_route(self, r) -> None:  # type: ignore[no-untyped-def]
        if not self.steps or r.layer <= self.steps[-1][-1][0]:
            self.steps.append([])
        self.steps[-1].append((r.layer, r.ids.copy()))
