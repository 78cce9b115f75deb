"""`edgemoe verify`: the self-check after installing. Each check compares the hook against stock llama.cpp.

1. identity: a hook that edits nothing gives bitwise the logits of a run without hook.
2. drop-last: dropping the last expert of every token (the others weighted by the layer's own
   rule, which the route record carries: renormalised, softmax over the kept, or unchanged)
   equals stock llama.cpp with expert_used_count = k - 1.
3. swap: routing expert a's slots to expert b (and b's to a) in one layer equals stock
   llama.cpp on a copy of the GGUF whose expert a and b weights are swapped in that layer.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..errors import EdgeMoeError
from ..gguf.info import read_model_info
from ..policies.route import RouteRecord, WeightRule
from ..runtime.engine import Engine, LoadConfig

PROMPT = (
    "ROMEO:\nBut soft, what light through yonder window breaks? It is the east, and Juliet is "
    "the sun.\n\nThe list type is a mutable sequence."
)
N_CTX = 256


@dataclass(frozen=True)
class CheckResult:
    name: str
    ok: bool
    detail: str
    max_abs_diff: float | None = None

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


class FnPolicy:
    """Wrap a function of a RouteRecord as a policy."""

    def __init__(self, fn: Callable[[RouteRecord], None], *, probs: bool = False) -> None:
        self.fn = fn
        self.wants_probs = probs
        self.wants_gate_inp = False

    def on_route(self, route: RouteRecord) -> None:
        self.fn(route)


def _logits(
    path: Path,
    tokens: list[int],
    policies: list[object] | None = None,
    expert_used_count: int | None = None,
    threads: int = 0,
) -> np.ndarray:
    with Engine(
        path,
        LoadConfig(
            n_ctx=N_CTX, n_batch=N_CTX, n_ubatch=N_CTX, n_threads=threads, expert_used_count=expert_used_count
        ),
    ) as eng:
        if policies:
            eng.set_policies(policies)  # type: ignore[arg-type]
        return np.array(eng.eval_logits(tokens))


def _compare(name: str, got: np.ndarray, ref: np.ndarray, *, bitwise: bool, what: str) -> CheckResult:
    """bitwise: must be identical. Otherwise identical or numerically equal: NMSE < 1e-6 and the same argmax
    everywhere (a different per-expert row count can change the CPU kernel's summation order)."""
    diff = float(np.abs(got - ref).max())
    if np.array_equal(got, ref):
        return CheckResult(name, True, f"{what}: bitwise equal", diff)
    if bitwise:
        return CheckResult(name, False, f"{what}: differ (max |diff| {diff:.3g})", diff)
    nmse = float(((got - ref) ** 2).mean() / max((ref**2).mean(), 1e-30))
    agree = float((got.argmax(-1) == ref.argmax(-1)).mean())
    ok = nmse < 1e-6 and agree == 1.0
    return CheckResult(name, ok, f"{what}: NMSE {nmse:.2e}, argmax agreement {agree:.3f}", diff)


def check_identity(path: Path, tokens: list[int], base: np.ndarray, threads: int = 0) -> CheckResult:
    calls = []
    got = _logits(path, tokens, [FnPolicy(lambda r: calls.append(r.layer), probs=True)], threads=threads)
    res = _compare("identity", got, base, bitwise=True, what="no-op hook vs no hook")
    if not calls:
        return CheckResult("identity", False, "the hook was never called")
    return res


def _drop_last(r: RouteRecord) -> None:
    """Drop every token's last slot and give the others the weights the layer's own rule gives k-1 experts."""
    r.ids[:, -1] = -1
    r.weights[:, -1] = 0.0
    kept_ids = r.ids[:, :-1].astype(np.int64)
    if r.weight_rule is WeightRule.NORM and r.probs is not None:
        # renormalise the kept probabilities the way llama.cpp's graph does (sum_rows
        # accumulates in double, clamp, f32 division), so the result can be bitwise equal
        kept = np.take_along_axis(r.probs, kept_ids, axis=1)
        total = np.maximum(kept.astype(np.float64).sum(1).astype(np.float32), np.float32(6.103515625e-5))
        r.weights[:, :-1] = kept / total[:, None]
    elif r.weight_rule is WeightRule.SOFTMAX and r.probs is not None:
        logits = np.take_along_axis(r.probs, kept_ids, axis=1).astype(
            np.float64
        )  # the gating outputs are logits
        e = np.exp(logits - logits.max(1, keepdims=True))
        r.weights[:, :-1] = e / e.sum(1, keepdims=True)
    else:
        return  # AS_IS: the kept weights do not change
    if r.weight_scale != 1.0:
        r.weights[:, :-1] *= np.float32(r.weight_scale)


def check_drop_last(path: Path, tokens: list[int], threads: int = 0) -> CheckResult:
    info = read_model_info(path)
    if info.n_expert_used < 2:
        return CheckResult("drop-last", True, "skipped: the model uses one expert per token")
    rules: set[str] = set()

    def drop(r: RouteRecord) -> None:
        rules.add(r.weight_rule.name.lower())
        _drop_last(r)

    got = _logits(path, tokens, [FnPolicy(drop, probs=True)], threads=threads)
    ref = _logits(path, tokens, expert_used_count=info.n_expert_used - 1, threads=threads)
    return _compare(
        "drop-last",
        got,
        ref,
        bitwise=False,
        what=f"drop expert {info.n_expert_used} of {info.n_expert_used} "
        f"(weights: {', '.join(sorted(rules))}) vs stock with k={info.n_expert_used - 1}",
    )


def _swap_experts_in_file(src: Path, dst: Path, layer: int, a: int, b: int) -> None:
    """Copy src to dst with experts a and b of `layer` swapped in every stacked expert tensor."""
    import gguf

    info = read_model_info(src)
    names = {t.name for t in info.expert_tensors[layer]}
    shutil.copyfile(src, dst)
    reader = gguf.GGUFReader(str(src))
    with dst.open("r+b") as f:
        for t in reader.tensors:
            if t.name not in names:
                continue
            if int(t.shape[-1]) != info.n_expert:  # ggml order: the experts are the last dim
                raise EdgeMoeError(
                    f"{t.name} has shape {list(t.shape)}: its last dim is not the "
                    f"{info.n_expert} experts, so its experts cannot be swapped"
                )
            per = int(t.n_bytes) // info.n_expert
            off = int(t.data_offset)
            ea = bytes(t.data.reshape(-1).view(np.uint8)[a * per : (a + 1) * per])
            eb = bytes(t.data.reshape(-1).view(np.uint8)[b * per : (b + 1) * per])
            f.seek(off + a * per)
            f.write(eb)
            f.seek(off + b * per)
            f.write(ea)


def check_swap(path: Path, tokens: list[int], threads: int = 0) -> CheckResult:
    info = read_model_info(path)
    if info.n_expert < 2:
        return CheckResult("swap", True, "skipped: the model has one expert per layer, nothing to swap")
    layer = info.moe_layers[len(info.moe_layers) // 2]
    counts = np.zeros(info.n_expert, np.int64)

    def count(r: RouteRecord) -> None:
        if r.layer == layer:
            np.add.at(counts, r.ids.reshape(-1), 1)

    _logits(path, tokens, [FnPolicy(count)], threads=threads)
    a, b = (int(e) for e in np.argsort(-counts, kind="stable")[:2])  # the two busiest experts

    def swap(r: RouteRecord) -> None:
        if r.layer == layer:
            ia, ib = r.ids == a, r.ids == b
            r.ids[ia], r.ids[ib] = b, a

    got = _logits(path, tokens, [FnPolicy(swap)], threads=threads)
    with tempfile.TemporaryDirectory(prefix="edgemoe-verify-") as tmp:
        swapped = Path(tmp) / "swapped.gguf"
        _swap_experts_in_file(path, swapped, layer, a, b)
        ref = _logits(swapped, tokens, threads=threads)
    return _compare(
        "swap",
        got,
        ref,
        bitwise=True,
        what=f"layer {layer}: experts {a}<->{b} by the hook vs swapped in the GGUF",
    )


def run_checks(path: Path, *, threads: int = 0) -> list[CheckResult]:
    info = read_model_info(path)
    if not info.is_moe:
        raise EdgeMoeError(f"{path.name} is a dense model: there is no routing to verify")
    with Engine(path, LoadConfig(n_ctx=N_CTX, n_threads=threads)) as eng:
        tokens = eng.tokenize(PROMPT)[: N_CTX - 1]
    base = _logits(path, tokens, threads=threads)
    return [
        check_identity(path, tokens, base, threads),
        check_drop_last(path, tokens, threads),
        check_swap(path, tokens, threads),
    ]
