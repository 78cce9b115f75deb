"""OpenAI's Responses API (POST /v1/responses), served by converting it to a chat, as llama-server does.

Codex CLI speaks only this API. The request's `instructions` and `input` items become template messages
(conversation.py): `message` items by role (`developer` is a system message; leading ones are merged),
`function_call` items an assistant's tool_calls, `function_call_output` items tool messages; reasoning items
are not part of the prompt. Function tools reach the template as OpenAI-shaped tools; a `namespace` tool's
functions are flattened to `namespace.name` (a call to one comes back with its `namespace` apart); `custom`
tools become functions of one string `input`; hosted tools (web search, file search...) are left out. Nothing
is stored: `previous_response_id` is refused, clients send the whole conversation (`store: false`).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import replace
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, model_validator

from ..runtime.sampling import SamplingParams
from .checks import check_object_schema, check_tool_name, refuse_lone_surrogates
from .conversation import DOCUMENT_PLACEHOLDER, IMAGE_PLACEHOLDER, join_text, media_notes
from .errors import APIError
from .grammar import Constraint, json_constraint, tool_constraint
from .limits import MAX_JSON_DEPTH, JSONRefused, loads_strict
from .reasoning import Reasoning
from .tools import ToolCall
from .worker import Outcome

log = logging.getLogger(__name__)

_TEXT_PARTS = ("input_text", "output_text", "text", "refusal", "summary_text", "reasoning_text")
_SKIPPED_ITEMS = ("reasoning", "web_search_call", "image_generation_call", "file_search_call", "compaction")


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ResponsesRequest(_Lenient):
    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        return refuse_lone_surrogates(data)

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    stream: StrictBool = False
    text: dict[str, Any] | None = None
    previous_response_id: str | None = None
    # edgemoe's: false turns the server's speculative decoding off for this request
    speculate: StrictBool = True

    def check(self) -> None:
        if self.previous_response_id:
            raise APIError(
                400,
                "previous_response_id is not supported: this server stores no responses; send the whole "
                "conversation in `input` (store: false)",
                param="previous_response_id",
                code="unsupported_parameter",
            )
        self.template_tools()  # names and schemas
        self.constraint()

    def limit(self, default: int) -> int:
        return self.max_output_tokens or default

    def sampling(self, default: SamplingParams) -> SamplingParams:
        given = {"temperature": self.temperature, "top_p": self.top_p}
        return replace(default, **{k: v for k, v in given.items() if v is not None})

    # -- the conversation ------------------------------------------------------------------
    def chat_messages(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self.instructions:
            out.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return [*out, {"role": "user", "content": self.input}]
        for i, item in enumerate(self.input):
            _add_item(out, item, f"input.{i}")
        return out

    def notes(self) -> tuple[str, ...]:
        images = documents = 0
        for item in self.input if isinstance(self.input, list) else []:
            for part in _parts(item.get("content")) + _parts(item.get("output")):
                images += part.get("type") == "input_image"
                documents += part.get("type") == "input_file"
        return media_notes(images, documents)

    # -- tools -----------------------------------------------------------------------------
    def namespaces(self) -> set[str]:
        return {str(t.get("name")) for t in self.tools or [] if t.get("type") == "namespace"}

    def template_tools(self) -> list[dict[str, Any]] | None:
        if not self.tools or self.tool_choice == "none":
            return None
        out: list[dict[str, Any]] = []
        hosted = []
        for i, t in enumerate(self.tools):
            kind = t.get("type", "function")
            if kind == "function":
                out.append(_function(t, f"tools.{i}"))
            elif kind == "namespace":
                check_tool_name(str(t.get("name", "")), f"tools.{i}.name")
                inner = t.get("tools")
                if not isinstance(inner, list) or not all(isinstance(fn, dict) for fn in inner):
                    raise APIError(
                        400, f"tools.{i}.tools must be a list of function tools", param=f"tools.{i}.tools"
                    )
                for j, fn in enumerate(inner):
                    out.append(_function(fn, f"tools.{i}.tools.{j}", namespace=str(t["name"])))
            elif kind == "custom":
                out.append(_custom(t, f"tools.{i}"))
            else:
                hosted.append(str(kind))
        if hosted:  # web search and the like run on OpenAI's side; a local model cannot call them
            log.info("ignoring hosted tools %s (only function tools reach the model)", ", ".join(hosted))
        return out or None

    def forced_tool(self) -> tuple[bool, str | None]:
        """(a call is forced, the tool it must call or None for any)."""
        choice = self.tool_choice
        if choice is None or choice == "auto" or choice == "none":
            return False, None
        if choice == "required":
            return True, None
        if (
            isinstance(choice, dict)
            and choice.get("type") == "function"
            and isinstance(choice.get("name"), str)
        ):
            return True, choice["name"]
        raise APIError(
            400,
            f"tool_choice {json.dumps(choice)[:80]} is not supported: give auto, none, required or "
            '{"type": "function", "name": ...}',
            param="tool_choice",
            code="unsupported_value",
        )

    def constraint(self) -> Constraint | None:
        forced, name = self.forced_tool()
        tools = self.template_tools()
        if forced:
            if not tools:
                raise APIError(
                    400, "tool_choice forces a call, but no function tools are given", param="tools"
                )
            if name is not None and name not in {t["function"]["name"] for t in tools}:
                raise APIError(
                    400,
                    f"tool_choice names the function {name[:80]!r}, which is not in tools: declare it there",
                    param="tool_choice",
                    code="invalid_value",
                )
            return tool_constraint(
                tools, only=name, parallel=self.parallel_tool_calls is not False, param="tools"
            )
        fmt = (self.text or {}).get("format") or {}
        if not isinstance(fmt, dict):
            raise APIError(400, "text.format must be an object", param="text.format")
        kind = fmt.get("type", "text")
        if kind == "json_object":
            return json_constraint(None, "text.format")
        if kind == "json_schema":
            schema = fmt.get("schema")
            if not isinstance(schema, dict):
                raise APIError(
                    400, "text.format.schema must be a JSON Schema object", param="text.format.schema"
                )
            return json_constraint(schema, "text.format.schema")
        if kind != "text":
            raise APIError(
                400, f"text.format type {str(kind)[:40]!r} is not supported", param="text.format.type"
            )
        return None


def _parts(content: Any) -> list[dict[str, Any]]:
    return [p for p in content if isinstance(p, dict)] if isinstance(content, list) else []


def _text_of(content: Any, param: str) -> str:
    """The text of an item's content: a string, or parts (text parts joined by "\\n", media as placeholders)."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise APIError(400, f"{param} must be a string or a list of content parts", param=param)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS:
            texts.append(str(part.get("text") or part.get("refusal") or ""))
        elif kind == "input_image":
            texts.append(IMAGE_PLACEHOLDER)
        elif kind == "input_file":
            texts.append(DOCUMENT_PLACEHOLDER)
        else:
            raise APIError(
                400,
                f"{param}.{j}: content parts of type {str(kind)[:40]!r} are not supported (input_text, "
                "output_text, input_image and input_file are)",
                param=f"{param}.{j}",
                code="unsupported_content",
            )
    return join_text(texts)


def _flat_name(item: dict[str, Any]) -> str:
    name = str(item.get("name") or "")
    return f"{item['namespace']}.{name}" if item.get("namespace") else name


def _open_assistant(out: list[dict[str, Any]]) -> dict[str, Any]:
    """The assistant message a function_call item belongs to: the last one, unless results followed it."""
    if out and out[-1]["role"] == "assistant":
        return out[-1]
    msg: dict[str, Any] = {"role": "assistant", "content": ""}
    out.append(msg)
    return msg


def _add_item(out: list[dict[str, Any]], item: dict[str, Any], param: str) -> None:
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise APIError(
                400, f"{param}.role: {str(role)[:40]!r} is not a message role", param=f"{param}.role"
            )
        text = _text_of(item.get("content"), f"{param}.content")
        out.append({"role": "system" if role == "developer" else role, "content": text})
    elif kind in ("function_call", "custom_tool_call"):
        args: Any = (
            item.get("arguments", "{}") if kind == "function_call" else {"input": item.get("input", "")}
        )
        if isinstance(args, str):
            try:
                args = loads_strict(args or "{}", MAX_JSON_DEPTH)
            except JSONRefused:
                args = None
        if not isinstance(args, dict):
            raise APIError(400, f"{param}.arguments is not a JSON object", param=f"{param}.arguments")
        call = {
            "id": str(item.get("call_id") or ""),
            "type": "function",
            "function": {"name": _flat_name(item), "arguments": args},
        }
        _open_assistant(out).setdefault("tool_calls", []).append(call)
    elif kind in ("function_call_output", "custom_tool_call_output"):
        output = item.get("output")
        text = output if isinstance(output, str) else _text_of(output, f"{param}.output")
        out.append({"role": "tool", "tool_call_id": str(item.get("call_id") or ""), "content": text})
    elif kind in _SKIPPED_ITEMS:
        return  # earlier turns' reasoning and hosted tools' calls are not part of the prompt
    else:
        raise APIError(
            400,
            f"{param}: input items of type {str(kind)[:40]!r} are not supported (message, function_call, "
            "function_call_output and reasoning are)",
            param=f"{param}.type",
            code="unsupported_value",
        )


def _function(t: dict[str, Any], param: str, *, namespace: str | None = None) -> dict[str, Any]:
    name = str(t.get("name", ""))
    check_tool_name(name, f"{param}.name")
    params = t.get("parameters") or {}
    if not isinstance(params, dict):
        raise APIError(400, f"{param}.parameters must be a JSON Schema object", param=f"{param}.parameters")
    check_object_schema(params, f"{param}.parameters")
    fn: dict[str, Any] = {"name": f"{namespace}.{name}" if namespace else name, "parameters": params}
    if t.get("description"):
        fn["description"] = str(t["description"])
    return {"type": "function", "function": fn}


def _custom(t: dict[str, Any], param: str) -> dict[str, Any]:
    """A freeform tool as a function taking the text as `input`."""
    name = str(t.get("name", ""))
    check_tool_name(name, f"{param}.name")
    schema = {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}
    return {
        "type": "function",
        "function": {"name": name, "description": str(t.get("description") or ""), "parameters": schema},
    }


# -- the reply --------------------------------------------------------------------------------------
def _usage(out: Outcome) -> dict[str, Any]:
    return {
        "input_tokens": out.prompt_tokens,
        "input_tokens_details": {"cached_tokens": out.cached_tokens},
        "output_tokens": out.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": out.prompt_tokens + out.completion_tokens,
    }


class ResponseReply:
    """The bodies of one /v1/responses reply: the whole response object, or its server-sent events."""

    def __init__(self, model: str, body: ResponsesRequest) -> None:
        self.model = model
        self.id = "resp_" + uuid.uuid4().hex
        self.created = int(time.time())
        self.namespaces = body.namespaces()
        self.custom = {str(t.get("name")) for t in body.tools or [] if t.get("type") == "custom"}
        self.echo = {
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "tool_choice": body.tool_choice or "auto",
            "max_output_tokens": body.max_output_tokens,
            "instructions": body.instructions,
        }
        self.output: list[dict[str, Any]] = []  # the items so far
        self.open: dict[str, Any] | None = None  # the item being streamed (message or reasoning)
        self.seq = 0

    def _response(self, status: str, out: Outcome | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": None,
            "model": self.model,
            "output": self.output if out is not None else [],
            "tools": [],
            "store": False,
            **self.echo,
        }
        if out is not None:
            body["usage"] = _usage(out)
            body["edgemoe"] = out.extension
            if out.finish_reason == "length":
                body["incomplete_details"] = {"reason": "max_output_tokens"}
        return body

    def call_item(self, call: ToolCall) -> dict[str, Any]:
        item: dict[str, Any] = {
            "type": "function_call",
            "id": "fc_" + uuid.uuid4().hex[:24],
            "call_id": call.id,
            "name": call.name,
            "arguments": call.arguments_json,
            "status": "completed",
        }
        space, _, name = call.name.rpartition(".")
        if space in self.namespaces:
            item["namespace"], item["name"] = space, name
        elif call.name in self.custom:
            item = {
                "type": "custom_tool_call",
                "id": item["id"],
                "call_id": call.id,
                "name": call.name,
                "input": str(call.arguments.get("input", "")),
                "status": "completed",
            }
        return item

    @staticmethod
    def _message(text: str) -> dict[str, Any]:
        return {
            "type": "message",
            "id": "msg_" + uuid.uuid4().hex[:24],
            "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}],
        }

    @staticmethod
    def _reasoning(text: str) -> dict[str, Any]:
        return {
            "type": "reasoning",
            "id": "rs_" + uuid.uuid4().hex[:24],
            "summary": [],
            "content": [{"type": "reasoning_text", "text": text}],
        }

    def whole(self, parts: list[str | ToolCall | Reasoning], out: Outcome) -> dict[str, Any]:
        for p in parts:
            last = self.output[-1] if self.output else None
            if isinstance(p, ToolCall):
                self.output.append(self.call_item(p))
            elif isinstance(p, Reasoning):
                if last is not None and last["type"] == "reasoning":
                    last["content"][0]["text"] += p.text
                else:
                    self.output.append(self._reasoning(p.text))
            elif last is not None and last["type"] == "message":
                last["content"][0]["text"] += p
            else:
                self.output.append(self._message(p))
        return self._response("incomplete" if out.finish_reason == "length" else "completed", out)

    # -- streaming ----------------------------------------------------------------------
    def event(self, kind: str, **data: Any) -> str:
        self.seq += 1
        payload = {"type": kind, "sequence_number": self.seq, **data}
        return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"

    def start(self) -> str:
        head = self._response("in_progress")
        return self.event("response.created", response=head) + self.event(
            "response.in_progress", response=head
        )

    def _close(self) -> str:
        item, self.open = self.open, None
        if item is None:
            return ""
        n = len(self.output) - 1
        where = {"item_id": item["id"], "output_index": n, "content_index": 0}
        if item["type"] == "message":
            part = item["content"][0]
            out = self.event("response.output_text.done", **where, text=part["text"])
            out += self.event("response.content_part.done", **where, part=part)
        else:
            out = self.event("response.reasoning_text.done", **where, text=item["content"][0]["text"])
        return out + self.event("response.output_item.done", output_index=n, item=item)

    def _piece(self, kind: str, piece: str) -> str:
        out = ""
        if self.open is None or self.open["type"] != kind:
            out += self._close()
            item = self._message("") if kind == "message" else self._reasoning("")
            self.output.append(item)
            self.open = item
            n = len(self.output) - 1
            out += self.event(
                "response.output_item.added", output_index=n, item={**item, "status": "in_progress"}
            )
            if kind == "message":
                out += self.event(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=n,
                    content_index=0,
                    part={"type": "output_text", "text": "", "annotations": []},
                )
        item = self.open
        item["content"][0]["text"] += piece
        delta = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        return out + self.event(
            delta, item_id=item["id"], output_index=len(self.output) - 1, content_index=0, delta=piece
        )

    def text(self, piece: str) -> str:
        return self._piece("message", piece)

    def reasoning(self, piece: str) -> str:
        return self._piece("reasoning", piece)

    def tool_call(self, call: ToolCall) -> str:
        out = self._close()
        item = self.call_item(call)
        self.output.append(item)
        n = len(self.output) - 1
        out += self.event(
            "response.output_item.added", output_index=n, item={**item, "status": "in_progress"}
        )
        if item["type"] == "function_call":
            out += self.event(
                "response.function_call_arguments.delta",
                item_id=item["id"],
                output_index=n,
                delta=item["arguments"],
            )
            out += self.event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=n,
                arguments=item["arguments"],
            )
        return out + self.event("response.output_item.done", output_index=n, item=item)

    def end(self, out: Outcome) -> str:
        status = "incomplete" if out.finish_reason == "length" else "completed"
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        return self._close() + self.event(kind, response=self._response(status, out))

    def failed(self, err: APIError) -> str:
        body = {**self._response("failed"), "error": {"code": err.code or err.type, "message": err.message}}
        return self.event("response.failed", response=body)
