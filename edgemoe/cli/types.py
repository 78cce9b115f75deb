"""click parameter types shared by the CLI modules."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from ..errors import EdgeMoeError, InvalidSizeError


class GGUFPath(click.ParamType):
    """A path to a GGUF model; validated (exists, GGUF, complete, known architecture) at parse time."""

    name = "MODEL.gguf"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Path:
        from ..gguf.info import check_gguf

        path = Path(value)
        try:
            check_gguf(path)
        except EdgeMoeError as err:  # one line, no usage text: the path was fine, the file is not
            raise click.ClickException(str(err)) from err
        return path


class Size(click.ParamType):
    """A byte size such as 6GiB, 8GB or 512MiB."""

    name = "SIZE"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        from ..gguf.info import parse_size

        if isinstance(value, int):
            return value
        try:
            return parse_size(value, option=f"--{param.name}" if param else "size")
        except InvalidSizeError as err:
            self.fail(str(err), param, ctx)
