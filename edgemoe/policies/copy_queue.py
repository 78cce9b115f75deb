"""A model of the expert cache's slots and copy queue, and of the copy stream's pace.

`CacheModel` applies the rules of llama.cpp's expert cache in Python: per MoE layer, which expert
is in which slot, and a queue of loads copied chunk by chunk (an expert's gate/up/down byte
ranges, plus biases and scales), highest priority first, FIFO among equal priorities:

- ``prefetch(load, priority)``: nothing if the expert is resident or already queued; else the
  loads queued into the slot are dropped, the slot's expert is evicted now, the load is queued;
- ``cancel(layer, slot)``: the loads queued into the slot are dropped and the slot is emptied
  (``llama_moe_cache_load(ctx, il, -1, slot)``: the native API's only way to drop a queued load);
- ``load(load)``: a synchronous copy (drops the queued loads into the slot or of the expert);
- ``issue()``: sends the next chunk of the best queued load.

It is the state a prefetching policy (edgemoe.policies.promoe) reads and acts on, both when it is
replayed on a trace (edgemoe.policies.replay) and in the engine, where every action is also logged
as a native operation (`take_ops`) for the runtime to make on llama.cpp's cache in the same order.
One simplification, exact for where every expert runs: a load whose chunks are all issued counts
as resident here at once; llama.cpp makes it resident when its layer next routes (or at a sync),
which is also the first time it could be used, and a later prefetch into its slot evicts it here
where llama.cpp drops it, which leaves the slot in the same state.

`CopyTiming` and `CopyStream` say how many chunks the copy stream moves while a layer computes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum

from ..errors import EdgeMoeError
from .loads import Load


def load_worker_default(device_name: str) -> bool:
    """Whether llama.cpp's load worker issues the expert cache's loads on this device by default: yes, except on llama.cpp's RPC device, whose one FIFO connection carries the copies and the graph
    runs, so a worker overlaps nothing there; then the caller issues them when it synchronises."""
    return not device_name.startswith("RPC")


DEFAULT_CHUNKS = (1, 1, 1)  # three chunks (gate, up, down) of one unit each, when only counts matter


class CacheModelError(EdgeMoeError):
    """An action on the cache model names a layer, slot or expert the cache does not have."""


class LoadState(IntEnum):
    """enum llama_moe_cache_state."""

    ABSENT = 0
    QUEUED = 1  # no chunk issued yet
    COPYING = 2  # some chunks issued
    RESIDENT = 3


class Priority(IntEnum):
    """Queue priorities (llama_moe_cache_prefetch's `priority`; higher first)."""

    REFILL = -1  # promoe: an expert a layer just ran on the CPU, for the layer's next run
    SPECULATIVE = 0  # ProMoE's low-priority tasks: predicted experts; lru/dali's loads for a later step
    PRECISE = 1  # ProMoE's high-priority tasks: experts the router chose, that a blocking layer waits for


@dataclass(eq=False)  # identity: two loads of the same expert are different requests
class Request:
    """One queued load."""

    layer: int
    expert: int
    slot: int
    priority: int
    seq: int  # FIFO among equal priorities
    chunks: tuple[int, ...]  # bytes of each chunk, in issue order
    issued: int = 0  # chunks sent
    tag: object = None  # the asker's bookkeeping (a prefetch policy's Prediction)

    @property
    def state(self) -> LoadState:
        return LoadState.COPYING if self.issued else LoadState.QUEUED


@dataclass
class Resident:
    slot: int
    tag: object = None  # the tag of the load that brought it
    counted: bool = True  # brought during a counted step
    used: bool = False  # has served a hit since


@dataclass(frozen=True)
class PrefetchOp:
    load: Load
    priority: int


@dataclass(frozen=True)
class CancelOp:
    layer: int
    slot: int


@dataclass(frozen=True)
class IssueOp:
    chunks: int


@dataclass(frozen=True)
class SyncOp:
    pass


NativeOp = PrefetchOp | CancelOp | IssueOp | SyncOp | Load  # Load: a synchronous copy


class CacheModel:
    """Slots and copy queue of one expert cache; starts empty. `chunk_bytes`: layer -> bytes of each chunk
    of one expert (ExpertCache.chunk_bytes); layers left out have DEFAULT_CHUNKS."""

    def __init__(
        self, n_slots: Mapping[int, int], chunk_bytes: Mapping[int, Sequence[int]] | None = None
    ) -> None:
        self.n_slots = {il: int(n) for il, n in n_slots.items()}
        self.chunk_bytes = {
            il: tuple(int(b) for b in chunk_bytes.get(il, DEFAULT_CHUNKS)) if chunk_bytes else DEFAULT_CHUNKS
            for il in self.n_slots
        }
        self._resident: dict[int, dict[int, Resident]] = {il: {} for il in self.n_slots}
        self.queue: list[Request] = []
        self._seq = 0
        self.counting = True  # what Resident.counted records (the driver sets it per step)
        self.queued: list[Request] = []  # loads queued, since the caller last took them
        self.completed: list[Request] = []  # loads that became resident, likewise
        self.dropped: list[Request] = []  # queued loads dropped before completing, likewise
        self.issued_bytes = 0  # bytes of chunks (and synchronous loads) sent, likewise
        self._ops: list[NativeOp] = []

    # -- reading ----------------------------------------------------------------------------
    def resident(self, layer: int) -> Mapping[int, Resident]:
        return self._resident.get(layer, {})

    def request(self, layer: int, expert: int) -> Request | None:
        return next((r for r in self.queue if r.layer == layer and r.expert == expert), None)

    def pending(self, layer: int) -> list[Request]:
        return [r for r in self.queue if r.layer == layer]

    def state(self, layer: int, expert: int) -> LoadState:
        if expert in self.resident(layer):
            return LoadState.RESIDENT
        req = self.request(layer, expert)
        return req.state if req is not None else LoadState.ABSENT

    def occupant(self, layer: int, slot: int) -> tuple[int, Request | None]:
        """(expert in the slot or loading into it, or -1; its queued load or None)."""
        req = next((r for r in self.queue if r.layer == layer and r.slot == slot), None)
        if req is not None:
            return req.expert, req
        return next((e for e, r in self.resident(layer).items() if r.slot == slot), -1), None

    # -- acting (each action is logged as the native operation that does the same) -----------
    def prefetch(self, load: Load, priority: int, tag: object = None) -> bool:
        """Queue a load (False: the expert is resident or queued already, nothing changes)."""
        self._check(load.layer, load.slot, load.expert)
        if self.state(load.layer, load.expert) is not LoadState.ABSENT:
            return False
        self._ops.append(PrefetchOp(load, int(priority)))
        self._drop(lambda r: r.layer == load.layer and r.slot == load.slot)
        self._evict(load.layer, load.slot)
        req = Request(
            load.layer,
            load.expert,
            load.slot,
            int(priority),
            self._seq,
            self.chunk_bytes[load.layer],
            tag=tag,
        )
        self.queue.append(req)
        self.queued.append(req)
        self._seq += 1
        return True

    def cancel(self, layer: int, slot: int) -> None:
        """Drop the loads queued into the slot and empty it."""
        self._check(layer, slot, -1)
        self._ops.append(CancelOp(layer, slot))
        self._drop(lambda r: r.layer == layer and r.slot == slot)
        self._evict(layer, slot)

    def load(self, load: Load, tag: object = None) -> None:
        """A synchronous copy: resident when this returns."""
        self._check(load.layer, load.slot, load.expert)
        res = self._resident[load.layer]
        if load.expert in res and res[load.expert].slot == load.slot:
            return
        self._ops.append(load)
        self._drop(lambda r: r.layer == load.layer and (r.slot == load.slot or r.expert == load.expert))
        self._evict(load.layer, load.slot)
        res.pop(load.expert, None)
        res[load.expert] = Resident(load.slot, tag, self.counting)
        self.issued_bytes += sum(self.chunk_bytes[load.layer])
        self.completed.append(
            Request(
                load.layer,
                load.expert,
                load.slot,
                Priority.PRECISE,
                -1,
                self.chunk_bytes[load.layer],
                len(self.chunk_bytes[load.layer]),
                tag,
            )
        )

    def next_chunk(self) -> Request | None:
        """The load whose chunk issue() would send next (highest priority, then the oldest)."""
        best = None
        for r in self.queue:
            if r.issued < len(r.chunks) and (
                best is None or (r.priority, -r.seq) > (best.priority, -best.seq)
            ):
                best = r
        return best

    def issue(self, max_chunks: int | None = None) -> int:
        """Send up to max_chunks chunks (None: all), best load first; returns the chunks sent."""
        n = 0
        while max_chunks is None or n < max_chunks:
            if self._issue_one() is None:
                break
            n += 1
        if n:
            self._ops.append(IssueOp(n))
        return n

    def issue_within(self, budget: float) -> tuple[int, float]:
        """Send chunks in issue() order while their bytes fit the budget: (chunks sent, budget left)."""
        n = 0
        while (r := self.next_chunk()) is not None and r.chunks[r.issued] <= budget:
            budget -= r.chunks[r.issued]
            self._issue_one()
            n += 1
        if n:
            self._ops.append(IssueOp(n))
        return n, budget

    def queued_bytes(self, priority: int = Priority.REFILL) -> int:
        """Bytes of the chunks still to send of loads at `priority` or above: what a load queued now at that
        priority waits for."""
        return sum(sum(r.chunks[r.issued :]) for r in self.queue if r.priority >= priority)

    def issue_until(self, requests: Iterable[Request]) -> tuple[int, int]:
        """Send chunks in issue() order until `requests` are complete: (chunks, bytes) sent."""
        todo = [r for r in requests if r in self.queue]
        n = nbytes = 0
        while any(r.issued < len(r.chunks) for r in todo):
            r = self.next_chunk()
            assert r is not None  # the requests are queued, so some chunk is left
            nbytes += r.chunks[r.issued]
            self._issue_one()
            n += 1
        if n:
            self._ops.append(IssueOp(n))
        return n, nbytes

    def sync(self) -> None:
        """llama_moe_cache_sync: the issued loads become resident there (here they are already)."""
        self._ops.append(SyncOp())

    def take_ops(self) -> list[NativeOp]:
        ops, self._ops = self._ops, []
        return ops

    def take_events(self) -> tuple[list[Request], list[Request], list[Request], int]:
        """(loads queued, loads completed, loads dropped, bytes sent) since the last call."""
        out = (self.queued, self.completed, self.dropped, self.issued_bytes)
        self.queued, self.completed, self.dropped, self.issued_bytes = [], [], [], 0
        return out

    # -- internals ---------------------------------------------------------------------------
    def _issue_one(self) -> Request | None:
        r = self.next_chunk()
        if r is None:
            return None
        self.issued_bytes += r.chunks[r.issued]
        r.issued += 1
        if r.issued == len(r.chunks):
            self.queue.remove(r)
            self._resident[r.layer][r.expert] = Resident(r.slot, r.tag, self.counting)
            self.completed.append(r)
        return r

    def _drop(self, which: object) -> None:
        keep = []
        for r in self.queue:
            (self.dropped if which(r) else keep).append(r)  # type: ignore[operator]
        self.queue = keep

    def _evict(self, layer: int, slot: int) -> None:
        res = self._resident[layer]
        for e in [e for e, r in res.items() if r.slot == slot]:
            del res[e]

    def _check(self, layer: int, slot: int, expert: int) -> None:
        n = self.n_slots.get(layer, 0)
        if not 0 <= slot < n or expert < -1:
            raise CacheModelError(
                f"layer {layer}: slot {slot} / expert {expert} is not in the cache (the layer has {n} slots)"
            )


@dataclass(frozen=True)
class CopyTiming:
    """How fast loads arrive: the copy stream's bandwidth against the time a MoE layer computes.

    While a MoE layer of an n-token ubatch computes (n * layer_s, the layers before the next MoE
    layer included), the stream moves bandwidth * n * layer_s bytes of queued chunks, in issue
    order; a chunk is complete for the next MoE layer if its bytes fit. With an infinite bandwidth
    every queued chunk is complete before the next MoE layer routes.
    """

    bandwidth: float = math.inf  # bytes/s host -> cache device
    layer_s: float = 1e-3  # seconds one MoE layer computes one token

    def __post_init__(self) -> None:
        if not self.bandwidth > 0 or not (math.isfinite(self.layer_s) and self.layer_s > 0):
            raise EdgeMoeError(
                f"copy timing: bandwidth {self.bandwidth} B/s and layer time {self.layer_s} s "
                "must both be > 0 (the bandwidth may be infinite)"
            )

    @property
    def infinite(self) -> bool:
        return math.isinf(self.bandwidth)

    def describe(self) -> str:
        if self.infinite:
            return "infinite bandwidth"
        return f"{self.bandwidth / 1e9:.3g} GB/s, {self.layer_s * 1e6:.0f} us per MoE layer"


@dataclass
class CopyStream:
    """The copy stream's pace in whole chunks. After each MoE layer routes, the chunks that the stream
    copies while the layer computes are issued: the queue's chunks in order while their bytes fit the
    bytes the interval moves plus what the last interval left (a chunk bigger than what is left waits for
    the next interval); an idle stream saves nothing. `wait` is a blocking layer: it waits (stall_s) until
    the given loads are complete."""

    timing: CopyTiming
    budget: float = 0.0  # bytes the stream moved that no issued chunk has used yet
    stall_s: float = field(default=0.0)  # time layers waited for loads (blocking)

    def interval(self, model: CacheModel, n_tokens: int) -> int:
        if self.timing.infinite:
            return model.issue()
        self.budget += self.timing.bandwidth * self.timing.layer_s * max(1, n_tokens)
        n, self.budget = model.issue_within(self.budget)
        if model.next_chunk() is None:
            self.budget = 0.0
        return n

    def wait(self, model: CacheModel, requests: Iterable[Request]) -> float:
        """Issue chunks in order until `requests` are complete; returns the seconds the layer waits."""
        _, nbytes = model.issue_until(requests)
        if self.timing.infinite:
            return 0.0
        stall = max(0.0, nbytes - self.budget) / self.timing.bandwidth
        self.budget = max(0.0, self.budget - nbytes)
        self.stall_s += stall
        return stall
