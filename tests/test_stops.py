"""Stop strings in a growing text (`minisgl.scheduler.stops`): the automaton gives the answer of a
brute-force search, whatever the pieces the text arrives in."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from minisgl.scheduler.stops import StopStrings, stop_strings

ALPHABET = "ab\u00e9\U0001f600"  # few characters: matches and overlaps are common


def first_completed(text: str, stops: tuple[str, ...], since: int) -> int | None:
    """The start of the stop string that ends first after `since` (the longest of those ending there)."""
    best = None
    for stop in stops:
        for start in range(len(text) - len(stop) + 1):
            end = start + len(stop)
            if end > since and text.startswith(stop, start) and (best is None or (end, start) < best):
                best = (end, start)
    return None if best is None else best[1]


@settings(max_examples=300, deadline=None)
@given(
    stops=st.lists(st.text(ALPHABET, min_size=1, max_size=5), min_size=1, max_size=20),
    pieces=st.lists(st.text(ALPHABET, max_size=6), max_size=12),
    since=st.integers(0, 8),
)
def test_growing_text_finds_what_a_brute_force_search_finds(stops, pieces, since) -> None:
    stops = tuple(stops)
    scanner, text, found = StopStrings(stops).scanner(), "", None
    for piece in pieces:
        text += piece
        found = scanner.search(text, min(since, len(text)))
        expected = first_completed(text, stops, min(since, len(text)))
        assert found == expected, (text, stops, since)
        if found is not None:
            break


def test_many_strings_cost_per_character_what_few_cost() -> None:
    """100 strings of 50 characters compile to an automaton that reads each character once: the
    scanner's position moves by the characters added, and a long text with no match is read in one
    pass."""
    stops = tuple(f"{i:03d}" + "x" * 47 for i in range(100))
    strings = stop_strings(stops)
    assert strings.max_len == 50
    scanner = strings.scanner()
    text = ""
    for _ in range(200):
        text += "0123456789 "
        assert scanner.search(text, 0) is None
        assert scanner.pos == len(text)
    text += "042" + "x" * 47 + "tail"
    assert scanner.search(text, 0) == len(text) - 54
    assert stop_strings(stops) is strings  # compiled once
