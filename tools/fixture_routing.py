#!/usr/bin/env python3
"""Regenerate the bundled `fixture-qwen3moe` routing (edgemoe/analysis/routing_profiles/fixture-qwen3moe.json):
the concentration and token-to-token reuse (edgemoe.analysis.routing_model.routing_stats) of the trained tiny
qwen3moe fixture, traced as tools/project_tables.py traced it (4096 tokens, 512-token chunks, 256 prefilled, the
rest decoded one token at a time), on the TRAINING split of python-docs.txt (the held-out 10% stays unseen).

    PYTHONPATH=. .venv/bin/python tools/fixture_routing.py
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgemoe import Engine, LoadConfig  # noqa: E402
from edgemoe.analysis.routing_model import QUANTILES, routing_stats  # noqa: E402
from edgemoe.analysis.trace import record_trace  # noqa: E402
from edgemoe.calibration.corpus import default_corpus_dir, split_corpus  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models/edgemoe-tiny-qwen3moe.Q4_K_M.gguf"
OUT = ROOT / "edgemoe/analysis/routing_profiles/fixture-qwen3moe.json"


def main() -> None:
    text = split_corpus(default_corpus_dir() / "python-docs.txt").train_text()
    with Engine(MODEL, LoadConfig(n_ctx=512, n_threads=2)) as eng:
        tokens = eng.tokenize(text)[:4096]
        tr = record_trace(eng, tokens, ctx=512, mode="decode", prefill_tokens=256)
    st = routing_stats(tr)
    doc = {
        "name": "fixture-qwen3moe", "kind": "stats", "toy": True,
        "n_expert": tr.n_expert, "k": int(tr.ids.shape[2]), "n_layer": int(tr.ids.shape[1]),
        "label": "TOY: the tiny trained qwen3moe fixture (32 experts, top-4, 8 MoE layers), far less local than "
                 "real models",
        "source": {"model": "models/edgemoe-tiny-qwen3moe.Q4_K_M.gguf (trained here)",
                   "text": "first 4096 tokens of the training split of shared/corpus/python-docs.txt",
                   "conditions": "512-token chunks, 256 prefilled then 256 decoded one token at a time",
                   "regenerate": "tools/fixture_routing.py"},
        "quantiles": [round(float(q), 6) for q in QUANTILES],
        "mass": [[round(float(x), 6) for x in row] for row in st.mass],
        "reuse": [round(float(x), 6) for x in st.reuse],
    }
    OUT.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {OUT}: reuse {[round(float(x), 3) for x in st.reuse]}")


if __name__ == "__main__":
    main()
