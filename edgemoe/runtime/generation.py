"""The generation loop of an Engine: prefill, sample, decode one token at a time, time it.

`run` is Engine.stream's loop (edgemoe.runtime.engine), kept apart from loading and the hook wiring;
it is given the engine's sequence (prefill, decode, logits), vocabulary and expert cache.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import TypedDict

from ..errors import EdgeMoeError
from ..speculation.config import SpeculationStats
from .sampling import Sampler, SamplingParams
from .sequence import KVSequence
from .speculative import Speculator
from .vocab import Vocabulary


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
    speculation: SpeculationStats | None = None  # what speculative decoding did (None: it was off)


class GenerateOptions(TypedDict, total=False):
    """Engine.stream's keywords, which Engine.generate takes too (typed **kwargs)."""

    max_tokens: int  # new tokens at most (128)
    sampling: SamplingParams | None  # None: SamplingParams()
    parse_special: bool  # tokenize special-token text in a str prompt as the special token
    ignore_eog: bool  # keep generating past end-of-generation tokens (benchmarks)
    speculate: bool  # False: the engine's speculative decoding (Engine.set_speculation) off for this call


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


def plain_tokens(seq: KVSequence, sampler: Sampler) -> Generator[int, None, None]:
    """One token per decode: sample from the last logits, then (when the consumer asks for the next) decode it.
    Ends when the context has no room for the next decode."""
    while True:
        seq.check_logits(-1)
        tok = sampler.sample(seq.handle.ctx)
        yield tok
        if len(seq.tokens) >= seq.n_ctx:  # no room to decode it: the context is full
            return
        seq.decode([tok])


def _mark(seq: KVSequence, phase: str) -> None:
    experts = seq.routing.experts
    if experts is not None:
        experts.mark(phase)


def run(
    seq: KVSequence,
    vocab: Vocabulary,
    prompt: str | Sequence[int],
    *,
    max_tokens: int,
    sampling: SamplingParams,
    parse_special: bool,
    ignore_eog: bool,
    speculator: Speculator | None = None,
) -> Generator[tuple[int, str], None, Generation]:
    """Engine.stream's loop: prefill `prompt` into seq, then sample and decode up to max_tokens; yields (token id,
    text piece) and returns the Generation. The engine's expert cache (seq.routing.experts, read at each mark: a
    context tier's step makes a new one) splits its hit rates into the prefill's and the decode's.
    `speculator`: verify proposed tokens in batches (edgemoe.runtime.speculative) instead of one per decode."""
    t0 = time.perf_counter()
    ids = vocab.tokenize(prompt, parse_special=parse_special) if isinstance(prompt, str) else list(prompt)
    if not ids:
        raise EdgeMoeError("the prompt is empty after tokenization; give some text")
    _mark(seq, "start")
    n_eval = seq.prefill(ids)
    _mark(seq, "decode")
    t_prefill = time.perf_counter()
    sampler: Sampler | None = None
    if speculator is not None:
        tokens = speculator.tokens(ids, max_tokens)
    else:
        sampler = Sampler(sampling, seq.handle.vocab, vocab.n_vocab)
        tokens = plain_tokens(seq, sampler)
    out: list[int] = []
    text = _Utf8Stream()
    stop = "length"
    t_first = t_prefill
    try:
        while len(out) < max_tokens:
            tok = next(tokens, None)
            if tok is None:  # the context is full
                stop = "context"
                break
            out.append(tok)
            if len(out) == 1:
                t_first = time.perf_counter()
            if vocab.is_eog(tok) and not ignore_eog:
                stop = "eog"
                break
            yield tok, text.push(vocab.token_piece(tok))
    finally:
        tokens.close()
        if sampler is not None:
            sampler.close()
    tail = text.flush()
    if tail:
        yield -1, tail
    t_end = time.perf_counter()
    gen_ids = [t for t in out if not vocab.is_eog(t)]
    timings = Timings(
        prompt_tokens=n_eval,
        prompt_s=t_prefill - t0,
        decode_tokens=len(out),
        decode_s=t_end - t_first,
        ttft_s=t_first - t0,
    )
    return Generation(
        text=vocab.detokenize(gen_ids),
        prompt_tokens=ids,
        tokens=out,
        stop_reason=stop,
        timings=timings,
        speculation=speculator.stats if speculator is not None else None,
    )
