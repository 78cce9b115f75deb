"""What an adaptive top-k threshold costs, and the threshold a KL-divergence budget allows.

On the calibration's validation tokens (train-split text, never the text a user evaluates), a threshold's cost is
measured against the full model the way llama.cpp users compare quantizations: the mean KL divergence of the
gated model's next-token distribution from the full one's and the share of tokens whose most probable token is
unchanged (edgemoe.analysis.kld), beside the NLL increase and the activations saved. A perplexity change under 1%
can hide flipped top tokens (published work on fewer experts per token finds exactly that), so the default
threshold is the one dropping the most experts within a budget on both (KldBudget: mean KLD <= 0.01 and same top
>= 97%), not a fixed share of activations.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ..analysis.kld import KldComparison
from ..analysis.kld_base import BaseRecorder, KldBase, RunKey
from ..analysis.perplexity import perplexity
from ..errors import EdgeMoeError
from ..policies.gating import (
    GatingPolicy,
    GatingRule,
    drops_more_with_higher_threshold,
    search_threshold,
    threshold_range,
)
from ..policies.protected import ProtectedExperts


@dataclass(frozen=True)
class KldBudget:
    """The most a default threshold may cost on the validation text."""

    max_mean_kld: float = 0.01
    min_same_top: float = 0.97

    def allows(self, cost: ThresholdCost) -> bool:
        return cost.mean_kld <= self.max_mean_kld and cost.same_top >= self.min_same_top

    @property
    def key(self) -> str:
        """Its name in thresholds.json (after the rule's)."""
        return f"kld{self.max_mean_kld:g}/top{self.min_same_top:g}"

    def describe(self) -> str:
        return f"mean KLD <= {self.max_mean_kld:g} and same top >= {self.min_same_top:.0%}"


@dataclass(frozen=True)
class ThresholdCost:
    """A threshold and what it did on the validation text, against the same model at full top-k."""

    threshold: float
    validation_reduction: float  # share of expert activations dropped
    mean_kld: float
    same_top: float
    nll_increase: float  # relative: gated NLL / full NLL - 1
    validation_tokens: int

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ThresholdCost | None:
        """The cost a thresholds.json entry records (None: an entry written before costs were measured)."""
        if "mean_kld" not in d:
            return None
        return cls(**{k: d[k] for k in cls.__dataclass_fields__})

    def describe(self) -> str:
        return (
            f"{self.validation_reduction:.1%} fewer expert activations, mean KLD {self.mean_kld:.4f}, same top "
            f"{self.same_top:.1%}, NLL {self.nll_increase:+.2%} on {self.validation_tokens} validation tokens"
        )


class ValidationRun:
    """The validation tokens, the full model's base of them (made once) and the cost of a gating policy there."""

    def __init__(self, engine: Any, tokens: Sequence[int], *, ctx: int) -> None:
        from ..analysis.kld_base import run_key

        self.engine, self.tokens, self.ctx = engine, list(tokens), ctx
        self._key: RunKey = run_key(engine, self.tokens, ctx=ctx, score_from=0)
        self._base: KldBase | None = None
        self._base_nll = 0.0

    def base(self) -> KldBase:
        if self._base is None:
            rec = BaseRecorder(self._key, run={"gating": "off"})
            self._base_nll = perplexity(self.engine, self.tokens, ctx=self.ctx, rows=rec).nll
            self._base = rec.base()
        return self._base

    def cost(self, policy: GatingPolicy) -> ThresholdCost:
        cmp = KldComparison(self.base())
        res = perplexity(self.engine, self.tokens, ctx=self.ctx, policies=[policy], rows=cmp)
        k = cmp.result()
        return ThresholdCost(
            threshold=policy.threshold,
            validation_reduction=res.activation_reduction,
            mean_kld=k.mean_kld,
            same_top=k.same_top,
            nll_increase=res.nll / self._base_nll - 1.0,
            validation_tokens=res.tokens,
        )

    def reduction_at(self, policy: GatingPolicy) -> float:
        return perplexity(self.engine, self.tokens, ctx=self.ctx, policies=[policy]).activation_reduction


Policy = Callable[[float], GatingPolicy]  # threshold -> the gating policy to measure (every token gated)


def policy_maker(
    rule: GatingRule, sens: Mapping[int, float] | None, protected: ProtectedExperts | None = None
) -> Policy:
    return lambda t: GatingPolicy(
        rule, t, sensitivity=sens, decode_only=False, protected=protected or ProtectedExperts()
    )


def cost_for_target(
    run: ValidationRun, rule: GatingRule, make: Policy, target: float, sens: Mapping[int, float] | None
) -> ThresholdCost:
    """The threshold giving `target` of the activations dropped on the validation text, and its cost."""
    threshold, _ = search_threshold(rule, target, lambda t: run.reduction_at(make(t)), sens)
    return run.cost(make(threshold))


def cost_for_budget(
    run: ValidationRun,
    rule: GatingRule,
    make: Policy,
    budget: KldBudget,
    sens: Mapping[int, float] | None,
    *,
    iters: int = 12,
) -> ThresholdCost:
    """The threshold dropping the most activations whose cost is within `budget` (bisected, cost taken as monotone
    in the threshold), and that cost. The threshold that drops nothing is the floor."""
    lo, hi = threshold_range(rule, sens)
    more = drops_more_with_higher_threshold(rule)
    # x in [0, 1]: 0 drops the least, 1 the most
    at = (lambda x: lo + x * (hi - lo)) if more else (lambda x: hi - x * (hi - lo))
    best = run.cost(make(at(0.0)))
    if not budget.allows(best):
        raise EdgeMoeError(
            f"the {rule.value} rule at its mildest threshold already costs {best.describe()}, over the budget "
            f"({budget.describe()}): give a `threshold` or a `target_reduction`"
        )
    top = run.cost(make(at(1.0)))
    if budget.allows(top):
        return top
    a, b = 0.0, 1.0  # a allowed, b not
    for _ in range(iters):
        mid = 0.5 * (a + b)
        c = run.cost(make(at(mid)))
        if budget.allows(c):
            a, best = mid, c
        else:
            b = mid
    return best
