"""The host terms of `edgemoe profile`: a bounded least-squares fit over repeated probe runs.

Each probe run's decode time per token, less the products the model prices, leaves
``call_s + nodes * node_s + n_vocab * vocab_s``. Solving three probes' equations exactly turned noise into
negative terms; here every run is a row, and the fit is the least-squares solution with each term at or
above a floor (call and vocabulary terms at 0, the node cost at the graph-node microbenchmark's: a real
node costs at least a trivial one's dispatch and barrier).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

HOST_TERMS = ("call_s", "node_s", "vocab_s")


def bounded_least_squares(a: np.ndarray, b: np.ndarray, lower: np.ndarray) -> np.ndarray:
    """argmin ||a x - b|| subject to x >= lower, for a handful of unknowns: the optimum has some terms at their
    bound and the rest at the least-squares solution of what remains, so every such split is tried and the
    best one whose free terms are above their bounds kept. Columns are scaled to unit norm first."""
    a, b, lower = np.asarray(a, float), np.asarray(b, float), np.asarray(lower, float)
    n = a.shape[1]
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    a_s, lo_s = a / scale, lower * scale
    rest = b - a_s @ lo_s  # unknowns y = x * scale - lo_s >= 0
    best, best_res = np.zeros(n), float(np.linalg.norm(rest))
    for free in itertools.product((False, True), repeat=n):
        idx = np.flatnonzero(free)
        if idx.size == 0:
            continue
        sol, *_ = np.linalg.lstsq(a_s[:, idx], rest, rcond=None)
        if (sol < 0).any():
            continue
        y = np.zeros(n)
        y[idx] = sol
        res = float(np.linalg.norm(a_s @ y - rest))
        if res < best_res * (1 - 1e-12):
            best, best_res = y, res
    return (best + lo_s) / scale


@dataclass(frozen=True)
class HostFit:
    call_s: float
    node_s: float
    vocab_s: float
    rms_s: float  # root mean square of the runs' residuals
    at_floor: tuple[str, ...]  # the terms the fit left at their floor (HOST_TERMS names)


def fit_host_terms(
    nodes: np.ndarray, n_vocab: np.ndarray, seconds: np.ndarray, *, node_floor: float = 0.0
) -> HostFit:
    """call_s, node_s and vocab_s from runs (one per row of the arrays): each run's graph nodes per decode
    step, vocabulary size, and decode seconds per token left after the modelled products."""
    a = np.column_stack([np.ones(len(nodes)), np.asarray(nodes, float), np.asarray(n_vocab, float)])
    lower = np.array([0.0, node_floor, 0.0])
    x = bounded_least_squares(a, np.asarray(seconds, float), lower)
    rms = float(np.sqrt(np.mean((a @ x - seconds) ** 2)))
    at_floor = tuple(
        name for name, v, lo in zip(HOST_TERMS, x, lower, strict=True) if v <= lo + 1e-9 * max(abs(lo), 1e-15)
    )
    return HostFit(float(x[0]), float(x[1]), float(x[2]), rms, at_floor)
