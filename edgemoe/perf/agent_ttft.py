"""Agent TTFT: a recorded coding-agent session replayed against `edgemoe serve`, and the same turns projected.

A coding agent's first turn is a 14-28K-token prompt (its system prompt and tool schemas) before the user's
question is even read: prefill speed decides whether a user stays. A session recorded from a real client
(tools/agent_proxy.py -> tools/agent_record.py, kept in tests/data/agents) is sent again request by request:

- warm: in order under one API key, as the client sent it: each turn reuses what the turns before left in the
  KV cache (the first is cold by nature);
- cold: each request under a key of its own, so that nothing is reused: the whole prompt is evaluated.

Each request asks for one token, so its latency is the time to the first token. The turns' prompt and reused
tokens are then projected through the performance model (perf.model.prefill_plan) for a model shape on a
machine profile: a cold turn is a prefill of the whole prompt from an empty cache; a warm one a prefill of the
tokens not reused, at the depth of those reused; each for stock llama.cpp and for edgemoe with --device-prefill,
at its fastest ubatch. tools/agent_ttft.py runs both.
"""

from __future__ import annotations

import copy
import json
import lzma
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .model.costmodel import ModelShape
from .model.prefill_plan import PrefillPlanner, PrefillSpec
from .model.workload import Step, Workload, prompt_workload


@dataclass(frozen=True)
class Session:
    client: str
    version: str
    requests: tuple[dict[str, Any], ...]  # {"path", "body"} in the order the client sent them


def load_session(path: Path) -> Session:
    """A session written by tools/agent_record.py --session (.json.xz, or plain .json)."""
    raw = Path(path).read_bytes()
    data = json.loads(lzma.decompress(raw) if str(path).endswith(".xz") else raw)
    return Session(data["client"], data["version"], tuple(data["requests"]))


def one_token(path: str, body: dict[str, Any], model: str) -> dict[str, Any]:
    """The request for `model`, whole (not streamed), asking for one token: its latency is the TTFT."""
    out = copy.deepcopy(body)
    out["model"] = model
    out["stream"] = False
    out.pop("stream_options", None)
    if path.endswith("/responses"):
        out["max_output_tokens"] = 1
    else:
        out.pop("max_completion_tokens", None)
        out["max_tokens"] = 1
    return out


def usage(path: str, reply: dict[str, Any]) -> tuple[int, int]:
    """(prompt tokens, tokens reused from the cache) of a reply of each API."""
    u = reply["usage"]
    if path.startswith("/v1/messages"):
        return u["input_tokens"] + u["cache_read_input_tokens"], u["cache_read_input_tokens"]
    if path.endswith("/responses"):
        return u["input_tokens"], u["input_tokens_details"]["cached_tokens"]
    return u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"]


@dataclass(frozen=True)
class TurnTTFT:
    turn: int  # 0-based, in the session's order
    path: str
    prompt_tokens: int
    reused_tokens: int  # in the warm replay
    warm_s: float
    cold_s: float


Post = Callable[[str, dict[str, Any], str], dict[str, Any]]  # (path, body, API key) -> the reply's JSON


def replay(session: Session, post: Post, *, model: str, keys: Sequence[str]) -> list[TurnTTFT]:
    """Warm then cold TTFT of each request; `keys`: one for the warm pass, then one per request (cold)."""
    if len(keys) < len(session.requests) + 1:
        raise ValueError(f"give {len(session.requests) + 1} API keys: one warm, one per request cold")
    warm: list[tuple[int, int, float]] = []
    for r in session.requests:
        t0 = time.perf_counter()
        reply = post(r["path"], one_token(r["path"], r["body"], model), keys[0])
        warm.append((*usage(r["path"], reply), time.perf_counter() - t0))
    out = []
    for i, r in enumerate(session.requests):
        t0 = time.perf_counter()
        reply = post(r["path"], one_token(r["path"], r["body"], model), keys[i + 1])
        cold_s = time.perf_counter() - t0
        n, reused = usage(r["path"], reply)
        if reused:
            raise RuntimeError(f"turn {i}: a cold request reused {reused} tokens; give each its own API key")
        out.append(TurnTTFT(i, r["path"], warm[i][0], warm[i][1], warm[i][2], cold_s))
    return out


# -- projection ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ProjectedTTFT:
    turn: int
    prompt_tokens: int
    reused_tokens: int
    cold_stock_s: float
    cold_edgemoe_s: float
    warm_stock_s: float
    warm_edgemoe_s: float


class _DeepPlanner(PrefillPlanner):
    """The prefill plan's sides (stock at its best --n-cpu-moe, edgemoe with --device-prefill) for a prompt's
    tail: `n_tokens` more tokens after `depth` already in the KV cache, at each side's fastest ubatch."""

    def ttft_at(self, n_tokens: int, depth: int) -> tuple[float, float]:
        """(stock's, edgemoe's) seconds to the first token."""
        if depth == 0:
            p = self.project(n_tokens)
            best = {c.kind: c.best.ttft_s for c in p.choices if not c.borrow}
            return best.get("stock", float("inf")), best.get("edgemoe", float("inf"))
        info = self.shape.info
        ctx = max(self.spec.n_ctx, depth + n_tokens)
        stock, ours = float("inf"), float("inf")
        for u in [u for u in self.spec.ubatches if u <= ctx] or [self.spec.ubatches[0]]:
            work = prompt_workload(self.trace, self.shape.moe_layers, info.n_expert, info.n_expert_used,
                                   n_tokens=n_tokens, n_ubatch=u)  # fmt: skip
            work = Workload(
                tuple(Step(s.phase, s.seq, s.kv_len + depth, s.ids) for s in work.steps),
                work.moe_layers,
                work.n_expert,
                work.note,
            )
            if (o := self._stock(work, ctx, u)) is not None:
                stock = min(stock, o.ttft_s)
            if (o := self._edgemoe(work, ctx, u)) is not None:
                ours = min(ours, o.ttft_s)
        return stock, ours


def project_turns(
    turns: Sequence[TurnTTFT], shape: ModelShape, trace: Any, prof: Any, spec: PrefillSpec
) -> list[ProjectedTTFT]:
    """Each turn's cold and warm TTFT for `shape` on `prof` (PROJECTED), its token counts as replayed."""
    planner = _DeepPlanner(shape, trace, prof, spec)
    out = []
    for t in turns:
        cold = planner.ttft_at(t.prompt_tokens, 0)
        new = max(1, t.prompt_tokens - t.reused_tokens)
        warm = planner.ttft_at(new, t.reused_tokens) if t.reused_tokens else cold
        out.append(ProjectedTTFT(t.turn, t.prompt_tokens, t.reused_tokens, *cold, *warm))
    return out
