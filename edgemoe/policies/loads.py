"""What a residency policy answers with (a Load: copy expert e of layer l into slot s), and the experts a
ubatch uses. A module of its own so that every residency policy module can import it without a circle
(residency.make_policy builds them all)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Load:
    layer: int
    expert: int
    slot: int


def used_experts(ids: np.ndarray) -> list[int]:
    """Experts a ubatch's (n_tokens, k) ids use, in first-use order (dropped slots, -1, left out)."""
    flat = np.asarray(ids).reshape(-1)
    _, first = np.unique(flat, return_index=True)
    return [int(flat[i]) for i in sorted(first) if flat[i] >= 0]
