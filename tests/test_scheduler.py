"""Scheduler invariants: random arrivals, tiny KV pools, chunked prefill, fairness, stop conditions."""

import dataclasses
import random
import time

import pytest
import torch
import transformers
from conftest import check_clean
from hypothesis import given, settings
from hypothesis import strategies as st

from minisgl.core import SamplingParams
from minisgl.engine import Engine, EngineConfig
from minisgl.llm import LLM
from minisgl.scheduler import IncrementalDetokenizer, Scheduler, SchedulerConfig, StepRecord, generate
from minisgl.scheduler.detokenizer import decoder


@pytest.fixture(scope="module")
def tiny_llama(tiny_model):
    return tiny_model("llama")


def _engine(folder, **kw) -> Engine:
    return Engine(EngineConfig(model_path=str(folder), dtype=torch.float32, device="cpu", **kw))


def _alone(engine: Engine, prompt: list[int], max_tokens: int) -> list[int]:
    return generate(engine, [prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True))[0]


def _check_drained(sched: Scheduler) -> None:
    assert not sched.has_work()
    check_clean(sched)


def _drain(sched: Scheduler) -> None:
    while sched.has_work():
        sched.step()


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_random_arrivals_finish_exactly_and_match_single_runs(tiny_llama, seed, overlap):
    rng = random.Random(seed)
    engine = _engine(tiny_llama, page_size=4, max_running_req=6, num_page_override=60)
    sched = Scheduler(
        engine, SchedulerConfig(max_prefill_tokens=24, overlap_scheduling=overlap), eos_token_ids=[2]
    )
    specs = [
        ([rng.randrange(3, 320) for _ in range(rng.randint(1, 60))], rng.randint(1, 20)) for _ in range(14)
    ]
    states, pending, steps = [], list(specs), 0
    while pending or sched.has_work():
        for _ in range(rng.choice([0, 0, 1, 2])):  # requests arrive between steps
            if pending:
                prompt, n = pending.pop(0)
                states.append(sched.add_request(prompt, SamplingParams(max_tokens=n, ignore_eos=True)))
        sched.step()
        assert sched.prep.pages.num_used <= engine.num_pages and sched.held_pages <= engine.num_pages
        steps += 1
        assert steps < 2000
    _check_drained(sched)
    for state, (prompt, n) in zip(states, specs):
        assert state.finish_reason == "length" and len(state.output_ids) == n
        assert state.output_ids == _alone(engine, prompt, n)


@pytest.mark.parametrize("overlap", [False, True])
def test_tiny_kv_pool_admission(tiny_llama, overlap):
    """12 pages of 4 tokens: requests needing 8-11 pages each must take turns; nothing is lost."""
    engine = _engine(tiny_llama, page_size=4, num_page_override=12, max_running_req=8)
    sched = Scheduler(engine, SchedulerConfig(max_prefill_tokens=16, overlap_scheduling=overlap))
    specs = [(list(range(3 + i, 30 + i)), 10 + i) for i in range(6)]  # 27 + 10..15 tokens: 10..11 pages
    states = [sched.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p, n in specs]
    max_running, max_waiting = 0, 0
    while sched.has_work():
        sched.step()
        max_running, max_waiting = max(max_running, len(sched.running)), max(max_waiting, len(sched.waiting))
    assert max_running == 1 and max_waiting == 5
    _check_drained(sched)
    for state, (prompt, n) in zip(states, specs):
        assert state.output_ids == _alone(engine, prompt, n)
    with pytest.raises(ValueError, match="exceeds max_seq_len=48"):  # 12 pages x 4: more can never fit
        sched.add_request(list(range(3, 43)), SamplingParams(max_tokens=10))
    assert not sched.has_work()


@pytest.mark.parametrize("overlap", [False, True])
def test_prefill_is_chunked_and_decodes_are_not_starved(tiny_llama, overlap):
    engine = _engine(tiny_llama, page_size=8)
    sched = Scheduler(
        engine, SchedulerConfig(max_prefill_tokens=16, overlap_scheduling=overlap), record_steps=100
    )
    short = sched.add_request([5, 6, 7], SamplingParams(max_tokens=30, ignore_eos=True))
    sched.step()  # prefill of the short request
    long_prompt = [random.Random(3).randrange(3, 320) for _ in range(100)]
    long = sched.add_request(long_prompt, SamplingParams(max_tokens=5, ignore_eos=True))
    launched_before = short.num_launched
    while not long.prefilled:
        sched.step()
    assert short.num_launched - launched_before == 7  # D P D P ... P: one decode before each chunk
    _drain(sched)
    # 100 prompt tokens in chunks of at most 16 (7 chunks), alternating with decode steps of the short
    # one, then decode steps only: the forwards in the order they ran
    steps = [(r.phase, r.batch_size, r.num_tokens) for r in sched.step_records]
    chunks = [("decode", 1, 1), ("prefill", 1, 16)] * 6 + [("decode", 1, 1), ("prefill", 1, 4)]
    assert steps[:15] == [("prefill", 1, 3)] + chunks
    assert steps[15:] == [("decode", 2, 2)] * 4 + [("decode", 1, 1)] * (30 - 8 - 4)
    assert long.output_ids == _alone(engine, long_prompt, 5)
    assert short.output_ids == _alone(engine, [5, 6, 7], 30)
    _check_drained(sched)


@pytest.mark.parametrize("overlap", [False, True])
def test_waiting_request_starts_within_two_steps(tiny_llama, overlap):
    # 5 table_idxs: 3 long requests, the new one, and the previous new one while it finishes
    engine = _engine(tiny_llama, page_size=4, max_running_req=5)
    sched = Scheduler(engine, SchedulerConfig(max_prefill_tokens=64, overlap_scheduling=overlap))
    for i in range(3):
        sched.add_request([4 + i] * 5, SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(5):
        sched.step()
    for extra_steps in range(3):
        late = sched.add_request([9, 9, 9], SamplingParams(max_tokens=3, ignore_eos=True))
        for _ in range(extra_steps):  # arrive after a prefill step as well as after a decode step
            sched.step()
        steps = 0
        while not late.prefilled:
            sched.step()
            steps += 1
        assert steps <= 2 and late.num_launched == 1  # its first token is sampled (or being sampled)
        assert len(late.output_ids) == (0 if overlap else 1)


def test_detokenizer_matches_full_decode(smollm2_path):
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_path)
    texts = ["Ünïcödé ✓ 日本語のテキスト 🚀🚀 emoji", "plain words, then\n  code(x) -> y", "ąęśćż · ½ ≠ ∞"]
    rng = random.Random(0)
    for text in texts + [None] * 5:
        ids = tokenizer(text)["input_ids"] if text else [rng.randrange(0, 49152) for _ in range(40)]
        detok, pieces = IncrementalDetokenizer(tokenizer), []
        for token in ids:
            pieces.append(detok.add(token))
        pieces.append(detok.flush())
        assert "".join(pieces) == detok.text == tokenizer.decode(ids, skip_special_tokens=True)


@pytest.fixture(scope="module")
def llm(smollm2_path):
    with LLM(device="cpu", dtype="float32", max_running_req=8) as llm:
        yield llm


@pytest.mark.slow
def test_stop_strings_across_token_boundaries(llm):
    prompt = "The capital of France is"
    full = llm.generate(prompt, SamplingParams(max_tokens=24, ignore_eos=True))[0]
    pieces = [llm.tokenizer.decode([t]) for t in full.token_ids]
    # a stop string made of the end of one token and the start of the next
    i = next(
        i
        for i in range(3, len(pieces) - 1)
        if len(pieces[i].strip()) >= 2 and len(pieces[i + 1].strip()) >= 2
    )
    stop = pieces[i][-2:] + pieces[i + 1][:2]
    cut = full.text.index(stop)
    out = llm.generate(prompt, SamplingParams(max_tokens=24, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.text == full.text[:cut]
    streamed = "".join(llm.stream(prompt, SamplingParams(max_tokens=24, stop=[stop, "zzzz"])))
    assert streamed == full.text[:cut]
    # min_tokens keeps a stop string from ending the output early
    late = llm.generate(prompt, SamplingParams(max_tokens=24, stop=[stop], min_tokens=i + 2))[0]
    assert late.text == full.text and late.finish_reason == "length"


@pytest.mark.slow
def test_eos_stop_tokens_ignore_eos_min_tokens(llm):
    chat = llm.chat_prompt([{"role": "user", "content": "What is 2+2?"}])
    out = llm.generate([chat], SamplingParams(max_tokens=64))[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == 2 and len(out.token_ids) < 64
    assert "4" in out.text and "<|im_end|>" not in out.text
    n = len(out.token_ids)
    forced = llm.generate([chat], SamplingParams(max_tokens=n + 5, ignore_eos=True))[0]
    assert forced.finish_reason == "length" and len(forced.token_ids) == n + 5
    assert forced.token_ids[: n - 1] == out.token_ids[:-1]
    longer = llm.generate([chat], SamplingParams(max_tokens=64, min_tokens=n + 3))[0]
    assert len(longer.token_ids) >= n + 3 and 2 not in longer.token_ids[: n + 3]
    stop_id = out.token_ids[3]
    early = llm.generate([chat], SamplingParams(max_tokens=64, stop_token_ids=[stop_id]))[0]
    assert early.finish_reason == "stop" and early.token_ids == out.token_ids[:4]
    assert early.text == llm.tokenizer.decode(out.token_ids[:3])
    _check_drained(llm.scheduler)


@pytest.mark.slow
def test_llm_batched_equals_one_at_a_time(llm):
    prompts = ["The capital of France is", "def add(a, b):", "Once upon a time", "1, 2, 3,"]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    together = llm.generate(prompts, params)
    assert [o.index for o in together] == [0, 1, 2, 3]
    for prompt, out in zip(prompts, together):
        assert llm.generate(prompt, params)[0].token_ids == out.token_ids
        assert out.time_to_first_token <= out.total_time
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        llm.generate(["hi", "x " * 9000], params)
    assert not llm.scheduler.has_work()  # the bad batch was refused whole


def test_overlap_gives_the_same_outputs_and_frees_everything(tiny_llama, monkeypatch):
    """Overlap scheduling reads a step's tokens one step late; outputs, stops and pages must not change."""
    engine = _engine(tiny_llama, page_size=4, max_running_req=8, num_page_override=200)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 320) for _ in range(rng.randint(2, 40))] for _ in range(8)]
    free_run = Scheduler(engine, SchedulerConfig(max_prefill_tokens=32, overlap_scheduling=False))
    probe = [free_run.add_request(p, SamplingParams(max_tokens=20, ignore_eos=True)) for p in prompts]
    _drain(free_run)
    eos, stop_id = probe[0].output_ids[4], probe[1].output_ids[6]  # tokens that do come up
    params = [
        SamplingParams(max_tokens=20),  # stops at eos
        SamplingParams(max_tokens=20, stop_token_ids=(stop_id,)),
        SamplingParams(max_tokens=20, min_tokens=8),  # eos suppressed for 8 tokens
        SamplingParams(max_tokens=20, ignore_eos=True),
        SamplingParams(max_tokens=1),
        SamplingParams(max_tokens=17, temperature=0.9, seed=7),
        SamplingParams(max_tokens=9, temperature=1.3, top_k=20, seed=8),
        SamplingParams(max_tokens=20, temperature=0.7, top_p=0.9, seed=9, stop_token_ids=(stop_id,)),
    ]
    results = {}
    for overlap in (False, True):
        sched = Scheduler(
            engine, SchedulerConfig(max_prefill_tokens=32, overlap_scheduling=overlap), eos_token_ids=[eos]
        )
        states = [sched.add_request(p, sp) for p, sp in zip(prompts, params)]
        _drain(sched)
        _check_drained(sched)
        results[overlap] = [(s.output_ids, s.finish_reason) for s in states]
    assert results[True] == results[False]
    assert results[True][0] == (probe[0].output_ids[:5], "stop")
    assert results[True][1][1] == "stop" and results[True][1][0][-1] == stop_id
    assert eos not in results[True][2][0][:8] and len(results[True][2][0]) > 8

    # the environment switch for ablation
    monkeypatch.setenv("MINISGL_OVERLAP_SCHEDULING", "0")
    with LLM(str(tiny_llama), device="cpu", dtype="float32") as llm:
        assert llm.scheduler.overlap is False
    monkeypatch.delenv("MINISGL_OVERLAP_SCHEDULING")
    with LLM(str(tiny_llama), device="cpu", dtype="float32") as llm:
        assert llm.scheduler.overlap is True


@pytest.mark.parametrize("overlap", [False, True])
def test_step_records(tiny_llama, overlap, monkeypatch):
    """Each forward leaves a StepRecord (in the order the forwards ran, the last N kept): what ran, and
    its host times split into launch, wait for the tokens and processing; off by default."""
    engine = _engine(tiny_llama, page_size=4, max_running_req=4)
    off = Scheduler(engine, SchedulerConfig(max_prefill_tokens=8, overlap_scheduling=overlap))
    off.add_request([5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True))
    _drain(off)
    assert off.record_steps == 0 and not off.step_records

    sched = Scheduler(
        engine, SchedulerConfig(max_prefill_tokens=8, overlap_scheduling=overlap), record_steps=100
    )
    # slow launches (20 ms) and slow token copies (30 ms), to see each in its own field: on a clock that
    # only they move, so each field is exactly its own wait however loaded the machine is
    forward_batch, clock = engine.forward_batch, [0.0]

    class SlowCopy:
        def synchronize(self) -> None:
            clock[0] += 0.03

    def slow_forward(batch, args):
        clock[0] += 0.02
        return forward_batch(batch, args)._replace(copy_done_event=SlowCopy())

    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    engine.forward_batch = slow_forward
    try:
        long = sched.add_request(list(range(3, 15)), SamplingParams(max_tokens=4, ignore_eos=True))
        short = sched.add_request([5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True))
        _drain(sched)
    finally:
        del engine.forward_batch
        monkeypatch.undo()
    assert len(long.output_ids) == 4 and len(short.output_ids) == 2
    records = list(sched.step_records)
    # 12 + 3 prompt tokens in chunks of 8: the long one's first chunk, then its rest with the short one
    assert [(r.phase, r.batch_size, r.num_tokens, r.num_generated) for r in records] == [
        ("prefill", 1, 8, 0),
        ("prefill", 2, 7, 2),
        ("decode", 2, 2, 2),
        ("decode", 1, 1, 1),
        ("decode", 1, 1, 1),
    ]
    for r in records:
        assert isinstance(r, StepRecord) and r.mode == "eager" and r.device_ms is None  # CPU
        assert (r.launch_s, r.wait_s, r.process_s) == (pytest.approx(0.02), pytest.approx(0.03), 0.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        records[0].phase = "decode"
    sched.record_steps = 2  # keeps the latest
    assert list(sched.step_records) == records[-2:] and sched.step_records.maxlen == 2
    with pytest.raises(ValueError, match="record_steps=-1"):
        sched.record_steps = -1


@pytest.mark.parametrize("overlap", [False, True])
def test_abort_frees_at_once_and_leaves_the_others_alone(tiny_llama, overlap):
    engine = _engine(tiny_llama, page_size=4, max_running_req=2, num_page_override=40)
    sched = Scheduler(engine, SchedulerConfig(max_prefill_tokens=64, overlap_scheduling=overlap))
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    prompts = [[5, 6, 7], list(range(8, 20)), [12, 13], [14, 15, 16]]
    keep, victim, queued, dropped = [sched.add_request(p, params) for p in prompts]
    sched.abort(dropped)  # still waiting: it just leaves the queue
    assert dropped.finish_reason == "abort" and dropped.output_ids == []
    assert list(sched.waiting) == [keep, victim, queued]
    for _ in range(4):
        sched.step()
    assert victim in sched.running and queued in sched.waiting  # two table_idxs, both taken
    kept = list(victim.output_ids)
    sched.abort(victim)
    assert victim.finish_reason == "abort" and victim.finished and victim not in sched.running
    assert sched.prep.table_idxs.num_free == 1 and sched.held_pages == keep.held_pages
    assert sched.prep.num_request_pages == sched.prep.pages_needed(keep.req.cached_len)
    sched.abort(victim)  # finished already: nothing happens
    _drain(sched)
    assert victim.output_ids == kept  # with overlap, its token in the forward in flight was dropped
    assert 0 < len(kept) < 10 and victim.finish_time is not None
    for state, prompt in ((keep, prompts[0]), (queued, prompts[2])):
        assert state.finish_reason == "length" and state.output_ids == _alone(engine, prompt, 10)
    _check_drained(sched)
    with pytest.raises(ValueError, match="not one of this scheduler's requests"):
        Scheduler(engine).abort(sched.add_request([5, 6], params))


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(0, 49151), max_size=12))
def test_decoder_equals_the_tokenizers_decode(smollm2_tokenizer, ids):
    # the backend's decode where transformers' only forwards to it; special tokens skipped either way
    assert decoder(smollm2_tokenizer)(ids) == smollm2_tokenizer.decode(ids, skip_special_tokens=True)


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_path):
    return transformers.AutoTokenizer.from_pretrained(smollm2_path)
