"""One configuration's replay: the clock, the copy stream and the step's layers, timed layer by layer, with
the configuration's features (feature.py) deciding where each MoE layer's experts run."""

from __future__ import annotations

from collections.abc import Sequence

from ....analysis.trace import PREFILL
from ..costmodel import ModelShape
from ..profile import MachineProfile
from ..workload import Step
from .config import CPU_NODES_PER_SPLIT
from .feature import Acc, Feature, LayerTimes, MoeLayer
from .state import RunState


class Run(RunState):
    """One configuration's replay: clock, copy stream, features."""

    def __init__(
        self,
        shape: ModelShape,
        prof: MachineProfile,
        nodes: tuple[int, int],
        features: Sequence[Feature],
        *,
        on_gpu: bool,
        pageable_loads: bool = False,
        flash_attn: bool = True,
    ) -> None:
        super().__init__(shape, prof, on_gpu=on_gpu, pageable_loads=pageable_loads, flash_attn=flash_attn)
        self.features = tuple(features)
        self.nodes_pp, self.nodes_tg = nodes
        self.moe_index = {il: j for j, il in enumerate(shape.moe_layers)}  # model layer -> ids' second axis
        for f in self.features:
            f.start(self)

    def _nodes(self, s: Step) -> int:
        nodes = self.nodes_pp if s.phase == PREFILL else self.nodes_tg
        for f in self.features:
            nodes += f.nodes(self, s)
        return nodes

    def step(self, s: Step, acc: Acc) -> float:
        """One ubatch or decode token. On a GPU a layer's kernels cannot run faster than the host launches
        them (`node_s` each): its GPU time is at least its share of the graph's nodes times the launch cost."""
        start = self.clock
        for f in self.features:
            f.begin_step(self, s)
        nodes = self._nodes(s)
        t, n_cpu_splits = self._layers(s, start, nodes, acc)
        main = self.gpu or self.cpu
        h = main.head(1)  # llama.cpp computes logits for the last token of a ubatch (and each decode token)
        t += h
        self._busy(acc, h, gpu=self.on_gpu)
        host = self.prof.host.call_s + self.prof.host.vocab_s * self.shape.n_vocab
        if self.on_gpu:
            host += n_cpu_splits * CPU_NODES_PER_SPLIT * self.prof.cpu.node_s
        else:
            n = s.n_tokens
            per_node = self.prof.cpu.node_s + (n - 1) * self.shape.info.n_embd * self.prof.host.node_elem_s
            host += nodes * per_node
        t += host
        acc.host += host
        for f in self.features:
            t = f.end_step(self, t, acc)
        acc.time += t - start
        self.clock = t
        return t - start

    def _layers(self, s: Step, t: float, nodes: int, acc: Acc) -> tuple[float, int]:
        """The step's layers from `t`: when the last one ends, and how many CPU expert branches they ran."""
        n = s.n_tokens
        main = self.gpu or self.cpu
        launch = (
            nodes / max(1, len(self.shape.layers)) * self.prof.gpu.node_s
            if self.gpu and self.prof.gpu
            else 0.0
        )
        overlap = any(f.overlaps(self, s) for f in self.features)
        n_cpu_splits = 0
        for ly in self.shape.layers:
            d = main.dense(ly.il, n) + main.attention(ly.il, n, s.kv_len)
            self._busy(acc, d, gpu=self.on_gpu)
            j = self.moe_index.get(ly.il)
            if not self.on_gpu:
                c = self.cpu.experts(ly.il, s.counts(j)) if j is not None else 0.0
                acc.cpu += c
                t += d + c
                continue
            g, c, wait, early = (
                (0.0, 0.0, 0.0, 0.0)
                if j is None
                else self._moe_layer(MoeLayer(ly.il, s.ids[:, j, :], s.counts(j), s, t, d), acc)
            )
            n_cpu_splits += bool(c) + bool(early)
            for f in self.features:
                wait = f.layer_wait(self, ly.il, wait, acc)
            gpu_side = max(d + g, launch)
            acc.host += gpu_side - (d + g)  # the GPU idles while the host launches the layer's kernels
            # overlapped, the CPU's experts start once the layer's dense part (attention, the router) is done; the
            # pre-calculated ones start with the layer, and the rest once both are done
            if overlap:
                t += max(wait + gpu_side, max(d, early) + c)
            else:
                t += wait + gpu_side + early + c
        return t, n_cpu_splits

    def _busy(self, acc: Acc, dt: float, *, gpu: bool) -> None:
        if gpu:
            acc.gpu += dt
        else:
            acc.cpu += dt

    def _moe_layer(self, lay: MoeLayer, acc: Acc) -> LayerTimes:
        """(GPU time, CPU time with its hand-offs, wait for slots still loading, CPU time of the experts
        pre-calculated for this layer with its hand-off) of one MoE layer's experts on the GPU."""
        assert self.gpu is not None and self.prof.link is not None
        for f in self.features:
            if (whole := f.whole_layer(self, lay, acc)) is not None:
                return whole
        for f in self.features:
            if (resident := f.route(self, lay, acc)) is not None:
                lay.gpu_e = resident
                break
        lay.cpu_e = {e: c for e, c in lay.counts.items() if e not in lay.gpu_e}
        ready = self.stream.ready
        lay.wait = (
            max([ready.get((lay.il, e), 0.0) for e in lay.gpu_e] + [lay.t]) - lay.t
        )  # slots still loading
        for f in self.features:
            if (routed := f.routed_layer(self, lay, acc)) is not None:
                return routed
        g = self.gpu.experts(lay.il, lay.gpu_e)
        c = early = 0.0
        if lay.cpu_e:
            g, c, early = self._misses(lay, g, acc)
        acc.gpu += g
        return g, c, lay.wait, early

    def _misses(self, lay: MoeLayer, g: float, acc: Acc) -> tuple[float, float, float]:
        """The experts outside the slots, by the first feature that runs them, else on the CPU with a hand-off
        each way: (the layer's GPU time, its CPU time, its pre-calculated CPU time)."""
        assert self.prof.link is not None
        for f in self.features:
            if (times := f.misses(self, lay, g, acc)) is not None:
                return times
        cpu = self.cpu.experts(lay.il, lay.cpu_e)
        acc.cpu += cpu
        return g, 2 * self.prof.link.latency_s + cpu, 0.0
