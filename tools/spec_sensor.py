#!/usr/bin/env python3
"""Speculation as a sensor for the expert cache: does the routing of the proposals a verification batch rejects
raise the hit rate of the tokens that are kept? Measured against lru and promoe one token per step.

  PYTHONPATH=. .venv/bin/python tools/spec_sensor.py [--json docs/figures/spec-sensor.json] [-t 2]

For each fixture and held-out corpus (the last 10% of python-docs and tinyshakespeare), an agent-shaped prompt (a
held-out passage given as "a file", then asked for again: tools/bench_speculation.py's task) is generated greedily
for --gen tokens on the CPU, once one token per decode and once with prompt lookup (--draft-max proposals per
verification batch). The routing hook records every ubatch's routes with float32 router inputs, and each
verification step's accepted count. Both recordings are then replayed (edgemoe.policies.replay's PolicyDriver)
through lru and promoe (the bundled calibration's mlp predictor, distance 2) with E/4 and E/2 slots in every MoE
layer, at infinite bandwidth and at the rtx4060-laptop profile's copy timing scaled to the fixture's expert bytes.
The counted hit rate is that of the kept tokens only (each verification's first a + 1 rows), over the generated
tokens (prefills are replayed, not counted):

- **one token per step**: today's decode without speculation;
- **sensor** (what the engine does): the cache sees every row of a verification batch, rejected proposals
  included: their misses are loaded and they refresh recency, as if they were a prefetch of the next steps;
- **kept path only**: the cache sees only the kept rows (the rejected proposals computed where their experts are,
  without loads or recency).

The greedy outputs with and without speculation must be equal (near-ties aside: docs/speculation.md), so the
three replays route the same generated tokens.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from prefetch_table import make, timings  # noqa: E402

import edgemoe.runtime.speculative as speculative  # noqa: E402
from edgemoe import GREEDY, Engine, LoadConfig  # noqa: E402
from edgemoe.calibration.card import find_calibration  # noqa: E402
from edgemoe.calibration.corpus import split_corpus  # noqa: E402
from edgemoe.gguf.info import read_model_info  # noqa: E402
from edgemoe.policies.copy_queue import CacheModel  # noqa: E402
from edgemoe.policies.replay import PolicyDriver  # noqa: E402
from edgemoe.runtime.expert_cache import expert_chunk_bytes  # noqa: E402
from edgemoe.runtime.prefetcher import prefetch_predictor  # noqa: E402
from edgemoe.speculation import SpeculationConfig  # noqa: E402

MODELS = [ROOT / "models" / "edgemoe-tiny-qwen3moe.Q4_K_M.gguf", ROOT / "models" / "edgemoe-tiny-mixtral.Q4_K_M.gguf"]
CORPORA = [ROOT.parent / "shared" / "corpus" / "python-docs.txt", ROOT.parent / "shared" / "corpus" / "tinyshakespeare.txt"]
Route = tuple[int, np.ndarray, np.ndarray]


class Recorder:
    """Every ubatch's routes (router inputs kept), and per step: a generated step? its kept rows."""

    wants_probs = False
    wants_gate_inp = True

    def __init__(self) -> None:
        self.steps: list[list[Route]] = []
        self.kept: list[int | None] = []  # None: a prefill ubatch (replayed, not counted)
        self.generating = False

    def on_route(self, r: Any) -> None:
        if not self.steps or r.layer <= self.steps[-1][-1][0]:
            self.steps.append([])
            self.kept.append(r.n_tokens if self.generating else None)
        self.steps[-1].append((r.layer, r.ids.copy(), r.gate_inp.copy()))


def prompt_of(eng: Engine, corpus: Path, n_file: int) -> str:
    ids = eng.tokenize(split_corpus(corpus).heldout_text(), add_special=False)[200 : 200 + n_file]
    body = eng.detokenize(ids)
    return "Here is a file:\n" + body + "\n\nThe same file again:\n" + "\n".join(body.split("\n")[:2]) + "\n"


def source_config(model: Path, source: str, draft_max: int) -> SpeculationConfig | None:
    """off; lookup; draft: the other fixture (the same tokenizer) proposes."""
    if source == "off":
        return None
    if source == "lookup":
        return SpeculationConfig(mode="lookup", draft_max=draft_max)
    other = next(m for m in MODELS if m != model)
    return SpeculationConfig(mode="draft", draft_max=draft_max, draft_model=str(other))


def record(model: Path, corpus: Path, args: argparse.Namespace, source: str) -> tuple[Recorder, list[int], Any]:
    rec = Recorder()
    with Engine(model, LoadConfig(n_ctx=2048, n_threads=args.threads)) as eng:
        prompt = prompt_of(eng, corpus, args.file_tokens)
        eng.set_policies([rec])
        eng.set_speculation(source_config(model, source, args.draft_max))
        verify = speculative.Speculator.verify

        def verify_and_note(self: Any, tok: int, proposals: list[int], generated: list[int]) -> Any:
            rec.generating = True
            verdict = verify(self, tok, proposals, generated)
            rec.kept[-1] = verdict.accepted + 1  # the step's first row and the proposals that stood
            return verdict

        speculative.Speculator.verify = verify_and_note  # type: ignore[method-assign]
        try:
            for _ in eng.stream(prompt, max_tokens=args.gen, sampling=GREEDY, ignore_eog=True):
                rec.generating = True  # the first token comes from the prefill; the decodes after it count
        finally:
            speculative.Speculator.verify = verify  # type: ignore[method-assign]
        g = eng.last
        assert g is not None
    return rec, g.tokens, g.speculation


class KeptRowsDriver(PolicyDriver):
    """Counts hits of a step's first `rows` rows only (the kept path); the policy sees what it is given."""

    rows: int | None = None

    def _count_hits(self, layer: int, ids: np.ndarray) -> None:
        super()._count_hits(layer, ids if self.rows is None else ids[: self.rows])


def replay_kept(policy: Any, rec: Recorder, chunks: Any, timing: Any, *, sensor: bool) -> tuple[float, float]:
    """(hit rate of the kept rows, experts read from CPU memory per kept token): the second counts, per step and
    layer, the distinct experts any row of the step routed to that were not resident when the layer ran (a
    rejected proposal's rows are computed too, kept-path-only or not)."""
    driver = KeptRowsDriver(policy, CacheModel(policy.n_slots, chunks), timing)
    cpu_reads = tokens = 0
    for step, kept in zip(rec.steps, rec.kept, strict=True):
        driver.rows = kept
        seen = step if sensor or kept is None else [(il, ids[:kept], h[:kept]) for il, ids, h in step]
        driver.begin_step(kept if kept is not None else int(step[0][1].shape[0]), kept is not None)
        tokens += kept or 0
        for (layer, ids, hidden), (_, all_ids, _) in zip(seen, step, strict=True):
            if kept is not None:
                resident = driver.model.resident(layer)
                cpu_reads += len({int(e) for e in all_ids.reshape(-1) if e >= 0 and int(e) not in resident})
            driver.on_route(layer, ids, hidden)
    r = driver.result
    return r.hits / max(1, r.hits + r.misses), cpu_reads / max(1, tokens)


@dataclass
class Replays:
    """One fixture's replay setup, and the one-token-per-step run's replays (the same for every draft source)."""

    info: Any
    cal: Path
    chunks: Any
    pred: Any
    settings: list[Any]
    one_token: dict[tuple[int, str, str], tuple[float, float]] = field(default_factory=dict)

    def policy(self, kind: str, slots: int, timing: Any) -> Any:
        layers = list(self.info.moe_layers)
        return make(kind, {il: slots for il in layers}, layers, self.cal, {"promoe": self.pred}, self.info.n_expert,
                    timing)

    def rows(self, plain: Recorder, spec: Recorder) -> list[tuple[int, str, str, dict[str, tuple[float, float]]]]:
        """Per slot count, copy timing and policy: (hit rate, CPU reads per kept token) of each run."""
        out = []
        for slots in (self.info.n_expert // 4, self.info.n_expert // 2):
            for key, lt in self.settings:
                timing = lt.timing if lt is not None else None
                for kind in ("lru", "promoe"):
                    if (slots, key, kind) not in self.one_token:
                        self.one_token[slots, key, kind] = replay_kept(
                            self.policy(kind, slots, timing), plain, self.chunks, timing, sensor=True)
                    runs = {"one_token": self.one_token[slots, key, kind]}
                    for name, sensor in (("sensor", True), ("kept_only", False)):
                        runs[name] = replay_kept(self.policy(kind, slots, timing), spec, self.chunks, timing,
                                                 sensor=sensor)
                    out.append((slots, key, kind, runs))
        return out


def model_rows(model: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    info = read_model_info(model)
    cal = find_calibration(model).path
    chunks = expert_chunk_bytes(model, list(info.moe_layers))
    pred, note = prefetch_predictor(model, cal, "mlp", 2)
    assert note is None, note
    settings = timings(args.reference, float(np.mean([sum(c) for c in chunks.values()])))[:2]
    rows = []
    for corpus in CORPORA:
        plain, plain_tokens, _ = record(model, corpus, args, "off")
        setup = Replays(info, cal, chunks, pred, settings)
        for source in ("lookup", "draft"):
            spec, spec_tokens, stats = record(model, corpus, args, source)
            differ = next((i for i, (a, b) in enumerate(zip(plain_tokens, spec_tokens, strict=False)) if a != b), None)
            for slots, key, kind, runs in setup.rows(plain, spec):
                row = {"model": model.name, "corpus": corpus.stem, "source": source, "slots": slots,
                       "timing": key, "policy": kind,
                       **{name: hit for name, (hit, _) in runs.items()},
                       **{f"{name}_cpu_reads": reads for name, (_, reads) in runs.items()},
                       "acceptance": stats.acceptance if stats else None,
                       "tokens_per_step": stats.tokens_per_step if stats else None,
                       "drafted": stats.drafted if stats else None,
                       "outputs_differ_at": differ}
                rows.append(row)
                print(json.dumps(row), file=sys.stderr)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| fixture | corpus | drafts | slots | timing | policy | hit rate: one token/step | sensor (all rows) "
           "| kept rows only | CPU reads/token: one token/step | sensor | kept rows only |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        name = r["model"].split(".")[0].removeprefix("edgemoe-")
        out.append(f"| {name} | {r['corpus']} | {r['source']} | {r['slots']} | {r['timing']} | {r['policy']} | "
                   f"{r['one_token']:.3f} | {r['sensor']:.3f} | {r['kept_only']:.3f} | "
                   f"{r['one_token_cpu_reads']:.2f} | {r['sensor_cpu_reads']:.2f} | {r['kept_only_cpu_reads']:.2f} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--gen", type=int, default=200)
    ap.add_argument("--file-tokens", type=int, default=300)
    ap.add_argument("--draft-max", type=int, default=4)
    ap.add_argument("--reference", type=Path, default=ROOT / ".build" / "synth" / "qwen3-30b-a3b.Q4_K.gguf")
    args = ap.parse_args()
    rows = [r for m in MODELS for r in model_rows(m, args)]
    print(table(rows))
    acc = {(r["model"], r["corpus"], r["source"]): r for r in rows}
    for (m, c, src), r in acc.items():
        print(f"{m} {c} {src}: {r['drafted']} proposals, acceptance {r['acceptance']:.2f}, "
              f"{r['tokens_per_step']:.2f} tokens per step, outputs differ at {r['outputs_differ_at']}")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "args": {k: str(v) for k, v in vars(args).items()}},
                                        indent=1) + "\n")


if __name__ == "__main__":
    main()
