"""One bad request never breaks the engine. Faults injected at each stage of a step finish the requests
of that step (or the one request whose own processing failed) with finish_reason "error"; requests that
can no longer be scheduled are finished; interrupted calls and closed or dropped streams abort their
requests at once; several threads share one LLM; a shut-down LLM says so. After each: no request holds
a page, every slot is free, and a normal request still gives the tokens it gives alone."""

import signal
import threading
import time

import pytest
import torch
from conftest import check_clean, llm_clean

from minisgl.core import FatalEngineError, SamplingParams
from minisgl.engine import Engine, EngineConfig, ForwardOutput
from minisgl.llm import LLM, RequestError
from minisgl.scheduler import Scheduler, SchedulerConfig, generate

FAULT = "injected fault"
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


class Fault(RuntimeError):
    pass


@pytest.fixture(scope="module")
def tiny_llama(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def tiny_text_llm(tiny_model):
    folder = tiny_model("llama", tokenizer=True)
    with LLM(str(folder), device="cpu", dtype="float32", max_running_req=8, page_size=4) as llm:
        yield llm


def _engine(folder) -> Engine:
    config = dict(dtype=torch.float32, device="cpu", page_size=4, max_running_req=6, num_page_override=80)
    return Engine(EngineConfig(model_path=str(folder), **config))


def _alone(engine: Engine, prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
    return generate(engine, [prompt], params)[0]


def _drain(sched: Scheduler) -> None:
    for _ in range(500):
        if not sched.has_work():
            return
        sched.step()
    raise AssertionError("the scheduler still has work after 500 steps")


PEERS = [[5, 6, 7, 8, 9], list(range(20, 33)), [40, 41]]
OFFENDER = [100, 101, 102, 103, 104, 105, 106]


def inject_fault(sched: Scheduler, stage: str, phase: str, offender_prompt: list[int]) -> list[int]:
    """Makes `stage` raise Fault in the first `phase` step that holds the offender; returns a list that
    gets one entry when it has."""
    engine, hit = sched.engine, []

    def offending(reqs) -> bool:
        return not hit and any(r.input_ids[: len(offender_prompt)] == offender_prompt for r in reqs)

    def wrap(obj, name, before=True, batch_of=lambda *a: a[0]):
        original = getattr(obj, name)

        def patched(*args, **kwargs):
            batch = batch_of(*args)
            if batch.phase == phase and offending(batch.reqs):
                if not before:
                    original(*args, **kwargs)
                hit.append(name)
                raise Fault(FAULT)
            return original(*args, **kwargs)

        setattr(obj, name, patched)

    if stage == "prepare":
        original = sched.prep.prefill if phase == "prefill" else sched.prep.decode
        name = "prefill" if phase == "prefill" else "decode"

        def prepare(reqs, *args, **kwargs):
            if offending(reqs):
                hit.append(name)
                raise Fault(FAULT)
            return original(reqs, *args, **kwargs)

        setattr(sched.prep, name, prepare)
    elif stage == "sampling_args":
        wrap(sched.prep, "sampling_args")
    elif stage == "model":  # the model ran (tokens marked cached), no token came out
        wrap(engine.forward_path, "run", before=False)
    elif stage == "sampler":
        current = []
        forward = engine.forward_path.run

        def remember(batch, *args, **kwargs):
            current[:] = [batch]
            return forward(batch, *args, **kwargs)

        engine.forward_path.run = remember
        wrap(engine.sampler, "sample", batch_of=lambda *a: current[0])
    elif stage == "device":  # the forward "fails on the device": waiting for its tokens raises

        class FailingEvent:
            def synchronize(self):
                raise Fault(FAULT)

        original_forward = engine.forward_batch

        def forward_batch(batch, args):
            out = original_forward(batch, args)
            if batch.phase == phase and offending(batch.reqs):
                hit.append("device")
                return ForwardOutput(out.next_tokens_gpu, out.next_tokens_cpu, FailingEvent())
            return out

        engine.forward_batch = forward_batch
    else:
        raise AssertionError(stage)
    return hit


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("phase", ["prefill", "decode"])
@pytest.mark.parametrize("stage", ["prepare", "sampling_args", "model", "sampler", "device"])
def test_a_failing_step_finishes_its_requests_and_the_engine_goes_on(tiny_llama, stage, phase, overlap):
    engine = _engine(tiny_llama)
    sched = Scheduler(
        engine, SchedulerConfig(max_prefill_tokens=16, overlap_scheduling=overlap), eos_token_ids=[2]
    )
    expected = {tuple(p): _alone(engine, p) for p in [*PEERS, OFFENDER]}
    hit = inject_fault(sched, stage, phase, OFFENDER)
    peers = [sched.add_request(p, GREEDY) for p in PEERS]
    for _ in range(3):  # the peers are decoding when the offender arrives: its prefill step is its own
        sched.step()
    offender = sched.add_request(OFFENDER, GREEDY)
    _drain(sched)
    assert hit, "the fault was never injected"
    assert offender.finish_reason == "error" and FAULT in offender.error and "Fault" in offender.error
    for state in peers:
        if phase == "prefill":  # the offender's prefill ran alone: only it failed
            assert state.finish_reason == "length", state.error
        if state.finish_reason == "length":
            assert state.output_ids == expected[tuple(state.prompt_ids)]
        else:  # in the failed decode step with the offender
            assert state.finish_reason == "error" and FAULT in state.error
    if phase == "decode":  # the peers were decoding with the offender when that step failed
        assert all(state.finish_reason == "error" for state in peers)
    check_clean(sched)
    again = [sched.add_request(p, GREEDY) for p in [*PEERS, OFFENDER]]
    _drain(sched)
    assert [s.output_ids for s in again] == [expected[tuple(p)] for p in [*PEERS, OFFENDER]]
    check_clean(sched)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_failure_in_one_requests_output_fails_it_alone(tiny_llama, overlap):
    engine = _engine(tiny_llama)
    sched = Scheduler(
        engine, SchedulerConfig(max_prefill_tokens=64, overlap_scheduling=overlap), eos_token_ids=[2]
    )
    check_stop = sched.output.check_stop

    def failing_check_stop(state, token):
        if state.prompt_ids == OFFENDER and len(state.output_ids) == 3:
            raise Fault(FAULT)
        return check_stop(state, token)

    sched.output.check_stop = failing_check_stop
    states = [sched.add_request(p, GREEDY) for p in [*PEERS, OFFENDER]]  # all in the same batches
    _drain(sched)
    *peers, offender = states
    assert offender.finish_reason == "error" and "processing its token" in offender.error
    assert offender.output_ids[:2] == _alone(engine, OFFENDER)[:2]
    assert [s.finish_reason for s in peers] == ["length"] * len(PEERS)
    assert [s.output_ids for s in peers] == [_alone(engine, p) for p in PEERS]
    check_clean(sched)


def test_a_failure_at_admission_fails_that_request_alone(tiny_llama):
    engine = _engine(tiny_llama)
    sched = Scheduler(engine, eos_token_ids=[2])
    add_request = sched.prep.add_request

    def failing_add(prompt, params, *rest):
        if prompt == OFFENDER:
            raise Fault(FAULT)
        return add_request(prompt, params, *rest)

    sched.prep.add_request = failing_add
    states = [sched.add_request(p, GREEDY) for p in [PEERS[0], OFFENDER, PEERS[1]]]
    _drain(sched)
    assert [s.finish_reason for s in states] == ["length", "error", "length"]
    assert "admitting it" in states[1].error and states[1].output_ids == []
    check_clean(sched)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_request_that_can_no_longer_be_scheduled_is_finished_not_kept(tiny_llama, overlap):
    """A bug that leaves a request running past its max_tokens (here: a stop check that never says
    "length") must not keep has_work() true for ever: the scheduler finishes the request with an error."""
    engine = _engine(tiny_llama)
    sched = Scheduler(engine, SchedulerConfig(overlap_scheduling=overlap), eos_token_ids=[2])
    check_stop = sched.output.check_stop
    sched.output.check_stop = lambda state, token: (check_stop(state, token) == "stop" or None) and "stop"
    state = sched.add_request(PEERS[0], GREEDY)
    _drain(sched)
    assert state.finish_reason == "error" and "could not be scheduled" in state.error
    assert state.output_ids == _alone(engine, PEERS[0])
    check_clean(sched)


def test_a_fatal_engine_failure_finishes_the_step_and_is_raised(tiny_llama):
    """After a failure no step can survive (here: the engine shut down under the scheduler), the step's
    requests finish with "error" and step() raises, so that a caller stops instead of failing every
    request one by one."""
    engine = _engine(tiny_llama)
    sched = Scheduler(engine, SchedulerConfig(overlap_scheduling=False), eos_token_ids=[2])
    states = [sched.add_request(p, GREEDY) for p in PEERS]
    sched.step()
    engine.shutdown()
    with pytest.raises(FatalEngineError, match="shut down"):
        sched.step()
    assert all(s.finish_reason == "error" and "shut down" in s.error for s in states)
    check_clean(sched)


# -- through the LLM -------------------------------------------------------------------------------


def test_a_request_failing_inside_the_llm_does_not_poison_it(tiny_text_llm):
    llm = tiny_text_llm
    before = llm.generate(["Hello there"], GREEDY)[0].token_ids
    sample = llm.engine.sampler.sample
    calls = []

    def failing_sample(logits, args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise Fault(FAULT)
        return sample(logits, args, **kw)

    llm.engine.sampler.sample = failing_sample
    try:
        [out] = llm.generate(["Hello there"], GREEDY)
    finally:
        llm.engine.sampler.sample = sample
    assert out.finish_reason == "error" and FAULT in out.error and len(out.token_ids) <= 1
    llm_clean(llm)
    assert llm.generate(["Hello there"], GREEDY)[0].token_ids == before
    llm.engine.sampler.sample = lambda logits, args, **kw: (_ for _ in ()).throw(Fault(FAULT))
    try:
        stream = llm.stream("Hello there", GREEDY)
        with pytest.raises(RequestError, match=FAULT):
            list(stream)
    finally:
        llm.engine.sampler.sample = sample
    assert stream.finish_reason == "error"
    llm_clean(llm)


def test_an_interrupted_generate_aborts_its_requests_between_steps(tiny_text_llm):
    """Ctrl-C (a real SIGINT) 4 steps into a long call: the step it arrived in completes, the call
    raises KeyboardInterrupt, and none of its requests stays queued or holds a page."""
    llm = tiny_text_llm
    expected = llm.generate(["Hello there"], GREEDY)[0].token_ids
    step, calls, completed = llm.scheduler.step, [], []

    def step_with_ctrl_c():
        main = threading.current_thread() is threading.main_thread()
        calls.append(main)
        if len(calls) == 4:
            # to this (the main) thread, handled before raise_signal returns (os.kill(os.getpid()) is
            # process-directed: POSIX lets any thread without it blocked take it, at its own pace)
            signal.raise_signal(signal.SIGINT)
        updates = step()
        completed.append(1)
        return updates

    # the LLM holds a Ctrl-C between steps only where Python's own handler is installed (a handler of
    # the application's is left alone): the test's precondition, whatever ran before it in the process
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    llm.scheduler.step = step_with_ctrl_c
    try:
        llm.generate([[i + 3] * (i % 7 + 1) for i in range(60)], SamplingParams(max_tokens=200))
    except KeyboardInterrupt:
        interrupted = True
    else:
        interrupted = False
    finally:
        del llm.scheduler.step
        after = signal.signal(signal.SIGINT, before)
    # on failure, what happened instead: the steps run (True: on the main thread) and the handler found
    assert interrupted, f"generate returned after steps {calls}; SIGINT handler before the test: {before!r}"
    assert len(calls) == len(completed) == 4  # the signal waited for its step to end
    assert after is signal.default_int_handler  # the LLM put Python's handler back
    llm_clean(llm)
    assert llm.generate(["Hello there"], GREEDY)[0].token_ids == expected
    llm_clean(llm)


def test_an_exception_in_the_loop_aborts_the_calls_requests(tiny_text_llm):
    llm = tiny_text_llm
    step, calls = llm.scheduler.step, []

    def broken_step():
        calls.append(1)
        if len(calls) == 3:
            raise Fault(FAULT)  # outside the step's own isolation: a bug in the loop itself
        return step()

    llm.scheduler.step = broken_step
    try:
        with pytest.raises(Fault):
            llm.generate([[5, 6, 7]] * 20, SamplingParams(max_tokens=50))
    finally:
        del llm.scheduler.step
    llm_clean(llm)


@pytest.mark.parametrize("how", ["close", "with", "break", "drop after two", "never iterated"])
def test_a_closed_or_dropped_stream_frees_its_request_at_once(tiny_text_llm, how):
    llm = tiny_text_llm
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    if how == "close":
        stream = llm.stream("Once upon a time", params)
        next(stream)
        stream.close()
        assert stream.finish_reason == "abort"
    elif how == "with":
        with llm.stream("Once upon a time", params) as stream:
            next(stream)
        assert stream.finish_reason == "abort"
    elif how == "break":
        for _ in llm.stream("Once upon a time", params):
            break
    elif how == "drop after two":
        stream = llm.stream("Once upon a time", params)
        next(stream), next(stream)
        del stream
    else:
        llm.stream("Once upon a time", params)  # the Stream object is dropped at once
    llm_clean(llm)  # no later call needed


def test_a_stream_dropped_during_a_step_is_aborted_by_the_next_one(tiny_text_llm):
    llm = tiny_text_llm
    stream = llm.stream("Once upon a time", SamplingParams(max_tokens=100, ignore_eos=True))
    state = stream.state
    with llm._lock:  # as when garbage collection runs inside a step
        del stream
        assert list(llm._abandoned) == [state]
    llm.generate(["Hi"], GREEDY)
    assert state.finish_reason == "abort"
    llm_clean(llm)


def test_threads_share_one_llm(tiny_text_llm):
    """Four threads generate at once (their requests share the batches) while a fifth streams: each
    gets what it gets alone, and nothing is left behind."""
    llm = tiny_text_llm
    prompts = [[[t * 10 + i + 3] * (i + 1) for i in range(5)] for t in range(4)]
    expected = [[o.token_ids for o in llm.generate(p, GREEDY)] for p in prompts]
    text = "".join(llm.stream("Once upon a time", GREEDY))
    results, errors = {}, []
    barrier = threading.Barrier(5)

    def run(t):
        try:
            barrier.wait(timeout=30)
            if t == 4:
                results[t] = "".join(llm.stream("Once upon a time", GREEDY))
            else:
                results[t] = [o.token_ids for o in llm.generate(prompts[t], GREEDY)]
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(t,)) for t in range(5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads) and not errors
    assert [results[t] for t in range(4)] == expected and results[4] == text
    llm_clean(llm)


def test_shutdown_aborts_other_threads_calls_and_later_calls_say_so(tiny_model):
    folder = tiny_model("llama", tokenizer=True)
    llm = LLM(str(folder), device="cpu", dtype="float32", max_running_req=4)
    step, started = llm.scheduler.step, threading.Event()

    def slow_step():
        started.set()
        time.sleep(0.01)  # 400 steps take 4 s or more: the shutdown always comes before the last one
        return step()

    llm.scheduler.step = slow_step
    outputs = []
    worker = threading.Thread(
        target=lambda: outputs.extend(llm.generate([[5, 6]] * 8, SamplingParams(max_tokens=400)))
    )
    worker.start()
    assert started.wait(timeout=60)
    llm.shutdown()
    worker.join(timeout=60)
    assert not worker.is_alive() and len(outputs) == 8
    assert {o.finish_reason for o in outputs} <= {"abort", "length"} and "abort" in {
        o.finish_reason for o in outputs
    }
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(["Hi"])
    with pytest.raises(RuntimeError, match="shut down"):
        llm.stream("Hi")
    llm.shutdown()  # idempotent
