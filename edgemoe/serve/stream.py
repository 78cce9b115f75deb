"""A chat reply's text, as it streams, turned into the events the routes send.

ReplySplitter chains the reasoning split (reasoning.py) and the tool-call parse (tools.py) and then:
- drops the whitespace between and after tool calls: it is the model's separator, not text, and a client that
  keeps it sends it back as assistant content (OpenCode does);
- with parallel calls off, ends the reply after its first call (`done`: the worker stops generating).

Events: ("reasoning", text), ("delta", text), ("tool_call", ToolCall).
"""

from __future__ import annotations

from typing import Any

from .reasoning import ReasoningScanner
from .tools import ToolCall, ToolCallScanner

Event = tuple[str, Any]


class ReplySplitter:
    def __init__(
        self, *, tools: bool, reasoning: bool = True, reasoning_open: bool = False, single_call: bool = False
    ) -> None:
        self.reasoning = ReasoningScanner(inside=reasoning_open) if reasoning else None
        self.calls = ToolCallScanner() if tools else None
        self.single_call = single_call
        self.n_calls = 0
        self.gap = ""  # whitespace after a call, held until text (kept) or another call / the end (dropped)
        self.done = False  # the one call allowed has been made

    def push(self, text: str) -> list[Event]:
        return self._split(
            self.reasoning.push(text) if self.reasoning is not None else [("text", text)], False
        )

    def flush(self) -> list[Event]:
        return self._split(self.reasoning.flush() if self.reasoning is not None else [], True)

    def _split(self, pieces: list[tuple[str, str]], final: bool) -> list[Event]:
        out: list[Event] = []
        for kind, piece in pieces:
            if kind == "reasoning":
                out += self._keep([("reasoning", piece)])
            elif self.calls is None:
                out += self._keep([("delta", piece)] if piece else [])
            else:
                out += self._keep([self._event(e) for e in self.calls.push(piece)])
        if final and self.calls is not None:
            out += self._keep([self._event(e) for e in self.calls.flush()])
        return out

    @staticmethod
    def _event(e: str | ToolCall) -> Event:
        return ("tool_call", e) if isinstance(e, ToolCall) else ("delta", e)

    def _keep(self, events: list[Event]) -> list[Event]:
        out: list[Event] = []
        for kind, value in events:
            if self.done:
                break
            if kind == "tool_call":
                self.gap = ""
                self.n_calls += 1
                self.done = self.single_call
                out.append((kind, value))
            elif kind == "delta" and self.n_calls and not value.strip():
                self.gap += value
            elif kind == "delta":
                if value:
                    out.append((kind, self.gap + value))
                self.gap = ""
            else:
                out.append((kind, value))
        return out
