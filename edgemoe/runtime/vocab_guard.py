"""Text llama.cpp's SentencePiece tokenizer cannot take: a vocabulary without byte tokens.

llama.cpp's SPM tokenizer splits text into UTF-8 characters (spaces become U+2581) and merges
them; a character that is not a token falls back to its bytes, each looked up as ``<0xNN>`` (or
as the one-byte piece). When a vocabulary has neither, the lookup throws through the C API and
the process terminates. `SpmByteGuard` finds such characters before llama.cpp sees them.
"""

from __future__ import annotations

from collections.abc import Iterable

SPM_SPACE = "\u2581"  # SentencePiece's escaped space


class SpmByteGuard:
    """The pieces of an SPM vocabulary and the bytes it has no token for."""

    def __init__(self, pieces: Iterable[bytes]) -> None:
        self.pieces = frozenset(pieces)
        self.missing_bytes = frozenset(
            b
            for b in range(256)
            if f"<0x{b:02X}>".encode() not in self.pieces and bytes([b]) not in self.pieces
        )

    def unencodable(self, text: str) -> list[str]:
        """Characters of `text` that are no token and have a byte without a token, sorted."""
        if not self.missing_bytes:
            return []
        chars = set(text.replace(" ", SPM_SPACE)) | {SPM_SPACE}  # llama.cpp may add a leading space
        return sorted(
            c
            for c in chars
            if (raw := c.encode("utf-8", errors="surrogatepass")) not in self.pieces
            and any(b in self.missing_bytes for b in raw)
        )
