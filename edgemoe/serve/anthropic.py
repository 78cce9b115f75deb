"""The Anthropic Messages API's request model and response bodies (POST /v1/messages, count_tokens).

Messages become the OpenAI-shaped dicts the chat template reads (template.py): the system prompt a
first "system" message (Claude Code's billing block left out), `tool_use` blocks an assistant's "tool_calls",
`tool_result` blocks "tool" messages, system turns inside `messages` system messages where they are, text
blocks joined with "\n", images and documents placeholder text (conversation.py). Unknown fields are accepted
and ignored; server tools (web search...) and `defer_loading` tools not yet loaded by a `tool_reference` are
left out, client tools go to the model. A forced `tool_choice`, `disable_parallel_tool_use` and
`output_config.format` are enforced (grammar.py, stream.py). Reasoning comes back as `thinking` blocks.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, model_validator

from ..runtime.sampling import SamplingParams
from .checks import check_object_schema, check_tool_name, refuse_lone_surrogates
from .conversation import (
    DOCUMENT_PLACEHOLDER,
    IMAGE_PLACEHOLDER,
    drop_billing_line,
    is_billing_block,
    join_text,
    media_notes,
)
from .errors import APIError, echo
from .grammar import Constraint, json_constraint, tool_constraint
from .limits import check_stops
from .reasoning import Reasoning
from .tools import ToolCall
from .worker import Outcome

log = logging.getLogger(__name__)


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class Block(_Lenient):
    type: str
    text: str | None = None
    id: str | None = None  # tool_use
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None  # tool_result
    content: str | list[Block] | None = None
    is_error: StrictBool | None = None
    tool_name: str | None = None  # tool_reference

    def plain(self, param: str) -> str:
        """The text of a text block (or of a tool_result's content)."""
        if self.type == "text":
            return self.text or ""
        if self.type in ("thinking", "redacted_thinking", "tool_reference"):
            return ""  # earlier turns' thinking is not part of the prompt; a reference loads a tool (tools)
        if self.type == "image":
            return IMAGE_PLACEHOLDER
        if self.type == "document":
            return DOCUMENT_PLACEHOLDER
        raise APIError(
            400,
            f"{param}: content blocks of type {self.type!r} are not supported here (text, image, "
            "document, tool_use and tool_result are)",
            param=param,
            code="unsupported_content",
        )


class AnthropicMessage(_Lenient):
    role: Literal["user", "assistant", "system"]  # system: a mid-conversation system turn (Claude Code's)
    content: str | list[Block]


class Tool(_Lenient):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    type: str | None = None  # "custom" or none; server tools are refused
    defer_loading: StrictBool | None = None  # left out of the prompt until a tool_reference loads it


class ToolChoice(_Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # of type "tool"
    disable_parallel_tool_use: StrictBool | None = None


class OutputConfig(_Lenient):
    format: dict[str, Any] | None = None  # {"type": "json_schema", "schema": ...}: enforced with a grammar


class Thinking(_Lenient):
    type: str | None = None
    display: str | None = None  # "omitted": thinking blocks come back without their text


class CountTokensRequest(_Lenient):
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[Block] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    output_config: OutputConfig | None = None
    output_format: dict[str, Any] | None = None  # the structured-outputs beta's name for output_config.format
    thinking: Thinking | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        return refuse_lone_surrogates(data)

    def check(self) -> None:
        """400 for what the Messages API refuses: bad tool names or schemas, an undeclared tool_choice,
        a tool_result that answers no tool_use of the message before it."""
        names = set()
        for i, t in enumerate(self.tools or []):
            check_tool_name(t.name, f"tools.{i}.name")
            if t.type in (None, "custom"):
                check_object_schema(t.input_schema, f"tools.{i}.input_schema")
            if t.name in names:
                raise APIError(
                    400, f"tools.{i}.name: tool names must be unique ({t.name!r} repeats)", param="tools"
                )
            names.add(t.name)
        choice = self.tool_choice
        if choice is not None and choice.type == "tool" and choice.name not in names:
            raise APIError(
                400,
                f"tool_choice names the tool {str(choice.name)[:80]!r}, which is not in tools: "
                "declare it there, or choose another",
                param="tool_choice",
            )
        _check_tool_results(self.messages)

    def chat_messages(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if isinstance(self.system, str):
            system = drop_billing_line(self.system)
        else:  # the billing block changes with every session: no session could reuse another's prompt
            blocks = [
                b for b in self.system or [] if not (b.type == "text" and is_billing_block(b.text or ""))
            ]
            system = join_text(b.plain(f"system.{i}") for i, b in enumerate(blocks))
        if system:
            out.append({"role": "system", "content": system})
        for i, m in enumerate(self.messages):
            out += _to_template(m, f"messages.{i}.content")
        return out

    def notes(self) -> tuple[str, ...]:
        blocks = [b for m in self.messages if not isinstance(m.content, str) for b in m.content]
        blocks += [c for b in blocks if isinstance(b.content, list) for c in b.content]  # in tool results
        return media_notes(sum(b.type == "image" for b in blocks), sum(b.type == "document" for b in blocks))

    def loaded(self) -> set[str]:
        """The deferred tools a tool_reference block (in a tool result) has loaded."""
        blocks = [b for m in self.messages if not isinstance(m.content, str) for b in m.content]
        blocks += [c for b in blocks if isinstance(b.content, list) for c in b.content]
        return {str(b.tool_name or b.name) for b in blocks if b.type == "tool_reference"}

    def template_tools(self) -> list[dict[str, Any]] | None:
        if not self.tools or (self.tool_choice is not None and self.tool_choice.type == "none"):
            return None
        server_tools = [t.name for t in self.tools if t.type not in (None, "custom")]
        if server_tools:  # web search, code execution...: Anthropic runs those; a local model cannot
            log.info("ignoring server tools %s (only client tools reach the model)", ", ".join(server_tools))
        loaded = self.loaded()
        return [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description or "",
                    "parameters": t.input_schema,
                },
            }
            for t in self.tools
            if t.type in (None, "custom") and (not t.defer_loading or t.name in loaded)
        ] or None

    def constraint(self) -> Constraint | None:
        """The grammar the reply must follow: a forced tool call (`any`, `tool`), or the output format."""
        choice, tools = self.tool_choice, self.template_tools()
        if choice is not None and choice.type in ("any", "tool") and tools:
            only = choice.name if choice.type == "tool" else None
            return tool_constraint(
                tools, only=only, parallel=not choice.disable_parallel_tool_use, param="tools"
            )
        fmt = (self.output_config.format if self.output_config else None) or self.output_format
        if not fmt:
            return None
        if fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise APIError(
                400,
                'output_config.format: give {"type": "json_schema", "schema": {...}}',
                param="output_config.format",
            )
        return json_constraint(fmt["schema"], "output_config.format.schema")

    @property
    def single_call(self) -> bool:
        return self.tool_choice is not None and bool(self.tool_choice.disable_parallel_tool_use)

    @property
    def show_thinking(self) -> bool:
        return self.thinking is None or self.thinking.display != "omitted"


def _check_tool_results(messages: list[AnthropicMessage]) -> None:
    """As the Messages API says: each tool_result answers a tool_use of the message just before it, each
    tool_use of a message that another follows is answered in that next one, and tool_use ids are unique."""
    asked: set[str] = set()
    seen: set[str] = set()
    for i, m in enumerate(messages):
        if m.role == "system":
            continue  # a system turn between a tool_use and its result separates nothing
        blocks = [] if isinstance(m.content, str) else m.content
        unanswered = sorted(asked - {b.tool_use_id for b in blocks if b.type == "tool_result"})
        if unanswered:
            raise APIError(
                400,
                f"messages.{i - 1}: `tool_use` ids were found without `tool_result` blocks immediately after: "
                f"{echo(', '.join(unanswered))}. Each `tool_use` block must have a corresponding `tool_result` "
                "block in the next message.",
                param=f"messages.{i - 1}",
            )
        for j, b in enumerate(blocks):
            if b.type == "tool_use" and b.id is not None:
                if b.id in seen:
                    where = f"messages.{i}.content.{j}"
                    raise APIError(400, f"{where}: `tool_use` ids must be unique", param=where)
                seen.add(b.id)
            if b.type == "tool_result" and (b.tool_use_id is None or b.tool_use_id not in asked):
                raise APIError(
                    400,
                    f"messages.{i}.content.{j}: unexpected `tool_use_id` found in `tool_result` blocks: "
                    f"{str(b.tool_use_id)[:80]}. Each `tool_result` block must have a corresponding "
                    "`tool_use` block in the previous message.",
                    param=f"messages.{i}.content.{j}.tool_use_id",
                )
        asked = {b.id for b in blocks if b.type == "tool_use" and b.id is not None}


def _to_template(m: AnthropicMessage, param: str) -> list[dict[str, Any]]:
    """One Anthropic message as template messages: tool results become "tool" messages before the text."""
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    text: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, b in enumerate(m.content):
        where = f"{param}.{j}"
        if b.type == "tool_use" and m.role == "assistant":
            calls.append(
                {
                    "id": b.id or "",
                    "type": "function",
                    "function": {"name": b.name or "", "arguments": b.input or {}},
                }
            )
        elif b.type == "tool_result" and m.role == "user":
            body = (
                b.content
                if isinstance(b.content, str) or b.content is None
                else join_text(c.plain(f"{where}.content.{k}") for k, c in enumerate(b.content))
            )
            results.append({"role": "tool", "tool_call_id": b.tool_use_id or "", "content": body or ""})
        else:
            text.append(b.plain(where))
    out = results
    if calls or text or not results:
        msg: dict[str, Any] = {"role": m.role, "content": join_text(text)}
        if calls:
            msg["tool_calls"] = calls
        out = out + [msg]
    return out


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    stream: StrictBool = False
    # edgemoe's: false turns the server's speculative decoding off for this request
    speculate: StrictBool = True

    def sampling(self, default: SamplingParams) -> SamplingParams:
        given = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}
        return replace(default, **{k: v for k, v in given.items() if v is not None})

    def stops(self) -> tuple[str, ...]:
        return check_stops(tuple(self.stop_sequences or ()), "stop_sequences")


_STOP_REASONS = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
}  # a reply cut short ("cancelled") never gets a stop reason: it ends with an error event


def stop_reason(out: Outcome) -> str:
    return "stop_sequence" if out.stop_sequence is not None else _STOP_REASONS[out.finish_reason]


def usage(out: Outcome) -> dict[str, int]:
    """Anthropic counts cache reads apart: input_tokens are the prompt tokens evaluated."""
    return {
        "input_tokens": out.prompt_tokens - out.cached_tokens,
        "output_tokens": out.completion_tokens,
        "cache_read_input_tokens": out.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


class MessageReply:
    """The bodies of one /v1/messages reply: whole, or its server-sent events. Reasoning comes as `thinking`
    blocks (without their text when the request's thinking.display is "omitted"); no signature is made."""

    def __init__(self, model: str, *, show_thinking: bool = True) -> None:
        self.model = model
        self.show_thinking = show_thinking
        self.id = "msg_" + uuid.uuid4().hex[:24]
        self.index = -1  # of the open content block
        self.open: str | None = None  # its type

    def whole(self, parts: list[str | ToolCall | Reasoning], out: Outcome) -> dict[str, Any]:
        content: list[dict[str, Any]] = []
        for p in parts:
            if isinstance(p, ToolCall):
                content.append({"type": "tool_use", "id": p.id, "name": p.name, "input": p.arguments})
            elif isinstance(p, Reasoning):
                text = p.text if self.show_thinking else ""
                if content and content[-1]["type"] == "thinking":
                    content[-1]["thinking"] += text
                else:
                    content.append({"type": "thinking", "thinking": text, "signature": ""})
            elif content and content[-1]["type"] == "text":
                content[-1]["text"] += p
            else:
                content.append({"type": "text", "text": p})
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop_reason(out),
            "stop_sequence": out.stop_sequence,
            "usage": usage(out),
            "edgemoe": out.extension,
        }

    # -- streaming ----------------------------------------------------------------------
    def start(self, prompt_tokens: int, cached: int) -> str:
        msg = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {
                "input_tokens": prompt_tokens - cached,
                "output_tokens": 0,
                "cache_read_input_tokens": cached,
                "cache_creation_input_tokens": 0,
            },
        }
        return event("message_start", {"type": "message_start", "message": msg})

    def _close(self) -> str:
        if self.open is None:
            return ""
        self.open = None
        return event("content_block_stop", {"type": "content_block_stop", "index": self.index})

    def _begin(self, block: dict[str, Any]) -> str:
        out = self._close()
        self.index += 1
        self.open = block["type"]
        return out + event(
            "content_block_start",
            {"type": "content_block_start", "index": self.index, "content_block": block},
        )

    def text(self, piece: str) -> str:
        out = "" if self.open == "text" else self._begin({"type": "text", "text": ""})
        return out + event(
            "content_block_delta",
            {
                "type": "content_block_delta",
                "index": self.index,
                "delta": {"type": "text_delta", "text": piece},
            },
        )

    def thinking(self, piece: str) -> str:
        out = (
            ""
            if self.open == "thinking"
            else self._begin({"type": "thinking", "thinking": "", "signature": ""})
        )
        if not self.show_thinking:
            return out
        return out + event(
            "content_block_delta",
            {
                "type": "content_block_delta",
                "index": self.index,
                "delta": {"type": "thinking_delta", "thinking": piece},
            },
        )

    def tool_use(self, call: ToolCall) -> str:
        out = self._begin({"type": "tool_use", "id": call.id, "name": call.name, "input": {}})
        out += event(
            "content_block_delta",
            {
                "type": "content_block_delta",
                "index": self.index,
                "delta": {"type": "input_json_delta", "partial_json": call.arguments_json},
            },
        )
        return out + self._close()

    def end(self, out: Outcome) -> str:
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason(out), "stop_sequence": out.stop_sequence},
            "usage": usage(out),
            "edgemoe": out.extension,
        }
        return self._close() + event("message_delta", delta) + event("message_stop", {"type": "message_stop"})


def event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


PING = event("ping", {"type": "ping"})


def error_event(err: APIError) -> str:
    return event("error", err.anthropic_body())
