"""The options of a prefetcher's model of the copy queue, shared by the records of promoe and dali."""

from __future__ import annotations

from dataclasses import dataclass

from ..copy_queue import CopyTiming
from ..registry import PolicyRecord


@dataclass(frozen=True)
class CopyQueueOptions(PolicyRecord):
    """The options of a prefetcher's model of the copy queue (promoe, dali's prefetcher)."""

    # how many chunks the copy queue issues after each MoE layer (None: every queued chunk, as a copy stream
    # that keeps up); a model of a slower stream for the stand-in, whose copies are instant
    copy_timing: CopyTiming | None = None
    # with a copy_timing: queue only the loads that can arrive in time (False: ProMoE's rule, every prediction)
    admission: bool = True

    @property
    def admitted_timing(self) -> CopyTiming | None:
        """The timing the prefetcher admits its loads by (None: every prediction)."""
        return self.copy_timing if self.admission else None
