"""perplexity's KL-divergence options (--kl-divergence-base, --kl-divergence, --kld-top-k), given to the command as
`kld`: KldOptions, which makes the run's row sink (edgemoe.analysis.kld) and reports what it found."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from .options import option_group
from .types import OutputPath

if TYPE_CHECKING:
    from ..analysis.kld import KldComparison
    from ..analysis.kld_base import BaseRecorder
    from ..runtime.engine import Engine

DEFAULT_TOP_K = 1024  # edgemoe.analysis.kld_base.DEFAULT_TOP_K (not imported: --help stays light)


@dataclass(frozen=True)
class KldOptions:
    write: Path | None = None  # --kl-divergence-base: write this run's logits there
    compare: Path | None = None  # --kl-divergence: compare this run with the base there
    top_k: int = DEFAULT_TOP_K

    @property
    def on(self) -> bool:
        return self.write is not None or self.compare is not None


class KldSink:
    """The run's scored rows go to a base recorder or a comparison; report() says what came of them."""

    def __init__(self, opts: KldOptions, sink: BaseRecorder | KldComparison) -> None:
        self.opts = opts
        self.sink = sink

    def __call__(self, logits: Any, targets: Any) -> None:
        self.sink(logits, targets)

    def report(self) -> tuple[dict[str, Any], list[str]]:
        """(the JSON entry "kld", the text lines) once the run is done; writes the base."""
        import math

        from ..analysis.kld_base import BaseRecorder

        if isinstance(self.sink, BaseRecorder):
            base = self.sink.base()
            assert self.opts.write is not None
            path = base.save(self.opts.write)
            tail = float(base.logp_rest.max()) if base.rows else float("-inf")
            d = {
                "base_written": str(path),
                "rows": base.rows,
                "top_k": base.top_k,
                "base_tail_max": math.exp(tail),
            }
            return d, [
                f"wrote the KL-divergence base {path}: {base.rows} tokens, top {base.top_k} log-probs each "
                f"(largest mass outside them {math.exp(tail):.2g})"
            ]
        res = self.sink.result()
        assert self.opts.compare is not None
        run = self.sink.base.meta.get("run", {})
        what = ", ".join(f"{k} {v}" for k, v in run.items() if v is not None)
        head = f"KL divergence against {self.opts.compare} ({res.tokens} tokens; base: {what or 'as given'}):"
        return {"base": str(self.opts.compare), "base_run": run, **res.to_dict()}, [
            head,
            *("  " + ln for ln in res.lines()),
        ]


def kld_sink(
    opts: KldOptions, engine: Engine, tokens: list[int], *, ctx: int, score_from: int, run: dict[str, Any]
) -> KldSink | None:
    """The sink for a run of `tokens` in chunks of `ctx` scored from `score_from` (None: no KLD option); a base to
    compare with is read and checked against the run here, before it starts (KldBaseError, one line)."""
    from ..analysis.kld import KldComparison
    from ..analysis.kld_base import BaseRecorder, KldBase, run_key

    if not opts.on:
        return None
    key = run_key(engine, tokens, ctx=ctx, score_from=score_from)
    if opts.compare is not None:
        base = KldBase.load(opts.compare)
        base.check(key, str(opts.compare))
        return KldSink(opts, KldComparison(base))
    return KldSink(opts, BaseRecorder(key, top_k=opts.top_k, run=run))


def kld_options(f: Any) -> Any:
    """--kl-divergence-base, --kl-divergence and --kld-top-k, given to the command as `kld`: KldOptions."""
    opts = [
        click.option(
            "--kl-divergence-base",
            "write",
            type=OutputPath(),
            default=None,
            metavar="FILE",
            help="write this run's logits (the top --kld-top-k log-probs of every scored token) to FILE, the base "
            "of later --kl-divergence runs (llama-perplexity's option; run the full model, without the options "
            "to compare)",
        ),
        click.option(
            "--kl-divergence",
            "compare",
            type=click.Path(exists=True, dir_okay=False, path_type=Path),
            default=None,
            metavar="FILE",
            help="compare this run with the base in FILE (same model, --input, --ctx, --max-tokens, "
            "--prompt-tokens): mean KL divergence and its percentiles, the share of tokens whose most probable "
            "token is the base's (same top p), and Δp, as llama-perplexity --kl-divergence reports them",
        ),
        click.option(
            "--kld-top-k",
            "top_k",
            type=click.IntRange(min=1),
            default=DEFAULT_TOP_K,
            show_default=True,
            help="log-probs per token a base keeps: the KLD over them plus the rest is a lower bound of the true "
            "one (exact when it covers the vocabulary); the comparison reports the mass outside them",
        ),
    ]
    return option_group("kld", opts, _kld)(f)


def _kld(*, write: Path | None, compare: Path | None, top_k: int) -> KldOptions:
    if write is not None and compare is not None:
        raise click.UsageError(
            "give --kl-divergence-base FILE (write this run as a base) or --kl-divergence FILE (compare with one), "
            "not both"
        )
    return KldOptions(write, compare, top_k)
