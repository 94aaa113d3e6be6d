"""The stop-string search's cost per token (`minisgl.scheduler.stops`), with one string and with the most
a request may give (`max_stop_strings`, 32, of 256 characters): the automaton reads each new character
once, so the two should cost about the same. Run with `nox -s perf`; the microseconds per token are in
extra_info."""

from __future__ import annotations

import random

import pytest

from minisgl.scheduler.stops import StopStrings

TOKENS = 4000


@pytest.mark.parametrize("count", [1, 32])
def test_stop_search_per_token(benchmark, count: int) -> None:
    rng = random.Random(0)
    stops = tuple("".join(rng.choice("abcdefgh ") for _ in range(255)) + str(i % 10) for i in range(count))
    texts, text = [], ""
    for _ in range(TOKENS):
        text += "".join(rng.choice("ijklmnop abc") for _ in range(4))  # never completes a stop string
        texts.append(text)

    strings = StopStrings(stops)  # compiled once per distinct list (cached), not per request

    def run() -> None:
        scanner = strings.scanner()
        for t in texts:
            assert scanner.search(t, 0) is None

    benchmark.pedantic(run, rounds=5, iterations=1)
    benchmark.extra_info["us_per_token"] = benchmark.stats.stats.min / TOKENS * 1e6
