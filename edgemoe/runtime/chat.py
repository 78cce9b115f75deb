"""Chat on an Engine: messages, the model's chat template (llama.cpp's template engine), sessions.

The template functions take the llama_model (Engine.chat_template, template_tokens and format_chat call them);
ChatSession keeps a conversation on an Engine.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import ContextOverflowError, EdgeMoeError
from .native import lib

if TYPE_CHECKING:
    from .sampling import SamplingParams


@dataclass
class ChatMessage:
    role: str
    content: str


def chat_template(model: Any) -> str | None:
    """The chat template in the metadata of the llama_model `model` (None: none)."""
    ptr = lib.llama_model_chat_template(model, None)
    return ptr.decode("utf-8") if ptr else None


def template_tokens(model: Any) -> tuple[str, str]:
    """The text of BOS and EOS as chat templates read them (bos_token, eos_token); "" for none."""
    vocab = lib.llama_model_get_vocab(model)
    assert vocab is not None  # a loaded model has a vocabulary
    out = []
    for tok in (lib.llama_vocab_bos(vocab), lib.llama_vocab_eos(vocab)):
        if int(tok) < 0:
            out.append("")
            continue
        buf = ctypes.create_string_buffer(256)
        n = lib.llama_token_to_piece(vocab, tok, buf, len(buf), 0, True)
        out.append(buf.raw[: max(n, 0)].decode("utf-8", errors="replace"))
    return out[0], out[1]


def format_chat(
    tmpl: str | None, messages: Sequence[ChatMessage], *, add_assistant: bool = True, name: str
) -> str:
    """Apply the chat template `tmpl` of the model file `name` (llama.cpp's built-in template engine)."""
    if tmpl is None:
        raise EdgeMoeError(
            f"{name} has no chat template in its metadata; use `edgemoe generate` for plain completion"
        )
    arr = (lib.llama_chat_message * len(messages))()
    keep = []  # keep the encoded strings alive during the call
    for i, m in enumerate(messages):
        role, content = m.role.encode(), m.content.encode()
        keep += [role, content]
        arr[i].role, arr[i].content = role, content
    size = 256 + 2 * sum(len(k) for k in keep)
    buf = ctypes.create_string_buffer(size)
    n = lib.llama_chat_apply_template(tmpl.encode(), arr, len(messages), add_assistant, buf, size)  # pyright: ignore[reportArgumentType]  # llama_cpp types buf bytes: it is written to
    if n > size:
        buf = ctypes.create_string_buffer(n)
        n = lib.llama_chat_apply_template(tmpl.encode(), arr, len(messages), add_assistant, buf, n)  # pyright: ignore[reportArgumentType]  # as above
    if n < 0:
        raise EdgeMoeError(
            f"llama.cpp does not recognise the chat template of {name}; "
            "use `edgemoe generate` for plain completion"
        )
    return buf.raw[:n].decode("utf-8")


class ChatEngine(Protocol):
    """What a ChatSession uses of Engine (edgemoe.runtime.engine imports this module)."""

    n_ctx: int

    def format_chat(self, messages: Sequence[ChatMessage], *, add_assistant: bool = True) -> str: ...

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]: ...

    def stream(
        self,
        prompt: str,
        *,
        max_tokens: int = ...,
        sampling: SamplingParams | None = None,
        parse_special: bool = False,
    ) -> Iterator[tuple[int, str]]: ...


@dataclass
class ChatSession:
    """A conversation on an Engine: history + template; only new tokens are evaluated per turn.

    When the history no longer fits the context (with room for the reply), the oldest turns are
    dropped, as llama.cpp's own chat does; `dropped_turns` counts them.
    """

    engine: ChatEngine
    system: str | None = None
    history: list[ChatMessage] = field(default_factory=list)
    dropped_turns: int = 0

    def reset(self) -> None:
        self.history.clear()

    def _head(self) -> list[ChatMessage]:
        return [ChatMessage("system", self.system)] if self.system else []

    def messages(self) -> list[ChatMessage]:
        return self._head() + self.history

    def reply_room(self, max_tokens: int) -> int:
        """Tokens kept free for the reply: max_tokens, at most a quarter of the context."""
        return max(1, min(max_tokens, self.engine.n_ctx // 4))

    def fit_prompt(self, max_tokens: int) -> str:
        """The templated prompt of the history, dropping the oldest turns until it leaves room for the
        reply; when even the last message alone does not fit, raises and leaves the history as it was."""
        room = self.reply_room(max_tokens)
        head = self._head()
        kept, dropped = list(self.history), 0
        while True:
            prompt = self.engine.format_chat(head + kept)
            n = len(self.engine.tokenize(prompt, parse_special=True))
            if n + room <= self.engine.n_ctx:
                self.history[:] = kept
                self.dropped_turns += dropped
                return prompt
            if len(kept) <= 1:  # the new message alone does not fit
                raise ContextOverflowError(
                    f"this message is {n} tokens with the chat template and the context holds "
                    f"{self.engine.n_ctx}, {room} of them kept for the reply: shorten it or raise `n_ctx`"
                )
            del kept[0]  # the oldest user message and the reply to it
            if kept and kept[0].role == "assistant":
                del kept[0]
            dropped += 1

    def send(
        self, user_text: str, *, max_tokens: int = 256, sampling: SamplingParams | None = None
    ) -> Iterator[str]:
        """Stream the assistant's reply to user_text; the full Generation is in engine.last.

        Raises ContextOverflowError (and leaves the history as it was) when the message alone
        does not fit the context.
        """
        self.history.append(ChatMessage("user", user_text))
        reply: list[str] = []
        try:
            prompt = self.fit_prompt(max_tokens)
            for _, piece in self.engine.stream(
                prompt, max_tokens=max_tokens, sampling=sampling, parse_special=True
            ):
                reply.append(piece)
                yield piece
        except BaseException:
            self.history.pop()
            raise
        self.history.append(ChatMessage("assistant", "".join(reply).strip()))
