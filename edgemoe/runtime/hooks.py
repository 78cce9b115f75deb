"""MoE routing hook: the native callback that turns each routing into a RouteRecord for a chain of policies.

llama.cpp calls the hook once per MoE layer per ubatch, after
top-k routing and before the experts run. A policy gets a RouteRecord whose
``ids`` and ``weights`` are writable views of the arrays llama.cpp then uses:
edit them in place (``ids[t, j] = -1`` drops slot j of token t: it contributes
exactly zero). Policies are plain Python over numpy arrays, so they can also be
driven from recorded traces without the native library.

An exception raised by a policy never unwinds through C: the hook returns
false, llama.cpp aborts the decode, and the Engine re-raises the exception.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np

from ..policies.route import RoutePolicy, RouteRecord, WeightRule
from . import interrupts, native


def _view(ptr: ctypes._Pointer, shape: tuple[int, int]) -> np.ndarray:  # type: ignore[type-arg]
    return np.ctypeslib.as_array(ptr, shape=shape)


class HookChain:
    """Owns the C callback for one context and passes each route record through the policies in order."""

    def __init__(self, policies: Sequence[RoutePolicy]) -> None:
        self.policies = list(policies)
        self.error: BaseException | None = None
        self.calls = 0
        self._fn = native.MoeHookFn(self._on_route)  # kept alive as long as this chain

    @property
    def flags(self) -> int:
        f = 0
        if any(p.wants_probs for p in self.policies):
            f |= native.MOE_HOOK_PROBS
        if any(p.wants_gate_inp for p in self.policies):
            f |= native.MOE_HOOK_GATE_INP
        return f

    @property
    def c_callback(self) -> object:
        return self._fn

    def _on_route(self, route_p: ctypes._Pointer, user_data: int) -> bool:  # type: ignore[type-arg]
        try:
            if interrupts.pending():  # Ctrl-C: stop this decode; Engine raises KeyboardInterrupt
                self.error = KeyboardInterrupt()
                return False
            r = route_p.contents
            t, k = r.n_tokens, r.n_expert_used
            rec = RouteRecord(
                layer=r.il,
                ids=_view(r.ids, (t, k)),
                weights=_view(r.weights, (t, k)),
                probs=_view(r.probs, (t, r.n_expert)) if r.probs else None,
                gate_inp=_view(r.gate_inp, (t, r.n_embd)) if r.gate_inp else None,
                n_expert=r.n_expert,
                weight_rule=WeightRule(r.weight_rule),
                weight_scale=float(r.weight_scale),
            )
            self.calls += 1
            for p in self.policies:
                p.on_route(rec)
            return True
        except BaseException as err:  # noqa: BLE001 - never let it unwind through C
            self.error = err
            return False

    def take_error(self) -> BaseException | None:
        err, self.error = self.error, None
        return err
