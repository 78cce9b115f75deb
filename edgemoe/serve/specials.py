"""Client text cannot forge the chat template's control tokens.

The rendered prompt is tokenized with special-token parsing, so that the template's own `<|im_start|>`,
`<|im_end|>`... become control tokens. Text a client wrote (messages, tool results, tool calls' names and
arguments, tool schemas) must not: before rendering, each control token's text inside a client string is
swapped for a placeholder; after rendering the prompt is split at the control tokens left (the template's),
and the text between them, placeholders put back, is tokenized without special parsing. A placeholder is a
pair of UTF-16 surrogate code points, which no client text holds (a request with a lone surrogate is refused,
and UTF-8 cannot carry one): any character a client writes comes back unchanged. A request whose strings hold no control token's text is tokenized in one
piece, as before. Tokens llama.cpp matches even without special parsing (user-defined ones such as
Qwen3's `<tool_call>`) are matched in client text too, as llama-server does.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, Protocol

_PLACEHOLDER = re.compile("[\ud800-\udbff][\udc00-\udfff]")


def placeholder(i: int) -> str:
    """The i-th control token's placeholder: a high and a low surrogate (2**20 of them), never client text."""
    return chr(0xD800 + (i >> 10)) + chr(0xDC00 + (i & 0x3FF))


class Vocab(Protocol):
    """What this module needs of Engine."""

    @property
    def n_vocab(self) -> int: ...

    def token_piece(self, token: int, *, special: bool = False) -> bytes: ...

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]: ...


def control_texts(vocab: Vocab) -> list[str]:
    """The texts of the vocabulary's control tokens: those only written out when specials are (one pass)."""
    out = []
    for t in range(vocab.n_vocab):
        if vocab.token_piece(t, special=False):
            continue
        text = vocab.token_piece(t, special=True).decode("utf-8", errors="replace")
        if text:
            out.append(text)
    return out


class SpecialGuard:
    """neutralize() the client's strings before rendering; tokenize() the rendered prompt after."""

    def __init__(self, texts: Iterable[str]) -> None:
        self.texts = sorted(set(texts), key=len, reverse=True)  # the longest first, as llama.cpp matches
        self._swap = {t: placeholder(i) for i, t in enumerate(self.texts)}
        self._back = {v: k for k, v in self._swap.items()}
        alternatives = "|".join(re.escape(t) for t in self.texts)
        self._find = re.compile(alternatives) if self.texts else None
        self._split = re.compile(f"({alternatives})") if self.texts else None

    def neutralize(self, value: Any) -> tuple[Any, bool]:
        """(value with every control token's text in its strings and keys swapped, whether any was)."""
        if self._find is None:
            return value, False
        if isinstance(value, str):
            swapped = self._find.sub(lambda m: self._swap[m.group(0)], value)
            return swapped, swapped != value
        if isinstance(value, dict):
            items = [(self.neutralize(k), self.neutralize(v)) for k, v in value.items()]
            return {k: v for (k, _), (v, _) in items}, any(a or b for (_, a), (_, b) in items)
        if isinstance(value, list):
            parts = [self.neutralize(v) for v in value]
            return [v for v, _ in parts], any(c for _, c in parts)
        return value, False

    def restore(self, text: str) -> str:
        """text with its placeholders put back (a pair the guard did not make is left as it is)."""
        return _PLACEHOLDER.sub(lambda m: self._back.get(m.group(0), m.group(0)), text)

    def tokenize(self, vocab: Vocab, text: str, *, add_bos: bool, swapped: bool) -> list[int]:
        """The ids of a prompt rendered from neutralized strings: its control-token texts (the template's) as
        control tokens, the rest (placeholders put back) as plain text."""
        if not swapped or self._split is None:
            return vocab.tokenize(text, add_special=add_bos, parse_special=True)
        ids = vocab.tokenize("", add_special=True, parse_special=False) if add_bos else []
        for n, piece in enumerate(self._split.split(text)):
            if n % 2:  # a control token of the template
                ids += vocab.tokenize(piece, add_special=False, parse_special=True)
            elif piece:
                ids += vocab.tokenize(self.restore(piece), add_special=False, parse_special=False)
        return ids
