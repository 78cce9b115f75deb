"""Library messages speak of the Python API's names; the CLI maps them to its flags (edgemoe/cli/flags.py).

A user of `open_engine(vram=..., expert_slots=...)` must not be told to "give --vram or --expert-slots"."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import click
import pytest

from edgemoe.cli.flags import as_flags, flag_table
from edgemoe.cli.main import cli

PKG = Path(__file__).resolve().parent.parent / "edgemoe"
# the doctor runs the CLI itself (its steps are `edgemoe generate ...` command lines) and reports on them
CLI_DRIVERS = {"analysis/doctor.py", "analysis/doctor_child.py"}
# a command to run, "`edgemoe calibrate MODEL --corpus FILE`" (to its closing backtick or the end of the text),
# names that command's flags, not the flags of the call that failed
# a piece of such a command built apart, f"--stage {s}", or one argument of a child's argv, "--rpc" (flags with
# their values only, no words)
ARGV_PIECE = re.compile(r"(?:\s*--[a-z][a-z-]*(?: \{\})?\s*)+")
COMMAND = re.compile(r"`(?:edgemoe|make|\S*python\S*|tools/)[^`\n]*`?|edgemoe [a-z][a-z-]*[^`\n]*")


def _flags() -> set[str]:
    out: set[str] = set()

    def walk(cmd: click.Command) -> None:
        for p in cmd.params:
            out.update(o for o in [*p.opts, *p.secondary_opts] if o.startswith("--"))
        if isinstance(cmd, click.Group):
            for sub in cmd.commands.values():
                walk(sub)

    walk(cli)
    return out - {"--help", "--version", "--debug"}  # `edgemoe --debug` is how to run any command, not an option


def _texts(tree: ast.Module) -> list[tuple[int, str]]:
    """Every string literal outside docstrings; an f-string as one text with {} for its fields."""
    docs: set[int] = set()
    parts: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docs.add(id(first.value))
        if isinstance(node, ast.JoinedStr):
            parts.update(id(v) for v in node.values)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
            out.append((node.lineno, str(text)))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if id(node) not in docs and id(node) not in parts:
                out.append((node.lineno, node.value))
    return out


def test_no_library_message_names_a_cli_flag() -> None:
    flags = _flags()
    flag = re.compile(r"(?<![\w-])(" + "|".join(sorted(map(re.escape, flags), key=len, reverse=True)) + r")(?![\w-])")
    hits = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        if rel.startswith("cli/") or rel in CLI_DRIVERS:
            continue
        for line, text in _texts(ast.parse(path.read_text(encoding="utf-8"))):
            if ARGV_PIECE.fullmatch(text):
                continue
            found = flag.findall(COMMAND.sub("", text))
            if found:
                hits.append(f"edgemoe/{rel}:{line}: {', '.join(found)} in {text[:80]!r}")
    assert not hits, "name the API's parameter in backticks (`expert_slots`), not the flag:\n" + "\n".join(hits)


def test_the_scan_sees_flags_in_messages_and_fstrings() -> None:
    tree = ast.parse('x = 1\nraise ValueError(f"give --vram or {x}")\ny = "edgemoe calibrate M --corpus F"\n')
    texts = [t for _, t in _texts(tree)]
    assert "give --vram or {}" in texts
    assert "edgemoe calibrate M --corpus F" in texts
    assert ARGV_PIECE.fullmatch("--stage {}") and ARGV_PIECE.fullmatch("--rpc")
    assert not ARGV_PIECE.fullmatch("give --vram {}") and not ARGV_PIECE.fullmatch("use --rpc")
    assert COMMAND.sub("", "run `edgemoe calibrate M --corpus F` or pass --calibration") == "run  or pass --calibration"


@pytest.mark.parametrize(
    ("library", "cli_text"),
    [
        ("give `vram` or `expert_slots`, not both", "give --vram or --expert-slots, not both"),
        ("`policy='static'` needs a calibration", "--policy static needs a calibration"),
        ("`blocking=True` loads a miss first", "--blocking-loads loads a miss first"),
        ("raise `n_ctx`; run `make install`", "raise --ctx; run `make install`"),
        ("`prefetch_distance=0`: use >= 1", "--prefetch-distance 0: use >= 1"),
        ("`context_tiers=False` keeps it whole", "--no-context-tiers keeps it whole"),
    ],
)
def test_the_cli_shows_its_flags(library: str, cli_text: str) -> None:
    assert as_flags(library, flag_table(cli)) == cli_text


# every refusal of the library a command shows (model, then arguments); each must come out in the CLI's flags
FIXTURE = Path(__file__).resolve().parent.parent / "models" / "edgemoe-tiny-qwen3moe.Q4_K_M.gguf"
REFUSALS = [
    ["generate", "-fa", "off", "-ctv", "q4_0"],
    ["generate", "-ctk", "q3_k"],
    ["generate", "--vram", "1GiB", "--expert-slots", "2"],
    ["generate", "--expert-slots", "2", "--device-prefill-borrow"],
    ["generate", "--expert-slots", "2", "--device-prefill-ahead", "routed"],
    ["generate", "--device-prefill", "16"],
    ["generate", "--precalc-from", "2"],
    ["generate", "--assign", "ratio"],
    ["generate", "--expert-slots", "2", "--policy", "static", "--blocking-loads"],
    ["generate", "--expert-slots", "2", "--policy", "lru", "--dali-window", "4"],
    ["generate", "--expert-slots", "2", "--policy", "lru", "--prefetch-distance", "2"],
    ["generate", "--expert-slots", "99", "--policy", "lru"],
    ["generate", "--expert-slots", "2", "--policy", "daop", "--precalc-from", "99"],
    ["generate", "--expert-slots", "2", "--policy", "lru", "--profile", "rtx4060-laptop"],
    ["generate", "--expert-slots", "2", "--policy", "lru", "--precalc-from", "2", "--degrade", "0.5"],
    ["generate", "--batch", "256", "--ubatch", "512"],
    ["generate", "--ctx", "256", "--ubatch", "1024"],
    ["bench", "-fa", "off", "-ctv", "q8_0", "--profile", "none"],
    ["bench", "--precalc-from", "99", "--profile", "none"],
    ["chat", "-fa", "off", "-ctv", "q5_0"],
]


def _api_names() -> list[str]:
    """The API's parameter names whose flag is spelt otherwise (`expert_slots` -> --expert-slots)."""
    table = flag_table(cli)
    return sorted(n for n in table if n != table[n].removeprefix("--"))


@pytest.mark.parametrize("args", REFUSALS, ids=lambda a: " ".join(a))
def test_every_refusal_shows_the_cli_s_flags(args: list[str]) -> None:
    """Each library refusal, run through the command line, names its flags and no API parameter: neither a name
    spelt otherwise as a flag (flash_attn, cache_type_v) nor a backticked parameter (`vram`)."""
    from click.testing import CliRunner

    cmd, *rest = args
    extra = ["-p", "hi", "-n", "1"] if cmd == "generate" else []
    res = CliRunner().invoke(cli, [cmd, str(FIXTURE), *extra, *rest])
    assert res.exit_code != 0, res.output
    assert "Traceback" not in res.output and "--" in res.output.split("Error:", 1)[-1], res.output
    table = flag_table(cli)
    leaked = [n for n in _api_names() if re.search(rf"(?<![\w-]){re.escape(n)}(?![\w-])", res.output)]
    leaked += [n for n in table if f"`{n}`" in res.output or f"`{n}=" in res.output]
    assert not leaked, f"{leaked} in {res.output!r}"
