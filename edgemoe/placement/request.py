"""What a user asks of the expert cache (budget or slots, policy and its options), the default policy, and every
rule that refuses a combination, in one place."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InvalidConfigError
from ..policies.assignment import assign_refusal
from ..policies.dali_prefetch import dali_prefetch_refusal
from ..policies.promoe import distance_refusal

POLICIES = ("lru", "dali", "daop", "static", "promoe", "manual")
# the default policy: static. On the bundled routing profiles of real models at 8 GiB (tools/default_policy.py,
# docs/expert-cache.md "Defaults") the projected decode over stock's best is, as a geometric mean, static 1.44x,
# daop 1.46x (static plus a swap per prompt: within the model's error, and it copies at each prompt), dali 1.05x,
# lru 0.95x: no LRU-style policy beats static on any row.
DEFAULT_POLICY = "static"
PREFILL_AHEAD = ("all", "predicted", "routed")


class PlacementError(InvalidConfigError):
    """A cache request that cannot run as given; the message names the options and what to change."""


@dataclass(frozen=True)
class CacheRequest:
    vram: int | None  # GPU budget in bytes: dense part and KV cache first, the rest as expert slots
    expert_slots: int | None  # slots per MoE layer instead of a budget (with alloc dp: the average)
    policy: str  # one of POLICIES
    blocking: bool = False  # lru, dali, promoe: load a missed expert before its layer runs
    alloc: str | None = None  # "equal", "dp", or None: dp when the calibration has a routing trace
    dali_window: int | None = None  # dali: tokens per window (None: the paper's, residency.DALI_WINDOW)
    dali_update: int | None = None  # dali: experts replaced per window (None: the paper's for this model)
    prefetch_distance: int | None = None  # promoe: predict layer l+d at layer l (None: ProMoE's 2)
    prefetch_extra: int | None = None  # promoe: prefetch the top-(k+m) (None: m = 1)
    dali_prefetch: int | None = (
        None  # dali: next-layer experts prefetched per MoE layer (None, 0: none, native)
    )
    assign: str | None = None  # lru, dali: the CPU/GPU assigner of each route's loads (None: none)
    profile: str | None = None  # assign's machine profile (a bundled name or a file; None: this machine's)
    degrade: float | None = None  # DAOP's graceful degradation ratio (None: off)
    device_prefill: int = 0  # prefill ubatches of this many tokens or more run on the cache's device (0: off)
    device_prefill_ahead: str = "all"  # what they copy one cached layer ahead (PREFILL_AHEAD)
    precalc_from: int | None = (
        None  # DAOP's pre-calculation of the cached layers from this one on (None: off)
    )

    @property
    def enabled(self) -> bool:
        return self.vram is not None or self.expert_slots is not None


def default_policy(
    *,
    blocking: bool = False,
    assign: str | None = None,
    dali_window: int | None = None,
    dali_update: int | None = None,
    dali_prefetch: int | None = None,
    prefetch_distance: int | None = None,
    prefetch_extra: int | None = None,
) -> str:
    """The policy when none is given: the one the other options belong to, else DEFAULT_POLICY."""
    if dali_window is not None or dali_update is not None or dali_prefetch:
        return "dali"
    if prefetch_distance is not None or prefetch_extra is not None:
        return "promoe"
    if assign is not None or blocking:
        return "lru"  # static never loads a miss: nothing to block on or to assign
    return DEFAULT_POLICY


def cache_request(
    *,
    vram: int | None = None,
    expert_slots: int | None = None,
    policy: str | None = None,
    blocking: bool = False,
    alloc: str | None = None,
    dali_window: int | None = None,
    dali_update: int | None = None,
    prefetch_distance: int | None = None,
    prefetch_extra: int | None = None,
    dali_prefetch: int | None = None,
    assign: str | None = None,
    profile: str | None = None,
    degrade: float | None = None,
    device_prefill: int = 0,
    device_prefill_ahead: str = "all",
    precalc_from: int | None = None,
) -> CacheRequest:
    """A checked CacheRequest; policy None picks default_policy(). Raises PlacementError."""
    if policy is None:
        policy = default_policy(
            blocking=blocking,
            assign=assign,
            dali_window=dali_window,
            dali_update=dali_update,
            dali_prefetch=dali_prefetch,
            prefetch_distance=prefetch_distance,
            prefetch_extra=prefetch_extra,
        )
    req = CacheRequest(
        vram,
        expert_slots,
        policy,
        blocking,
        alloc,
        dali_window,
        dali_update,
        prefetch_distance,
        prefetch_extra,
        dali_prefetch,
        assign,
        profile,
        degrade,
        device_prefill,
        device_prefill_ahead,
        precalc_from,
    )
    check_request(req)
    return req


def check_request(r: CacheRequest) -> None:
    """Every combination the cache cannot run, refused with what to change."""
    if r.policy not in POLICIES:
        raise PlacementError(f"unknown policy {r.policy!r}: one of {', '.join(POLICIES)}")
    if r.vram is not None and r.expert_slots is not None:
        raise PlacementError("give --vram or --expert-slots, not both")
    if r.policy != "promoe" and (r.prefetch_distance is not None or r.prefetch_extra is not None):
        raise PlacementError("--prefetch-distance and --prefetch-extra are options of --policy promoe")
    if r.policy != "dali" and (r.dali_window is not None or r.dali_update is not None):
        raise PlacementError("--dali-window and --dali-update are options of --policy dali")
    refusal = distance_refusal(r.prefetch_distance) if r.prefetch_distance is not None else None
    if refusal is not None:
        raise PlacementError(refusal)
    for option, value in (("--dali-window", r.dali_window), ("--dali-update", r.dali_update)):
        if value is not None and value < 1:
            raise PlacementError(f"{option} {value}: at least 1")
    if r.blocking and r.policy in ("static", "manual"):
        raise PlacementError(
            f"--blocking-loads loads a miss before its layer runs; --policy {r.policy} loads no miss "
            "(static keeps its placement, manual makes only your loads): leave it out"
        )
    refusal = dali_prefetch_refusal(r.policy, blocking=r.blocking) if r.dali_prefetch else None
    if refusal is not None:
        raise PlacementError(refusal)
    if r.assign is not None:
        refusal = assign_refusal(r.policy, blocking=r.blocking, prefetcher=bool(r.dali_prefetch))
        if refusal is not None:
            raise PlacementError(refusal)
    if r.profile is not None and r.assign is None:
        raise PlacementError("--profile gives --assign its costs: add --assign ratio (or greedy)")
    if (r.assign is not None or r.degrade is not None) and not r.enabled:
        raise PlacementError("--assign and --degrade act on the expert cache: give --vram or --expert-slots")
    if r.device_prefill and not r.enabled:
        raise PlacementError(
            "--device-prefill runs prefill from the expert cache's device: give --vram or --expert-slots"
        )
    if r.device_prefill_ahead not in PREFILL_AHEAD:
        raise PlacementError(
            f"--device-prefill-ahead {r.device_prefill_ahead!r}: one of {', '.join(PREFILL_AHEAD)}"
        )
    if r.device_prefill_ahead != "all" and not r.device_prefill:
        raise PlacementError(
            "--device-prefill-ahead says what --device-prefill copies ahead: add --device-prefill N"
        )
    if r.precalc_from is not None:
        if not r.enabled:
            raise PlacementError(
                "--precalc-from pre-calculates the experts outside the expert cache's slots: give "
                "--vram or --expert-slots"
            )
        hook = [
            o
            for o, on in (
                ("--degrade", r.degrade is not None),
                ("--assign", r.assign is not None),
                ("--blocking-loads", r.blocking),
                ("--dali-prefetch", bool(r.dali_prefetch)),
            )
            if on
        ]
        if hook:
            raise PlacementError(
                f"--precalc-from needs the cache's tables in the graph; {hook[0]} runs the cache "
                "from the routing hook: leave one of the two out"
            )
