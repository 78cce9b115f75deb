"""Reasoning apart from the answer: the `<think>...</think>` block a reasoning model writes first.

llama-server returns it as OpenAI's `reasoning_content` and Anthropic's `thinking` blocks instead of as the
answer; so does serve. ReasoningScanner splits a reply's text, as it streams, into ("reasoning", text) and
("text", text) pieces: a `<think>` at the very start of the reply (whitespace before it allowed) opens the
block, `</think>` closes it, and the whitespace after it is dropped. A prompt whose generation prompt already
opened the block (a template that forces thinking) starts inside it. A `<think>` later in the answer is text.
"""

from __future__ import annotations

from dataclasses import dataclass

OPEN, CLOSE = "<think>", "</think>"
Piece = tuple[str, str]  # ("reasoning" | "text", text)


@dataclass(frozen=True)
class Reasoning:
    """A piece of the reasoning block among a reply's parts (text pieces are plain str)."""

    text: str


def _held(text: str, tag: str) -> int:
    """Length of the longest tail of text that is a proper prefix of tag."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:k])), 0)


def opens_reasoning(prompt: str) -> bool:
    """Does the rendered prompt end inside a reasoning block (the template opened it for the model)?"""
    tail = prompt.rstrip()
    return tail.endswith(OPEN)


class ReasoningScanner:
    """push(piece) -> pieces safe to emit now; flush() -> the rest at the end of the reply."""

    def __init__(self, *, inside: bool = False) -> None:
        self.state = "inside" if inside else "start"  # start -> (inside ->) after
        self.buf = ""

    def push(self, piece: str) -> list[Piece]:
        self.buf += piece
        out: list[Piece] = []
        if self.state == "start":
            head = self.buf.lstrip()
            if not head:
                return out
            if head.startswith(OPEN):
                self.buf, self.state = head[len(OPEN) :], "inside"
            elif OPEN.startswith(head):
                return out  # may still become the tag
            else:
                self.state = "after"
        if self.state == "inside":
            j = self.buf.find(CLOSE)
            if j < 0:
                keep = _held(self.buf, CLOSE)
                text, self.buf = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep :]
                return out + ([("reasoning", text)] if text else [])
            if j:
                out.append(("reasoning", self.buf[:j]))
            self.buf, self.state = self.buf[j + len(CLOSE) :], "gap"
        if self.state == "gap":  # the whitespace between the block and the answer is neither
            self.buf = self.buf.lstrip()
            if not self.buf:
                return out
            self.state = "after"
        text, self.buf = self.buf, ""
        return out + ([("text", text)] if text else [])

    def flush(self) -> list[Piece]:
        rest, self.buf = self.buf, ""
        if not rest:
            return []
        if self.state == "inside":
            return [("reasoning", rest)]
        if self.state == "gap":
            return []
        return [("text", rest)]
