"""The reference logits of a perplexity run, kept for KL-divergence comparisons (`perplexity --kl-divergence-base`).

llama.cpp's `llama-perplexity --kl-divergence-base FILE` stores every scored token's whole distribution (16-bit
log-probabilities over the vocabulary). A base here keeps, per scored row, the base's top-k log-probabilities and
their token ids, the log of the mass outside them and the log-probability of the text's next token (the base's
NLL, exact whatever k). Its size is k * 8 bytes a row instead of n_vocab * 2.

What truncation costs (edgemoe.analysis.kld): the KLD is computed over the k tokens plus one bucket holding the
rest. Merging outcomes never raises a KL divergence (the log-sum inequality), so the truncated KLD is a lower
bound of the true one, exact when k >= n_vocab; the gap is p_rest * KL(P_rest || Q_rest) between the two
distributions' tails, each renormalised, where p_rest is the base's mass outside its top k (reported as
`base_tail_max` / `base_tail_mean`). The same-top rate and the probability of the next token are exact.

A base holds what a comparison must share with it: the model's identity (architecture, shape and vocabulary,
not its quantization: comparing quantizations of one model is what the file is for), the chunk length, the rows
skipped at each chunk's start and the tokens. A run that differs in any of them is refused (KldBaseError).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import EdgeMoeError

if TYPE_CHECKING:
    from ..runtime.engine import Engine

FORMAT = "edgemoe-kld-base"
VERSION = 1
# per row 8 KiB (llama.cpp: 2 bytes per vocabulary entry); the fixtures' whole vocabulary
DEFAULT_TOP_K = 1024


class KldBaseError(EdgeMoeError):
    """A KL-divergence base file is unreadable, or was written for another model, text or context."""


def model_identity(engine: Engine) -> dict[str, Any]:
    """What must match between a base and a run compared with it: the architecture, its shape and the
    vocabulary (a digest of every token's text), not the file (another quantization of the same model matches)."""
    info = engine.info
    h = hashlib.sha256()
    for t in range(engine.n_vocab):
        piece = engine.token_piece(t, special=True)
        h.update(len(piece).to_bytes(4, "little") + piece)
    return {
        "architecture": info.architecture,
        "n_layer": info.n_layer,
        "n_embd": info.n_embd,
        "n_expert": info.n_expert,
        "n_vocab": engine.n_vocab,
        "vocab_sha256": h.hexdigest()[:16],
    }


def tokens_digest(tokens: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(tokens, np.int32).tobytes()).hexdigest()[:16]


@dataclass(frozen=True)
class RunKey:
    """What a run and the base it is compared with must share."""

    model: dict[str, Any]  # model_identity()
    ctx: int  # tokens per chunk
    score_from: int  # rows skipped at the start of each chunk (perplexity's --prompt-tokens)
    tokens: np.ndarray = field(repr=False)  # (n,) int32: the text's tokens, before chunking

    def meta(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "ctx": self.ctx,
            "score_from": self.score_from,
            "n_tokens": int(len(self.tokens)),
            "tokens_sha256": tokens_digest(self.tokens),
        }


def run_key(engine: Engine, tokens: list[int], *, ctx: int, score_from: int) -> RunKey:
    return RunKey(model_identity(engine), ctx, score_from, np.asarray(tokens, np.int32))


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """(rows, n_vocab) log-probabilities in float64."""
    x = np.asarray(logits, np.float64)
    m = x.max(1, keepdims=True)
    return x - (m + np.log(np.exp(x - m).sum(1, keepdims=True)))


def rest_logmass(logp: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """(rows,) log of the probability outside ids (rows, k) of each row; -inf where nothing is outside.
    The same arithmetic for a base and a run, so that a run compared with its own base gives 0 exactly."""
    x = np.array(logp, np.float64, copy=True)
    np.put_along_axis(x, ids.astype(np.int64), -np.inf, axis=1)
    m = x.max(1)
    finite = np.isfinite(m)
    out = np.full(len(x), -np.inf)
    if finite.any():
        mf = m[finite, None]
        out[finite] = m[finite] + np.log(np.exp(x[finite] - mf).sum(1))
    return out


@dataclass(frozen=True)
class KldBase:
    """The base's rows (every array's first axis: scored rows, in run order) and what it was made from."""

    meta: dict[str, Any]  # RunKey.meta() plus "top_k", "rows" and "run" (how the base ran, for display)
    ids: np.ndarray  # (rows, k) int32: the base's top-k tokens, most probable first
    logp: np.ndarray  # (rows, k) float32: their log-probabilities
    logp_rest: np.ndarray  # (rows,) float64: log of the mass outside them (-inf: none)
    logp_target: np.ndarray  # (rows,) float64: log-probability of the text's next token
    tokens: np.ndarray = field(repr=False)  # (n,) int32: the run's tokens (before chunking)

    @property
    def rows(self) -> int:
        return int(len(self.ids))

    @property
    def top_k(self) -> int:
        return int(self.ids.shape[1])

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write it (atomically: a half-written base is never left under its name)."""
        path = Path(path)
        tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
        try:
            with tmp.open("wb") as f:  # a file object: np.savez adds no ".npz" to the name
                np.savez(
                    f,
                    meta=np.array(json.dumps(self.meta)),
                    ids=self.ids,
                    logp=self.logp,
                    logp_rest=self.logp_rest,
                    logp_target=self.logp_target,
                    tokens=self.tokens,
                )
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> KldBase:
        how = f"write one with `edgemoe perplexity MODEL --input FILE --kl-divergence-base {path}`"
        with open(path, "rb") as f:
            if f.read(4) != b"PK\x03\x04":  # an .npz is a zip archive
                raise KldBaseError(f"{path} is not a KL-divergence base: {how}")
        try:
            with np.load(path, allow_pickle=False) as z:
                meta = json.loads(str(z["meta"]))
                base = cls(meta, z["ids"], z["logp"], z["logp_rest"], z["logp_target"], z["tokens"])
        except (OSError, ValueError, KeyError) as err:
            raise KldBaseError(
                f"{path} is not a KL-divergence base ({type(err).__name__}: {err}); {how}"
            ) from err
        if meta.get("format") != FORMAT or meta.get("version") != VERSION:
            raise KldBaseError(
                f"{path} is a {meta.get('format')} file of version {meta.get('version')}, not an {FORMAT} "
                f"of version {VERSION}: write the base again with this edgemoe"
            )
        n = base.rows
        shapes_ok = (
            base.logp.shape == base.ids.shape
            and base.logp_rest.shape == (n,)
            and base.logp_target.shape == (n,)
            and meta.get("rows") == n
        )
        if not shapes_ok:
            raise KldBaseError(
                f"{path} is damaged (its arrays disagree on the number of rows): write it again"
            )
        return base

    def check(self, key: RunKey, name: str = "the base") -> None:
        """Refuse (KldBaseError, one line) a run that differs from the base in model, context or tokens."""
        m = self.meta
        if m["model"] != key.model:
            diff = [k for k in key.model if m["model"].get(k) != key.model[k]]
            what = ", ".join(f"{k} {m['model'].get(k)} vs {key.model[k]}" for k in diff)
            raise KldBaseError(
                f"{name} was written for another model ({what}): compare runs of the same model"
            )
        if m["ctx"] != key.ctx or m["score_from"] != key.score_from:
            raise KldBaseError(
                f"{name} was written with `ctx={m['ctx']}` `prompt_tokens={m['score_from']}`, this run has "
                f"`ctx={key.ctx}` `prompt_tokens={key.score_from}`: use the base's settings"
            )
        if m["n_tokens"] != len(key.tokens) or m["tokens_sha256"] != tokens_digest(key.tokens):
            raise KldBaseError(
                f"{name} was written for other tokens ({m['n_tokens']} tokens, digest {m['tokens_sha256']}; this "
                f"run: {len(key.tokens)}, {tokens_digest(key.tokens)}): use the same `input_path` and `max_tokens`"
            )


class BaseRecorder:
    """Collects the scored rows of a run (perplexity's `rows` callback) into a KldBase."""

    def __init__(self, key: RunKey, *, top_k: int = DEFAULT_TOP_K, run: dict[str, Any] | None = None) -> None:
        if top_k < 1:
            raise KldBaseError(f"top_k {top_k}: keep at least the most probable token of each row")
        self.key = key
        self.top_k = top_k
        self.run = dict(run or {})
        self._parts: list[tuple[np.ndarray, ...]] = []

    def __call__(self, logits: np.ndarray, targets: np.ndarray) -> None:
        lp = log_softmax(logits)
        k = min(self.top_k, lp.shape[1])
        ids = np.argsort(-lp, axis=1, kind="stable")[:, :k].astype(np.int32)
        top = np.take_along_axis(lp, ids, axis=1).astype(np.float32)
        target = lp[np.arange(len(lp)), np.asarray(targets, np.int64)]
        self._parts.append((ids, top, rest_logmass(lp, ids), target))

    def base(self) -> KldBase:
        k = min((p[0].shape[1] for p in self._parts), default=self.top_k)
        cat = [np.concatenate(a) for a in zip(*self._parts, strict=True)] if self._parts else None
        ids, logp, rest, target = cat or (
            np.zeros((0, k), np.int32),
            np.zeros((0, k), np.float32),
            np.zeros(0),
            np.zeros(0),
        )
        meta = {
            "format": FORMAT,
            "version": VERSION,
            **self.key.meta(),
            "top_k": int(k),
            "rows": int(len(ids)),
            "run": self.run,
        }
        return KldBase(meta, ids, logp, rest, target, self.key.tokens)
