"""A progress bar on stderr for long CLI work (tqdm when the terminal is interactive)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def progress_bar(total: int, desc: str, *, unit: str = "it") -> Iterator[Callable[[int], None]]:
    """Yield an `advance(n)` function; draws a bar only when stderr is a terminal."""
    if not sys.stderr.isatty():
        yield lambda n: None
        return
    from tqdm import tqdm

    with tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False) as bar:

        def advance(n: int) -> None:
            bar.update(n)

        yield advance
