"""Bounds on what one request can make the server hold or do (docs/serve.md, "Limits").

- JSON nesting: a request body nests arrays and objects at most MAX_JSON_DEPTH levels, and so does JSON inside
  one (a tool call's `arguments` string); the JSON of the model's tool calls at most MAX_CALL_DEPTH, so that a
  client echoing a call back stays within the body's limit. Deeper JSON would exhaust Python's recursion in
  the parser, the validation or the template (a 500 with a traceback of hundreds of KB).
- strict JSON text (`loads_strict`): no NaN or Infinity, no number that is not a finite float, no integer of more
  digits than Python parses, no lone UTF-16 surrogate: what the model writes in a tool call must come out as
  JSON any client parses, or stay text.
- stop strings: at most MAX_STOPS, of at most MAX_STOP_CHARS characters each (OpenAI allows 4).
- BodyBudget: the bytes of request bodies held at once while they arrive, across all connections.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from .errors import APIError

MAX_JSON_DEPTH = 128  # nesting of a request body (and of JSON inside it)
MAX_CALL_DEPTH = 64  # nesting of a tool call the model wrote (its arguments sit ~6 levels deep in a request)
MAX_STOPS = 16
MAX_STOP_CHARS = 256

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)  # a JSON string, escapes included
_STEP = np.zeros(256, np.int8)
_STEP[[ord("["), ord("{")]] = 1
_STEP[[ord("]"), ord("}")]] = -1
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def json_depth(data: bytes | str) -> int:
    """How deep the arrays and objects of a JSON text nest, brackets inside strings not counted (linear, no
    recursion). Of a text that is not JSON, a depth that is at least as large as a parser would reach."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    brackets = _STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    if not brackets:
        return 0
    return int(np.cumsum(_STEP[np.frombuffer(brackets, np.uint8)], dtype=np.int32).max())


class JSONRefused(ValueError):
    """JSON text that loads_strict does not accept (the message says why)."""


def _no_constant(name: str) -> Any:
    raise JSONRefused(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise JSONRefused(f"{text[:20]} does not fit a double")
    return value


def loads_strict(text: str, max_depth: int) -> Any:
    """json.loads of text that nests at most max_depth levels and holds only what every JSON parser reads back
    the same: finite numbers, integers Python parses (4,300 digits), valid Unicode; JSONRefused otherwise."""
    depth = json_depth(text)
    if depth > max_depth:
        raise JSONRefused(f"it nests {depth} levels deep, more than {max_depth}")
    try:
        value = json.loads(text, parse_constant=_no_constant, parse_float=_finite)
    except JSONRefused:
        raise
    except (ValueError, RecursionError) as err:  # JSONDecodeError, an integer of too many digits
        raise JSONRefused(str(err)[:200]) from None
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")  # one C-speed pass finds a lone surrogate
    except UnicodeEncodeError:
        raise JSONRefused("a string holds a lone UTF-16 surrogate") from None
    return value


def check_body_depth(body: bytes) -> None:
    """APIError 400 for a request body that nests deeper than MAX_JSON_DEPTH."""
    depth = json_depth(body)
    if depth > MAX_JSON_DEPTH:
        raise APIError(
            400,
            f"the request body nests arrays and objects {depth} levels deep; at most {MAX_JSON_DEPTH} are "
            "accepted",
            code="json_too_deep",
        )


def check_stops(stops: Sequence[str], param: str) -> tuple[str, ...]:
    """The stop strings, or APIError 400 when there are more than MAX_STOPS or one is longer than
    MAX_STOP_CHARS (each is searched for in the output, token by token)."""
    if len(stops) > MAX_STOPS:
        raise APIError(
            400,
            f"{param}: {len(stops)} stop strings given; at most {MAX_STOPS} are accepted",
            param=param,
            code="invalid_value",
        )
    for i, s in enumerate(stops):
        if len(s) > MAX_STOP_CHARS:
            raise APIError(
                400,
                f"{param}.{i}: a stop string of {len(s)} characters; at most {MAX_STOP_CHARS} are accepted",
                param=f"{param}.{i}",
                code="invalid_value",
            )
    return tuple(stops)


class BodyBudget:
    """The bytes of request bodies held at once while they arrive, across connections (one event loop: no
    lock). take() refuses past the capacity; give() returns what a body took once it is read or refused."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.held = 0

    def take(self, n: int) -> bool:
        if self.held + n > self.capacity:
            return False
        self.held += n
        return True

    def give(self, n: int) -> None:
        self.held -= n
