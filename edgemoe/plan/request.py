"""What a user asks of the expert cache (budget or slots, policy and its options), the default policy, and every
rule that refuses a combination, in one place."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidConfigError
from ..policies.assignment import ASSIGN_REFUSAL
from ..policies.registry import PolicyRecord, PolicySpec, policy_names, policy_spec

# the default policy: static. On the bundled routing profiles of real models at 8 GiB (tools/default_policy.py,
# docs/expert-cache.md "Defaults") the projected decode over stock's best is, as a geometric mean, static 1.44x,
# daop 1.46x (static plus a swap per prompt: within the model's error, and it copies at each prompt), dali 1.05x,
# lru 0.95x: no LRU-style policy beats static on any row.
DEFAULT_POLICY = "static"
PREFILL_AHEAD = ("all", "predicted", "routed")
NO_MISS = (
    "`blocking` loads a miss before its layer runs; `policy={name!r}` loads no miss "
    "(static keeps its placement, manual makes only your loads): leave it out"
)


class PlacementError(InvalidConfigError):
    """A cache request that cannot run as given; the message names the options and what to change."""


@dataclass(frozen=True)
class CacheRequest:
    vram: int | None  # GPU budget in bytes: dense part and KV cache first, the rest as expert slots
    expert_slots: int | None  # slots per MoE layer instead of a budget (with alloc dp: the average)
    # the policy's record with the options of its own the user gave (dali's window, promoe's distance, ...);
    # install_cache adds the calibration directory and the assigner's costs
    config: PolicyRecord
    blocking: bool = False  # the policies that load misses: load a missed expert before its layer runs
    alloc: str | None = None  # "equal", "dp", or None: dp when the calibration has a routing trace
    assign: str | None = None  # lru, dali: the CPU/GPU assigner of each route's loads (None: none)
    # the machine profile of assign's costs and of a budget's prefill ubatch (edgemoe.plan.ubatch; a bundled
    # name or a file; None: this machine's)
    profile: str | None = None
    degrade: float | None = None  # DAOP's graceful degradation ratio (None: off)
    device_prefill: int = 0  # prefill ubatches of this many tokens or more run on the cache's device (0: off)
    device_prefill_ahead: str = "all"  # what they copy one cached layer ahead (PREFILL_AHEAD)
    precalc_from: int | None = (
        None  # DAOP's pre-calculation of the cached layers from this one on (None: off)
    )
    # with a budget: the context created in steps as the conversation grows, each step's unused KV bytes as
    # expert slots (edgemoe.runtime.context_tiers; False: the whole context from the start)
    context_tiers: bool = True
    # device prefill's two buffers borrow the slots of the last cached layers while a prompt is prefilled
    # (refilled after it) instead of coming out of the budget beside the slots
    device_prefill_borrow: bool = False

    @property
    def policy(self) -> str:
        """The policy's name (a registered one)."""
        return self.config.name

    @property
    def enabled(self) -> bool:
        return self.vram is not None or self.expert_slots is not None

    @property
    def reserves_prefill_buffers(self) -> bool:
        """Device prefill's two buffers come out of the budget beside the slots (not borrowed from them)."""
        return bool(self.device_prefill) and not self.device_prefill_borrow


def _given(options: Mapping[str, Any]) -> dict[str, Any]:
    """The policy options that were given: each one's "unset" values (None; 0 for dali_prefetch) left out."""
    unset = {o.keyword: o.unset for n in policy_names() for o in policy_spec(n).options}
    return {k: v for k, v in options.items() if v not in unset.get(k, (None,))}


def _takes(spec: PolicySpec, keywords: set[str]) -> bool:
    own = {o.keyword for o in spec.options}
    own |= {"blocking"} if spec.loads_misses else set()
    own |= {"assign"} if spec.assignable else set()
    return keywords <= own


def default_policy(*, blocking: bool = False, assign: str | None = None, **options: Any) -> str:
    """The policy when none is given: the first registered one that takes every option given (dali for
    --dali-window, promoe for --prefetch-distance, lru for --assign or --blocking-loads: static never loads a miss,
    so there is nothing to block on or to assign), else DEFAULT_POLICY."""
    given = (
        set(_given(options))
        | ({"blocking"} if blocking else set())
        | ({"assign"} if assign is not None else set())
    )
    if not given:
        return DEFAULT_POLICY
    specs = [policy_spec(n) for n in policy_names()]
    for spec in specs:
        if _takes(spec, given):
            return spec.name
    owners = [s.name for s in specs for o in s.options if o.keyword in given]  # no policy takes them all
    return owners[0] if owners else DEFAULT_POLICY


def policy_record(
    name: str, options: Mapping[str, Any], *, blocking: bool, assign: str | None
) -> PolicyRecord:
    """The record of the policy `name` from the request's options, each refused with what to change where the
    policy does not take it (or its record refuses the combination)."""
    given = _given(options)
    spec = policy_spec(name)
    own = {o.keyword: o.field for o in spec.options}
    for other in policy_names():
        for o in policy_spec(other).options:
            if o.keyword in given and o.keyword not in own:
                raise PlacementError(o.foreign)
    if blocking and not spec.loads_misses:
        raise PlacementError(NO_MISS.format(name=name))
    if assign is not None and not spec.assignable:
        raise PlacementError(ASSIGN_REFUSAL)
    fields = {own[k]: v for k, v in given.items() if k in own}
    fields |= {"blocking": blocking} if spec.loads_misses else {}
    fields |= {"assign": assign} if spec.assignable else {}
    try:
        record = spec.config(**fields)
    except InvalidConfigError as err:
        raise PlacementError(str(err)) from None
    refusal = record.request_refusal()
    if refusal is not None:
        raise PlacementError(refusal)
    return record


def cache_request(
    *,
    vram: int | None = None,
    expert_slots: int | None = None,
    policy: str | None = None,
    blocking: bool = False,
    alloc: str | None = None,
    assign: str | None = None,
    profile: str | None = None,
    degrade: float | None = None,
    device_prefill: int = 0,
    device_prefill_ahead: str = "all",
    precalc_from: int | None = None,
    context_tiers: bool = True,
    device_prefill_borrow: bool = False,
    **policy_options: Any,
) -> CacheRequest:
    """A checked CacheRequest; policy None picks default_policy(). `policy_options`: the options that belong to
    one policy (dali_window, dali_update, dali_prefetch, prefetch_distance, prefetch_extra: each spec's
    RequestOptions). Raises PlacementError."""
    known = {o.keyword for n in policy_names() for o in policy_spec(n).options}
    unknown = sorted(set(policy_options) - known)
    if unknown:
        raise TypeError(f"cache_request() got an unexpected keyword argument {unknown[0]!r}")
    if policy is None:
        policy = default_policy(blocking=blocking, assign=assign, **policy_options)
    if policy not in policy_names():
        raise PlacementError(f"unknown policy {policy!r}: one of {', '.join(policy_names())}")
    if vram is not None and expert_slots is not None:
        raise PlacementError("give `vram` or `expert_slots`, not both")
    req = CacheRequest(
        vram,
        expert_slots,
        policy_record(policy, policy_options, blocking=blocking, assign=assign),
        blocking,
        alloc,
        assign,
        profile,
        degrade,
        device_prefill,
        device_prefill_ahead,
        precalc_from,
        context_tiers,
        device_prefill_borrow,
    )
    check_request(req)
    return req


def check_request(r: CacheRequest) -> None:
    """Every combination of the shared options the cache cannot run, refused with what to change (the policy's
    own options were checked as its record was built: policy_record)."""
    if r.vram is not None and r.expert_slots is not None:
        raise PlacementError("give `vram` or `expert_slots`, not both")
    if r.profile is not None and r.assign is None and r.vram is None:
        raise PlacementError(
            "`profile` gives `assign` its costs and plans a budget's prefill ubatch: add `assign='ratio'` "
            "(or greedy), or `vram`"
        )
    if (r.assign is not None or r.degrade is not None) and not r.enabled:
        raise PlacementError("`assign` and `degrade` act on the expert cache: give `vram` or `expert_slots`")
    if r.device_prefill and not r.enabled:
        raise PlacementError(
            "`device_prefill` runs prefill from the expert cache's device: give `vram` or `expert_slots`"
        )
    if r.device_prefill_ahead not in PREFILL_AHEAD:
        raise PlacementError(
            f"`device_prefill_ahead={r.device_prefill_ahead!r}`: one of {', '.join(PREFILL_AHEAD)}"
        )
    if r.device_prefill_borrow and not r.device_prefill:
        raise PlacementError(
            "`device_prefill_borrow` lends the slots to `device_prefill`'s buffers: add `device_prefill=N`"
        )
    if r.device_prefill_ahead != "all" and not r.device_prefill:
        raise PlacementError(
            "`device_prefill_ahead` says what `device_prefill` copies ahead: add `device_prefill=N`"
        )
    if r.precalc_from is not None:
        if not r.enabled:
            raise PlacementError(
                "`precalc_from` pre-calculates the experts outside the expert cache's slots: give "
                "`vram` or `expert_slots`"
            )
        hook = [
            o
            for o, on in (
                ("`degrade`", r.degrade is not None),
                ("`assign`", r.assign is not None),
                ("`blocking`", r.blocking),
            )
            if on
        ]
        hook += [o for o in (r.config.hook_option(),) if o is not None]
        if hook:
            raise PlacementError(
                f"`precalc_from` needs the cache's tables in the graph; {hook[0]} runs the cache "
                "from the routing hook: leave one of the two out"
            )
