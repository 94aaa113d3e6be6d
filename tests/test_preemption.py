"""Admission by need and preemption: a pool far too small for every request's worst case still runs
them all, several at once, with the outputs of a pool that never runs out (greedy and seeded sampling,
with and without overlap scheduling, chunked prefill, under lockstep), and leaves nothing held."""

import random

import pytest
import torch
from conftest import FIXED_EXAMPLES, check_clean
from hypothesis import given, settings
from hypothesis import strategies as st

from minisgl import metrics
from minisgl.core import SamplingParams
from minisgl.engine import Engine, EngineConfig
from minisgl.scheduler import Scheduler, SchedulerConfig

EOS = 2
PAGE_SIZE = 4


@pytest.fixture(scope="module")
def tiny_llama(tiny_model):
    return tiny_model("llama")


def _engine(folder, num_pages: int, max_running_req: int = 8) -> Engine:
    config = EngineConfig(
        model_path=str(folder),
        dtype=torch.float32,
        device="cpu",
        page_size=PAGE_SIZE,
        max_running_req=max_running_req,
        num_page_override=num_pages,
    )
    return Engine(config)


@pytest.fixture(scope="module")
def big(tiny_llama):
    engine = _engine(tiny_llama, 600)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def small(tiny_llama):
    """24 pages of 4 tokens: max_seq_len 96, a handful of short requests at a time."""
    engine = _engine(tiny_llama, 24)
    yield engine
    engine.shutdown()


def _specs(seed: int, n: int = 10, max_len: int = 96) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    specs = []
    for _ in range(n):
        prompt = [rng.randrange(3, 320) for _ in range(rng.randint(1, 40))]
        specs.append((prompt, rng.randint(20, max_len - len(prompt))))
    return specs


def _params(kind: str, max_tokens: int, i: int) -> SamplingParams:
    if kind == "greedy":
        return SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    if kind == "seeded":
        return SamplingParams(
            max_tokens=max_tokens, temperature=0.8, top_k=50, seed=1000 + i, ignore_eos=True
        )
    if kind == "penalized":  # the per-slot counts are made again at a re-admission, from the output so far
        return SamplingParams(
            max_tokens=max_tokens,
            ignore_eos=True,
            temperature=0.0 if i % 2 else 0.9,
            seed=i,
            repetition_penalty=1.3,
            frequency_penalty=0.5 * (i % 3),
            presence_penalty=0.4,
        )
    if kind == "scored":  # log probabilities: the prompt's are not scored twice, nor the output's
        return SamplingParams(
            max_tokens=max_tokens,
            ignore_eos=True,
            temperature=0.0 if i % 2 else 0.9,
            seed=i,
            logprobs=i % 3,
            prompt_logprobs=2 if i % 2 else None,
        )
    # EOS and min_tokens: the count of what is left of min_tokens survives a preemption
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i, min_tokens=max_tokens // 2)


def _run(sched: Scheduler, specs, kind: str, arrive_every: int = 0) -> list:
    """Runs the requests (all at once, or one every `arrive_every` steps); returns their states."""
    pending = list(enumerate(specs))
    states, steps = [], 0
    while pending or sched.has_work():
        if pending and (arrive_every == 0 or steps % arrive_every == 0):
            batch = pending if arrive_every == 0 else pending[:1]
            for i, (prompt, n) in batch:
                states.append(sched.add_request(prompt, _params(kind, n, i)))
            pending = pending[len(batch) :]
        sched.step()
        assert sched.prep.num_request_pages <= sched.held_pages <= sched.engine.num_pages
        sched.prep.check_pages()
        steps += 1
        assert steps < 5000
    check_clean(sched)
    return states


def _preemptions_metric(name: str) -> float:
    return metrics.REGISTRY.get_sample_value("minisgl_preemptions_total", {"model_name": name}) or 0.0


_reference_runs: dict = {}


def _references(big, kind: str, specs) -> list:
    """The states of `specs` run over a pool that never runs out (once per kind)."""
    if kind not in _reference_runs:
        sched = Scheduler(
            big, SchedulerConfig(max_prefill_tokens=512, overlap_scheduling=False), eos_token_ids=[EOS]
        )
        _reference_runs[kind] = _run(sched, specs, kind)
        assert sched.preemptions == 0
    return _reference_runs[kind]


# every kind with and without overlap; chunks of 8 tokens (a chunk cut to fit the free pages too) and
# of 64 (whole prompts): without overlap 8, with it 64 (seeded the other way round)
KINDS = ("greedy", "seeded", "eos", "penalized", "scored")
CASES = [
    (kind, overlap, 64 if overlap != (kind == "seeded") else 8) for kind in KINDS for overlap in (False, True)
]


@pytest.mark.parametrize(("kind", "overlap", "budget"), CASES)
def test_outputs_under_preemption_equal_those_without(big, small, kind, overlap, budget):
    specs = _specs({"greedy": 1, "seeded": 2, "eos": 3, "penalized": 4, "scored": 5}[kind])
    worst_case = sum(-(-(len(p) + n) // PAGE_SIZE) for p, n in specs)
    assert worst_case > 4 * small.num_pages  # reserved up front, they would run one or two at a time
    reference = _references(big, kind, specs)
    name = f"preempt-{kind}-{overlap}-{budget}"
    sched = Scheduler(
        small,
        SchedulerConfig(max_prefill_tokens=budget, overlap_scheduling=overlap),
        eos_token_ids=[EOS],
        model_name=name,
        record_steps=5000,
    )
    states = _run(sched, specs, kind, arrive_every=3)
    assert sched.preemptions > 0 and _preemptions_metric(name) == sched.preemptions
    assert sum(s.num_preemptions for s in states) == sched.preemptions
    assert max(r.batch_size for r in sched.step_records if r.phase == "decode") > 1
    for state, ref in zip(states, reference):
        assert state.finish_reason == ref.finish_reason
        assert state.output_ids == ref.output_ids, state.uid
        if kind == "scored":
            for got, want in ((state.logprobs, ref.logprobs), (state.prompt_logprobs, ref.prompt_logprobs)):
                assert (got is None) == (want is None) and len(got or ()) == len(want or ())
                for a, b in zip(got or (), want or ()):
                    assert (a is None) == (b is None)
                    if a is not None:
                        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
                        assert [t for t, _ in a.top] == [t for t, _ in b.top]
    if kind in ("greedy", "penalized", "scored"):
        assert all(len(s.output_ids) == n for s, (_, n) in zip(states, specs))


@pytest.mark.parametrize("overlap", [False, True])
def test_requests_without_max_tokens_run_many_at_once(tiny_llama, overlap):
    """max_tokens = the rest of the context (the server's default): reserved up front, each would take
    the whole pool; admitted by need, many run at once, and the pool frees completely."""
    engine = _engine(tiny_llama, 60)
    try:
        sched = Scheduler(
            engine, SchedulerConfig(max_prefill_tokens=64, overlap_scheduling=overlap), record_steps=200
        )
        rest = engine.max_seq_len
        states = [
            sched.add_request(
                list(range(3 + i, 13 + i)), SamplingParams(max_tokens=rest - 10, ignore_eos=True)
            )
            for i in range(6)
        ]
        most = 0
        for _ in range(40):
            sched.step()
            most = max(most, len(sched.running))
        assert most >= 5 and max(r.batch_size for r in sched.step_records) >= 5
        for state in states:
            sched.abort(state)
        while sched.has_work():
            sched.step()
        check_clean(sched)
        assert all(s.finish_reason == "abort" and len(s.output_ids) > 0 for s in states)
    finally:
        engine.shutdown()


def test_a_request_that_never_fits_is_still_refused_at_once(small):
    sched = Scheduler(small)
    with pytest.raises(ValueError, match="exceeds max_seq_len=96"):
        sched.add_request(list(range(3, 60)), SamplingParams(max_tokens=40))
    assert not sched.has_work()


@pytest.mark.parametrize("overlap", [False, True])
def test_abort_of_a_preempted_request(big, small, overlap):
    """A preempted request waits at the front of the queue holding nothing; aborting it keeps its
    output so far, which is a prefix of its output without preemption."""
    specs = _specs(7, n=6)
    reference = _run(Scheduler(big, SchedulerConfig(overlap_scheduling=False)), specs, "greedy")
    sched = Scheduler(small, SchedulerConfig(max_prefill_tokens=16, overlap_scheduling=overlap))
    states = [sched.add_request(p, _params("greedy", n, i)) for i, (p, n) in enumerate(specs)]
    while sched.preemptions == 0:
        sched.step()
    victim = sched.waiting[0]
    assert victim.num_preemptions == 1 and victim.req is None and victim.held_pages == 0
    sched.abort(victim)
    while sched.has_work():
        sched.step()
    check_clean(sched)
    for state, ref in zip(states, reference):
        if state is victim:
            assert (
                state.finish_reason == "abort" and state.output_ids == ref.output_ids[: len(state.output_ids)]
            )
        else:
            assert state.output_ids == ref.output_ids


# -- under lockstep --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_pair_engines(tiny_llama):
    pair = [_engine(tiny_llama, 20, max_running_req=4) for _ in range(2)]
    yield pair
    for engine in pair:
        engine.shutdown()


@pytest.mark.parametrize("overlap", [False, True])
def test_lockstep_ranks_preempt_alike(big, small_pair_engines, overlap):
    """Rank 0 and a follower over tiny pools: both preempt the same requests at the same steps (the
    follower checks rank 0's plan, pages in use included, every step) and end with the same tokens."""
    from test_lockstep import Pair, _follower_states

    specs = _specs(11, n=8, max_len=80)
    reference = _run(
        Scheduler(big, SchedulerConfig(overlap_scheduling=False), eos_token_ids=[EOS]), specs, "seeded"
    )
    pair = Pair(small_pair_engines, overlap=overlap, max_prefill_tokens=8)
    seen = _follower_states(pair)
    try:
        for i, (prompt, n) in enumerate(specs):
            pair.add(prompt, _params("seeded", n, i))
            pair.step()
        pair.run(max_steps=3000)
        assert pair.lead.preemptions > 0 and pair.follow.preemptions == pair.lead.preemptions
        for state, ref in zip(pair.states, reference):
            assert state.output_ids == ref.output_ids
            assert seen[state.uid].output_ids == state.output_ids
        pair.check_same()
    finally:
        pair.close()


# -- random arrivals, aborts and pool sizes --------------------------------------------------------

POOLS = (12, 18, 30)


@pytest.fixture(scope="module")
def pools(tiny_llama):
    engines = {n: _engine(tiny_llama, n, max_running_req=5) for n in POOLS}
    yield engines
    for engine in engines.values():
        engine.shutdown()


_reference_cache: dict = {}


def _reference(big, prompt: list[int], params: SamplingParams) -> list[int]:
    key = (tuple(prompt), params)
    if key not in _reference_cache:
        sched = Scheduler(big, SchedulerConfig(overlap_scheduling=False), eos_token_ids=[EOS])
        state = sched.add_request(prompt, params)
        while sched.has_work():
            sched.step()
        _reference_cache[key] = state.output_ids
    return _reference_cache[key]


ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("add"),
            st.integers(1, 30),
            st.integers(1, 40),
            st.sampled_from(["greedy", "seeded", "eos"]),
        ),
        st.tuples(st.just("step"), st.integers(1, 6)),
        st.tuples(st.just("abort"), st.integers(0, 30)),
    ),
    max_size=30,
)


@settings(FIXED_EXAMPLES, max_examples=30)
@given(ops=ops, pool=st.sampled_from(POOLS), overlap=st.booleans(), budget=st.sampled_from([4, 16, 64]))
def test_random_arrivals_and_aborts_over_small_pools(big, pools, ops, pool, overlap, budget):
    engine = pools[pool]
    sched = Scheduler(
        engine, SchedulerConfig(max_prefill_tokens=budget, overlap_scheduling=overlap), eos_token_ids=[EOS]
    )
    states, specs = [], []
    for n, op in enumerate(ops):
        if op[0] == "add":
            _, length, max_tokens, kind = op
            prompt = [random.Random(n).randrange(3, 320) for _ in range(length)]
            max_tokens = min(max_tokens, engine.max_seq_len - length)
            params = _params(kind, max_tokens, n)
            states.append(sched.add_request(prompt, params))
            specs.append((prompt, params))
        elif op[0] == "step":
            for _ in range(op[1]):
                sched.step()
                assert sched.prep.num_request_pages <= sched.held_pages <= engine.num_pages
                sched.prep.check_pages()
        elif op[0] == "abort" and states:
            sched.abort(states[op[1] % len(states)])
    steps = 0
    while sched.has_work():
        sched.step()
        steps += 1
        assert steps < 5000
    check_clean(sched)
    for state, (prompt, params) in zip(states, specs):
        expected = _reference(big, prompt, params)
        if state.finish_reason == "abort":
            assert state.output_ids == expected[: len(state.output_ids)]
        else:
            assert state.finish_reason in ("stop", "length") and state.output_ids == expected
