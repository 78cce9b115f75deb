"""Stock llama.cpp as the reference: llama-cpp-python's greedy generation, and the tensors llama.cpp's own eval
callback sees."""
from __future__ import annotations

from pathlib import Path

import numpy as np


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
