"""Options shared by several commands, each group given to the command as one object: adaptive top-k gating
(--gating, --threshold, ...), attention (--flash-attn, --cache-type-k/-v) and the run's sampling and load
options (--temp, --threads, --ctx, ...)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from .types import THREADS, Finite

if TYPE_CHECKING:
    from ..gguf.kv_types import FlashAttn, KvCacheType

Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]


def option_group(dest: str, options: list[Decorator], build: Callable[..., Any]) -> Decorator:
    """Add `options` to a command and hand their values to it as one keyword, `dest` = build(**values)."""

    def decorate(f: Callable[..., Any]) -> Callable[..., Any]:
        names: list[str] = []

        @functools.wraps(f)
        def command(*args: Any, **kwargs: Any) -> Any:
            kwargs[dest] = build(**{n: kwargs.pop(n) for n in names})
            return f(*args, **kwargs)

        params = command.__dict__.setdefault("__click_params__", [])
        before = len(params)
        cmd: Callable[..., Any] = command
        for o in reversed(options):
            cmd = o(cmd)
        names.extend(p.name for p in cmd.__click_params__[before:])  # type: ignore[attr-defined]
        return cmd

    return decorate


def gating_options(f: Any) -> Any:
    """--gating, --threshold, --target-reduction and --calibration, given to the command as `gating`: a
    GatingOptions whose calibration is the one given (None: the model's, found where it is used)."""
    opts = [
        click.option(
            "--gating",
            type=click.Choice(["off", "fisher", "empirical", "score", "ser"]),
            default="off",
            show_default=True,
            help="adaptive top-k: drop experts a token does not need (docs/gating.md)",
        ),
        click.option(
            "--threshold",
            type=Finite(0.0),
            default=None,
            help="the gating rule's threshold (finite, >= 0); without it or --target-reduction, the one dropping "
            "the most experts within mean KL divergence <= 0.01 and same top token >= 97% against full top-k, on "
            "the calibration's validation text (docs/gating.md)",
        ),
        click.option(
            "--target-reduction",
            type=click.FloatRange(0.0, 1.0, min_open=True, max_open=True),
            default=None,
            help="find the threshold that drops this share of expert activations "
            "(on the calibration's validation text), e.g. 0.25",
        ),
        click.option(
            "--calibration",
            type=click.Path(file_okay=False, path_type=Path),
            default=None,
            help="calibration directory (default: the model's, see docs/predictors.md)",
        ),
    ]
    return option_group("gating", opts, _gating)(f)


def _gating(
    *, gating: str, threshold: float | None, target_reduction: float | None, calibration: Path | None
) -> Any:
    from ..calibration.adaptive import GatingOptions

    return GatingOptions(
        mode=gating, threshold=threshold, target_reduction=target_reduction, calibration=calibration
    )


@dataclass(frozen=True)
class AttentionOptions:
    """LoadConfig's attention fields as the command line gave them."""

    flash_attn: FlashAttn = "auto"
    cache_type_k: KvCacheType = "f16"
    cache_type_v: KvCacheType = "f16"

    def load_kwargs(self) -> dict[str, Any]:
        """LoadConfig's keyword arguments (and open_engine's)."""
        return {
            "flash_attn": self.flash_attn,
            "cache_type_k": self.cache_type_k,
            "cache_type_v": self.cache_type_v,
        }


def _attention_opts(*, kv_only: bool = False) -> list[Decorator]:
    from ..gguf.kv_types import KV_CACHE_TYPES

    helps = {
        "k": "the K cache's type (llama.cpp's -ctk): q8_0 takes 8.5/16 of f16's bytes, q4_0 4.5/16",
        "v": "the V cache's type (llama.cpp's -ctv); a quantized one needs flash attention",
    }
    kv = [
        click.option(
            f"-ct{x}",
            f"--cache-type-{x}",
            type=click.Choice(KV_CACHE_TYPES),
            default="f16",
            show_default=True,
            help=h,
        )
        for x, h in helps.items()
    ]
    return kv if kv_only else [flash_attn_option(), *kv]


def flash_attn_option(
    text: str = "flash attention (auto: on where the backend supports it, as llama.cpp's default)",
) -> Decorator:
    """-fa/--flash-attn, given to the command as `flash_attn`."""
    return click.option(
        "-fa",
        "--flash-attn",
        type=click.Choice(["auto", "on", "off"]),
        default="auto",
        show_default=True,
        help=text,
    )


def attention_options(f: Any) -> Any:
    """--flash-attn, --cache-type-k and --cache-type-v, given to the command as `attention`: AttentionOptions."""
    return option_group("attention", _attention_opts(), AttentionOptions)(f)


def kv_type_options(f: Any) -> Any:
    """--cache-type-k and --cache-type-v alone (for a plan's KV estimate), given as `attention`: AttentionOptions."""
    return option_group("attention", _attention_opts(kv_only=True), AttentionOptions)(f)


@dataclass(frozen=True)
class RunOptions:
    sampling: Any  # edgemoe.runtime.sampling.SamplingParams
    threads: int  # CPU threads (0: physical cores)
    n_ctx: int  # context length (0: with a budget, the plan's pick; else the model's, at most 4096)
    gpu_layers: int  # layers stock llama.cpp offloads whole to the GPU
    attention: AttentionOptions = AttentionOptions()  # flash attention and the KV cache's types
    n_batch: int | None = None  # tokens per llama_decode in prefill (None: 512, or what holds the ubatch)
    n_ubatch: int | None = (
        None  # tokens per prefill ubatch (None: the plan's pick with a budget on a GPU, else 512)
    )

    def batch_kwargs(self) -> dict[str, int]:
        """open_engine's n_batch / n_ubatch where given (the plan decides the rest)."""
        given = {"n_batch": self.n_batch, "n_ubatch": self.n_ubatch}
        return {k: v for k, v in given.items() if v is not None}


def run_options(f: Any) -> Any:
    """Sampling (--temp, --top-k, ...), load (--threads, --ctx, -ngl) and attention (--flash-attn,
    --cache-type-k/-v) options, given as `run`: RunOptions."""
    opts = [
        click.option(
            "--temp",
            "temperature",
            type=Finite(0.0),
            default=0.8,
            show_default=True,
            help="sampling temperature; 0 = greedy (identical to stock llama.cpp; with an expert cache the "
            "cached experts run other kernels and long outputs may differ, see docs/expert-cache.md)",
        ),
        click.option("--top-k", type=click.IntRange(min=0), default=40, show_default=True, help="0: off"),
        click.option("--top-p", type=Finite(0.0, 1.0), default=0.95, show_default=True),
        click.option("--min-p", type=Finite(0.0, 1.0), default=0.05, show_default=True),
        click.option("--repeat-penalty", type=Finite(0.0), default=1.0, show_default=True, help="1.0: off"),
        click.option("--seed", type=int, default=None, help="sampling seed (default: random)"),
        click.option(
            "-t",
            "--threads",
            type=THREADS,
            default=0,
            help="CPU threads (default: physical cores)",
            envvar="EDGEMOE_THREADS",
        ),
        click.option(
            "--ctx",
            "n_ctx",
            type=click.IntRange(min=0),
            default=0,
            help="context length (default: with --vram, the context the plan picks for the budget, the "
            "largest of 4096..131072 up to the model's training context that keeps >= 75% of the expert slots at "
            "4096, said in a note; else the model's, at most 4096; llama.cpp rounds it up to a multiple of 256)",
        ),
        click.option(
            "-ngl",
            "--gpu-layers",
            type=click.IntRange(min=0),
            default=0,
            show_default=True,
            help="layers stock llama.cpp offloads whole to the GPU (CUDA builds)",
        ),
        *batch_opts(),
        *_attention_opts(),
    ]
    return option_group("run", opts, _run)(f)


def batch_opts() -> list[Decorator]:
    """-b/--batch and -ub/--ubatch (llama.cpp's), given to the command as `n_batch` and `n_ubatch` (None: not
    given)."""
    return [
        click.option(
            "-b",
            "--batch",
            "n_batch",
            type=int,
            default=None,
            help="tokens per llama_decode call in prefill, the chunk a long prompt is prefilled in (default: 512, "
            "or the ubatch where that is larger)",
        ),
        click.option(
            "-ub",
            "--ubatch",
            "n_ubatch",
            type=int,
            default=None,
            help="tokens per prefill ubatch, at most --batch and the context (default: with --vram and "
            "--device-prefill on a GPU, the ubatch the plan picks for a long prompt on --profile or this "
            "machine's profile, its compute buffer out of the slots, said in a note; else 512)",
        ),
    ]


def _run(
    *,
    temperature: float,
    top_k: int,
    top_p: float,
    min_p: float,
    repeat_penalty: float,
    seed: int | None,
    threads: int,
    n_ctx: int,
    gpu_layers: int,
    n_batch: int | None,
    n_ubatch: int | None,
    flash_attn: FlashAttn,
    cache_type_k: KvCacheType,
    cache_type_v: KvCacheType,
) -> RunOptions:
    from ..runtime.sampling import DEFAULT_SEED, SamplingParams

    sampling = SamplingParams(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        repeat_penalty=repeat_penalty,
        seed=DEFAULT_SEED if seed is None else seed,
    )
    attention = AttentionOptions(flash_attn, cache_type_k, cache_type_v)
    return RunOptions(sampling, threads, n_ctx, gpu_layers, attention, n_batch, n_ubatch)


def speculation_options(f: Any) -> Any:
    """--speculate, --draft-max and --draft-model, given to the command as `speculation`: a SpeculationConfig."""
    from ..speculation.config import DRAFT_MAX_LIMIT, SPECULATE_MODES

    opts = [
        click.option(
            "--speculate",
            type=click.Choice(SPECULATE_MODES),
            default=None,
            help="speculative decoding: lookup proposes what followed the context's last tokens earlier in it; "
            "draft runs --draft-model; mtp runs the model's own MTP heads where it has them, e.g. DeepSeek-V3 "
            "and GLM-4.5 (docs/speculation.md). "
            "Default: off, or draft with --draft-model",
        ),
        click.option(
            "--draft-max",
            type=click.IntRange(1, DRAFT_MAX_LIMIT),
            default=8,
            show_default=True,
            help="tokens proposed per verification step at the most",
        ),
        click.option(
            "--draft-model",
            type=click.Path(dir_okay=False, exists=True, path_type=Path),
            default=None,
            help="a small GGUF with the model's vocabulary that drafts for it (on the CPU)",
        ),
    ]
    return option_group("speculation", opts, _speculation)(f)


def _speculation(*, speculate: str | None, draft_max: int, draft_model: Path | None) -> Any:
    from ..speculation.config import SpeculationConfig

    mode = speculate or ("draft" if draft_model is not None else "off")
    if draft_model is not None and mode != "draft":
        raise click.UsageError(f"--draft-model drafts with --speculate draft, not --speculate {mode}")
    return SpeculationConfig(
        mode=mode, draft_max=draft_max, draft_model=str(draft_model) if draft_model else None
    )
