"""Shared test fixtures: the bundled fixture models and a stock llama-cpp-python reference."""
from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURE_MODELS = sorted((ROOT / "models").glob("*.gguf"))


@pytest.fixture(params=FIXTURE_MODELS, ids=lambda p: p.name.split(".")[0])
def fixture_model(request: pytest.FixtureRequest) -> Path:
    """Each bundled fixture GGUF in models/."""
    return request.param


def stock_greedy(path: Path, prompt: str, n: int, n_ctx: int = 512) -> tuple[list[int], list[int]]:
    """(prompt ids, generated ids) from stock llama-cpp-python's high-level Llama at temperature 0."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_threads=2, verbose=False, seed=0)
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
