"""Prompt lookup proposals (`minisgl.scheduler.ngram`): the index proposes what a brute-force search
proposes, whatever the pieces its tokens arrive in, at a cost per token that does not grow with the
sequence; the per-request proposer feeds each index incrementally and rebuilds it when a list shrinks."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minisgl.scheduler.ngram import NgramIndex, NgramProposer


def reference(tokens: list[int], max_n: int, min_n: int, k: int) -> list[int]:
    """The proposal by scanning: for n from max_n down, the latest occurrence of the last n tokens that
    ends before the last position, and the k tokens after it, copied one at a time from the same
    distance back past the end of the sequence (the copy reads the tokens it wrote)."""
    if k <= 0:
        return []
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n > length - 1:
            continue
        suffix = tokens[length - n :]
        for end in range(length - 1, n - 1, -1):  # an occurrence tokens[end-n..end) with end <= length-1
            if tokens[end - n : end] == suffix:
                copied = list(tokens)
                for j in range(k):
                    copied.append(copied[end + j])
                return copied[length:]
    return []


bounds = st.integers(1, 5).flatmap(lambda max_n: st.tuples(st.just(max_n), st.integers(1, max_n)))
token_lists = st.integers(1, 4).flatmap(lambda size: st.lists(st.integers(0, size - 1), max_size=40))


@settings(max_examples=150, deadline=None)
@given(tokens=token_lists, bounds=bounds, k=st.integers(0, 7))
def test_every_prefix_proposes_what_a_scan_finds(tokens, bounds, k) -> None:
    max_n, min_n = bounds
    index = NgramIndex(max_n, min_n)
    assert index.propose(k) == []
    for i, token in enumerate(tokens):
        index.extend([token])
        assert len(index) == i + 1
        assert index.propose(k) == reference(tokens[: i + 1], max_n, min_n, k), (tokens[: i + 1], bounds, k)


@settings(max_examples=150, deadline=None)
@given(tokens=token_lists, bounds=bounds, k=st.integers(0, 7), cuts=st.lists(st.integers(0, 40), max_size=5))
def test_the_pieces_tokens_arrive_in_do_not_matter(tokens, bounds, k, cuts) -> None:
    max_n, min_n = bounds
    whole, pieces = NgramIndex(max_n, min_n), NgramIndex(max_n, min_n)
    whole.extend(tokens)
    points = sorted({0, len(tokens), *(min(c, len(tokens)) for c in cuts)})
    for a, b in zip(points, points[1:]):
        pieces.extend(tokens[a:b])
    pieces.extend([])
    expected = reference(tokens, max_n, min_n, k)
    assert whole.propose(k) == pieces.propose(k) == expected
    assert len(whole) == len(pieces) == len(tokens)


def test_a_repeated_paragraph_proposes_its_continuation() -> None:
    paragraph = [101, 7, 55, 23, 9, 301, 44, 12, 87, 5, 66]
    index = NgramIndex(max_n=4)
    index.extend([1, 2, 3] + paragraph + [900, 901] + paragraph[:4])  # copying the paragraph again
    assert index.propose(5) == paragraph[4:9]
    # past the end of the tokens, the copy goes on: the paragraph and what followed it, again
    continued = paragraph[4:] + [900, 901] + paragraph[:4]
    assert index.propose(len(continued) + 3) == continued + continued[:3]


def test_a_period_two_sequence_proposes_its_own_continuation() -> None:
    index = NgramIndex(max_n=3)
    index.extend([1, 2, 1, 2, 1])
    # the 3-gram [1, 2, 1] last ended at position 2: what followed runs into the suffix, and on past
    # the end of the sequence, copying from 2 back: the period goes on for as many tokens as asked
    assert index.propose(1) == [2]
    assert index.propose(2) == [2, 1]
    assert index.propose(5) == [2, 1, 2, 1, 2]
    index.extend([2, 1, 2, 1])
    assert index.propose(4) == [2, 1, 2, 1]
    run = NgramIndex(max_n=4)
    run.extend([3, 0, 0])  # a run of one token: period 1
    assert run.propose(4) == [0, 0, 0, 0]


def test_no_match_and_no_budget_propose_nothing() -> None:
    index = NgramIndex(max_n=3)
    assert index.propose(4) == []
    index.extend([5])
    assert index.propose(4) == []  # one token: nothing before it
    index.extend([6, 7, 8])
    assert index.propose(4) == []  # 8 never occurred before
    index.extend([5, 6])
    assert index.propose(2) == [7, 8]
    assert index.propose(6) == [7, 8, 5, 6, 7, 8]  # copying from 4 back, on past the end
    assert index.propose(0) == []
    assert index.propose(-1) == []
    # min_n: a 1-gram match is not enough
    strict = NgramIndex(max_n=3, min_n=2)
    strict.extend([5, 6, 7, 8, 9, 6])
    assert strict.propose(3) == []
    loose = NgramIndex(max_n=3)
    loose.extend([5, 6, 7, 8, 9, 6])
    assert loose.propose(3) == [7, 8, 9] == reference([5, 6, 7, 8, 9, 6], 3, 1, 3)


def test_the_longest_match_wins_over_a_later_shorter_one() -> None:
    # [1, 2] last occurred at positions 0-1 (followed by 3); [2] alone last occurred at 5 (followed by 4)
    tokens = [1, 2, 3, 9, 9, 2, 4, 1, 2]
    index = NgramIndex(max_n=2)
    index.extend(tokens)
    assert index.propose(2) == [3, 9]
    one = NgramIndex(max_n=1)
    one.extend(tokens)
    assert one.propose(2) == [4, 1]
    # among occurrences of the same n-gram, the latest one wins
    latest = NgramIndex(max_n=2)
    latest.extend([1, 2, 3, 1, 2, 4, 1, 2])
    assert latest.propose(1) == [4]


@pytest.mark.parametrize(
    ("max_n", "min_n", "named"),
    [(0, 1, "max_n=0"), (-2, 1, "max_n=-2"), (3, 0, "min_n=0"), (2, 3, "min_n=3 > max_n=2")],
)
def test_bad_bounds_are_refused_by_name(max_n, min_n, named) -> None:
    with pytest.raises(ValueError, match=named):
        NgramIndex(max_n, min_n)
    with pytest.raises(ValueError, match=named):
        NgramProposer(max_n, min_n)


def test_token_ids_outside_the_vocabulary_range_are_refused() -> None:
    index = NgramIndex(max_n=2)
    with pytest.raises(ValueError, match="-1"):
        index.extend([3, -1])
    with pytest.raises(ValueError, match=str(1 << 32)):
        index.extend([1 << 32])
    assert len(index) == 0


@settings(max_examples=60, deadline=None)
@given(
    streams=st.lists(st.tuples(token_lists, st.lists(st.integers(1, 6), max_size=6)), min_size=1, max_size=4),
    k=st.integers(0, 5),
)
def test_proposer_fed_incrementally_equals_a_fresh_index(streams, k) -> None:
    """Several requests, each list growing by a few tokens per call, interleaved."""
    proposer = NgramProposer(max_n=3)
    grown = [0] * len(streams)
    for _ in range(8):
        requests = []
        for uid, (tokens, steps) in enumerate(streams):
            grown[uid] = min(len(tokens), grown[uid] + (steps[grown[uid] % len(steps)] if steps else 1))
            requests.append((uid, tokens[: grown[uid]]))
        got = proposer.propose(requests, [k] * len(requests))
        for (_, tokens), proposal in zip(requests, got):
            fresh = NgramIndex(max_n=3)
            fresh.extend(tokens)
            assert proposal == fresh.propose(k) == reference(tokens, 3, 1, k)
    assert len(proposer) == len(streams)


def test_proposer_reads_only_the_new_tokens() -> None:
    proposer = NgramProposer(max_n=2)
    tokens = [1, 2, 3, 1, 2]
    assert proposer.propose([(7, tokens)], [2]) == [[3, 1]]
    index = proposer._indexes[7]
    tokens += [3, 1]
    assert proposer.propose([(7, tokens)], [2]) == [[2, 3]]
    assert proposer._indexes[7] is index and len(index) == 7  # extended, not rebuilt


def test_proposer_rebuilds_from_a_shorter_or_different_list() -> None:
    proposer = NgramProposer(max_n=2)
    assert proposer.propose([(1, [4, 5, 6, 4, 5, 6, 4])], [3]) == [[5, 6, 4]]
    first = proposer._indexes[1]
    # recomputed after a preemption: the list is shorter than what was indexed
    assert proposer.propose([(1, [4, 5, 6, 4])], [3]) == [[5, 6, 4]]
    assert proposer._indexes[1] is not first and len(proposer._indexes[1]) == 4
    # a reused uid whose list is as long but differs at the last indexed token
    assert proposer.propose([(1, [8, 9, 8, 7])], [3]) == [[]]
    assert proposer.propose([(1, [8, 9, 8, 7, 8])], [3]) == [[7, 8, 7]]


def test_proposer_respects_limits_and_forgets() -> None:
    proposer = NgramProposer(max_n=3)
    loop = [1, 2, 3, 4] * 4
    got = proposer.propose([(1, loop), (2, loop), (3, loop), (4, [9, 8])], [0, 1, 3, 5])
    assert got == [[], [1], [1, 2, 3], []]
    assert len(proposer) == 4  # a zero limit still indexes
    assert len(proposer._indexes[1]) == len(loop)
    proposer.forget(1)
    proposer.forget(1)  # twice, or a uid never seen: nothing happens
    proposer.forget(99)
    assert len(proposer) == 3 and 1 not in proposer._indexes
    assert proposer.propose([(1, loop)], [2]) == [[1, 2]]  # indexed afresh
    with pytest.raises(ValueError, match="2 requests but 1 limits"):
        proposer.propose([(1, loop), (2, loop)], [1])


class CountingMap(dict):
    """The trie's child map, counting look-ups and insertions."""

    operations = 0

    def get(self, key, default=None):
        CountingMap.operations += 1
        return super().get(key, default)

    def __setitem__(self, key, value) -> None:
        CountingMap.operations += 1
        super().__setitem__(key, value)

    def __getitem__(self, key):
        CountingMap.operations += 1
        return super().__getitem__(key)


class CountingIndex(NgramIndex):
    _map_type = CountingMap


@pytest.mark.parametrize("max_n", [1, 4])
def test_the_cost_per_token_does_not_grow_with_the_sequence(max_n) -> None:
    """Each token costs at most max_n look-ups and max_n insertions, whether the tokens come in one
    call or one at a time, and a proposal at most max_n look-ups: nothing rescans the sequence."""
    period = 97  # long repeats: every n-gram has many earlier occurrences
    tokens = [(i * 31) % period for i in range(3000)]
    for pieces in ([tokens], [[t] for t in tokens]):
        CountingMap.operations = 0
        index = CountingIndex(max_n)
        assert isinstance(index._child, CountingMap)
        for piece in pieces:
            index.extend(piece)
        assert 0 < CountingMap.operations <= 2 * max_n * len(tokens)
        # the repeats insert nothing new after the first period: one look-up per n per token
        assert CountingMap.operations <= max_n * len(tokens) + max_n * period
        CountingMap.operations = 0
        assert index.propose(8) == tokens[len(tokens) - period : len(tokens) - period + 8]
        assert CountingMap.operations <= max_n
    # the trie has at most max_n nodes per token, however long the sequence
    assert len(index._end) <= 1 + max_n * len(tokens)


def test_a_back_off_step_counts_once_per_forward():
    """A request backing off sits out one step per forward: when no verify step can be launched on the
    guess of the one in flight (here its guess leaves no drafts), the decode step that runs instead
    counts one step of the back-off (`Speculator.wanted`), and the attempt counted none."""
    from types import SimpleNamespace

    from minisgl.core import Req, SamplingParams
    from minisgl.scheduler import RequestState, SchedulerConfig
    from minisgl.scheduler.speculative import Speculator
    from minisgl.scheduler.verify import Verifier, Verify

    spec = Speculator(SchedulerConfig(speculative_method="ngram", speculative_num_tokens=4))
    req = Req(input_ids=list(range(10, 30)), table_idx=0, cached_len=19, output_len=64, uid=0)
    state = RequestState(0, list(range(10, 20)), SamplingParams(max_tokens=64), 0.0, req=req)
    state.output_ids, state.spec_wait = list(range(20, 30)), 3
    sched = SimpleNamespace(
        engine=SimpleNamespace(max_seq_len=4096),
        prep=None,
        pipeline=SimpleNamespace(overlap=True),
        waiting=[],
        running=[state],
    )
    pending = Verify(SimpleNamespace(states=[state], reqs=[req]), [4], [[]], [None], [True])
    assert Verifier(sched, spec).pipeline(pending, 0.0, []) is None
    assert state.spec_wait == 3
    spec.wanted([state])
    assert state.spec_wait == 2
