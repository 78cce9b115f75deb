"""Chat on an Engine: messages, the model's chat template (llama.cpp's template engine), sessions.

ChatMixin is a part of Engine (edgemoe.runtime.engine), where ChatSession keeps a conversation.
"""
from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import EdgeMoeError
from .native import lib


@dataclass
class ChatMessage:
    role: str
    content: str


class ChatMixin:
    """chat_template() / format_chat() of Engine."""

    _model: Any
    path: Path

    def chat_template(self) -> str | None:
        ptr = lib.llama_model_chat_template(self._model, None)
        return ptr.decode("utf-8") if ptr else None

    def format_chat(self, messages: Sequence[ChatMessage], *, add_assistant: bool = True) -> str:
        """Apply the model's chat template (llama.cpp's built-in template engine)."""
        tmpl = self.chat_template()
        if tmpl is None:
            raise EdgeMoeError(f"{self.path.name} has no chat template in its metadata; use "
                               "`edgemoe generate` for plain completion")
        arr = (lib.llama_chat_message * len(messages))()
        keep = []  # keep the encoded strings alive during the call
        for i, m in enumerate(messages):
            role, content = m.role.encode(), m.content.encode()
            keep += [role, content]
            arr[i].role, arr[i].content = role, content
        size = 256 + 2 * sum(len(k) for k in keep)
        buf = ctypes.create_string_buffer(size)
        n = lib.llama_chat_apply_template(tmpl.encode(), arr, len(messages), add_assistant, buf, size)
        if n > size:
            buf = ctypes.create_string_buffer(n)
            n = lib.llama_chat_apply_template(tmpl.encode(), arr, len(messages), add_assistant, buf, n)
        if n < 0:
            raise EdgeMoeError(f"llama.cpp does not recognise the chat template of {self.path.name}; "
                               "use `edgemoe generate` for plain completion")
        return buf.raw[:n].decode("utf-8")
