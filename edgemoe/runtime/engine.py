"""edgemoe.Engine: load a GGUF, tokenize, generate/stream, chat, timings.

Built on llama-cpp-python's low-level bindings (edgemoe.runtime.native.lib). One
sequence, one context; the KV cache keeps the longest common prefix between
calls, so a chat turn only evaluates the new tokens.

The Engine holds one object per concern, each given what it needs in its constructor, as llama-cpp-python's
Llama holds its model, context and sampler: the llama.cpp pointers (`handle`, handle.py), the thread guard
(exclusive.py), the vocabulary (vocab.py), the sequence and its KV state (sequence.py), adaptive top-k
(`gating`, gating.py), the expert predictors in the graph (`prefetch`, prediction.py) and the routing hook with
the expert cache (`routing`, routing.py; `experts`, expert_cache.py). Its methods are thin calls into them; the
generation loop (generation.py) and the chat templates (chat.py) are functions; LoadConfig is in config.py.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import InvalidConfigError
from ..gguf.header import GgufHeader
from ..gguf.info import ModelInfo, check_gguf, model_info
from ..gguf.validate import validate_hparams
from ..policies.gating import GatingPolicy
from ..policies.route import RoutePolicy
from ..predictors.base import Predictor
from ..speculation.config import SpeculationConfig
from . import chat, generation, native
from .cache_config import CacheConfig
from .chat import ChatMessage, ChatSession
from .config import DEFAULT_BATCH, LoadConfig, default_threads
from .context_tiers import ContextResizer, ContextTiers, check_tiers, tiers_refusal
from .device_ids import DeviceIdsChoice
from .draft_model import make_source
from .exclusive import ThreadGuard
from .expert_cache import CacheController, ExpertCache
from .gating import Gating
from .generation import GenerateOptions, Generation, Timings
from .handle import KvCacheInfo, NativeHandle
from .hooks import HookChain
from .mtp import MtpDrafter, check_mtp
from .prediction import GraphPredictors
from .prompt_cache import KVSnapshot
from .routing import Routing
from .sampling import SamplingParams
from .sequence import KVSequence
from .speculative import Speculation, Speculator
from .vocab import Vocabulary

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing.Unpack from Python 3.11

__all__ = [
    "ChatMessage",
    "ChatSession",
    "Engine",
    "Generation",
    "LoadConfig",
    "Timings",
    "default_threads",
]


class Engine:
    """A loaded model with one context. Use as a context manager or call close()."""

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        config: LoadConfig | None = None,
        *,
        header: GgufHeader | None = None,
    ) -> None:
        """`header`: the file's check_gguf(), where the caller has it already (edgemoe.open_engine); else it is
        read here."""
        self.path = Path(model_path)
        self.config = config or LoadConfig()
        # typed, actionable errors before llama.cpp sees the file; the expert cache reads its tensors' offsets
        header = check_gguf(self.path) if header is None else header
        if header.path != self.path:
            raise InvalidConfigError(
                f"the header given is {header.path}'s, not {self.path}'s: give the model's own"
            )
        self.header = header
        native.require_patched()
        native.route_logs_to_python()
        self.info: ModelInfo = model_info(header)
        self.config.validate(n_expert=self.info.n_expert, n_expert_used=self.info.n_expert_used)
        self.config.validate_kv_shape(
            n_embd_head_k=self.info.n_embd_head_k,
            n_embd_head_v=self.info.n_embd_head_v,
            mla=self.info.kv_lora_rank > 0,
        )
        # values llama.cpp would abort on, with the expert_used_count override in place of the file's
        validate_hparams(header, expert_used_count=self.config.expert_used_count)
        if self.config.load_mtp:
            check_mtp(header, self.info)  # llama.cpp asserts (aborts) where it cannot run them
        self.handle = NativeHandle(self.path, self.config, self.info)
        self.n_threads = self.handle.n_threads
        self.n_ctx = self.handle.n_ctx
        self.n_batch = self.handle.n_batch
        self.n_ubatch = self.handle.n_ubatch  # the prefill ubatch llama.cpp runs (at most n_batch)
        self.graph_nodes = self.handle.graph_nodes
        self.flash_attn = self.handle.flash_attn  # what "auto" resolved to
        self.last: Generation | None = None  # the result of the last generate()/stream()
        self._guard = ThreadGuard(self.path.name)
        self._vocab = Vocabulary(self.handle)
        self.gating = Gating(self.handle, self.info.n_layer)
        self.prefetch = GraphPredictors(self.handle, self.info)
        self.routing = Routing(self.handle, header, self.info, self.gating, self.prefetch)
        self._seq = KVSequence(self.handle, self._vocab, self._guard, self.routing)
        self.speculation: Speculation | None = None  # set_speculation: the draft source stream() verifies
        self.tiers: ContextResizer | None = None  # set_context_tiers: the context grown in steps
        self._ids_check = False  # set_ids_check's setting, put on a re-created context again

    @property
    def kv_cache(self) -> KvCacheInfo | None:
        """The KV cache llama.cpp made for the context as it is now (None: the model has none)."""
        return self.handle.kv_cache

    @property
    def experts(self) -> CacheController | None:
        """The expert cache (enable_expert_cache; None: none): stats(), slots, policy, report(), ..."""
        return self.routing.experts

    # -- lifetime -----------------------------------------------------------------------
    def close(self) -> None:
        """Free the context and the model; any later use raises EngineClosedError. Closing twice is fine."""
        self._guard.check_closable()
        self.set_speculation(None)
        if self.handle.is_open:
            self.routing.close_experts()
        self.handle.free()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- vocabulary ---------------------------------------------------------------------
    @property
    def n_vocab(self) -> int:
        return self._vocab.n_vocab

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Text -> ids; add_special adds BOS/EOS as the model's metadata says."""
        return self._vocab.tokenize(text, add_special=add_special, parse_special=parse_special)

    def token_piece(self, token: int, *, special: bool = False) -> bytes:
        return self._vocab.token_piece(token, special=special)

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self._vocab.detokenize(tokens)

    def adds_bos(self) -> bool:
        """Does tokenize(add_special=True) prepend BOS (the model's metadata says)?"""
        return self._vocab.adds_bos()

    def bos_token(self) -> int:
        return self._vocab.bos_token()

    def is_eog(self, token: int) -> bool:
        return self._vocab.is_eog(token)

    # -- evaluation and KV state --------------------------------------------------------
    def reset(self) -> None:
        """Forget the KV cache."""
        self._seq.reset()

    def feed(self, tokens: Sequence[int], *, all_logits: bool = False) -> None:
        """Append tokens to the current sequence without sampling (prefill, teacher forcing).

        all_logits asks for every token's logits; it also makes the last layer route every
        token (llama.cpp computes the last layer only for tokens whose outputs are kept).
        """
        self._seq.feed(tokens, all_logits=all_logits)

    def prefill(self, tokens: Sequence[int]) -> int:
        """Make the KV cache hold exactly `tokens`, reusing the common prefix; returns the tokens evaluated (one
        at least, for fresh logits)."""
        return self._seq.prefill(list(tokens))

    def truncate(self, n: int) -> None:
        """Keep the first n tokens' K/V and forget the rest."""
        self._seq.truncate(n)

    def check_logits(self, idx: int = -1) -> None:
        """Raise NonFiniteLogitsError when output idx of the last decode has a NaN or inf, or one value for
        every token (what NaN weights give on the CPU)."""
        self._seq.check_logits(idx)

    def logits(self, idx: int = -1) -> ctypes.Array[ctypes.c_float]:
        """Logits of the idx-th output of the last decode (a float array of n_vocab)."""
        return self._seq.logits(idx)

    def eval_logits(self, tokens: Sequence[int]) -> list[np.ndarray]:
        """Fresh sequence: logits for every position (for perplexity and tests)."""
        return self._seq.eval_logits(tokens)

    def cached_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of a prompt the KV cache holds now (prefill evaluates at least one)."""
        return self._seq.cached_prefix(tokens)

    def kv_tokens(self) -> tuple[int, ...]:
        return tuple(self._seq.tokens)

    def snapshot(self) -> KVSnapshot:
        """A copy of the KV state of the tokens evaluated so far."""
        return self._seq.snapshot()

    def watch_prefill(self, on_chunk: Callable[[int], None] | None) -> None:
        """Call `on_chunk(n)` between the chunks of every prefill from now on (n_batch tokens each, from where
        the prefill starts; n: the tokens the KV cache then holds), e.g. to snapshot a chunk boundary; None:
        stop."""
        self._seq.on_chunk = on_chunk

    def restore(self, snap: KVSnapshot) -> None:
        """Make the KV cache hold snap's tokens again (the next prompt then reuses what it shares)."""
        self._seq.restore(snap)

    # -- generation and chat ------------------------------------------------------------
    def stream(
        self,
        prompt: str | Sequence[int],
        *,
        max_tokens: int = 128,
        sampling: SamplingParams | None = None,
        parse_special: bool = False,
        ignore_eog: bool = False,
        speculate: bool = True,
    ) -> Iterator[tuple[int, str]]:
        """Yield (token id, text piece) as they are generated; the Generation is then in self.last.

        The id is -1 for a final piece flushed from an incomplete UTF-8 sequence.
        ignore_eog keeps generating past end-of-generation tokens (benchmarks). speculate=False turns the
        engine's speculation (set_speculation) off for this call, as does a sampling grammar.
        """
        params = sampling or SamplingParams()
        spec = self.speculation if speculate and params.grammar is None else None  # drafts ignore grammars
        speculator = (
            Speculator(self._seq, self.routing, spec.source, params, draft_max=spec.config.draft_max)
            if spec is not None
            else None
        )
        with self._guard.hold():  # the whole generation belongs to this thread
            gen = generation.run(
                self._seq,
                self._vocab,
                prompt,
                max_tokens=max_tokens,
                sampling=params,
                parse_special=parse_special,
                ignore_eog=ignore_eog,
                speculator=speculator,
            )
            try:
                while True:
                    yield next(gen)
            except StopIteration as stop:
                self.last = stop.value

    def generate(self, prompt: str | Sequence[int], **options: Unpack[GenerateOptions]) -> Generation:
        """Generate to the end (stream's keywords: max_tokens, sampling, parse_special, ignore_eog, speculate) and return
        the Generation."""
        for _ in self.stream(prompt, **options):
            pass
        assert self.last is not None
        return self.last

    # -- speculative decoding -------------------------------------------------------------
    def set_speculation(self, config: SpeculationConfig | None) -> Speculation | None:
        """Verify proposed tokens in batches from now on (None or mode off: one token per decode). A draft model
        is opened here, and the previous source closed."""
        if self.speculation is not None:
            self._seq.mirror = None
            self.speculation.source.close()
            self.speculation = None
        if config is not None and config.on:
            self.speculation = Speculation(
                config, make_source(config, self, self._open_draft, self._open_mtp)
            )
        return self.speculation

    def _open_mtp(self) -> MtpDrafter:
        """The model's MTP heads as a draft source, in a context beside this one that mirrors every decode."""
        if not self.config.load_mtp:
            raise InvalidConfigError(
                f"{self.path.name} was opened without its MTP heads: open it with `load_mtp=True` (open_engine "
                "does, given `mtp` speculation)"
            )
        with self._guard.hold(native=True):
            drafter = MtpDrafter(self.handle, self.config, self.n_ctx)
        self._seq.mirror = drafter
        return drafter

    def _open_draft(self, path: str) -> Engine:
        """A draft model's Engine beside this one: the same context, threads and batch, on the CPU."""
        ubatch = min(DEFAULT_BATCH, self.n_batch)  # llama.cpp's default, as before -ub existed
        return Engine(
            path,
            LoadConfig(n_ctx=self.n_ctx, n_threads=self.n_threads, n_batch=self.n_batch, n_ubatch=ubatch),
        )

    def chat_template(self) -> str | None:
        return chat.chat_template(self.handle.model)

    def template_tokens(self) -> tuple[str, str]:
        """The text of BOS and EOS as chat templates read them (bos_token, eos_token); "" for none."""
        return chat.template_tokens(self.handle.model)

    def format_chat(self, messages: Sequence[ChatMessage], *, add_assistant: bool = True) -> str:
        """Apply the model's chat template (llama.cpp's built-in template engine)."""
        return chat.format_chat(
            self.chat_template(), messages, add_assistant=add_assistant, name=self.path.name
        )

    # -- routing: policies, adaptive top-k, the expert cache -----------------------------
    def set_policies(self, policies: Sequence[RoutePolicy] | None) -> HookChain | None:
        """Route every MoE layer of every ubatch through these policies (None or [] removes the hook)."""
        return self.routing.set_policies(policies)

    @property
    def gating_path(self) -> str | None:
        """Where adaptive top-k runs: "graph" (inside llama.cpp), "hook" (the Python callback) or None."""
        return self.routing.gating_path

    def set_gating(self, policy: GatingPolicy | None) -> str | None:
        """Adaptive top-k on every MoE layer (None turns it off); returns where it runs (gating_path).

        In the graph the decisions equal ``policy``'s and the kept weights follow the model's own rule;
        while the user's policies or the expert cache's blocking loads need the routing callback,
        ``policy`` runs there (same decisions, same kept weights).
        """
        self.gating.set_policy(policy)
        self.reset_control_stats()
        self.routing.rewire()
        return self.gating_path

    def gating_report(self) -> dict[str, Any] | None:
        """{"rule", "threshold", "path", "activation_reduction"} of the gated routes so far, or None."""
        return self.gating.report(self.gating_path)

    def control_stats(self) -> dict[str, int]:
        """What the MoE control path did: ubatches, host syncs of the routing callback, slots gated in the graph,
        device splits overlapped with the CPU."""
        return native.moe_stats(self.handle.ctx)

    def reset_control_stats(self) -> None:
        """Zero control_stats() and the gating counters (the graph is kept)."""
        native.moe_reset_stats(self.handle.ctx)
        self.gating.reset_counters()

    def set_ids_check(self, on: bool = True) -> None:
        """Check every id row this engine hands a device's mul_mat_id / add_id (a GPU's, or the RPC stand-in's):
        only valid, distinct ids per token (docs/architecture.md, "Id rows on a device"). Slow: tests and doctor;
        EDGEMOE_CHECK_IDS=1 turns it on for every Engine."""
        self._ids_check = on
        native.moe_set_ids_check(self.handle.ctx, on)

    def _after_resize(self) -> None:
        if self._ids_check:
            native.moe_set_ids_check(self.handle.ctx, True)
        if isinstance(self._seq.mirror, MtpDrafter):
            self._seq.mirror.attach()  # the new context keeps the hidden rows the MTP heads read

    # -- context tiers ------------------------------------------------------------------
    def set_context_tiers(self, tiers: ContextTiers | None) -> ContextResizer | None:
        """Create the context in steps (edgemoe.runtime.context_tiers): at the smallest of `tiers` that holds the
        sequence, with that tier's expert slots, re-created at the next when it would outgrow it. The last tier is
        the whole context (n_ctx); none holds fewer tokens than a batch. None: the whole context from now on."""
        with self._guard.hold():
            old = self.tiers
            if old is not None and old.current != old.tiers.tiers[-1]:
                old.resize(old.tiers.tiers[-1], len(self._seq.tokens))  # the whole context again
            self.tiers = self._seq.fit = None
            if tiers is None:
                return None
            refusal = tiers_refusal(self.header)
            if refusal is not None:
                raise InvalidConfigError(
                    f"context tiers would change {self.path.name}'s output: {refusal}; run it without them"
                )
            check_tiers(
                tiers,
                n_ctx=self.n_ctx,
                n_batch=self.n_batch,
                moe_layers=list(self.info.moe_layers),
                n_expert=self.info.n_expert,
            )
            self.tiers = ContextResizer(
                self.handle, self.routing, self.prefetch, tiers, carry=self._seq, after=self._after_resize
            )
            self._seq.fit = self.tiers.fit
            if not self._seq.tokens:
                self.tiers.fit(1, 0)  # an empty sequence starts at the smallest tier
            return self.tiers

    @property
    def device_ids(self) -> list[DeviceIdsChoice]:
        """How each device other than the CPU gets skipped ids ("raw" or "fill", and why): LoadConfig.device_ids,
        else EDGEMOE_DEVICE_IDS, else the device's recorded id-row self-test (edgemoe.runtime.device_ids)."""
        return list(self.handle.device_ids)

    def ids_check(self) -> dict[str, int | str]:
        """The checker's counts since set_ids_check(): nodes and rows checked, rows with a negative, out-of-range or
        repeated id, and the first failing node and row."""
        return native.moe_ids_check(self.handle.ctx)

    def enable_expert_cache(self, config: CacheConfig | None, *, device: object = None) -> ExpertCache | None:
        """Give the MoE layers config.slots_per_layer expert slots run by config.policy (None removes it).

        device None uses the CPU buffer that stands in for a GPU (the split logic without one). The promoe
        policy (ProMoE's prefetcher) runs inside llama.cpp with the calibration's predictor in the graph (it
        replaces the predictors set with set_predictors), or in the routing hook where it cannot.
        """
        return self.routing.enable_expert_cache(config, device)

    # -- expert predictors in the graph -------------------------------------------------
    def set_predictors(
        self, predictors: Sequence[Predictor] | None, *, n_out: int | None = None, weights: str = "f32"
    ) -> list[int]:
        """Run these predictors inside llama.cpp's graph (None or []: none); returns their target layers (il).

        n_out: ids per token and target, best first (default top-(k+m), default_n_out); weights: how the
        predictor matrices are stored on the device ("f32", "f16", "q8_0"). Replaces the predictors set before.
        """
        return self.prefetch.set(predictors, n_out=n_out, weights=weights)

    @property
    def predictor_targets(self) -> list[int]:
        """The layers (il) with a predictor in the graph."""
        return self.prefetch.targets

    def predictions(self, target_il: int) -> np.ndarray:
        """The last ubatch's predicted experts of layer target_il: (n_tokens, n_out) int32, best first."""
        return self.prefetch.predictions(target_il)

    def predictor_bytes(self) -> int:
        """Device memory of the predictors' weights (what counts against --vram)."""
        return self.prefetch.nbytes()
