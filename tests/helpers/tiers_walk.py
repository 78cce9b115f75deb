"""The walk that context tiers are checked on, the same in-process and on the RPC device
(tests/helpers/rpc_tiers_check.py): the context filled from empty across every step, with a truncation, a new
prompt and a restored snapshot."""
from __future__ import annotations

import numpy as np

from edgemoe.runtime.context_tiers import ContextTier, ContextTiers
from edgemoe.runtime.engine import Engine, LoadConfig

CFG = LoadConfig(n_ctx=1024, n_batch=64, n_ubatch=64, n_threads=2, use_extra_bufts=False)


def tiers_for(n_expert: int) -> ContextTiers:
    """Three steps on a fixture, 3/4, 1/2 and 1/4 of its experts in slots."""
    return ContextTiers(tuple(ContextTier(c, n_expert * k // 4) for c, k in ((256, 3), (512, 2), (1024, 1))))


def walk_steps(eng: Engine, ids: list[int]) -> list[np.ndarray]:
    """Fill the context from empty across every step, with a truncation, a restored snapshot and a new prompt."""
    out: list[np.ndarray] = []

    def take() -> None:
        out.append(np.ctypeslib.as_array(eng.logits(-1)).copy())

    pos = 0
    for n in (200, 40, 16, 1, 1, 300, 2, 250):
        eng.feed(ids[pos : pos + n])
        pos += n
        take()
    snap = eng.snapshot()
    eng.truncate(230)  # speculation's rejected proposals, serve's shared prefix
    eng.feed(ids[230:300])
    take()
    eng.prefill(ids[900:960])  # a new prompt sharing nothing
    take()
    eng.restore(snap)  # serve's host prompt cache
    eng.feed(ids[pos : pos + eng.n_ctx - 3 - len(eng.kv_tokens())])
    take()
    for _ in range(3):  # to the last cell of the context
        eng.feed([int(np.argmax(out[-1]))])
        take()
    assert len(eng.kv_tokens()) == eng.n_ctx
    return out
