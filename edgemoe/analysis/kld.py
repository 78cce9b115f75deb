"""KL divergence, top-token agreement and Δp of a run against a base (`perplexity --kl-divergence`).

The figures llama.cpp's `llama-perplexity --kl-divergence` reports, on the rows a base holds
(edgemoe.analysis.kld_base): per scored token, KLD(P_base || Q) over the base's top-k tokens plus the rest
(a lower bound of the true KLD, exact when the base keeps the whole vocabulary), whether the run's most
probable token is the base's ("same top"), and Δp = q(next token) - p_base(next token). Means carry
llama.cpp's uncertainty (standard deviation / sqrt(n - 1)); percentiles are its linear interpolation.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from .kld_base import KldBase, KldBaseError, log_softmax, rest_logmass

KLD_PERCENTILES = (99.9, 99.0, 95.0, 90.0, 50.0, 10.0, 5.0, 1.0, 0.1)
DP_PERCENTILES = (99.9, 99.0, 95.0, 90.0, 75.0, 50.0, 25.0, 10.0, 5.0, 1.0, 0.1)


def row_kld(base: KldBase, rows: slice, logits: np.ndarray) -> np.ndarray:
    """(rows,) KLD(P_base || Q) of the run's logits on the base's rows `rows`, over the base's top k + the rest."""
    lq = log_softmax(logits)
    ids = base.ids[rows].astype(np.int64)
    lp_top = base.logp[rows].astype(np.float64)
    # q rounded as the base's p was stored, so a run compared with its own base gives 0 exactly
    lq_top = np.take_along_axis(lq, ids, axis=1).astype(np.float32).astype(np.float64)
    kld = (np.exp(lp_top) * (lp_top - lq_top)).sum(1)
    lp_rest, lq_rest = base.logp_rest[rows], rest_logmass(lq, ids)
    has_rest = np.isfinite(lp_rest)
    kld[has_rest] += np.exp(lp_rest[has_rest]) * (lp_rest[has_rest] - lq_rest[has_rest])
    return kld


def full_kld(p_logits: np.ndarray, q_logits: np.ndarray) -> np.ndarray:
    """(rows,) the exact KL(P || Q) over the whole vocabulary, P and Q given as logits (float64)."""
    lp, lq = log_softmax(p_logits), log_softmax(q_logits)
    return (np.exp(lp) * (lp - lq)).sum(1)


def _mean_unc(x: np.ndarray) -> tuple[float, float]:
    """Mean and llama.cpp's uncertainty of it (0 with 10 values or fewer)."""
    n = len(x)
    if n == 0:
        return 0.0, 0.0
    return float(x.mean()), float(x.std() / math.sqrt(n - 1)) if n > 10 else 0.0


def _percentiles(x: np.ndarray, qs: tuple[float, ...]) -> dict[str, float]:
    if not len(x):
        return {}
    return {
        "max": float(x.max()),
        **{f"{q:g}": float(np.percentile(x, q)) for q in qs},
        "min": float(x.min()),
    }


@dataclass(frozen=True)
class KldResult:
    tokens: int  # scored rows compared
    top_k: int  # tokens per row the base keeps
    mean_kld: float
    mean_kld_unc: float
    kld_percentiles: dict[str, float]  # "max", "99.9" ... "0.1", "min"
    same_top: float  # share of rows whose most probable token is the base's
    same_top_unc: float
    mean_dp: float  # mean of q(next) - p_base(next)
    mean_dp_unc: float
    rms_dp: float
    rms_dp_unc: float
    dp_percentiles: dict[str, float]
    ppl: float
    ppl_base: float
    ln_ppl_ratio: float  # mean of NLL - NLL_base (llama.cpp's ln(PPL(Q)/PPL(base)))
    ln_ppl_ratio_unc: float
    base_tail_max: float  # the base's largest mass outside its top k (what truncation can miss; 0: exact)
    base_tail_mean: float

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    def lines(self) -> list[str]:
        """The figures as `perplexity` prints them (llama.cpp's names)."""
        kp, dp = self.kld_percentiles, self.dp_percentiles
        tail = (
            "every token kept: exact"
            if self.base_tail_max == 0.0
            else f"mass outside it max {self.base_tail_max:.2g}, mean {self.base_tail_mean:.2g}; "
            "the KLD is a lower bound"
        )
        return [
            f"mean KLD {self.mean_kld:.6f} ± {self.mean_kld_unc:.6f}; 99.9% {kp['99.9']:.6f}, 99% {kp['99']:.6f}, "
            f"90% {kp['90']:.6f}, median {kp['50']:.6f}, max {kp['max']:.6f}",
            f"same top p {self.same_top:.3%} ± {self.same_top_unc:.3%}",
            f"Δp mean {self.mean_dp:+.3%} ± {self.mean_dp_unc:.3%}, RMS {self.rms_dp:.3%} ± {self.rms_dp_unc:.3%}; "
            f"99% {dp['99']:+.3%}, 90% {dp['90']:+.3%}, median {dp['50']:+.3%}, 10% {dp['10']:+.3%}, "
            f"1% {dp['1']:+.3%}",
            f"PPL {self.ppl:.4f} vs base {self.ppl_base:.4f}: ln(PPL/PPL base) {self.ln_ppl_ratio:+.6f} ± "
            f"{self.ln_ppl_ratio_unc:.6f}",
            f"base: top {self.top_k} log-probs per token ({tail})",
        ]


class KldComparison:
    """Compares a run's scored rows with a base's, in order (perplexity's `rows` callback), then result()."""

    def __init__(self, base: KldBase) -> None:
        self.base = base
        self.offset = 0
        self._kld: list[np.ndarray] = []
        self._same: list[np.ndarray] = []
        self._nll: list[np.ndarray] = []

    def __call__(self, logits: np.ndarray, targets: np.ndarray) -> None:
        n = len(logits)
        if self.offset + n > self.base.rows:
            raise KldBaseError(
                f"this run scores more than the base's {self.base.rows} rows: it was written for another run"
            )
        rows = slice(self.offset, self.offset + n)
        self._kld.append(row_kld(self.base, rows, logits))
        self._same.append(np.asarray(logits).argmax(1) == self.base.ids[rows, 0])
        lq = log_softmax(logits)
        self._nll.append(-lq[np.arange(n), np.asarray(targets, np.int64)])
        self.offset += n

    def result(self) -> KldResult:
        base = self.base
        if self.offset != base.rows:
            raise KldBaseError(
                f"this run scored {self.offset} rows, the base holds {base.rows}: it was written for another run"
            )
        if base.rows == 0:
            raise KldBaseError("the base holds no scored rows: write it from a longer text")
        kld = np.concatenate(self._kld)
        same = np.concatenate(self._same).astype(np.float64)
        nll = np.concatenate(self._nll)
        nll_base = -base.logp_target
        dp = np.exp(-nll) - np.exp(-nll_base)
        n = len(kld)
        p_same = float(same.mean())
        rms2, rms2_unc = _mean_unc(dp * dp)
        rms = math.sqrt(rms2)
        tail = np.exp(base.logp_rest)
        return KldResult(
            tokens=n,
            top_k=base.top_k,
            mean_kld=_mean_unc(kld)[0],
            mean_kld_unc=_mean_unc(kld)[1],
            kld_percentiles=_percentiles(kld, KLD_PERCENTILES),
            same_top=p_same,
            same_top_unc=math.sqrt(p_same * (1 - p_same) / (n - 1)) if n > 1 else 0.0,
            mean_dp=_mean_unc(dp)[0],
            mean_dp_unc=_mean_unc(dp)[1],
            rms_dp=rms,
            rms_dp_unc=0.5 / rms * rms2_unc if rms > 0 else 0.0,
            dp_percentiles=_percentiles(dp, DP_PERCENTILES),
            ppl=math.exp(float(nll.mean())),
            ppl_base=math.exp(float(nll_base.mean())),
            ln_ppl_ratio=_mean_unc(nll - nll_base)[0],
            ln_ppl_ratio_unc=_mean_unc(nll - nll_base)[1],
            base_tail_max=float(tail.max()),
            base_tail_mean=float(tail.mean()),
        )
