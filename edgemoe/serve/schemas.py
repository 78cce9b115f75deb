"""OpenAI's request models (pydantic, as FastAPI validates them) and response bodies.

Fields the server does not use (frequency_penalty, user, ...) are accepted and ignored, as
other local servers do; fields it cannot honour (n > 1, logprobs) are refused with a 400.
Chat messages become the OpenAI-shaped dicts the chat template reads (template.py): text parts joined
with "\n", images and files as placeholder text (conversation.py). `response_format`, a forced
`tool_choice` and `parallel_tool_calls: false` are enforced (grammar.py, stream.py).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, model_validator

from ..runtime.sampling import SamplingParams
from .checks import check_object_schema, check_tool_answers, check_tool_name, refuse_lone_surrogates
from .conversation import DOCUMENT_PLACEHOLDER, IMAGE_PLACEHOLDER, join_text, media_notes
from .errors import APIError, echo
from .grammar import Constraint, json_constraint, tool_constraint
from .limits import MAX_JSON_DEPTH, JSONRefused, check_stops, loads_strict
from .tools import ToolCall
from .worker import Outcome


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ContentPart(_Lenient):
    type: str
    text: str | None = None

    def plain(self, param: str) -> str:
        """The part as prompt text: media the model cannot read as a placeholder."""
        if self.type in ("text", "input_text") and self.text is not None:
            return self.text
        if self.type in ("image_url", "input_image"):
            return IMAGE_PLACEHOLDER
        if self.type in ("file", "input_file"):
            return DOCUMENT_PLACEHOLDER
        raise APIError(
            400,
            f"{param}: content parts of type {self.type[:40]!r} are not supported (text, image_url and "
            "file are; images and files reach the model as a placeholder)",
            param=param,
            code="unsupported_content",
        )


class FunctionCall(_Lenient):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(_Lenient):
    id: str | None = None
    type: str = "function"
    function: FunctionCall


class FunctionDef(_Lenient):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ChosenFunction(_Lenient):
    name: str


class ToolChoice(_Lenient):
    type: Literal["function"]
    function: ChosenFunction


class ToolDef(_Lenient):
    type: Literal["function"] = "function"
    function: FunctionDef


Role = Literal["system", "developer", "user", "assistant", "tool", "function"]


class Message(_Lenient):
    role: Role
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    reasoning_content: str | None = None  # an earlier turn's reasoning (llama-server's field)

    def to_template(self, i: int) -> dict[str, Any]:
        if self.content is None or isinstance(self.content, str):
            text = self.content or ""
        else:
            text = join_text(p.plain(f"messages.{i}.content.{j}") for j, p in enumerate(self.content))
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.role == "assistant" and self.reasoning_content:
            out["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            out["tool_calls"] = [
                _call_to_template(c, f"messages.{i}.tool_calls.{j}") for j, c in enumerate(self.tool_calls)
            ]
        if self.role == "tool":
            if not self.tool_call_id:
                raise APIError(
                    400,
                    f"messages.{i}.tool_call_id is missing: a tool message answers the tool call of "
                    "that id (the assistant message's tool_calls[].id)",
                    param=f"messages.{i}.tool_call_id",
                    code="missing_required_parameter",
                )
            out["tool_call_id"] = self.tool_call_id
            if self.name:
                out["name"] = self.name
        return out


def _call_to_template(call: ToolCallIn, param: str) -> dict[str, Any]:
    args = call.function.arguments
    if isinstance(args, str):
        try:
            args = loads_strict(args or "{}", MAX_JSON_DEPTH)
        except JSONRefused as err:
            raise APIError(
                400,
                f"{param}.function.arguments is not a JSON object ({err}): {echo(args)}",
                param=param,
                code="invalid_value",
            ) from None
    return {
        "id": call.id or "",
        "type": "function",
        "function": {"name": call.function.name, "arguments": args},
    }


_NULL_IS_DEFAULT = ("n", "stream", "echo")


class StreamOptions(_Lenient):
    include_usage: StrictBool = False


class GenerationRequest(_Lenient):
    """The fields chat and text completions share."""

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        return refuse_lone_surrogates(data)

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data: Any) -> Any:
        """OpenAI takes `"n": null`, `"stream": null`... as the defaults."""
        if isinstance(data, dict) and any(data.get(k, 0) is None for k in _NULL_IS_DEFAULT):
            return {k: v for k, v in data.items() if not (k in _NULL_IS_DEFAULT and v is None)}
        return data

    model: str
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repeat_penalty: float | None = Field(None, gt=0.0)  # llama.cpp's, not in OpenAI's API
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    logprobs: bool | int | None = None
    # edgemoe's: false turns the server's speculative decoding off for this request
    speculate: StrictBool = True

    def check(self) -> None:
        if self.n != 1:
            raise APIError(
                400, "only n = 1 is supported (one engine, one sequence)", param="n", code="unsupported_value"
            )
        if self.logprobs not in (None, False, 0):
            raise APIError(400, "logprobs are not supported", param="logprobs", code="unsupported_value")

    def stops(self) -> tuple[str, ...]:
        return check_stops((self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ()), "stop")

    def limit(self, default: int) -> int:
        return self.max_tokens or self.max_completion_tokens or default

    def sampling(self, default: SamplingParams) -> SamplingParams:
        names = ("temperature", "top_p", "top_k", "min_p", "repeat_penalty", "seed")
        given = {k: getattr(self, k) for k in names}
        return replace(default, **{k: v for k, v in given.items() if v is not None})

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(GenerationRequest):
    messages: list[Message] = Field(min_length=1)
    tools: list[ToolDef] | None = None
    # "none" drops the tools; "required" and a named function are enforced with a grammar
    tool_choice: Literal["none", "auto", "required"] | ToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None  # false: the reply ends after its first call
    response_format: dict[str, Any] | None = None  # json_object / json_schema: enforced with a grammar

    def check(self) -> None:
        super().check()
        names = set()
        for i, t in enumerate(self.tools or []):
            check_tool_name(t.function.name, f"tools.{i}.function.name")
            check_object_schema(t.function.parameters or {}, f"tools.{i}.function.parameters")
            names.add(t.function.name)
        check_tool_answers(
            [(m.role, [c.id or "" for c in m.tool_calls or []], m.tool_call_id) for m in self.messages]
        )
        if isinstance(self.tool_choice, ToolChoice) and self.tool_choice.function.name not in names:
            raise APIError(
                400,
                f"tool_choice names the function {self.tool_choice.function.name[:80]!r}, which is not "
                "in tools: declare it there, or choose another",
                param="tool_choice",
                code="invalid_value",
            )

    def chat_messages(self) -> list[dict[str, Any]]:
        return [m.to_template(i) for i, m in enumerate(self.messages)]

    def notes(self) -> tuple[str, ...]:
        parts = [p for m in self.messages if isinstance(m.content, list) for p in m.content]
        return media_notes(
            sum(p.type in ("image_url", "input_image") for p in parts),
            sum(p.type in ("file", "input_file") for p in parts),
        )

    def constraint(self) -> Constraint | None:
        """The grammar the reply must follow: a forced tool call, or the response_format; None: free text."""
        tools = self.template_tools()
        choice = self.tool_choice
        if tools and (choice == "required" or isinstance(choice, ToolChoice)):
            only = choice.function.name if isinstance(choice, ToolChoice) else None
            return tool_constraint(
                tools, only=only, parallel=self.parallel_tool_calls is not False, param="tools"
            )
        fmt = self.response_format or {}
        kind = fmt.get("type", "text")
        if kind == "json_object":
            return json_constraint(None, "response_format")
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise APIError(
                    400,
                    "response_format.json_schema.schema must be a JSON Schema object",
                    param="response_format.json_schema.schema",
                )
            return json_constraint(schema, "response_format.json_schema.schema")
        if kind != "text":
            raise APIError(
                400,
                f"response_format type {str(kind)[:40]!r} is not supported (text, json_object, json_schema)",
                param="response_format.type",
                code="unsupported_value",
            )
        return None

    def template_tools(self) -> list[dict[str, Any]] | None:
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]


class CompletionRequest(GenerationRequest):
    prompt: str | list[str]
    echo: StrictBool = False

    def text(self) -> str:
        if self.echo:
            raise APIError(400, "echo is not supported", param="echo", code="unsupported_value")
        if isinstance(self.prompt, str):
            return self.prompt
        if len(self.prompt) != 1:
            raise APIError(400, "give one prompt per request", param="prompt", code="unsupported_value")
        return self.prompt[0]


Kind = Literal["chat", "text"]


class Reply:
    """Builds the response bodies of one request (the whole reply or its stream chunks)."""

    def __init__(self, kind: Kind, model: str) -> None:
        self.kind = kind
        self.model = model
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion" if kind == "chat" else "text_completion"

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    @staticmethod
    def usage(out: Outcome) -> dict[str, Any]:
        return {
            "prompt_tokens": out.prompt_tokens,
            "completion_tokens": out.completion_tokens,
            "total_tokens": out.prompt_tokens + out.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": out.cached_tokens},
        }

    @staticmethod
    def tool_call(call: ToolCall, index: int | None = None) -> dict[str, Any]:
        head = {} if index is None else {"index": index}
        return {
            **head,
            "id": call.id,
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments_json},
        }

    def whole(
        self, text: str, out: Outcome, calls: list[ToolCall] | None = None, reasoning: str = ""
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": out.finish_reason, "logprobs": None}
        if self.kind == "chat":
            choice["message"] = {"role": "assistant", "content": text if text or not calls else None}
            if reasoning:
                choice["message"]["reasoning_content"] = reasoning
            if calls:
                choice["message"]["tool_calls"] = [self.tool_call(c) for c in calls]
        else:
            choice["text"] = text
        return {
            **self._head(self.object),
            "choices": [choice],
            "usage": self.usage(out),
            "edgemoe": out.extension,
        }

    def chunk(
        self, text: str | None, finish_reason: str | None = None, *, first: bool = False
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
        if self.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice["text"] = text or ""
        return {**self._head("text_completion"), "choices": [choice]}

    def reasoning_chunk(self, text: str) -> dict[str, Any]:
        choice = {"index": 0, "finish_reason": None, "logprobs": None, "delta": {"reasoning_content": text}}
        return {**self._head("chat.completion.chunk"), "choices": [choice]}

    def tool_chunk(self, call: ToolCall, index: int) -> dict[str, Any]:
        choice = {
            "index": 0,
            "finish_reason": None,
            "logprobs": None,
            "delta": {"tool_calls": [self.tool_call(call, index)]},
        }
        return {**self._head("chat.completion.chunk"), "choices": [choice]}

    def usage_chunk(self, out: Outcome) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": [], "usage": self.usage(out)}
