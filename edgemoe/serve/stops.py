"""Stop strings in streamed text, found in time linear in the text (an Aho-Corasick automaton).

The reply ends at the first place where a stop string is complete (where several end there, the longest is
the one reported); the scanner holds back the longest tail of the text that may begin a stop string, so
that no part of one is ever emitted. The answer does not depend on how the text is split into pieces.
"""

from __future__ import annotations

from collections.abc import Sequence


class _Automaton:
    """Trie states of the stop strings with failure links: state 0 is the root; depth[s] is the length of
    the prefix state s stands for; ends[s] is the longest stop string that ends there (via failure links)."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.next: list[dict[str, int]] = [{}]
        self.depth = [0]
        self.ends: list[int] = [-1]  # index into stops, -1: none
        for i, s in enumerate(stops):
            state = 0
            for ch in s:
                if ch not in self.next[state]:
                    self.next.append({})
                    self.depth.append(self.depth[state] + 1)
                    self.ends.append(-1)
                    self.next[state][ch] = len(self.next) - 1
                state = self.next[state][ch]
            self.ends[state] = i
        self.fail = [0] * len(self.next)
        order = list(self.next[0].values())  # breadth first: a state's failure state is shallower
        for state in order:
            for ch, child in self.next[state].items():
                order.append(child)
                f = self.fail[state]
                while f and ch not in self.next[f]:
                    f = self.fail[f]
                self.fail[child] = self.next[f].get(ch, 0)
                if self.ends[child] < 0:
                    self.ends[child] = self.ends[self.fail[child]]

    def step(self, state: int, ch: str) -> int:
        while state and ch not in self.next[state]:
            state = self.fail[state]
        return self.next[state].get(ch, 0)


class StopScanner:
    """Cuts generated text at the first stop string; holds back a tail that may begin one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self._auto = _Automaton(self.stops)
        self._state = 0
        self.buf = ""  # the held tail: the text of the automaton's state
        self.hit: str | None = None  # the stop string that ended the text

    def push(self, piece: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string was reached)."""
        auto, state = self._auto, self._state
        for i, ch in enumerate(piece):
            state = auto.step(state, ch)
            if auto.ends[state] >= 0:
                self.hit = self.stops[auto.ends[state]]
                text = self.buf + piece[: i + 1]
                self.buf, self._state = "", 0
                return text[: len(text) - len(self.hit)], True
        self._state = state
        text = self.buf + piece
        keep = auto.depth[state]
        self.buf = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        out, self.buf, self._state = self.buf, "", 0
        return out
