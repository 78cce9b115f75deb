"""CUDA checks (run on the GPU machine: `make test PYTEST_ARGS='-m gpu'` after `make install EDGEMOE_CUDA=1`)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edgemoe import native
from edgemoe.engine import Engine, LoadConfig
from edgemoe.sampling import GREEDY

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not native.supports_gpu_offload(), reason="llama.cpp was built without a GPU backend"),
]

PROMPT = "ROMEO:\nWhat light through yonder window"


def test_greedy_equals_stock_on_gpu(fixture_model: Path) -> None:
    import llama_cpp

    with Engine(fixture_model, LoadConfig(n_ctx=512, n_gpu_layers=999)) as eng:
        g = eng.generate(PROMPT, max_tokens=48, sampling=GREEDY)
    llm = llama_cpp.Llama(model_path=str(fixture_model), n_ctx=512, n_gpu_layers=-1, verbose=False)
    stock = []
    for tok in llm.generate(g.prompt_tokens, temp=0.0, top_k=1, repeat_penalty=1.0):
        stock.append(tok)
        if len(stock) >= len(g.tokens):
            break
    llm.close()
    assert g.tokens == stock


def test_gpu_logits_close_to_cpu(fixture_model: Path) -> None:
    with Engine(fixture_model, LoadConfig(n_ctx=256, n_gpu_layers=999)) as eng:
        ids = eng.tokenize(PROMPT)
        gpu = np.array(eng.eval_logits(ids))
    with Engine(fixture_model, LoadConfig(n_ctx=256, n_gpu_layers=0)) as eng:
        cpu = np.array(eng.eval_logits(ids))
    nmse = ((gpu - cpu) ** 2).mean() / (cpu ** 2).mean()
    assert nmse < 1e-3, nmse
