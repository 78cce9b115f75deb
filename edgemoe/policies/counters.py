"""The counters a replay reports: `ReplayResult` (hits, misses, loads, bytes, stalls) and, for a prefetcher,
`PrefetchCounts` (ProMoE's GoodPred); edgemoe.policies.replay and residency.replay_policy both return them."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, overload


class Share:
    """A counter record's derived ratio of two of its counters, num / den (None where den is 0); to_dict lists
    every one of a record's with its counters."""

    def __init__(self, num: str, den: str) -> None:
        self.num, self.den = num, den

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> Share: ...
    @overload
    def __get__(self, obj: object, owner: type | None = None) -> float | None: ...
    def __get__(self, obj: object | None, owner: type | None = None) -> Share | float | None:
        if obj is None:
            return self
        num, den = getattr(obj, self.num), getattr(obj, self.den)
        return num / den if den else None


def _shares(record: object) -> dict[str, float | None]:
    """Each Share of the record's class by name, with its value."""
    return {name: getattr(record, name) for name, v in vars(type(record)).items() if isinstance(v, Share)}


@dataclass
class PrefetchCounts:
    issued: int = 0  # speculative loads queued for a prediction
    useful: int = 0  # ... complete when their layer routed, whose expert it then used
    preempted: int = 0  # ... dropped before they completed (early preemption)
    predicted: int = 0  # experts predicted (sum |P|)
    in_time: int = 0  # predicted experts resident when their layer routed
    routed: int = 0  # experts the predicted layers used (sum |A|)
    correct: int = 0  # used experts that were predicted (sum |P & A|)

    accuracy = Share("correct", "routed")
    fetch_rate = Share("in_time", "predicted")

    @property
    def goodpred(self) -> float | None:
        a, f = self.accuracy, self.fetch_rate
        return None if a is None or f is None else a * f

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), **_shares(self), "goodpred": self.goodpred}


@dataclass
class ReplayResult:
    tokens: int = 0
    hits: int = 0  # routed slots (of layers with slots) whose expert was resident
    misses: int = 0
    loads: int = 0  # loads completed
    useful_loads: int = 0  # completed loads whose expert served a hit before it left
    bytes: int = 0  # bytes copied host -> cache device
    stall_s: float = 0.0  # time blocking layers waited for loads
    prefetch: PrefetchCounts | None = None

    @property
    def hit_rate(self) -> float:
        return self.hits / (self.hits + self.misses) if self.hits + self.misses else 0.0

    loads_per_token = Share("loads", "tokens")
    bytes_per_token = Share("bytes", "tokens")
    useful_share = Share("useful_loads", "loads")

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k != "prefetch"}
        d.update(hit_rate=self.hit_rate, **_shares(self))
        d["prefetch"] = self.prefetch.to_dict() if self.prefetch else None
        return d
