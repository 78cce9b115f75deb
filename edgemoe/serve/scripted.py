"""Scripted replies (`edgemoe serve --scripted-replies FILE`, for tests): the model's output given instead of
sampled, where the tiny fixture cannot do what a test or a real client's round trip needs.

The file is a JSON list. A string is the next reply whatever the prompt; an object {"when": REGEX, "reply":
TEXT} is a reply for a prompt (the rendered prompt text) that REGEX matches. Each request takes the first
entry in the list that fits it and removes it; with none left, the reply is empty. Agents send side requests
(a title, a memory pass) at the same time as their main loop's: `when` keeps each reply for its request.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import EdgeMoeError


@dataclass(frozen=True)
class Entry:
    reply: str
    when: re.Pattern[str] | None = None  # None: any prompt


class Script:
    def __init__(self, entries: list[Entry]) -> None:
        self.entries = list(entries)

    @classmethod
    def parse(cls, data: object, source: str = "the script") -> Script:
        if not isinstance(data, list):
            raise EdgeMoeError(
                f"{source}: give a JSON list of replies (strings, or {{'when', 'reply'}} objects)"
            )
        entries = []
        for i, e in enumerate(data):
            if isinstance(e, str):
                entries.append(Entry(e))
            elif isinstance(e, dict) and isinstance(e.get("reply"), str) and isinstance(e.get("when"), str):
                try:
                    entries.append(Entry(e["reply"], re.compile(e["when"])))
                except re.error as err:
                    raise EdgeMoeError(
                        f"{source}: entry {i}: `when` is not a regular expression ({err})"
                    ) from None
            else:
                raise EdgeMoeError(
                    f'{source}: entry {i} is neither a string nor {{"when": REGEX, "reply": TEXT}}'
                )
        return cls(entries)

    @classmethod
    def read(cls, path: Path) -> Script:
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise EdgeMoeError(f"{path}: cannot read the scripted replies ({err})") from None
        return cls.parse(data, str(path))

    def take(self, prompt: str) -> str:
        """The reply for this prompt (removed from the script); "" when no entry fits."""
        for i, e in enumerate(self.entries):
            if e.when is None or e.when.search(prompt):
                return self.entries.pop(i).reply
        return ""

    def __len__(self) -> int:
        return len(self.entries)
