"""Library messages name the Python API's parameters; the CLI shows its own flags in their place.

Below `cli/`, a message names a parameter as it is spelt in the API, in backticks: `expert_slots`, or with a
value, `policy='static'` (tests/test_messages.py keeps CLI flags out of the library). `as_flags` rewrites each
such span whose name is a parameter of some edgemoe command to that command's flag: "give `vram` or
`expert_slots`, not both" is printed as "give --vram or --expert-slots, not both", and `policy='static'` as
"--policy static". Any other backticked text (`edgemoe calibrate MODEL`, `make install`) is left as it is.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping

import click

# API names whose flag is spelt differently from the click parameter that takes it
ALIASES: Mapping[str, str] = {
    "blocking": "--blocking-loads",
    "corpus": "--corpus",
    "ctx": "--ctx",
    "n_gpu_layers": "--gpu-layers",
    "n_threads": "--threads",
    "stage": "--stage",
    "temp": "--temp",
}
_SPAN = re.compile(r"`([a-z_][a-z0-9_]*)(?:=([^`\n]*))?`")


@functools.cache
def flag_table(root: click.Command) -> Mapping[str, str]:
    """API name -> long flag, from every command's parameters under `root`, plus ALIASES (built once per root:
    the command tree does not change while it runs)."""
    table: dict[str, str] = {}

    def walk(cmd: click.Command) -> None:
        for p in cmd.params:
            long = [o for o in p.opts if o.startswith("--")]
            if p.name and long:
                table.setdefault(p.name, long[0])
        if isinstance(cmd, click.Group):
            for sub in cmd.commands.values():
                walk(sub)

    walk(root)
    table.update(ALIASES)
    return table


def as_flags(message: str, table: Mapping[str, str]) -> str:
    """`message` with each backticked API name (or name=value) that has a flag in `table` written as the flag."""

    def sub(m: re.Match[str]) -> str:
        flag = table.get(m.group(1))
        if flag is None:
            return m.group(0)
        value = m.group(2)
        if value is None or value == "True":
            return flag
        if value == "False":  # an on/off flag's other half (click's --x/--no-x)
            return f"--no-{flag[2:]}"
        return f"{flag} {value.strip(chr(39) + chr(34))}"

    return _SPAN.sub(sub, message)


def cli_text(message: str) -> str:
    """`message` (library text: an error, a note, a report line) in the running command's terms: as_flags over
    the flags of the command tree being run; unchanged outside a click invocation."""
    ctx = click.get_current_context(silent=True)
    return as_flags(message, flag_table(ctx.find_root().command)) if ctx is not None else message
