"""An agent-shaped task with and without speculative decoding: rewrite a file given in the prompt.

    .venv/bin/python tools/bench_speculation.py [MODEL ...] [--file-tokens 300,1000] [--reps 3] [--json OUT]

The prompt holds a passage of the held-out python-docs corpus (its last 10%) as "a file", then asks for the
file again and gives its first two lines; the model continues greedily for --gen tokens. Each repetition runs
every configuration once in a fixed order on one engine (off, lookup with each --draft-max), each from an empty
KV cache; the medians of decode tok/s (the steps after the first token) are printed with each configuration's
acceptance and tokens per verification step, and whether its tokens equal the plain run's (a near-tie flipped
by batch numerics shows as "differs at N"; docs/speculation.md).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import click

from edgemoe import GREEDY, Engine, LoadConfig
from edgemoe.speculation import SpeculationConfig

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT.parent / "shared" / "corpus" / "python-docs.txt"
FIXTURES = sorted((ROOT / "models").glob("*.gguf"))


def _prompt(eng: Engine, n_file: int) -> str:
    text = CORPUS.read_text()
    held = text[int(len(text) * 0.9) :]
    ids = eng.tokenize(held, add_special=False)[1000 : 1000 + n_file]
    body = eng.detokenize(ids)
    return "Here is a file:\n" + body + "\n\nThe same file again:\n" + "\n".join(body.split("\n")[:2]) + "\n"


def _run(
    eng: Engine, prompt: str, gen: int, cfg: SpeculationConfig | None
) -> tuple[float, list[int], dict | None]:
    eng.set_speculation(cfg)
    eng.reset()
    g = eng.generate(prompt, max_tokens=gen, sampling=GREEDY, ignore_eog=True)
    return g.timings.decode_tps, g.tokens, g.speculation.to_dict() if g.speculation else None


@click.command()
@click.argument("models", nargs=-1, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--file-tokens", default="300,1000", show_default=True)
@click.option("--draft-max", "draft_max", default="4,8", show_default=True)
@click.option("--gen", type=int, default=200, show_default=True)
@click.option("--reps", type=int, default=3, show_default=True)
@click.option("--threads", type=int, default=0)
@click.option("--json", "as_json", type=click.Path(path_type=Path), default=None)
def main(
    models: tuple[Path, ...],
    file_tokens: str,
    draft_max: str,
    gen: int,
    reps: int,
    threads: int,
    as_json: Path | None,
) -> None:
    rows = []
    for model in models or FIXTURES:
        for n_file in (int(x) for x in file_tokens.split(",")):
            configs = [None] + [
                SpeculationConfig(mode="lookup", draft_max=int(k)) for k in draft_max.split(",")
            ]
            with Engine(model, LoadConfig(n_ctx=n_file + gen + 256, n_threads=threads)) as eng:
                prompt = _prompt(eng, n_file)
                runs: dict[int, list[tuple[float, list[int], dict | None]]] = {
                    i: [] for i in range(len(configs))
                }
                for _ in range(reps):
                    for i, cfg in enumerate(configs):
                        runs[i].append(_run(eng, prompt, gen, cfg))
            plain = runs[0][0][1]
            base = statistics.median(r[0] for r in runs[0])
            for i, cfg in enumerate(configs):
                tps = statistics.median(r[0] for r in runs[i])
                toks, spec = runs[i][0][1], runs[i][0][2]
                diff = next((j for j, (a, b) in enumerate(zip(toks, plain, strict=False)) if a != b), None)
                rows.append(
                    {
                        "model": model.name,
                        "file_tokens": n_file,
                        "speculate": "off" if cfg is None else f"lookup k={cfg.draft_max}",
                        "decode_tps": tps,
                        "x_off": tps / base,
                        "acceptance": spec["acceptance"] if spec else None,
                        "tokens_per_step": spec["tokens_per_step"] if spec else None,
                        "equal_to_off": "yes" if diff is None else f"differs at {diff}",
                    }
                )
    click.echo(
        f"{'model':<36} {'file':>5} {'speculate':<12} {'decode t/s':>10} {'x off':>6} {'accept':>6} {'tok/step':>8}  equal"
    )
    for r in rows:
        acc = f"{r['acceptance']:.2f}" if r["acceptance"] is not None else "-"
        tps = f"{r['tokens_per_step']:.2f}" if r["tokens_per_step"] is not None else "-"
        click.echo(
            f"{r['model']:<36} {r['file_tokens']:>5} {r['speculate']:<12} {r['decode_tps']:>10.1f} {r['x_off']:>6.2f} "
            f"{acc:>6} {tps:>8}  {r['equal_to_off']}"
        )
    if as_json is not None:
        as_json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
