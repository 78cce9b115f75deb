#!/usr/bin/env python3
"""Quality vs activation reduction of the adaptive top-k rules on the fixtures (held-out text).

  .venv/bin/python tools/gating_curves.py [--targets 0.1 0.25 0.4] [--eval-tokens 4096] \
      [--out docs/figures/gating-curves.png] [--json docs/figures/gating-curves.json]
  .venv/bin/python tools/gating_curves.py --table docs/figures/gating-curves.json   # the markdown tables

For each fixture: sensitivities (Fisher, empirical) from calibration tokens of the
train splits; for each rule and target reduction, the threshold is searched on
separate validation tokens of the train splits; then, on the held-out split of each
corpus: NLL increase relative to full top-k, the reduction reached, and greedy-token
agreement over 256 generated tokens (teacher-forced: the full-top-k greedy continuation
of a held-out prompt is fed back, and the gated model's argmax is compared at each
generated position). Beside them, against the full model's logits on the same held-out tokens (a KL-divergence
base, edgemoe.analysis.kld): mean KLD and the same-top-token rate. Each rule's default threshold (no target: the
most drops within the KL-divergence budget on the validation tokens, edgemoe.calibration.gating_cost) is a row
with target null. Gating applies to every token here.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from edgemoe.analysis.kld import KldComparison  # noqa: E402
from edgemoe.analysis.kld_base import BaseRecorder, run_key  # noqa: E402
from edgemoe.analysis.perplexity import perplexity  # noqa: E402
from edgemoe.calibration.adaptive import GatingOptions, build_gating  # noqa: E402
from edgemoe.calibration.card import CARD, FORMAT_VERSION, write_json  # noqa: E402
from edgemoe.calibration.corpus import default_corpus_dir, split_corpus  # noqa: E402
from edgemoe.calibration.run import _model_entry  # noqa: E402
from edgemoe.calibration.sensitivity import calibrate_sensitivity, save_validation_tokens  # noqa: E402
from edgemoe.runtime.engine import Engine, LoadConfig  # noqa: E402
from edgemoe.runtime.sampling import GREEDY  # noqa: E402

MODELS = [ROOT / "models" / "edgemoe-tiny-qwen3moe.Q4_K_M.gguf", ROOT / "models" / "edgemoe-tiny-mixtral.Q4_K_M.gguf"]
CORPORA = ["tinyshakespeare.txt", "python-docs.txt"]
RULES = ["fisher", "empirical", "score", "ser"]
CTX = 256


def train_tokens(eng: Engine, start: int, n: int) -> list[int]:
    """n tokens from each corpus' train split, starting `start` bytes in (calibration / validation)."""
    out: list[int] = []
    for c in CORPORA:
        text = split_corpus(default_corpus_dir() / c).train_text()[start:start + 40 * n]
        out += eng.tokenize(text, add_special=False)[:n]
    return out


def agreement(eng: Engine, prompt: list[int], cont: list[int], policy: object | None) -> float:
    eng.set_policies([policy] if policy is not None else None)  # type: ignore[list-item]
    try:
        logits = np.stack(eng.eval_logits(prompt + cont[:-1]))
    finally:
        eng.set_policies(None)
    pred = logits[len(prompt) - 1:].argmax(-1)
    return float((pred == np.array(cont)).mean())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--targets", type=float, nargs="+", default=[0.1, 0.25, 0.4])
    ap.add_argument("--calib-tokens", type=int, default=2048, help="per corpus")
    ap.add_argument("--valid-tokens", type=int, default=1024, help="per corpus")
    ap.add_argument("--eval-tokens", type=int, default=4096, help="per held-out corpus")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "figures" / "gating-curves.png")
    ap.add_argument("--json", type=Path, default=ROOT / "docs" / "figures" / "gating-curves.json")
    ap.add_argument("--table", type=Path, default=None, help="print the markdown tables of this JSON and stop")
    args = ap.parse_args()
    if args.table is not None:
        print_tables(json.loads(args.table.read_text()))
        return 0

    results: list[dict[str, object]] = []
    for model in MODELS:
        # perplexity runs in chunks of CTX; the context has room for a prompt plus 256 generated tokens
        with Engine(model, LoadConfig(n_ctx=2 * CTX, n_batch=2 * CTX, n_ubatch=2 * CTX, n_threads=2)) as eng, \
                tempfile.TemporaryDirectory() as tmp:
            calib = Path(tmp)
            write_json(calib / CARD, {"format": FORMAT_VERSION, "model": _model_entry(model)})  # this model's
            sens = calibrate_sensitivity(model, eng, train_tokens(eng, 100_000, args.calib_tokens), ctx=CTX)
            sens.save(calib)
            save_validation_tokens(calib, train_tokens(eng, 400_000, args.valid_tokens))
            print(f"{model.name}: spearman(fisher, empirical) = {sens.spearman}", flush=True)
            evals = {}
            for c in CORPORA:
                text = split_corpus(default_corpus_dir() / c).heldout_text()
                toks = eng.tokenize(text, add_special=False)[:args.eval_tokens]
                rec = BaseRecorder(run_key(eng, toks, ctx=CTX, score_from=0))
                base = perplexity(eng, toks, ctx=CTX, rows=rec)
                prompt = toks[:32]
                eng.reset()
                cont = eng.generate(prompt, max_tokens=256, sampling=GREEDY, ignore_eog=True).tokens
                assert len(cont) == 256, len(cont)
                evals[c] = (toks, base, prompt, cont, rec.base())
            for rule in RULES:
                for target in [*args.targets, None]:  # None: the default, the KL-divergence budget's threshold
                    pol = build_gating(eng, GatingOptions(mode=rule, target_reduction=target, calibration=calib,
                                                          decode_only=False), ctx=CTX)
                    for c, (toks, base, prompt, cont, kbase) in evals.items():
                        cmp = KldComparison(kbase)
                        r = perplexity(eng, toks, ctx=CTX, policies=[pol], rows=cmp)
                        k = cmp.result()
                        row = {"model": model.name.split(".")[0], "rule": rule, "target": target,
                               "threshold": pol.threshold, "corpus": c, "reduction": r.activation_reduction,
                               "nll": r.nll, "base_nll": base.nll, "nll_increase_rel": r.nll / base.nll - 1,
                               "mean_kld": k.mean_kld, "kld_99": k.kld_percentiles["99"], "same_top": k.same_top,
                               "greedy_agreement": agreement(eng, prompt, cont, pol),
                               "validation": pol.calibrated}
                        results.append(row)
                        print(json.dumps(row), flush=True)
            results.append({"model": model.name.split(".")[0], "sensitivity": {
                "fisher": sens.fisher, "empirical": sens.empirical, "spearman": sens.spearman}})
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1))
    plot(results, args.out)
    return 0


def print_tables(results: list[dict]) -> None:
    """Per fixture: each rule at each target (and at its default) on both held-out corpora."""
    rows = [r for r in results if "rule" in r]
    for m in sorted({r["model"] for r in rows}):
        print(f"\n{m}: NLL increase / mean KLD / same top, held-out text (reduction reached on it)\n")
        print("| rule | target | Shakespeare | Python docs |\n|---|---|---|---|")
        for rule in RULES:
            for target in sorted({r["target"] for r in rows if r["model"] == m and r["rule"] == rule},
                                 key=lambda t: (t is None, t or 0)):
                cells = []
                for c in CORPORA:
                    r = next(x for x in rows if x["model"] == m and x["rule"] == rule and x["target"] == target
                             and x["corpus"] == c)
                    cells.append(f"{r['nll_increase_rel']:+.2%} / {r['mean_kld']:.4f} / {r['same_top']:.1%} "
                                 f"({r['reduction']:.1%})")
                name = f"{target:.0%}" if target is not None else "default (KLD budget)"
                print(f"| {rule} | {name} | {cells[0]} | {cells[1]} |")


def plot(results: list[dict[str, object]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results if "rule" in r]
    models = sorted({str(r["model"]) for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 3.8), squeeze=False)
    markers = {"fisher": "o", "empirical": "s", "score": "^", "ser": "v"}
    for ax, m in zip(axes[0], models, strict=False):
        for rule in RULES:
            for c, ls in zip(CORPORA, ("-", "--"), strict=False):
                pts = sorted((float(r["reduction"]), 100 * float(r["nll_increase_rel"])) for r in rows
                             if r["model"] == m and r["rule"] == rule and r["corpus"] == c
                             and r["target"] is not None)
                if pts:
                    ax.plot(*zip(*pts, strict=False), ls, marker=markers[rule], label=f"{rule} ({c.split('.')[0]})")
        ax.axhline(1.0, color="grey", lw=0.8, ls=":")
        ax.set(title=m, xlabel="expert activations removed", ylabel="held-out NLL increase (%)")
        ax.legend(fontsize=6)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
