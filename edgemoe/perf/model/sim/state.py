"""What a simulated run's features read and move: the model's shape, the machine profile, each device's
layer costs, the clock and the copy stream."""

from __future__ import annotations

from ..costmodel import LayerCosts, ModelShape
from ..profile import MachineProfile
from .stream import CopyStream


class RunState:
    def __init__(
        self,
        shape: ModelShape,
        prof: MachineProfile,
        *,
        on_gpu: bool,
        pageable_loads: bool,
        flash_attn: bool = True,
    ) -> None:
        self.shape, self.prof = shape, prof
        self.cpu = LayerCosts.of(prof.cpu, shape, flash_attn=flash_attn)
        self.gpu = (
            LayerCosts.of(prof.gpu, shape, flash_attn=flash_attn) if on_gpu and prof.gpu is not None else None
        )
        self.on_gpu = self.gpu is not None
        self.clock = 0.0
        self.stream = CopyStream(shape, prof.link, timed=self.on_gpu, pageable=pageable_loads)
