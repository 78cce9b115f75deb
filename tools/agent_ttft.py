"""Agent TTFT: recorded coding-agent sessions replayed against serve (cold and warm TTFT per turn, measured),
and the same turns projected for a model shape on machine profiles (edgemoe.perf.agent_ttft).

    python tools/agent_ttft.py tests/data/agents/claude-code-session.json.xz [more sessions] -t 2 \\
        --project rtx4060-laptop:8GiB --project rtx5060ti-desktop:16GiB [--json out.json]

The server runs in this process (the app over an EngineWorker, no sockets): the bundled fixture with the tests'
tool-calling template (tests/helpers/serve_harness.TOOL_TEMPLATE), a 32K context and a prompt cache. The
projections use the recorded turns' token counts, as the fixture's tokenizer counted them (a real model's counts
fewer tokens for the same text: the figures are then upper bounds), on the synthetic shape (--shape, default
qwen3-30b-a3b, Q4_K) with the bundled routing profile of that shape.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from fastapi.testclient import TestClient  # noqa: E402

from edgemoe import Engine, LoadConfig  # noqa: E402
from edgemoe.perf.agent_ttft import ProjectedTTFT, Session, TurnTTFT, load_session, project_turns, replay  # noqa: E402
from edgemoe.runtime.prompt_cache import PromptCache  # noqa: E402
from edgemoe.runtime.sampling import GREEDY  # noqa: E402
from edgemoe.serve.app import ServerConfig, create_app  # noqa: E402
from edgemoe.serve.template import ChatTemplate  # noqa: E402
from edgemoe.serve.worker import EngineWorker  # noqa: E402

from helpers.serve_harness import MODEL, TOOL_TEMPLATE  # noqa: E402

MODEL_ID = "tiny"


def poster(client: TestClient) -> Any:
    def post(path: str, body: dict[str, Any], key: str) -> dict[str, Any]:
        r = client.post(path, json=body, headers={"Authorization": f"Bearer {key}"})
        if r.status_code != 200:
            raise RuntimeError(f"{path}: {r.status_code} {r.text[:300]}")
        return r.json()

    return post


def measure(sessions: list[Session], threads: int, n_ctx: int) -> dict[str, list[TurnTTFT]]:
    keys = ["warm"] + [f"cold-{i}" for i in range(max(len(s.requests) for s in sessions))]
    out = {}
    with Engine(MODEL, LoadConfig(n_ctx=n_ctx, n_threads=threads)) as eng:
        bos, eos = eng.template_tokens()
        for s in sessions:  # a fresh worker and store per session: nothing carries over
            worker = EngineWorker(eng, 4, template=ChatTemplate(TOOL_TEMPLATE, bos_token=bos, eos_token=eos),
                                  prompt_cache=PromptCache(4 << 30))  # fmt: skip
            eng.reset()
            worker.start()
            try:
                config = ServerConfig(model_id=MODEL_ID, sampling=GREEDY, max_tokens=1, api_keys=tuple(keys))
                out[s.client] = replay(
                    s, poster(TestClient(create_app(worker, config))), model=MODEL_ID, keys=keys
                )
            finally:
                worker.stop()
    return out


def project(
    turns: dict[str, list[TurnTTFT]], specs: list[str], shape_name: str, qtype: str, n_ctx: int
) -> Any:
    from edgemoe.analysis.routing_profile import routing_for_model
    from edgemoe.gguf.info import parse_size
    from edgemoe.perf.model.costmodel import ModelShape
    from edgemoe.perf.model.prefill_plan import PrefillSpec
    from edgemoe.perf.model.profile import load_profile
    from edgemoe.perf.model.shapes import shape_file

    shape = ModelShape.read(shape_file(shape_name, qtype, Path(tempfile.gettempdir()) / "edgemoe-shapes"))
    info = shape.info
    trace = routing_for_model(info.n_expert, info.n_expert_used, len(info.moe_layers)).trace
    out: dict[str, dict[str, list[ProjectedTTFT]]] = {}
    for spec in specs:
        name, _, vram = spec.partition(":")
        prof = load_profile(name)
        plan = PrefillSpec(parse_size(vram), n_ctx)
        out[spec] = {client: project_turns(t, shape, trace, prof, plan) for client, t in turns.items()}
    return out


def table(turns: dict[str, list[TurnTTFT]], projected: dict[str, dict[str, list[ProjectedTTFT]]]) -> str:
    head = "| client | turn | prompt tokens | reused (warm) | cold TTFT | warm TTFT |"
    cols = "".join(f" {s} cold stock / edgemoe | warm stock / edgemoe |" for s in projected)
    lines = [head + cols, "|" + " --- |" * (6 + 2 * len(projected))]
    for client, ts in turns.items():
        for t in ts:
            row = f"| {client} | {t.turn + 1} | {t.prompt_tokens} | {t.reused_tokens} | {t.cold_s:.2f} s | {t.warm_s:.2f} s |"
            for spec in projected:
                p = projected[spec][client][t.turn]
                row += (f" {p.cold_stock_s:.1f} / {p.cold_edgemoe_s:.1f} s |"
                        f" {p.warm_stock_s:.2f} / {p.warm_edgemoe_s:.2f} s |")  # fmt: skip
            lines.append(row)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("sessions", nargs="+", type=Path)
    parser.add_argument("-t", "--threads", type=int, default=2)
    parser.add_argument("--ctx", type=int, default=32768)
    parser.add_argument(
        "--project", action="append", default=[], help="PROFILE:VRAM, e.g. rtx4060-laptop:8GiB"
    )
    parser.add_argument("--shape", default="qwen3-30b-a3b")
    parser.add_argument("--qtype", default="Q4_K")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    sessions = [load_session(p) for p in args.sessions]
    turns = measure(sessions, args.threads, args.ctx)
    projected = project(turns, args.project, args.shape, args.qtype, args.ctx) if args.project else {}
    print(table(turns, projected))
    if args.json:
        data = {
            "measured": {c: [asdict(t) for t in ts] for c, ts in turns.items()},
            "projected": {
                s: {c: [asdict(p) for p in ps] for c, ps in v.items()} for s, v in projected.items()
            },
            "threads": args.threads,
            "shape": f"{args.shape} {args.qtype}",
        }
        args.json.write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    main()
