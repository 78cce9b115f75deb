"""The GGUF's own Jinja chat template, rendered with jinja2's sandbox (as transformers renders it).

Messages reach the template in OpenAI's shape, whichever API they came in by: {"role", "content"},
assistant turns with "tool_calls" ([{"id", "type": "function", "function": {"name", "arguments": dict}}]),
tool results as {"role": "tool", "tool_call_id", "name", "content"}; tools as
[{"type": "function", "function": {"name", "description", "parameters"}}].
"""

from __future__ import annotations

import json
import logging
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import APIError

log = logging.getLogger(__name__)


class TemplateRefusal(Exception):
    """The template called raise_exception (a role order or content it does not accept)."""


def _raise(message: str) -> None:
    raise TemplateRefusal(message)


def _tojson(
    value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False
) -> str:
    # transformers' tojson: no HTML escaping (jinja2's own escapes <, > and &, which changes the prompt)
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """One model's chat template, compiled once."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "") -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals.update(raise_exception=_raise, strftime_now=_strftime_now)
        self.source = source
        self._template = env.from_string(source)  # raises jinja2.TemplateSyntaxError
        self._names = meta.find_undeclared_variables(env.parse(source))
        self.bos_token, self.eos_token = bos_token, eos_token

    @property
    def supports_tools(self) -> bool:
        """Does the template read the `tools` variable (render the tools it is given)?"""
        return "tools" in self._names

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> str:
        """The prompt text; APIError 400 when the template refuses the messages or has no tool support."""
        if tools and not self.supports_tools:
            raise APIError(
                400,
                "this model's chat template does not render tools (it has no `tools` "
                "variable), so it cannot call them: send the request without tools, or "
                "serve a GGUF whose chat template supports tool calling",
                param="tools",
                code="tools_unsupported",
            )
        try:
            return self._template.render(
                messages=messages,
                tools=tools or None,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except TemplateRefusal as err:
            raise APIError(
                400,
                f"the model's chat template refuses these messages: {err}",
                param="messages",
                code="template_refused",
            ) from None
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError) as err:
            raise APIError(
                400,
                f"the model's chat template failed on these messages ({type(err).__name__}: "
                f"{err}); check the roles and content types",
                param="messages",
                code="template_error",
            ) from None


def load_template(source: str | None, *, bos_token: str = "", eos_token: str = "") -> ChatTemplate | None:
    """The compiled template, or None when there is none or jinja2 cannot compile it (the server then uses
    llama.cpp's built-in template engine, without tools)."""
    if source is None:
        return None
    try:
        return ChatTemplate(source, bos_token=bos_token, eos_token=eos_token)
    except jinja2.TemplateError as err:
        log.warning(
            "the chat template does not compile with jinja2 (%s): using llama.cpp's built-in "
            "templates, without tool calls",
            err,
        )
        return None
