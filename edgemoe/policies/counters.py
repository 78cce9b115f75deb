"""The counters a replay reports: `ReplayResult` (hits, misses, loads, bytes, stalls) and, for a prefetcher,
`PrefetchCounts` (ProMoE's GoodPred); edgemoe.policies.replay and residency.replay_policy both return them."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


def _share(num: float, den: float) -> float | None:
    return num / den if den else None


@dataclass
class PrefetchCounts:
    issued: int = 0  # speculative loads queued for a prediction
    useful: int = 0  # ... complete when their layer routed, whose expert it then used
    preempted: int = 0  # ... dropped before they completed (early preemption)
    predicted: int = 0  # experts predicted (sum |P|)
    in_time: int = 0  # predicted experts resident when their layer routed
    routed: int = 0  # experts the predicted layers used (sum |A|)
    correct: int = 0  # used experts that were predicted (sum |P & A|)

    @property
    def accuracy(self) -> float | None:
        return _share(self.correct, self.routed)

    @property
    def fetch_rate(self) -> float | None:
        return _share(self.in_time, self.predicted)

    @property
    def goodpred(self) -> float | None:
        a, f = self.accuracy, self.fetch_rate
        return None if a is None or f is None else a * f

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "accuracy": self.accuracy,
            "fetch_rate": self.fetch_rate,
            "goodpred": self.goodpred,
        }


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

    @property
    def loads_per_token(self) -> float | None:
        return _share(self.loads, self.tokens)

    @property
    def bytes_per_token(self) -> float | None:
        return _share(self.bytes, self.tokens)

    @property
    def useful_share(self) -> float | None:
        return _share(self.useful_loads, self.loads)

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k != "prefetch"}
        d.update(
            hit_rate=self.hit_rate,
            loads_per_token=self.loads_per_token,
            bytes_per_token=self.bytes_per_token,
            useful_share=self.useful_share,
            prefetch=self.prefetch.to_dict() if self.prefetch else None,
        )
        return d
