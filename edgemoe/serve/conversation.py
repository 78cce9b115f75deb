"""What clients send, shaped into what the chat template reads (OpenAI-shaped message dicts, template.py).

The three APIs' converters (schemas, anthropic, responses) build template messages with these helpers, and the
worker renders them with render_chat:

- text parts are joined with "\\n" (as llama.cpp and vLLM join them), so that two parts never run together;
- images and documents become a placeholder text part: the served models read text only, and a 400 would end
  an agent's session (the reply's `edgemoe.notes` says what was left out);
- Claude Code's billing block (`x-anthropic-billing-header: ...`, new with every session) is left out of the
  system prompt, or no session could reuse the previous one's prompt;
- tool results are put in the order of the calls they answer (clients send them in completion order, and a
  template without ids pairs results with calls by position);
- leading system / developer messages are merged into one; system turns later in the conversation are rendered
  where they are when the template accepts them, else merged into the system prompt;
- a conversation ending with an assistant turn is a prefill: the reply continues that turn.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

from .errors import APIError

IMAGE_PLACEHOLDER = "[image omitted: this model reads text only]"
DOCUMENT_PLACEHOLDER = "[document omitted: this model reads text only]"
BILLING_HEADER = "x-anthropic-billing-header:"  # Claude Code's per-session attribution block


def join_text(parts: Iterable[str]) -> str:
    """Text parts as one string, "\\n" between non-empty parts."""
    return "\n".join(p for p in parts if p)


def is_billing_block(text: str) -> bool:
    return text.lstrip().startswith(BILLING_HEADER)


def drop_billing_line(text: str) -> str:
    """A system prompt given as one string, without a leading billing line."""
    if not is_billing_block(text):
        return text
    _, _, rest = text.lstrip().partition("\n")
    return rest


def media_notes(images: int, documents: int) -> tuple[str, ...]:
    """The reply's notes on the media left out of the prompt."""
    out = []
    if images:
        out.append(f"{images} image(s) replaced by a text placeholder: this model reads text only")
    if documents:
        out.append(f"{documents} document(s) replaced by a text placeholder: this model reads text only")
    return tuple(out)


def reorder_tool_results(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each run of tool messages after an assistant turn with tool_calls, in the order of those calls (results
    answering no call of that turn keep their place after the others)."""
    out: list[dict[str, Any]] = []
    i = 0
    while i < len(messages):
        m = messages[i]
        out.append(m)
        i += 1
        calls = m.get("tool_calls") if m.get("role") == "assistant" else None
        if not calls:
            continue
        j = i
        while j < len(messages) and messages[j].get("role") == "tool":
            j += 1
        order = {c.get("id"): n for n, c in enumerate(calls) if c.get("id")}
        run = messages[i:j]
        out += sorted(run, key=lambda r: order.get(r.get("tool_call_id"), len(order)))
        i = j
    return out


def merge_leading_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive system messages at the start (Codex sends two developer messages) as one."""
    n = 0
    while n < len(messages) and messages[n].get("role") == "system":
        n += 1
    if n < 2:
        return messages
    merged = {"role": "system", "content": "\n\n".join(str(m.get("content") or "") for m in messages[:n])}
    return [merged, *messages[n:]]


def merge_later_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """System turns after the first message merged into the (first) system prompt, in order."""
    later = [m for m in messages[1:] if m.get("role") == "system"]
    rest = [m for m in messages[1:] if m.get("role") != "system"]
    first = messages[0] if messages else None
    texts = [str(m.get("content") or "") for m in later]
    if first is not None and first.get("role") == "system":
        return [{**first, "content": "\n\n".join([str(first.get("content") or ""), *texts])}, *rest]
    head = [first] if first is not None else []
    return [{"role": "system", "content": "\n\n".join(texts)}, *head, *rest]


def has_later_system(messages: list[dict[str, Any]]) -> bool:
    return any(m.get("role") == "system" for m in messages[1:])


def prefill_of(messages: list[dict[str, Any]]) -> str | None:
    """The text of a final assistant turn without tool calls (the start of the reply), else None."""
    if not messages or messages[-1].get("role") != "assistant" or messages[-1].get("tool_calls"):
        return None
    content = messages[-1].get("content")
    return content if isinstance(content, str) and content else None


def normalize(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The order-independent fixes every API's messages get before rendering."""
    return merge_leading_system(reorder_tool_results(messages))


class Renderer(Protocol):
    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> str: ...


def render_chat(
    template: Renderer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> str:
    """The prompt text of a conversation: normalized; a final assistant turn continued (the generation prompt
    then that turn's text); system turns the template refuses in the middle merged into the system prompt."""
    messages = normalize(messages)
    prefill = prefill_of(messages)
    if prefill is not None:
        messages = messages[:-1]
    try:
        text = template.render(messages, tools)
    except APIError as err:
        if err.code != "template_refused" or not has_later_system(messages):
            raise
        text = template.render(merge_later_system(messages), tools)
    return text + (prefill or "")
