"""Stop strings found in a growing text, at a cost per new character that does not grow with their
number (an Aho-Corasick automaton: docs/scheduler.md#finishing). The answer does not depend on how the
text was cut: the stop string that ends earliest (of those, the longest) among those ending after a
given point (text already handed out is never taken back).
"""

from __future__ import annotations

from functools import lru_cache


class StopStrings:
    """A request's stop strings, compiled once (shared by every request with the same ones: see
    `stop_strings`); `scanner()` makes the per-text cursor."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        if not stops or not all(stops):
            raise ValueError("stop strings must be non-empty")
        self.stops = stops
        self.max_len = max(map(len, stops))  # text that may still become a stop string is held back
        self.automaton = _Automaton(stops)

    def scanner(self) -> StopScanner:
        return StopScanner(self)


@lru_cache(maxsize=64)
def stop_strings(stops: tuple[str, ...]) -> StopStrings:
    """The compiled form of `stops` (cached: requests of one client usually share theirs)."""
    return StopStrings(stops)


class _Automaton:
    """Aho-Corasick over the stop strings: `goto[node]` maps a character to the next node of the trie,
    `fail[node]` is the node of the longest proper suffix of the node's string that is in the trie,
    `out[node]` the length of the longest stop string ending at the node (0: none)."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        goto: list[dict[str, int]] = [{}]
        out = [0]
        for stop in stops:
            node = 0
            for ch in stop:
                nxt = goto[node].get(ch)
                if nxt is None:
                    nxt = len(goto)
                    goto[node][ch] = nxt
                    goto.append({})
                    out.append(0)
                node = nxt
            out[node] = max(out[node], len(stop))
        fail = [0] * len(goto)
        frontier = list(goto[0].values())  # breadth first: a node's failure is known before its children's
        while frontier:
            following = []
            for node in frontier:
                for ch, child in goto[node].items():
                    f = fail[node]
                    while f and ch not in goto[f]:
                        f = fail[f]
                    fail[child] = goto[f].get(ch, 0) if node else 0
                    out[child] = max(out[child], out[fail[child]])
                    following.append(child)
            frontier = following
        self.goto, self.fail, self.out = goto, fail, out


class StopScanner:
    """Where the search stands in one growing text: the characters read so far and the automaton's
    node after them. The text must only grow between calls."""

    __slots__ = ("strings", "pos", "node")

    def __init__(self, strings: StopStrings) -> None:
        self.strings = strings
        self.pos = -1  # characters read; -1: none yet
        self.node = 0

    def search(self, text: str, since: int) -> int | None:
        """The start of the first stop string completed in `text` that ends after character `since`
        (the text before `since` is out of reach: handed out already), or None; reads only the text
        added since the last call. `since` must not decrease between calls."""
        strings = self.strings
        if self.pos < 0:  # no string ending after `since` starts before this
            self.pos = max(0, since - strings.max_len + 1)
        automaton = strings.automaton
        goto, fail, out = automaton.goto, automaton.fail, automaton.out
        node = self.node
        for i in range(self.pos, len(text)):
            ch = text[i]
            while True:
                nxt = goto[node].get(ch)
                if nxt is not None:
                    node = nxt
                    break
                if not node:
                    break
                node = fail[node]
            if out[node] and i >= since:  # a stop string ends at i + 1 > since
                self.pos, self.node = i + 1, node
                return i + 1 - out[node]
        self.pos, self.node = len(text), node
        return None
