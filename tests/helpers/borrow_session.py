"""The session that device prefill with borrowed slots is checked on, the same on the CPU stand-in (in-process) and on
the RPC device (tests/helpers/rpc_borrow_check.py): a prompt of several ubatches, decode steps, a second prompt after
cutting the KV cache, a restored snapshot."""
from __future__ import annotations

import numpy as np

from edgemoe.runtime.engine import Engine, LoadConfig

MIN_TOKENS = 32  # prefill_min_tokens: a ubatch of this many tokens or more is a prefill, run from the buffers


def session(eng: Engine, n_ubatch: int, n_decode: int = 4) -> list[np.ndarray]:
    """Logits of a prompt of 2.5 ubatches and greedy decode steps, then (as serve does) the KV cache cut to the
    prompt's first half and a second prompt of 1.5 ubatches after it with its decode steps, then the first
    session's snapshot restored and one more step."""
    rng = np.random.default_rng(n_ubatch)
    p1 = [int(t) for t in rng.integers(10, eng.n_vocab - 10, n_ubatch * 5 // 2)]
    p2 = [int(t) for t in rng.integers(10, eng.n_vocab - 10, n_ubatch * 3 // 2)]
    out: list[np.ndarray] = []

    def step(tokens: list[int]) -> None:
        eng.feed(tokens)
        out.append(np.array(eng.logits(-1)))

    def decode() -> None:
        for _ in range(n_decode):
            step([int(np.argmax(out[-1]))])

    eng.reset()
    step(p1)
    decode()
    snap = eng.snapshot()
    eng.truncate(len(p1) // 2)
    step(p2)
    decode()
    eng.restore(snap)
    step([int(np.argmax(out[n_decode]))])
    return out


def load_config(n_ubatch: int) -> LoadConfig:
    # past the fixtures' 512-token training context: the logits are compared, not judged
    return LoadConfig(n_ctx=3 * n_ubatch + 64, n_batch=n_ubatch, n_ubatch=n_ubatch, n_threads=2,
                      use_extra_bufts=False)
