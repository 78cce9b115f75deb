"""Output constraints enforced with llama.cpp grammars (GBNF), as llama-server enforces them.

- `response_format` (OpenAI `json_object` / `json_schema`, the Responses API's `text.format`, Anthropic's
  `output_config.format`): the reply is JSON (of that schema);
- a forced tool call (OpenAI `tool_choice: "required"` or a named function, Anthropic `any` / `tool`): the reply
  is one or more calls in the Qwen3 / Hermes form the server parses (tools.py), of the allowed tools, their
  arguments held to each tool's parameter schema; one call only when parallel calls are off.

A Constraint is built when the request is read (a schema the converter cannot turn into a grammar is a 400
then); the worker turns it into the grammar once the prompt is rendered: a prompt whose template opened a
reasoning block lets the model finish it before the constrained part.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from llama_cpp.llama_grammar import SchemaConverter

from .errors import APIError
from .tools import CLOSE, OPEN

# the text of a reasoning block the template opened: anything but "</" until "</think>"
_REASONING = 'reasoning ::= ([^<] | "<" [^/])* "</think>" space'


@dataclass(frozen=True)
class Constraint:
    rules: str  # GBNF rules defining `body` (and what it uses)
    what: str  # what it enforces, for the logs and the reply's notes

    def grammar(self, *, reasoning_open: bool = False) -> str:
        if reasoning_open:
            return f"root ::= reasoning body\n{_REASONING}\n{self.rules}"
        return f"root ::= body\n{self.rules}"


def _converter() -> SchemaConverter:
    return SchemaConverter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)


def _visit(conv: SchemaConverter, schema: dict[str, Any], name: str, param: str) -> str:
    try:
        return conv.visit(conv.resolve_refs(schema, "request"), name)
    except Exception as err:  # noqa: BLE001 - the converter raises bare exceptions on what it does not support
        raise APIError(
            400,
            f"{param}: this JSON Schema cannot be enforced with a grammar ({type(err).__name__}: "
            f"{str(err)[:160]}); simplify it or leave it out",
            param=param,
            code="unsupported_schema",
        ) from None


def json_constraint(schema: dict[str, Any] | None, param: str) -> Constraint:
    """JSON output: of `schema`, or any JSON object when None."""
    conv = _converter()
    _visit(conv, schema if schema is not None else {"type": "object"}, "body", param)
    return Constraint(conv.format_grammar(), "JSON schema" if schema is not None else "JSON object")


def _literal(conv: SchemaConverter, text: str) -> str:
    return conv._format_literal(text)  # the converter's own GBNF string quoting


def tool_constraint(
    tools: list[dict[str, Any]], *, only: str | None, parallel: bool, param: str
) -> Constraint:
    """One call (or several, when parallel) to one of `tools` (OpenAI-shaped), or to the tool named `only`."""
    conv = _converter()
    alternatives = []
    for i, t in enumerate(tools):
        fn = t["function"]
        if only is not None and fn["name"] != only:
            continue
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        args = _visit(conv, params, f"args{i}", f"{param}.{i}.parameters")
        head = _literal(conv, f'{OPEN}\n{{"name": {json.dumps(fn["name"])}, "arguments": ')
        tail = _literal(conv, f"}}\n{CLOSE}")
        alternatives.append(f"{head} {args} {tail}")
    if not alternatives:
        raise APIError(400, f"no tool to call: {param} is empty", param=param, code="invalid_value")
    calls = 'call ("\\n" call)*' if parallel else "call"
    rules = f"body ::= {calls}\ncall ::= {' | '.join(alternatives)}\n{conv.format_grammar()}"
    return Constraint(rules, f"a call to {only}" if only else "a tool call")
