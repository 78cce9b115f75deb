"""--device-prefill: a prefill ubatch's layer runs every routed expert on the GPU; the experts outside the
slots were copied into the layer's prefill buffer on the copy stream from the previous cached layer's
routing (the first layer's from the step's start), so the layer's experts wait for the end of that copy."""

from __future__ import annotations

from ..workload import Step
from .config import OFFLOAD_MIN_TOKENS
from .feature import Acc, Feature, LayerTimes, MoeLayer
from .state import RunState


class DevicePrefill(Feature):
    def __init__(self) -> None:
        self.issued: float | None = None  # when the next layer's buffer copy was issued

    def begin_step(self, run: RunState, s: Step) -> None:
        self.issued = None  # the first cached layer's copy is queued when the step starts

    def routed_layer(self, run: RunState, lay: MoeLayer, acc: Acc) -> LayerTimes | None:
        """(GPU time including the wait for the copy, CPU time 0, the wait for slots still loading, 0)."""
        if lay.n_tokens < OFFLOAD_MIN_TOKENS or not lay.counts:
            return None
        assert run.gpu is not None and run.prof.link is not None
        il, t, dense_s = lay.il, lay.t, lay.dense_s
        outside = run.shape.info.n_expert - len(run.stream.resident.get(il, {}))
        nbytes = run.shape.expert_bytes(il) * outside
        # issued at the previous cached layer's routing callback (after its dense part), or when the step began
        issued = self.issued if self.issued is not None else t
        done = max(run.stream.free, issued) + nbytes / run.prof.link.loads_bw
        run.stream.free = done
        acc.pcie += nbytes
        self.issued = t + dense_s  # this layer's routing: the next layer's copy starts then
        g = run.gpu.experts(il, lay.counts)
        acc.gpu += g
        return max(0.0, done - (t + dense_s)) + g, 0.0, lay.wait, 0.0
