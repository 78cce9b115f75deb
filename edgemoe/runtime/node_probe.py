"""A second llama context on an Engine's model that hands chosen graph nodes to Python as they are computed.

llama.cpp's scheduler calls an eval callback (llama_context_params.cb_eval) per node: first asking whether the
node is wanted (it then computes the graph up to that node and synchronizes), then with its values. Calibration
reads the experts' down-projection outputs (`ffn_moe_down-<il>`) this way (edgemoe.calibration.super_experts),
with route policies on the probe's own routing hook to see which expert each row belongs to; the Engine's own
context is left as it is. Every wanted node costs a synchronization: a measurement tool, not a serving path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..errors import EdgeMoeError
from ..policies.route import RoutePolicy
from . import native
from .config import LoadConfig
from .handle import context_params
from .hooks import HookChain
from .native import lib

# (node name, its values, flat float32) for each wanted node, as it is computed
NodeFn = Callable[[str, np.ndarray], None]


class NodeProbe:
    """Evaluates token sequences on its own context of `engine`'s model, handing each node `wanted` names to
    `on_node` (F32 nodes only) and each routing to `policies` (read-only use). Close it before the engine."""

    def __init__(
        self,
        engine: Any,
        wanted: Callable[[str], bool],
        on_node: NodeFn,
        *,
        policies: Sequence[RoutePolicy] = (),
        n_ctx: int = 512,
        n_threads: int = 0,
    ) -> None:
        self._wanted, self._on_node = wanted, on_node
        self.error: BaseException | None = None
        self._cb = lib.ggml_backend_sched_eval_callback(self._eval)  # kept alive with the context
        cfg = LoadConfig(n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, n_threads=n_threads)
        cparams = context_params(cfg, n_ctx, n_threads or engine.n_threads)
        cparams.cb_eval = self._cb
        cparams.cb_eval_user_data = None
        self.n_ctx = n_ctx
        self._ctx: Any = lib.llama_init_from_model(engine.handle.model, cparams)
        if not self._ctx:
            raise EdgeMoeError(
                f"llama.cpp could not create a {n_ctx}-token probe context: {native.recent_error()[-200:]}"
            )
        self._hooks = HookChain(list(policies)) if policies else None
        if self._hooks is not None:
            native.moe_set_hook(self._ctx, self._hooks.c_callback, self._hooks.flags)

    def _eval(self, tensor: int, ask: bool, user_data: int) -> bool:
        try:
            name = native.tensor_name(tensor)
            if not self._wanted(name):
                return False
            if not ask:
                self._on_node(name, native.tensor_f32(tensor))
        except BaseException as err:  # noqa: BLE001 - never let it unwind through C; raised after the decode
            self.error = self.error or err
        return True

    def eval(self, tokens: Sequence[int]) -> None:
        """One fresh sequence of at most n_ctx tokens in one ubatch, every token an output (so the last MoE layer
        routes all of them)."""
        if not 0 < len(tokens) <= self.n_ctx:
            raise EdgeMoeError(f"the probe evaluates 1..{self.n_ctx} tokens at a time, not {len(tokens)}")
        lib.llama_memory_clear(lib.llama_get_memory(self._ctx), True)  # pyright: ignore[reportArgumentType]  # takes NULL too
        batch = lib.llama_batch_init(len(tokens), 0, 1)
        try:
            batch.n_tokens = len(tokens)
            for i, tok in enumerate(tokens):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = int(tok), i, 1, True
                batch.seq_id[i][0] = 0
            rc = lib.llama_decode(self._ctx, batch)
        finally:
            lib.llama_batch_free(batch)
        err = self.error or (self._hooks.take_error() if self._hooks else None)
        self.error = None
        if err is not None:
            raise err
        if rc != 0:
            raise EdgeMoeError(
                f"llama_decode failed ({rc}) in the probe context: {native.recent_error()[-200:]}"
            )

    def close(self) -> None:
        if self._ctx:
            lib.llama_free(self._ctx)
            self._ctx = None

    def __enter__(self) -> NodeProbe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
