"""Speculative decoding (docs/speculative.md) on the CPU, float32, the default model: the outputs with
'ngram' are those without speculation, token for token, greedy and seeded; what it holds returns at
rest and the prefix cache never sees a rejected token."""

from __future__ import annotations

import math

import pytest
from conftest import llm_clean

from minisgl import metrics
from minisgl.core import SamplingParams
from minisgl.llm import LLM

K = 4
PARAGRAPH = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based ink and a wooden press adapted from wine making. Books that once took "
    "months to copy by hand could now be produced in days, and the price of knowledge fell across Europe."
)
# a KV pool of 0.5 GiB (11,000 tokens of the default model) holds every test's requests, and is made
# at start in a fraction of the default's time (10% of the RAM)
COMMON = dict(device="cpu", dtype="float32", max_running_req=8, page_size=4, cpu_kv_budget_gib=0.5)


@pytest.fixture(scope="module")
def pair(smollm2_path):
    """The same model without and with n-gram speculation. Without, it takes 16 requests at a time: the
    references of a test run as one batch (`reference`)."""
    with (
        LLM(str(smollm2_path), **dict(COMMON, max_running_req=16)) as off,
        LLM(str(smollm2_path), speculative_method="ngram", speculative_num_tokens=K, **COMMON) as on,
    ):
        yield off, on


@pytest.fixture(scope="module")
def reference(pair):
    """`reference(prompts, params)`: the outputs without speculation (`pair`'s first LLM), `params` one
    for all prompts or one per prompt. Each request (prompt and parameters) runs once a module: those
    not run before go as one batch, so that a test's references cost the steps of its longest (on the
    CPU a decode step of 12 rows takes about 1.5x one of 3; a request's greedy or seeded tokens do not
    depend on the batch it runs in)."""
    off, memo = pair[0], {}

    def run(prompts: list[list[int]], params) -> list:
        params = params if isinstance(params, list) else [params] * len(prompts)
        keys = [(tuple(prompt), repr(p)) for prompt, p in zip(prompts, params)]
        new = {key: (prompt, p) for key, prompt, p in zip(keys, prompts, params) if key not in memo}
        if new:
            off.scheduler.clear_prefix_cache()  # a reference does not depend on the tests before it
            outs = off.generate([prompt for prompt, _ in new.values()], [p for _, p in new.values()])
            memo.update(zip(new, outs))
        return [memo[key] for key in keys]

    return run


def _chat(llm: LLM, text: str) -> list[int]:
    return llm.chat_prompt([{"role": "user", "content": text}])


def _prompts(llm: LLM) -> list[list[int]]:
    """Prompts whose answers copy them (so drafts are accepted), and others (so some are rejected)."""
    return [
        _chat(llm, "Repeat this text exactly:\n\n" + PARAGRAPH),
        _chat(llm, "Repeat this list exactly: apple, banana, cherry, apple, banana, cherry, apple, banana"),
        _chat(llm, "Write the numbers from 1 to 40 separated by commas."),
        _chat(llm, "What is the capital of France? Answer in one sentence."),
        llm.tokenizer(PARAGRAPH + " " + PARAGRAPH[:60])["input_ids"],
        [5, 6, 7, 8, 5, 6, 7, 8, 5, 6],
    ]


def _same(a, b) -> None:
    """Two runs' outputs agree: tokens, text, finish reason; log probabilities within float tolerance."""
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.text for o in a] == [o.text for o in b]
    assert [o.finish_reason for o in a] == [o.finish_reason for o in b]
    for x, y in zip(a, b):
        assert (x.logprobs is None) == (y.logprobs is None)
        for p, q in zip(x.logprobs or [], y.logprobs or []):
            assert p.token_id == q.token_id and math.isclose(p.logprob, q.logprob, rel_tol=1e-4, abs_tol=1e-4)
            assert [t for t, _ in p.top] == [t for t, _ in q.top]


def test_greedy_ngram_is_token_exact_and_accepts_drafts(pair, reference):
    off, on = pair
    spec = on.scheduler.spec
    drafted, accepted = spec.drafted, spec.accepted
    prompts = _prompts(off)
    params = [
        SamplingParams(max_tokens=90),
        SamplingParams(max_tokens=40, logprobs=2),
        SamplingParams(max_tokens=60, stop=["567"], min_tokens=25),  # "1234567890" repeated
        SamplingParams(max_tokens=30, stop_token_ids=[13]),
        SamplingParams(max_tokens=50, ignore_eos=True),
        SamplingParams(max_tokens=25, ignore_eos=True, min_tokens=10),
    ]
    pipelined = spec.pipelined_steps
    want, got = reference(prompts, params), on.generate(prompts, params)
    _same(want, got)
    assert got[2].finish_reason == "stop" and got[2].text.endswith("1234")  # a stop string inside a run
    assert spec.pipelined_steps > pipelined  # once min_tokens is behind every request (see below)
    assert spec.drafted > drafted and spec.accepted - accepted >= 20  # the copy prompts were drafted
    assert spec.accepted - accepted < spec.drafted - drafted  # and some drafts were rejected
    for llm in pair:
        llm_clean(llm)


def test_one_copying_request_overlaps_its_verify_steps(pair, reference, smollm2_path):
    """One request that copies its prompt: most verify steps are launched before the one before them is
    read (on the guess that it accepts every draft), and the output is that of a run without
    speculation; without overlap scheduling none is, and the output is the same. A mixed batch
    overlaps too: requests without drafts ride along with one row."""
    off, on = pair
    prompts, mixed = _prompts(off), SamplingParams(max_tokens=40, ignore_eos=True)
    prompt, params = prompts[0], SamplingParams(max_tokens=60, ignore_eos=True)
    want, *want_mixed = reference([prompt, *prompts], [params] + [mixed] * len(prompts))
    spec = on.scheduler.spec
    steps, pipelined, missed = spec.verify_steps, spec.pipelined_steps, spec.missed_guesses
    _same([want], on.generate([prompt], params))
    assert spec.pipelined_steps - pipelined >= (spec.verify_steps - steps) // 2 > 0
    # some guesses failed: those steps were moved back on the device, and the tokens are still exact
    assert spec.missed_guesses > missed
    llm_clean(on)
    pipelined = spec.pipelined_steps
    _same(want_mixed, on.generate(prompts, mixed))
    assert spec.pipelined_steps > pipelined
    llm_clean(on)
    with LLM(str(smollm2_path), speculative_method="ngram", overlap_scheduling=False, **COMMON) as plain:
        _same([want], plain.generate([prompt], params))
        assert plain.scheduler.spec.verify_steps > 0 and plain.scheduler.spec.pipelined_steps == 0
        llm_clean(plain)


@pytest.mark.parametrize("max_tokens", range(1, K + 3))
def test_max_tokens_is_never_exceeded(pair, reference, max_tokens):
    off, on = pair
    prompts = _prompts(off)[:2]
    cases = [SamplingParams(max_tokens=m, ignore_eos=True) for m in range(1, K + 3)]
    reference(prompts * len(cases), [case for case in cases for _ in prompts])  # every case's, at once
    params = cases[max_tokens - 1]
    want, got = reference(prompts, params), on.generate(prompts, params)
    _same(want, got)
    assert all(len(o.token_ids) == max_tokens for o in got)
    llm_clean(on)


def _each(reference, prompts: list[list[int]], cases: list[SamplingParams]) -> list[list]:
    """The references of `prompts` under each of `cases` (one batch), a list per case."""
    want = reference(prompts * len(cases), [case for case in cases for _ in prompts])
    return [want[i : i + len(prompts)] for i in range(0, len(want), len(prompts))]


def test_seeded_sampling_is_token_identical(pair, reference):
    """The draft is one-hot: each verified position draws the target's token with the (seed, position)
    uniform a decode step there would use, so seeded requests give the same tokens as without."""
    off, on = pair
    prompts = _prompts(off)[:3]
    cases = [
        SamplingParams(temperature=0.7, seed=1, max_tokens=32),
        SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=2, max_tokens=32),
        SamplingParams(temperature=0.5, min_p=0.1, seed=3, max_tokens=32, logit_bias={13: 2.0}),
    ]
    spec = on.scheduler.spec
    for params, want in zip(cases, _each(reference, prompts, cases)):
        drafted, accepted = spec.drafted, spec.accepted
        _same(want, on.generate(prompts, params))
        assert spec.drafted - drafted > spec.accepted - accepted > 0  # drafts accepted and rejected
    llm_clean(on)


def test_penalties_count_the_drafts_before_each_row(pair, reference):
    """Penalised requests draft too: each verified row's penalties count the drafts before it, and only
    the accepted tokens enter the counts (a wrong count changes the next tokens)."""
    off, on = pair
    prompts = _prompts(off)[:3] + [_prompts(off)[5]]
    spec = on.scheduler.spec
    drafted, accepted = spec.drafted, spec.accepted
    cases = [
        SamplingParams(max_tokens=36, frequency_penalty=0.4),
        SamplingParams(max_tokens=36, presence_penalty=0.6, repetition_penalty=1.2, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=4, max_tokens=30, frequency_penalty=0.5, repetition_penalty=1.1),
    ]
    for params, want in zip(cases, _each(reference, prompts, cases)):
        _same(want, on.generate(prompts, params))
    # drafts were verified and some accepted, some rejected (the penalties push away from copies)
    assert spec.drafted - drafted > spec.accepted - accepted > 10
    llm_clean(on)


def test_structured_output_drafts_under_its_grammar(pair, reference):
    """JSON under a schema: each verified row is masked by the grammar after the drafts before it, so
    the outputs are those without speculation, valid, and the repeated keys are drafted and accepted."""
    import json

    import jsonschema

    off, on = pair
    schema = {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
            "required": ["name", "age"],
            "additionalProperties": False,
        },
        "minItems": 4,
        "maxItems": 4,
    }
    prompts = [
        _chat(off, "List four people as JSON objects with a name and an age."),
        _chat(off, "Give me the names and ages of four friends in JSON."),
    ]
    params = [
        SamplingParams(max_tokens=120, json_schema=schema),
        SamplingParams(max_tokens=120, regex=r"(ab|cd){1,30}"),
    ]
    spec = on.scheduler.spec
    accepted = spec.accepted
    want, got = reference(prompts, params), on.generate(prompts, params)
    _same(want, got)
    jsonschema.validate(json.loads(got[0].text), schema)
    assert spec.accepted - accepted >= 10
    llm_clean(on)


def test_streaming_gives_the_same_text_in_fewer_chunks(pair, reference):
    off, on = pair
    prompt = _prompts(off)[0]
    params = SamplingParams(max_tokens=60)
    want = reference([prompt], params)[0]
    chunks = list(on.stream(prompt, params))
    assert "".join(chunks) == want.text
    assert len([c for c in chunks if c]) < len(want.token_ids)  # several tokens arrived per step
    llm_clean(on)


def test_an_abort_between_verify_steps_frees_everything(pair, reference):
    """A stream closed after a few chunks (verify steps) aborts its request: its pages, drafts' pages
    included, and its slot are free, and the next request decodes as without speculation."""
    off, on = pair
    prompt = _prompts(off)[0]
    stream = on.stream(prompt, SamplingParams(max_tokens=80))
    first = [next(stream) for _ in range(3)]
    stream.close()
    assert first and on.scheduler.spec.verify_steps > 0
    llm_clean(on)
    params = SamplingParams(max_tokens=30)
    _same(reference([prompt], params), on.generate([prompt], params))
    llm_clean(on)


def test_prefix_cache_holds_only_accepted_tokens(pair, reference):
    """A second round whose prompts are the first round's prompts and outputs hits the pages the first
    round's decode filled (speculated): outputs still match, and every cached run of tokens is a
    prefix of some request's prompt and output."""
    off, on = pair
    prompts = _prompts(off)[:3]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    on.scheduler.clear_prefix_cache()
    first = on.generate(prompts, params)
    _same(reference(prompts, params), first)
    sequences = [p + o.token_ids for p, o in zip(prompts, first)]
    cache = on.scheduler.prefix_cache
    for node in cache._nodes():
        path, n = [], node
        while n is not None and n.tokens:
            path[:0] = n.tokens
            n = n.parent
        assert any(seq[: len(path)] == list(path) for seq in sequences)
    hits = on.scheduler.prefix_cached_tokens
    second = [seq + [13] for seq in sequences]
    _same(reference(second, params), on.generate(second, params))
    assert on.scheduler.prefix_cached_tokens - hits > sum(map(len, prompts))  # output pages were hit
    llm_clean(on)


def test_preemption_keeps_outputs(smollm2_path, reference):
    """A pool too small for every request at once: requests are preempted and recomputed mid-run
    (their drafts' pages included) and the outputs are those of a run without speculation (and without
    preemption: `reference`)."""
    small = dict(COMMON, num_page_override=48)
    prompts = [[5 + i, 6, 7, 8, 5 + i, 6, 7, 8, 5 + i, 6] * 2 for i in range(6)]
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    with LLM(str(smollm2_path), speculative_method="ngram", **small) as llm:
        got = llm.generate(prompts, params)
        assert llm.scheduler.preemptions > 0 and llm.scheduler.spec.accepted > 0
        llm_clean(llm)
    _same(reference(prompts, params), got)


def test_counters_and_request_acceptance(pair):
    _, on = pair
    labels = {"model_name": on.model_name}

    def sample(name: str) -> float:
        return metrics.REGISTRY.get_sample_value(name, labels) or 0.0

    before = sample("minisgl_spec_draft_tokens_total"), sample("minisgl_spec_accepted_tokens_total")
    steps = sample("minisgl_spec_accepted_per_verify_count")
    state = on.scheduler.add_request(_prompts(on)[0], SamplingParams(max_tokens=40))
    while not state.finished:
        on.scheduler.step()
    assert state.spec_drafted > 0 and 0 < state.spec_accepted <= state.spec_drafted
    assert sample("minisgl_spec_draft_tokens_total") - before[0] == state.spec_drafted
    assert sample("minisgl_spec_accepted_tokens_total") - before[1] == state.spec_accepted
    assert sample("minisgl_spec_accepted_per_verify_count") > steps
    llm_clean(on)


def test_settings_that_make_no_sense_are_refused(smollm2_path):
    with pytest.raises(ValueError, match="speculative_method='draft' needs speculative_draft_model"):
        LLM(str(smollm2_path), device="cpu", speculative_method="draft")
    with pytest.raises(ValueError, match="speculative_num_tokens=0"):
        LLM(str(smollm2_path), device="cpu", speculative_method="ngram", speculative_num_tokens=0)
    with pytest.raises(ValueError, match="speculative_method='eagle' is not valid"):
        LLM(str(smollm2_path), device="cpu", speculative_method="eagle")
    with pytest.raises(ValueError, match="not supported under tensor parallelism"):
        LLM(str(smollm2_path), device="cpu", speculative_method="ngram", tp_size=2)


def test_server_speculates_over_http(pair, reference, tmp_path):
    """`minisgl-run serve --speculative-method ngram`: chat completions (whole, streamed, n=2) answer
    what the model without speculation answers; the counters and the request trace show the drafts."""
    import json

    import openai
    from test_server import Server

    off, _ = pair
    trace = tmp_path / "trace.jsonl"
    srv = Server(
        "--speculative-method", "ngram", "--page-size", "4", "--request-trace", str(trace),
        "--cpu-kv-budget-gib", "0.5",
    )  # fmt: skip
    try:
        client = openai.OpenAI(base_url=srv.url, api_key="unused", timeout=120, max_retries=0)
        ask = [{"role": "user", "content": "Repeat this text exactly:\n\n" + PARAGRAPH}]
        greedy, seeded = SamplingParams(max_tokens=40), SamplingParams(max_tokens=40, temperature=0.8, seed=7)
        want, sampled = reference([off.chat_prompt(ask)] * 2, [greedy, seeded])
        ask_for = dict(model="smollm2-135m-instruct", messages=ask, max_tokens=40)
        whole = client.chat.completions.create(**ask_for, n=2, temperature=0)
        assert [c.message.content for c in whole.choices] == [want.text] * 2
        assert whole.usage.completion_tokens == 2 * len(want.token_ids)
        stream = client.chat.completions.create(**ask_for, stream=True, temperature=0.8, seed=7)
        parts = [c.choices[0].delta.content or "" for c in stream if c.choices]
        assert "".join(parts) == sampled.text
        values = srv.metrics()
        drafted, accepted = (
            values["minisgl_spec_draft_tokens_total"],
            values["minisgl_spec_accepted_tokens_total"],
        )
        assert 0 < accepted <= drafted
        assert values["minisgl_spec_accepted_per_verify_count"] > 0
    finally:
        assert srv.stop() == 0, srv.output()
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    assert len(records) == 2 and records[0]["n"] == 2
    assert sum(r["spec"]["drafted"] for r in records) == drafted
    assert sum(r["spec"]["accepted"] for r in records) == accepted


@pytest.fixture(scope="module")
def draft_llm(smollm2_path):
    """The default model drafting for itself (the draft's own KV pool, at the target's page ids)."""
    with LLM(
        str(smollm2_path), speculative_method="draft", speculative_draft_model="smollm2-135m", **COMMON
    ) as llm:
        yield llm


def test_draft_model_greedy_is_token_exact(pair, reference, draft_llm):
    off, _ = pair
    spec = draft_llm.scheduler.spec
    prompts = _prompts(off)
    params = [SamplingParams(max_tokens=m, ignore_eos=m % 2 == 0) for m in (40, 1, 2, 5, 6, 33)]
    _same(reference(prompts, params), draft_llm.generate(prompts, params))
    # a model drafting for itself proposes its own greedy tokens: nearly all accepted
    assert spec.drafted > 50 and spec.accepted >= 0.9 * spec.drafted
    llm_clean(draft_llm)


def test_draft_model_sampling_keeps_the_distribution(pair, reference, draft_llm):
    """Sampled requests over many seeds: every request's tokens after the first are those without
    speculation (each verified position draws the target's token with the decode step's (seed,
    position) uniform and the one-hot draft is accepted while it equals it), so the distribution of
    those tokens is the target's exactly: the test's bound on the difference between the two
    empirical distributions is zero, over 48 seeds and three parameter sets."""
    off, _ = pair
    spec = draft_llm.scheduler.spec
    accepted = spec.accepted
    prompt = _prompts(off)[2]
    cases = [
        [SamplingParams(temperature=1.0, seed=s, max_tokens=12, **extra) for s in range(16)]
        for extra in (dict(), dict(top_p=0.8), dict(top_k=5, min_p=0.05))
    ]
    wants = reference([prompt] * 48, sum(cases, []))  # the three sets' references in one call
    for i, params in enumerate(cases):
        want = wants[16 * i : 16 * (i + 1)]
        got = draft_llm.generate([prompt] * 16, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert len({tuple(o.token_ids) for o in got}) > 1  # the seeds made different outputs
    assert spec.accepted > accepted
    llm_clean(draft_llm)


def test_the_policy_backs_off_and_skips_large_batches():
    """A request that proposes nothing (or has every draft rejected) sits out 1, 3, 7, 15, then 16
    decode steps between verify attempts; an accepted draft resets it; a batch above the policy's size
    (k = 4 on the CPU: 6 requests) never speculates; nor does a request short of min_tokens."""
    from types import SimpleNamespace

    from minisgl.scheduler import SchedulerConfig
    from minisgl.scheduler.speculative import MAX_BACKOFF, Speculator, max_verify_batch

    spec = Speculator(
        SchedulerConfig(speculative_method="ngram", speculative_num_tokens=K), device_type="cpu"
    )
    assert spec.max_batch == max_verify_batch("cpu", K) == 32 // (K + 1)

    def request(**params):
        fields = dict(spec_wait=0, spec_backoff=0, spec_drafted=0, spec_accepted=0, num_launched=5, req=None)
        return SimpleNamespace(params=SamplingParams(max_tokens=100, **params), **fields)

    state = request()
    attempts = []
    for step in range(60):
        if spec.wanted([state]):
            attempts.append(step)
            spec.verified(state, K, 0, 0)  # proposed nothing
    assert attempts == [0, 2, 6, 14, 30, 47] and state.spec_backoff == MAX_BACKOFF
    spec.verified(state, K, 3, 2)  # drafts accepted: due again at once
    assert state.spec_wait == 0 and spec.wanted([state])
    assert not spec.wanted([request() for _ in range(spec.max_batch + 1)])
    assert not spec.wanted([request(min_tokens=10)]) and spec.wanted([request(min_tokens=5)])


def test_the_spec_benchmark_times_a_verify_step_and_its_parts(pair, monkeypatch) -> None:
    """`perf.gpu.spec`'s `StepTimes` wraps the scheduler's parts by name (the speculator's proposal, the
    batch's preparation, the verify forward, the pipeline's read): each is timed in the verify steps of a
    request whose drafts are accepted, so a renamed part fails here, not on the GPU machine. (The
    wrappers are attributes of the shared LLM's objects: `monkeypatch` removes them after the test.)"""
    from perf.gpu.spec import StepTimes

    _, on = pair
    sched = on.scheduler
    for owner, name in [(sched, "step"), *((getattr(sched, owner), name) for owner, name in StepTimes.PARTS)]:
        monkeypatch.setattr(owner, name, getattr(owner, name))
    times = StepTimes(on)
    on.generate([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]], SamplingParams(max_tokens=24, ignore_eos=True))
    assert times.steps["verify"] and times.steps["plain"]
    for part in ("propose", "prefill", "forward_verify", "read"):
        assert times.parts[part] > 0, part
    llm_clean(on)
