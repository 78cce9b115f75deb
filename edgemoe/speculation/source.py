"""The interface every draft source offers: propose up to n tokens that follow a context."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class DraftSource(Protocol):
    """Proposes tokens; the verifier decides. Proposals are deterministic (a point mass per position), which
    keeps the acceptance rule exact for sampling too (edgemoe.speculation.accept)."""

    name: str

    def propose(self, context: Sequence[int], n: int) -> list[int]:
        """Up to n tokens that may follow `context` (the prompt and every token generated so far); [] for none."""
        ...

    def close(self) -> None:
        """Free what the source holds (a draft model's engine); a no-op for prompt lookup."""
        ...
