"""Stock llama.cpp's `--n-cpu-moe`: the layers past the first N keep all their experts on the GPU."""

from __future__ import annotations

from .feature import Acc, Feature, LayerTimes, MoeLayer
from .state import RunState


class GpuExpertLayers(Feature):
    def __init__(self, layers: frozenset[int]) -> None:
        self.layers = layers

    def whole_layer(self, run: RunState, lay: MoeLayer, acc: Acc) -> LayerTimes | None:
        if lay.il not in self.layers:
            return None
        assert run.gpu is not None
        g = run.gpu.experts(lay.il, lay.counts)
        acc.gpu += g
        return g, 0.0, 0.0, 0.0
