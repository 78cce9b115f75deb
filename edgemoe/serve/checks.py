"""Checks both APIs make on what a client wrote, before it reaches the template or the tokenizer.

- lone UTF-16 surrogates (valid JSON, `"\\ud800"`, but not text: UTF-8 cannot encode them);
- tool names as OpenAI and Anthropic allow them (`^[a-zA-Z0-9_-]{1,64}$`), so none can carry template text;
- tool parameter schemas: a JSON Schema of an object, as both APIs require;
- OpenAI's tool messages: each answers a call of the assistant message before it, and every call of an
  assistant message that others follow is answered.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from pydantic_core import PydanticCustomError

from .errors import APIError, echo

TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
LONE_SURROGATE = "lone_surrogate"  # the pydantic error type of a request holding one


def _surrogate_at(text: str) -> int | None:
    return next((i for i, c in enumerate(text) if "\ud800" <= c <= "\udfff"), None)


def _find_surrogate(value: Any, where: str) -> tuple[str, int] | None:
    """(the dotted path of the first string holding a lone surrogate, its index there), or None."""
    if isinstance(value, str):
        i = _surrogate_at(value)
        return None if i is None else (where, i)
    if isinstance(value, dict):
        for k, v in value.items():
            path = f"{where}.{k}" if where else str(k)
            if isinstance(k, str) and (i := _surrogate_at(k)) is not None:
                return path, i
            if (found := _find_surrogate(v, path)) is not None:
                return found
    if isinstance(value, list):
        for n, v in enumerate(value):
            if (found := _find_surrogate(v, f"{where}.{n}" if where else str(n))) is not None:
                return found
    return None


def refuse_lone_surrogates(data: Any) -> Any:
    """A `mode="before"` model validator of a request body: PydanticCustomError naming the field of the first
    lone surrogate; the body unchanged when it has none (one C-speed encode tells)."""
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
        return data
    except UnicodeEncodeError:
        pass
    except (TypeError, ValueError):  # not JSON data: the model's own validation says what is wrong
        return data
    found = _find_surrogate(data, "")
    if found is None:
        return data
    where, i = found
    where = where.encode("utf-8", "backslashreplace").decode()  # a key may hold the surrogate itself
    raise PydanticCustomError(
        LONE_SURROGATE,
        "{param}: the string holds a lone UTF-16 surrogate at character {index}, which is not text; "
        "send valid Unicode (a high surrogate \\ud800-\\udbff followed by a low one \\udc00-\\udfff, "
        "or the character itself)",
        {"param": where, "index": i},
    )


def check_tool_name(name: str, param: str) -> None:
    if not TOOL_NAME.fullmatch(name):
        raise APIError(
            400,
            f"{param}: {echo(name)} is not a valid tool name: use 1 to 64 letters, digits, "
            "underscores or hyphens (^[a-zA-Z0-9_-]{1,64}$)",
            param=param,
            code="invalid_value",
        )


def check_object_schema(schema: dict[str, Any], param: str) -> None:
    """A tool's parameters must be a JSON Schema of an object (`{}` alone means no parameters)."""
    if not schema:
        return
    problem = _schema_problem(schema)
    if problem is not None:
        raise APIError(
            400,
            f"{param}: invalid JSON Schema for the tool's parameters: {problem}",
            param=param,
            code="invalid_value",
        )


def _schema_problem(schema: dict[str, Any]) -> str | None:
    if schema.get("type") != "object":
        return f"it must be of 'type: \"object\"', got 'type: {json.dumps(schema.get('type'))[:40]}'"
    props = schema.get("properties", {})
    if not isinstance(props, dict) or not all(isinstance(p, dict) for p in props.values()):
        return "'properties' must map each parameter's name to its schema (an object)"
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        return "'required' must be a list of parameter names"
    return None


def check_tool_answers(messages: Sequence[tuple[str, Sequence[str], str | None]]) -> None:
    """OpenAI's rule for tool messages, given (role, the ids of its tool calls, the tool_call_id it answers) per
    message: a tool message answers a call of the assistant message before its run of tool messages, and the
    calls of an assistant message that another message follows are all answered (the last may stay open). A
    tool message without an id is left to the message's own check."""
    asked: list[str] = []  # the calls of the assistant message before this run of tool messages
    answered: set[str] = set()
    asker = -1
    for i, (role, calls, answer) in enumerate(messages):
        if role == "tool":
            if answer is not None and answer not in asked:
                raise APIError(
                    400,
                    f"messages.{i}.tool_call_id: {echo(answer)} answers no tool call: a tool message must "
                    "answer a call in the tool_calls of the assistant message before it",
                    param=f"messages.{i}.tool_call_id",
                    code="invalid_value",
                )
            answered.add(answer or "")
            continue
        _check_answered(asker, asked, answered)
        asked, answered, asker = (list(calls), set(), i) if calls else ([], set(), -1)


def _check_answered(asker: int, asked: list[str], answered: set[str]) -> None:
    missing = [c for c in asked if c not in answered]
    if missing:
        raise APIError(
            400,
            f"messages.{asker}.tool_calls: an assistant message with tool_calls must be followed by tool messages "
            f"answering each tool_call_id; these have none: {echo(', '.join(missing))}",
            param=f"messages.{asker}.tool_calls",
            code="invalid_value",
        )
