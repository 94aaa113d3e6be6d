"""Ranks in lockstep, in one process: a leading and a following scheduler, each over its own engine
(single-rank engines of the same weights, so they compute the same tokens) and linked by ZeroMQ
sockets as tensor-parallel ranks are. Random arrivals, aborts and faults injected on rank 0 alone; the
follower must take every decision from rank 0's messages and end in rank 0's state. The real
two-process groups are in test_tp_launch.py."""

import itertools

import pytest
import torch
import zmq
from conftest import FIXED_EXAMPLES, check_clean
from hypothesis import given, settings
from hypothesis import strategies as st

from minisgl.core import FatalEngineError, SamplingParams
from minisgl.engine import Engine, EngineConfig
from minisgl.scheduler import Scheduler, SchedulerConfig
from minisgl.scheduler.lockstep import Follower, Leader

_names = itertools.count()


class Fault(RuntimeError):
    pass


@pytest.fixture(scope="module")
def engines(tiny_model):
    folder = tiny_model("qwen3")
    config = dict(model_path=str(folder), dtype=torch.float32, device="cpu", max_running_req=4, page_size=4)
    pair = [Engine(EngineConfig(**config, num_page_override=40)) for _ in range(2)]
    yield pair
    for engine in pair:
        engine.shutdown()


class Pair:
    """A leader and a follower scheduler linked as ranks 0 and 1 are (sockets in this process)."""

    def __init__(self, engines, overlap=True, max_prefill_tokens=16, follower_prefill=None) -> None:
        context = zmq.Context.instance()
        name = next(_names)
        inbox, to_follower = context.socket(zmq.PULL), context.socket(zmq.PUSH)
        inbox.bind(f"inproc://steps-{name}")
        to_follower.connect(f"inproc://steps-{name}")
        reports, report = context.socket(zmq.PULL), context.socket(zmq.PUSH)
        reports.bind(f"inproc://reports-{name}")
        report.connect(f"inproc://reports-{name}")
        self.leader, self.follower = Leader([to_follower], reports), Follower(1, inbox, report)
        eos = engines[0].config.model_config.eos_token_ids
        self.lead = Scheduler(
            engines[0],
            SchedulerConfig(max_prefill_tokens=max_prefill_tokens, overlap_scheduling=overlap),
            eos_token_ids=eos,
            link=self.leader,
        )
        self.follow = Scheduler(
            engines[1],
            SchedulerConfig(
                max_prefill_tokens=follower_prefill or max_prefill_tokens, overlap_scheduling=overlap
            ),
            eos_token_ids=eos,
            link=self.follower,
        )
        self.states = []

    def add(self, prompt, params):
        self.states.append(self.lead.add_request(prompt, params))
        return self.states[-1]

    def step(self) -> None:
        self.lead.step()
        assert self.follower.wait_for_step()
        self.follow.step()

    def run(self, max_steps=400) -> None:
        for _ in range(max_steps):
            if not self.lead.has_work():
                break
            self.step()
        assert not self.lead.has_work()
        self.step()  # the follower applies rank 0's last finishes

    def check_same(self) -> None:
        """Both ranks ended in the same place: same tokens and finish of every request, nothing held."""
        check_clean(self.lead)
        check_clean(self.follow)
        assert self.follow._by_uid == {}

    def close(self) -> None:
        self.leader.close()
        self.follower.close()


def _follower_states(pair: Pair):
    """The follower's RequestStates by uid, captured as it queues them."""
    seen = {}
    original = pair.follow.follow_add

    def add(uid, prompt, params, *rest):
        original(uid, prompt, params, *rest)
        seen[uid] = pair.follow._by_uid[uid]

    pair.follow.follow_add = add
    return seen


def _prompt(draw_len, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 300, (draw_len,), generator=gen).tolist()


ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("add"),
            st.integers(1, 30),  # prompt length
            st.integers(1, 8),  # max_tokens
            st.sampled_from(["greedy", "sampled", "seeded", "min_tokens", "stop_ids"]),
        ),
        st.tuples(st.just("step"), st.integers(1, 3)),
        st.tuples(st.just("abort"), st.integers(0, 20)),
        st.tuples(st.just("fail_prepare"), st.just(0)),  # preparing the next step fails on rank 0 only
        st.tuples(st.just("fail_token"), st.integers(0, 20)),  # one request's token handling, rank 0 only
    ),
    max_size=25,
)


def _params(kind: str, max_tokens: int, seed: int) -> SamplingParams:
    if kind == "greedy":
        return SamplingParams(max_tokens=max_tokens)
    if kind == "sampled":  # no seed: rank 0 draws one and sends it
        return SamplingParams(max_tokens=max_tokens, temperature=1.0)
    if kind == "seeded":
        return SamplingParams(max_tokens=max_tokens, temperature=0.7, top_k=20, seed=seed)
    if kind == "min_tokens":
        return SamplingParams(max_tokens=max_tokens, temperature=1.0, min_tokens=max_tokens // 2)
    return SamplingParams(max_tokens=max_tokens, stop_token_ids=[7, 11, 13, 17, 19, 23])


@settings(FIXED_EXAMPLES, max_examples=40)
@given(ops=ops, overlap=st.booleans(), budget=st.sampled_from([4, 16, 64]))
def test_follower_ends_where_the_leader_does(engines, ops, overlap, budget):
    """Random arrivals, steps, aborts and rank-0-only faults: every step the follower's plan, state
    counts and last tokens equal the leader's (else it raises), and at the end each request has the
    same tokens and finish on both ranks and nothing is held on either."""
    pair = Pair(engines, overlap=overlap, max_prefill_tokens=budget)
    followed = _follower_states(pair)
    lead = pair.lead
    try:
        for n, op in enumerate(ops):
            if op[0] == "add":
                _, length, max_tokens, kind = op
                pair.add(_prompt(length, n), _params(kind, max_tokens, n))
            elif op[0] == "step":
                for _ in range(op[1]):
                    pair.step()
            elif op[0] == "abort" and pair.states:
                lead.abort(pair.states[op[1] % len(pair.states)])
            elif op[0] == "fail_prepare":
                original = lead.output.suppressed

                def fail_once(*args, original=original):
                    lead.output.suppressed = original
                    raise Fault("prepare")

                lead.output.suppressed = fail_once
            elif op[0] == "fail_token" and pair.states:
                target = pair.states[op[1] % len(pair.states)]
                original = lead.output.check_stop

                def check_stop(state, token, original=original, target=target):
                    if state is target:
                        raise Fault("token")
                    return original(state, token)

                lead.output.check_stop = check_stop
        pair.run()
        for state in pair.states:
            twin = followed[state.uid]
            assert twin.finished and twin.finish_reason == state.finish_reason, state.uid
            assert twin.output_ids == state.output_ids, state.uid
            assert twin.params == state.params  # the seed rank 0 drew travelled with the request
        pair.check_same()
    finally:
        pair.close()


def test_sampled_requests_get_a_seed_on_rank_0(engines):
    """An unseeded sampled request is given a seed at arrival (once: its draws are a function of that
    seed and the position), which the follower receives; a greedy one keeps none."""
    pair = Pair(engines)
    try:
        # ignore_eos: the seed is drawn at random, and a random draw of the tiny model may sample EOS
        sampled = pair.add([5, 6, 7], SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True))
        greedy = pair.add([5, 6, 7], SamplingParams(max_tokens=4))
        assert isinstance(sampled.params.seed, int) and greedy.params.seed is None
        pair.run()
        assert len(sampled.output_ids) == 4
        pair.check_same()
    finally:
        pair.close()


def test_a_follower_that_schedules_otherwise_stops_with_the_step_named(engines):
    pair = Pair(engines, max_prefill_tokens=16, follower_prefill=8)
    try:
        pair.add(list(range(3, 23)), SamplingParams(max_tokens=2))
        pair.lead.step()
        assert pair.follower.wait_for_step()
        with pytest.raises(FatalEngineError, match=r"rank 1 diverged from rank 0 at step 0.*'prefill', 1, 8"):
            pair.follow.step()
    finally:
        pair.close()


def test_a_follower_that_samples_otherwise_stops(engines):
    """Tokens that differ between ranks (here: the follower's sampler shifted) are caught at the next
    step by the digest in the plan, not left to corrupt the batch."""
    pair = Pair(engines)
    sampler = pair.follow.engine.sampler
    original = sampler.sample
    sampler.sample = lambda logits, args, **kw: (original(logits, args, **kw) + 1) % 300
    try:
        pair.add([5, 6, 7, 8], SamplingParams(max_tokens=6, ignore_eos=True))
        with pytest.raises(FatalEngineError, match="diverged from rank 0"):
            for _ in range(6):
                pair.step()
    finally:
        del sampler.sample
        pair.close()


def test_a_failure_on_the_follower_alone_is_reported_to_rank_0_by_rank(engines):
    """A step that fails only on a follower raises there; the report it sends makes rank 0's next step
    raise a FatalEngineError naming the rank and the error, failing that step's requests."""
    pair = Pair(engines)
    prep = pair.follow.prep
    original = prep.prefill

    def broken(*args, **kwargs):
        raise Fault("follower only")

    prep.prefill = broken
    try:
        state = pair.add([5, 6, 7], SamplingParams(max_tokens=3))
        pair.lead.step()
        assert pair.follower.wait_for_step()
        with pytest.raises(FatalEngineError, match="rank 1 failed to prepare step 0") as failure:
            pair.follow.step()
        pair.follower.send_report(failure.value)
        with pytest.raises(
            FatalEngineError, match=r"tensor-parallel rank 1 failed \(FatalEngineError: rank 1"
        ):
            pair.lead.step()
        assert state.finish_reason == "error" and "tensor-parallel rank 1 failed" in state.error
        with pytest.raises(FatalEngineError):  # the group stays stopped
            pair.lead.step()
    finally:
        prep.prefill = original
        pair.close()


def test_an_admission_that_fails_on_rank_0_fails_on_the_follower_at_the_same_point(engines):
    pair = Pair(engines)
    followed = _follower_states(pair)
    prep = pair.lead.prep
    original = prep.add_request

    def fail_second(tokens, params, *rest):
        if tokens == [9, 9, 9]:
            raise Fault("admission")
        return original(tokens, params, *rest)

    prep.add_request = fail_second
    try:
        a = pair.add([5, 6, 7], SamplingParams(max_tokens=3))
        b = pair.add([9, 9, 9], SamplingParams(max_tokens=3))
        c = pair.add([4, 4, 4, 4], SamplingParams(max_tokens=3))
        pair.run()
        assert [s.finish_reason for s in (a, b, c)] == ["length", "error", "length"]
        assert followed[b.uid].finish_reason == "error" and "on rank 0" in followed[b.uid].error
        assert followed[c.uid].output_ids == c.output_ids
        pair.check_same()
    finally:
        prep.add_request = original
        pair.close()
