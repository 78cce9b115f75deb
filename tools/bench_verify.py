"""What a speculative verification step costs: one llama_decode of k + 1 positions against one of 1 position.

    .venv/bin/python tools/bench_verify.py MODEL [--sizes 1,2,4,8] [--reps 7] [--routing qwen3-30b-a3b|random]

In-process and paired: the model's pages are read once first (a 768-token prompt), then every repetition decodes each size once, in a shuffled order, from the same KV length
(the batch's K/V are removed after it), and the ratio to one position is taken within the repetition; the
medians are printed. The MoE layers' routing is the model's own (`random`: the synthetic models route
at random, the worst case for a batch's expert union) or replayed from a bundled routing profile drawn at the
model's shape (consecutive decode tokens of one sequence, so the union shows a real model's locality); a
route hook runs in both cases and counts the union of experts each layer reads per step. Greedy logits are
not used: the step's cost is the measurement.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import click
import numpy as np

from edgemoe import Engine, LoadConfig
from edgemoe.analysis.routing_profile import routing_for_model
from edgemoe.policies.route import RouteRecord

WARM_TOKENS = 768


class UnionCounter:
    """A route policy: replays `rows` (T, L, k) into the routes when given, and counts each layer's union."""

    wants_probs = False
    wants_gate_inp = False

    def __init__(self, layers: list[int], rows: np.ndarray | None) -> None:
        self.index = {il: j for j, il in enumerate(layers)}
        self.rows = rows
        self.at = 0  # the first trace row of the next decode
        self.unions: list[int] = []

    def on_route(self, route: RouteRecord) -> None:
        if self.rows is not None:
            n = route.n_tokens
            route.ids[:] = self.rows[self.at : self.at + n, self.index[route.layer], : route.n_expert_used]
        self.unions.append(len(np.unique(route.ids[route.ids >= 0])))


def _step(eng: Engine, counter: UnionCounter, tokens: list[int]) -> tuple[float, float]:
    """Seconds of one decode of `tokens` and the mean union per MoE layer; the batch's K/V are removed after."""
    base = len(eng.kv_tokens())
    counter.unions.clear()
    t0 = time.perf_counter()
    eng.feed(tokens, all_logits=True)
    dt = time.perf_counter() - t0
    eng.truncate(base)
    return dt, float(np.mean(counter.unions))


@click.command()
@click.argument("model", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--sizes", default="1,2,4,8", show_default=True, help="positions per verification step")
@click.option("--reps", type=int, default=7, show_default=True)
@click.option("--threads", type=int, default=0)
@click.option("--prompt", "n_prompt", type=int, default=128, show_default=True)
@click.option(
    "--routing", default="qwen3-30b-a3b", show_default=True, help="bundled routing profile, or random"
)
@click.option(
    "--json", "as_json", type=click.Path(path_type=Path), default=None, help="also write the figures"
)
def main(
    model: Path, sizes: str, reps: int, threads: int, n_prompt: int, routing: str, as_json: Path | None
) -> None:
    ks = [int(s) for s in sizes.split(",")]
    rng = np.random.default_rng(0)
    with Engine(model, LoadConfig(n_ctx=1024, n_threads=threads)) as eng:
        info = eng.info
        layers = list(info.moe_layers)
        rows = None
        if routing != "random":
            tr = routing_for_model(
                info.n_expert, info.n_expert_used, len(layers), name=routing, n_seq=1, prefill=0, decode=512
            ).trace
            rows = tr.ids
        counter = UnionCounter(layers, rows)
        eng.set_policies([counter])
        # warm the page cache: a long prompt routes to (nearly) every expert, so no timed step reads the file
        eng.feed([int(t) for t in rng.integers(16, 1000, WARM_TOKENS)])
        eng.reset()
        prompt = [int(t) for t in rng.integers(16, 1000, n_prompt)]
        eng.feed(prompt)
        times: dict[int, list[float]] = {k: [] for k in ks}
        unions: dict[int, list[float]] = {k: [] for k in ks}
        for rep in range(reps + 1):  # the first repetition warms up
            for k in rng.permutation(ks):
                counter.at = int(rng.integers(0, 512 - max(ks)))
                dt, u = _step(eng, counter, [int(t) for t in rng.integers(16, 1000, int(k))])
                if rep:
                    times[int(k)].append(dt)
                    unions[int(k)].append(u)
    one = times[ks[0]]
    out = {
        "model": model.name,
        "routing": routing,
        "threads": eng.n_threads,
        "rows": [
            {
                "positions": k,
                "median_ms": statistics.median(times[k]) * 1e3,
                "ratio_to_1": statistics.median([t / o for t, o in zip(times[k], one, strict=True)]),
                "union_experts_per_layer": statistics.mean(unions[k]),
            }
            for k in ks
        ],
    }
    click.echo(f"{model.name} · routing {routing} · {reps} paired repetitions · {eng.n_threads} threads")
    click.echo(f"{'positions':>9} {'median ms':>10} {'x one':>7} {'experts/layer':>14}")
    for r in out["rows"]:
        click.echo(
            f"{r['positions']:>9} {r['median_ms']:>10.1f} {r['ratio_to_1']:>7.2f} {r['union_experts_per_layer']:>14.1f}"
        )
    if as_json is not None:
        as_json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
