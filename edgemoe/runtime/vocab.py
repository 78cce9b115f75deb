"""The vocabulary of a loaded model: text to token ids and back, special tokens.

Vocabulary is a part of an Engine (edgemoe.runtime.engine) given the NativeHandle it reads the vocabulary from.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

from ..errors import EdgeMoeError
from .handle import NativeHandle
from .native import lib
from .vocab_guard import SpmByteGuard


class Vocabulary:
    """tokenize / token_piece / detokenize over the model's vocabulary, with the checks llama.cpp lacks."""

    def __init__(self, handle: NativeHandle) -> None:
        self.handle = handle
        self.name = handle.name  # the model file's name, for the messages
        # a GGUF without a tokenizer (tokenizer.ggml.model "none") loads, but llama.cpp aborts on any text
        self.has_tokenizer = lib.llama_vocab_type(handle.vocab) != lib.LLAMA_VOCAB_TYPE_NONE
        self._spm_guard: SpmByteGuard | None = None  # built on the first tokenize of an SPM vocabulary

    @property
    def n_vocab(self) -> int:
        return lib.llama_vocab_n_tokens(self.handle.vocab)

    def require_tokenizer(self) -> None:
        if not self.has_tokenizer:
            raise EdgeMoeError(
                f"{self.name} has no tokenizer (tokenizer.ggml.model none or no_vocab): "
                "it cannot turn text into tokens or back; pass token ids, or use a GGUF with "
                "a vocabulary"
            )

    def check_spm_bytes(self, text: str) -> None:
        """Refuse text llama.cpp's SentencePiece tokenizer would terminate the process on."""
        vocab = self.handle.vocab
        if lib.llama_vocab_type(vocab) != lib.LLAMA_VOCAB_TYPE_SPM:
            return
        if self._spm_guard is None:
            self._spm_guard = SpmByteGuard(lib.llama_vocab_get_text(vocab, i) for i in range(self.n_vocab))
        bad = self._spm_guard.unencodable(text)
        if bad:
            shown = ", ".join(repr(c) for c in bad[:5]) + (
                f" and {len(bad) - 5} more" if len(bad) > 5 else ""
            )
            raise EdgeMoeError(
                f"{self.name}'s SentencePiece vocabulary has no token for {shown} and no "
                f"byte tokens (<0x00>..<0xFF>) to spell it with ({len(self._spm_guard.missing_bytes)}"
                " of 256 missing), so llama.cpp cannot tokenize this text: use a GGUF converted "
                "with byte fallback, or pass token ids"
            )

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Text -> ids; add_special adds BOS/EOS as the model's metadata says."""
        self.require_tokenizer()
        self.check_spm_bytes(text)
        data = text.encode("utf-8")
        cap = len(data) + 16
        buf = (lib.llama_token * cap)()
        vocab = self.handle.vocab
        n = lib.llama_tokenize(vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            buf = (lib.llama_token * cap)()
            n = lib.llama_tokenize(vocab, data, len(data), buf, cap, add_special, parse_special)
        return list(buf[:n])

    def token_piece(self, token: int, *, special: bool = False) -> bytes:
        if not 0 <= token < self.n_vocab:
            raise EdgeMoeError(
                f"token id {token} is not in the vocabulary of {self.name} (0..{self.n_vocab - 1})"
            )
        self.require_tokenizer()
        vocab = self.handle.vocab
        buf = ctypes.create_string_buffer(64)
        n = lib.llama_token_to_piece(vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = lib.llama_token_to_piece(vocab, token, buf, len(buf), 0, special)
        return buf.raw[:n]

    def detokenize(self, tokens: Sequence[int]) -> str:
        return b"".join(self.token_piece(t) for t in tokens).decode("utf-8", errors="replace")

    def adds_bos(self) -> bool:
        """Does tokenize(add_special=True) prepend BOS (the model's metadata says)?"""
        return bool(lib.llama_vocab_get_add_bos(self.handle.vocab))

    def bos_token(self) -> int:
        return int(lib.llama_vocab_bos(self.handle.vocab))

    def is_eog(self, token: int) -> bool:
        return bool(lib.llama_vocab_is_eog(self.handle.vocab, token))
