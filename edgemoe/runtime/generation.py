"""The generation loop of an Engine: prefill, sample, decode one token at a time, time it.

GenerationMixin is a part of Engine (edgemoe.runtime.engine), kept apart from loading and
the hook wiring; it uses the engine's tokenizer, _prefill/_decode and llama.cpp context.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import EdgeMoeError
from .sampling import Sampler, SamplingParams


@dataclass(frozen=True)
class Timings:
    prompt_tokens: int  # tokens evaluated in prefill (after prefix reuse)
    prompt_s: float
    decode_tokens: int
    decode_s: float
    ttft_s: float  # request start -> first generated token

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_s if self.prompt_s > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        # the first token comes out of prefill; decode speed counts the steps after it
        steps = self.decode_tokens - 1
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else 0.0

    def to_dict(self) -> dict[str, float]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "prompt_s": self.prompt_s,
            "prompt_tps": self.prompt_tps,
            "decode_tokens": self.decode_tokens,
            "decode_s": self.decode_s,
            "decode_tps": self.decode_tps,
            "ttft_s": self.ttft_s,
        }


@dataclass
class Generation:
    text: str
    prompt_tokens: list[int]
    tokens: list[int]  # generated ids (the stop token included when one ended generation)
    stop_reason: str  # "eog" | "length" | "context"
    timings: Timings


class _Utf8Stream:
    """Turns token pieces (bytes) into text without splitting multi-byte characters."""

    def __init__(self) -> None:
        self.buf = b""

    def push(self, piece: bytes) -> str:
        self.buf += piece
        for cut in range(len(self.buf), max(len(self.buf) - 4, -1), -1):
            try:
                text = self.buf[:cut].decode("utf-8")
            except UnicodeDecodeError:
                continue
            self.buf = self.buf[cut:]
            return text
        text, self.buf = self.buf.decode("utf-8", errors="replace"), b""
        return text

    def flush(self) -> str:
        text, self.buf = self.buf.decode("utf-8", errors="replace"), b""
        return text


class GenerationMixin:
    """stream() / generate() of Engine."""

    _ctx: Any
    _vocab: Any
    _kv: list[int]
    n_ctx: int
    n_vocab: int
    last: Generation | None

    if TYPE_CHECKING:  # Engine's methods, which this part uses

        def _exclusive(self, *, native: bool = False) -> AbstractContextManager[None]: ...
        def tokenize(
            self, text: str, *, add_special: bool = True, parse_special: bool = False
        ) -> list[int]: ...
        def token_piece(self, token: int, *, special: bool = False) -> bytes: ...
        def detokenize(self, tokens: Sequence[int]) -> str: ...
        def is_eog(self, token: int) -> bool: ...
        def check_logits(self, idx: int = -1) -> None: ...
        def _prefill(self, tokens: list[int]) -> int: ...
        def _decode(self, tokens: Sequence[int], *, all_logits: bool = False) -> None: ...

    # -- generation ---------------------------------------------------------------------
    def stream(
        self,
        prompt: str | Sequence[int],
        *,
        max_tokens: int = 128,
        sampling: SamplingParams | None = None,
        parse_special: bool = False,
        ignore_eog: bool = False,
    ) -> Iterator[tuple[int, str]]:
        """Yield (token id, text piece) as they are generated; the Generation is then in self.last.

        The id is -1 for a final piece flushed from an incomplete UTF-8 sequence.
        ignore_eog keeps generating past end-of-generation tokens (benchmarks).
        """
        with self._exclusive():  # the whole generation belongs to this thread
            gen = self._run(prompt, max_tokens, sampling or SamplingParams(), parse_special, ignore_eog)
            try:
                while True:
                    yield next(gen)
            except StopIteration as stop:
                self.last = stop.value

    def generate(
        self,
        prompt: str | Sequence[int],
        *,
        max_tokens: int = 128,
        sampling: SamplingParams | None = None,
        parse_special: bool = False,
        ignore_eog: bool = False,
    ) -> Generation:
        for _ in self.stream(
            prompt,
            max_tokens=max_tokens,
            sampling=sampling,
            parse_special=parse_special,
            ignore_eog=ignore_eog,
        ):
            pass
        assert self.last is not None
        return self.last

    def _run(
        self,
        prompt: str | Sequence[int],
        max_tokens: int,
        sampling: SamplingParams,
        parse_special: bool,
        ignore_eog: bool,
    ) -> Generator[tuple[int, str], None, Generation]:
        t0 = time.perf_counter()
        ids = self.tokenize(prompt, parse_special=parse_special) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise EdgeMoeError("the prompt is empty after tokenization; give some text")
        cache = getattr(getattr(self, "cache", None), "cache", None)  # the expert cache, when enabled
        if cache is not None:
            cache.mark("start")
        n_eval = self._prefill(ids)
        if cache is not None:
            cache.mark("decode")
        t_prefill = time.perf_counter()
        sampler = Sampler(sampling, self._vocab, self.n_vocab)
        out: list[int] = []
        text = _Utf8Stream()
        stop = "length"
        t_first = t_prefill
        try:
            for i in range(max_tokens):
                self.check_logits(-1)
                tok = sampler.sample(self._ctx)
                out.append(tok)
                if i == 0:
                    t_first = time.perf_counter()
                if self.is_eog(tok) and not ignore_eog:
                    stop = "eog"
                    break
                yield tok, text.push(self.token_piece(tok))
                if i + 1 < max_tokens:
                    if len(self._kv) >= self.n_ctx:  # no room to decode it: the context is full
                        stop = "context"
                        break
                    self._decode([tok])
        finally:
            sampler.close()
        tail = text.flush()
        if tail:
            yield -1, tail
        t_end = time.perf_counter()
        gen_ids = [t for t in out if not self.is_eog(t)]
        timings = Timings(
            prompt_tokens=n_eval,
            prompt_s=t_prefill - t0,
            decode_tokens=len(out),
            decode_s=t_end - t_first,
            ttft_s=t_first - t0,
        )
        return Generation(
            text=self.detokenize(gen_ids), prompt_tokens=ids, tokens=out, stop_reason=stop, timings=timings
        )
