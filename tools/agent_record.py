"""Turn a recording of tools/agent_proxy.py into test data: a real client's request shapes.

    python tools/agent_record.py /tmp/agent-session --client claude-code --version 2.1.328 \\
        --session tests/data/agents/claude-code-session.json.xz --shape 0:tests/data/agents/claude-code-request.json

--session keeps every request whole (path and body; xz packs the prefix each turn repeats), for the TTFT replay
(tools/agent_ttft.py). --shape N:FILE keeps request N with every long string cut to its head: the structure a
test needs (roles, block types, fields), small enough to read. Secrets go in neither: no headers are kept, and
the bodies' identifiers (Claude Code's metadata.user_id, Codex's client_metadata and prompt_cache_key) are
replaced or dropped.
"""

from __future__ import annotations

import argparse
import json
import lzma
from pathlib import Path
from typing import Any

KEEP_CHARS = 200  # a longer string keeps its first characters and says how many it had


def scrub(body: Any) -> Any:
    """The body without the client's identifiers."""
    if not isinstance(body, dict):
        return body
    out = {k: v for k, v in body.items() if k not in ("client_metadata", "prompt_cache_key")}
    if isinstance(out.get("metadata"), dict) and "user_id" in out["metadata"]:
        out["metadata"] = {**out["metadata"], "user_id": "<redacted>"}
    return out


def trim(value: Any) -> Any:
    if isinstance(value, str) and len(value) > KEEP_CHARS + 40:
        return f"{value[:KEEP_CHARS]}[... {len(value)} characters in all]"
    if isinstance(value, dict):
        return {k: trim(v) for k, v in value.items()}
    if isinstance(value, list):
        return [trim(v) for v in value]
    return value


def read_requests(record: Path) -> list[dict[str, Any]]:
    out = []
    for f in sorted(record.glob("*-request.json")):
        entry = json.loads(f.read_text())
        out.append({"path": entry["path"], "query": entry.get("query", ""), "body": scrub(entry["body"])})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("record", type=Path, help="the directory tools/agent_proxy.py wrote")
    parser.add_argument("--client", required=True)
    parser.add_argument("--version", required=True)
    parser.add_argument("--session", type=Path, help="write every request here (.json.xz)")
    parser.add_argument("--shape", action="append", default=[], help="N:FILE: request N, trimmed, as JSON")
    args = parser.parse_args()
    requests = read_requests(args.record)
    head = {"client": args.client, "version": args.version, "recorded_with": "tools/agent_proxy.py"}
    if args.session:
        data = json.dumps({**head, "requests": requests}, ensure_ascii=False).encode()
        args.session.parent.mkdir(parents=True, exist_ok=True)
        args.session.write_bytes(lzma.compress(data, preset=9 | lzma.PRESET_EXTREME))
    for spec in args.shape:
        n, _, path = spec.partition(":")
        shape = {**head, "note": "long strings cut (tools/agent_record.py)", **trim(requests[int(n)])}
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(shape, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
