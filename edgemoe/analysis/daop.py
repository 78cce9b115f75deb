"""DAOP's graceful degradation on text (`edgemoe perplexity --degrade`, tools/daop_eval.py).

Each chunk is evaluated in one ubatch: its first `prompt_tokens` rows are the prompt (DAOP swaps each
layer's calibration placement by their routing: PromptSwapResidency), the rest stands for decoding
(routing does not depend on batching) and is degraded against that placement (GracefulDegradation);
only the rows after the prompt are scored, so the NLL and the greedy agreement compare what decoding
would compute with and without degradation.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..policies.daop import PromptSwapResidency
from ..policies.degrade import GracefulDegradation
from ..policies.protected import ProtectedExperts
from ..policies.residency import load_frequency
from ..policies.route import RoutePolicy
from ..runtime.engine import Engine


def daop_degradation(
    engine: Engine,
    calibration: Path,
    *,
    slots: int,
    ratio: float,
    prompt_tokens: int,
    protected: ProtectedExperts | None = None,
) -> tuple[PromptSwapResidency, GracefulDegradation]:
    """The two route policies, in chain order: DAOP's residency (`slots` in every MoE layer) and degradation
    (never swapping a `protected` expert)."""
    info = engine.info
    layers = list(info.moe_layers)
    freq = load_frequency(calibration, n_expert=info.n_expert, layers=layers, phase="decode")
    residency = PromptSwapResidency(freq, {il: slots for il in layers}, info.n_expert, prompt_tokens)
    deg = GracefulDegradation(
        residency,
        ratio=ratio,
        decode_only=False,
        skip_rows=prompt_tokens,
        protected=protected or ProtectedExperts(),
    )
    return residency, deg


def greedy_agreement(
    engine: Engine, prompt: Sequence[int], cont: Sequence[int], policies: Sequence[RoutePolicy] = ()
) -> float:
    """Share of positions where the argmax, teacher-forced on prompt + cont, is the next token of `cont`
    (the reference's greedy continuation of `prompt`); the prompt + cont must fit one ubatch."""
    engine.set_policies(list(policies) or None)
    try:
        logits = np.stack(engine.eval_logits([*prompt, *cont[:-1]]))
    finally:
        engine.set_policies(None)
    pred = logits[len(prompt) - 1 :].argmax(-1)
    return float((pred == np.asarray(cont)).mean())
