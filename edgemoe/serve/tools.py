"""Tool calls in the model's output: the Qwen3 / Hermes form, parsed as the text streams.

The model writes `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (whitespace around the JSON
allowed); ToolCallScanner turns a stream of text pieces into text events and ToolCall events, holding
back a tail that may begin a tag. A call whose JSON does not parse is given back as text, and so is one that
no client could read back the same: NaN or Infinity, a number beyond a double or an integer beyond Python's
4,300 digits, nesting deeper than MAX_CALL_DEPTH, a lone-surrogate escape, a name that is not a tool name (or
namespace.name, the Responses API's flattened namespace tools).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from .limits import MAX_CALL_DEPTH, JSONRefused, loads_strict

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# a tool name as clients send it, or a Responses namespace tool's function flattened as namespace.name
CALL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}(?:\.[a-zA-Z0-9_-]{1,64})?")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


Event = str | ToolCall  # a piece of text, or a whole call


def parse_call(body: str) -> ToolCall | None:
    """The call in the text between the tags, or None when it is not {"name": tool name, "arguments": object}
    in strict JSON (limits.loads_strict)."""
    try:
        obj = loads_strict(body, MAX_CALL_DEPTH)
    except JSONRefused:
        return None
    if (
        not isinstance(obj, dict)
        or not isinstance(obj.get("name"), str)
        or not CALL_NAME.fullmatch(obj["name"])
    ):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = loads_strict(args, MAX_CALL_DEPTH)
        except JSONRefused:
            return None
    return ToolCall(obj["name"], args) if isinstance(args, dict) else None


def _held(text: str, tag: str) -> int:
    """Length of the longest tail of text that is a proper prefix of tag."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:k])), 0)


class ToolCallScanner:
    """push(piece) -> events safe to emit now; flush() -> the rest at the end of the reply."""

    def __init__(self) -> None:
        self.buf = ""
        self.inside = False  # between OPEN and CLOSE

    def push(self, piece: str) -> list[Event]:
        self.buf += piece
        out: list[Event] = []
        while True:
            if not self.inside:
                i = self.buf.find(OPEN)
                if i < 0:
                    keep = _held(self.buf, OPEN)
                    text, self.buf = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep :]
                    if text:
                        out.append(text)
                    return out
                if i:
                    out.append(self.buf[:i])
                self.buf, self.inside = self.buf[i + len(OPEN) :], True
            j = self.buf.find(CLOSE)
            if j < 0:
                return out
            body, self.buf, self.inside = self.buf[:j], self.buf[j + len(CLOSE) :], False
            call = parse_call(body.strip())
            out.append(call if call is not None else OPEN + body + CLOSE)

    def flush(self) -> list[Event]:
        """At the end: an unclosed call still counts when its JSON is whole, else it is text."""
        rest, inside = self.buf, self.inside
        self.buf, self.inside = "", False
        if not inside:
            return [rest] if rest else []
        call = parse_call(rest.strip())
        return [call] if call is not None else [OPEN + rest]


def split_calls(text: str) -> tuple[str, list[ToolCall]]:
    """A whole reply: (its text without the calls, the calls in order)."""
    scanner = ToolCallScanner()
    events = scanner.push(text) + scanner.flush()
    return "".join(e for e in events if isinstance(e, str)), [e for e in events if isinstance(e, ToolCall)]
