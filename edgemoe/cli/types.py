"""click parameter types shared by the CLI modules."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from ..errors import EdgeMoeError, InvalidSizeError
from ..runtime.config import MAX_THREADS
from .flags import cli_text

# -t/--threads of every command: 0 (the default count) up to ggml's limit, past which llama.cpp aborts
THREADS = click.IntRange(0, MAX_THREADS)


class GGUFPath(click.ParamType):
    """A path to a GGUF model; validated (exists, GGUF, complete, known architecture, possible
    hyper-parameters) at parse time."""

    name = "MODEL.gguf"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Path:
        from ..gguf.validate import check_model

        path = Path(value)
        try:
            check_model(path)
        except EdgeMoeError as err:  # one line, no usage text: the path was fine, the file is not
            raise click.ClickException(cli_text(str(err))) from err
        return path


class Size(click.ParamType):
    """A byte size such as 6GiB, 8GB or 512MiB; with auto=True also `auto`: the free memory of this build's GPU
    now (said on stderr), refused on a build without one."""

    name = "SIZE"

    def __init__(self, *, auto: bool = False) -> None:
        self.auto = auto

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        from ..gguf.info import parse_size

        if isinstance(value, int):
            return value
        option = f"--{param.name}" if param else "size"
        if self.auto and str(value).strip().lower() == "auto":
            return self._gpu_free(option, param, ctx)
        try:
            return parse_size(value, option=option)
        except InvalidSizeError as err:
            self.fail(str(err), param, ctx)

    def _gpu_free(self, option: str, param: click.Parameter | None, ctx: click.Context | None) -> int:
        from ..gguf.info import format_size
        from ..runtime import native

        dev = native.gpu_device()
        if dev is None:
            self.fail(
                f"{option} auto takes the GPU's free memory, and this build has no GPU (a CUDA build: make "
                "install EDGEMOE_CUDA=1); give a size such as 8GiB",
                param,
                ctx,
            )
        free, _total = native.device_memory(dev)
        click.echo(f"{option} auto: {format_size(free)} free on {native.device_name(dev)}", err=True)
        return free


class Finite(click.ParamType):
    """A finite number within [lo, hi] (click.FloatRange lets nan through: nan compares false)."""

    name = "NUMBER"

    def __init__(self, lo: float = -math.inf, hi: float = math.inf) -> None:
        self.lo, self.hi = lo, hi

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        try:
            x = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number", param, ctx)
        if not math.isfinite(x) or not self.lo <= x <= self.hi:
            self.fail(f"{value} is not a finite number in [{self.lo:g}, {self.hi:g}]", param, ctx)
        return x


class OutputPath(click.ParamType):
    """A file (or, with directory=True, a directory) to write at the end of a long run: its parent must
    exist and be writable now, so a typo fails at once instead of after the work."""

    name = "PATH"

    def __init__(self, *, directory: bool = False) -> None:
        self.directory = directory

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Path:
        import os

        path = Path(value)
        if path.exists() and path.is_dir() != self.directory:
            self.fail(f"{path} is {'not ' if self.directory else ''}a directory", param, ctx)
        parent = path if self.directory and path.exists() else path.parent
        if not parent.is_dir():
            self.fail(f"cannot write {path}: the directory {parent} does not exist", param, ctx)
        if not os.access(parent, os.W_OK | os.X_OK):
            self.fail(f"cannot write {path}: the directory {parent} is not writable", param, ctx)
        return path


class IntList(click.ParamType):
    """A comma-separated list of positive integers, e.g. 24,32,49."""

    name = "N,N,..."

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> list[int]:
        if isinstance(value, list):
            return value
        try:
            out = [int(x) for x in str(value).split(",") if x.strip()]
        except ValueError:
            self.fail(f"{value!r} is not a comma-separated list of integers (e.g. 24,32,49)", param, ctx)
        if not out or min(out) < 1:
            self.fail(f"{value!r}: give one or more positive integers, e.g. 24,32,49", param, ctx)
        return out


class PolicyName(click.ParamType):
    """A registered residency policy's name, read from the registry when the command runs (a policy registered
    after the CLI was imported is taken too): every one, or those `which` returns (e.g. the projected ones)."""

    name = "POLICY"

    def __init__(self, which: Callable[[], tuple[str, ...]] | None = None) -> None:
        self.which = which

    def names(self) -> tuple[str, ...]:
        from ..policies.registry import policy_names

        return self.which() if self.which is not None else policy_names()

    def get_metavar(self, param: click.Parameter, ctx: click.Context | None = None) -> str:
        return "[" + "|".join(self.names()) + "]"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        if value in self.names():
            return str(value)
        self.fail(f"{value!r} is not one of {', '.join(map(repr, self.names()))}", param, ctx)
