"""Structured output: JSON schemas, any JSON object, regexes and EBNF grammars
through xgrammar, on the real default model (SmolLM2-135M-Instruct, float32 on the CPU). Every output
is checked against what was asked: parsed and validated by `jsonschema`, matched by `re.fullmatch`, or
read by a hand-written checker; an output cut by max_tokens fails the test. Then: the mask leaves the
free requests of a mixed batch their own tokens (overlap scheduling on and off), a preempted constrained
request resumes where it stopped, EOS comes only where the grammar ends, errors name the field before
anything is queued (LLM) or in a 400 (server), and plain generation never imports xgrammar."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading

import httpx2 as httpx
import jsonschema
import openai
import pytest
import torch
from conftest import llm_clean
from test_server import MODEL

from minisgl.core import SamplingParams
from minisgl.engine.token_mask import apply_token_mask, unpack_mask
from minisgl.llm import LLM
from minisgl.scheduler.grammar import Grammars

MAX_TOKENS = 96  # each output below needs far fewer: one that hits it fails its test

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
}
SCHEMAS = {
    "person": PERSON,
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 9999},
                    "tags": {
                        "type": "array",
                        "items": {"type": "string", "maxLength": 8},
                        "minItems": 1,
                        "maxItems": 3,
                    },
                },
                "required": ["id", "tags"],
            }
        },
        "required": ["user"],
    },
    "enums": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"type": "string", "enum": ["S", "M", "L"]},
            "in_stock": {"type": "boolean"},
        },
        "required": ["color", "size", "in_stock"],
    },
    "pattern": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
        "required": ["code"],
    },
    "array": {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 99},
        "minItems": 2,
        "maxItems": 4,
    },
}
QUESTIONS = {
    "person": "Describe a person as JSON with a name and an age.",
    "nested": "Give a user record as JSON: an id and a few tags.",
    "enums": "Describe a T-shirt in stock as JSON.",
    "pattern": "Give a product code as JSON.",
    "array": "List a few small numbers as a JSON array.",
}
DATE = r"\d{4}-\d{2}-\d{2}"
ANSWER = r"(yes|no), [a-z]{2,10}\."
FRUITS = 'root ::= item (", " item){0,2}\nitem ::= ("apple" | "pear" | "plum") " x" [1-9]'
FRUIT_RE = re.compile(r"(apple|pear|plum) x[1-9](, (apple|pear|plum) x[1-9]){0,2}")


def chat(llm: LLM, question: str) -> list[int]:
    return llm.chat_prompt([{"role": "user", "content": question}])


def finished(out) -> str:
    """The output's text, after checking that the grammar ended it (EOS), not max_tokens or an error."""
    assert out.finish_reason == "stop", (out.finish_reason, out.error, out.text)
    return out.text


def is_fruit_list(text: str) -> bool:
    """The language of FRUITS, read by hand: 1 to 3 items "<fruit> x<digit 1-9>" joined by ", "."""
    items = text.split(", ")
    return 1 <= len(items) <= 3 and all(
        len(item.split(" x")) == 2
        and item.split(" x")[0] in ("apple", "pear", "plum")
        and len(item.split(" x")[1]) == 1
        and item.split(" x")[1] in "123456789"
        for item in items
    )


@pytest.fixture(scope="module")
def no_overlap(smollm2_path):
    with LLM(
        str(smollm2_path), device="cpu", dtype="float32", max_running_req=8, overlap_scheduling=False
    ) as llm:
        yield llm


def test_every_output_validates_under_its_json_schema(llm32) -> None:
    names = list(SCHEMAS)
    prompts = [chat(llm32, QUESTIONS[n]) for n in names] * 2
    params = [SamplingParams(json_schema=SCHEMAS[n], max_tokens=MAX_TOKENS) for n in names] + [
        SamplingParams(json_schema=SCHEMAS[n], max_tokens=MAX_TOKENS, temperature=0.9, seed=i)
        for i, n in enumerate(names)
    ]
    outputs = llm32.generate(prompts, params)
    for name, out in zip(names * 2, outputs):
        value = json.loads(finished(out))
        jsonschema.validate(value, SCHEMAS[name])
        assert out.token_ids[-1] in llm32.scheduler.output.eos_token_ids  # the grammar's end, then EOS
    llm_clean(llm32)


def test_json_object_outputs_are_json_objects(llm32) -> None:
    prompts = [chat(llm32, "Give a tiny JSON object with one key."), "A JSON object:"]
    params = [
        SamplingParams(json_object=True, max_tokens=MAX_TOKENS),
        SamplingParams(json_object=True, max_tokens=MAX_TOKENS, temperature=0.8, seed=5),
    ]
    for out in llm32.generate(prompts, params):
        assert isinstance(json.loads(finished(out)), dict)


def test_regex_and_ebnf_outputs_are_in_their_languages(llm32) -> None:
    prompts = [
        chat(llm32, "When was the Eiffel Tower finished? Give the date."),
        chat(llm32, "Is the sky blue? Answer yes or no and one word why."),
        chat(llm32, "List some fruit with counts."),
        chat(llm32, "What fruit do you have?"),
    ]
    params = [
        SamplingParams(regex=DATE, max_tokens=MAX_TOKENS),
        SamplingParams(regex=ANSWER, max_tokens=MAX_TOKENS, temperature=1.0, seed=2),
        SamplingParams(ebnf=FRUITS, max_tokens=MAX_TOKENS),
        SamplingParams(ebnf=FRUITS, max_tokens=MAX_TOKENS, temperature=1.0, top_p=0.9, seed=4),
    ]
    date, answer, *fruits = [finished(out) for out in llm32.generate(prompts, params)]
    assert re.fullmatch(DATE, date) and re.fullmatch(ANSWER, answer)
    for text in fruits:
        assert is_fruit_list(text) and FRUIT_RE.fullmatch(text), text
    assert not is_fruit_list("apple x0") and not is_fruit_list("apple x1, pear x2, plum x3, apple x4")


@pytest.mark.parametrize("which", ["overlap", "no_overlap"])
def test_a_mixed_batch_gives_every_request_the_tokens_it_gets_alone(which, llm32, no_overlap) -> None:
    llm = llm32 if which == "overlap" else no_overlap
    assert llm.scheduler.overlap == (which == "overlap")
    prompts = [
        chat(llm, QUESTIONS["person"]),
        "The capital of France is",
        chat(llm, "Give the date of the moon landing."),
        "def fibonacci(n):",
    ]
    params = [
        SamplingParams(json_schema=PERSON, max_tokens=MAX_TOKENS),
        SamplingParams(max_tokens=8, ignore_eos=True),
        SamplingParams(regex=DATE, max_tokens=MAX_TOKENS),
        SamplingParams(max_tokens=8, temperature=0.8, seed=3, ignore_eos=True),
    ]
    alone = [llm.generate([p], [sp])[0].token_ids for p, sp in zip(prompts, params)]
    together = llm.generate(prompts, params)
    assert [out.token_ids for out in together] == alone
    jsonschema.validate(json.loads(finished(together[0])), PERSON)
    assert re.fullmatch(DATE, finished(together[2]))
    llm_clean(llm)


def test_constrained_steps_keep_overlap_and_the_tokens_of_steps_without(llm32, no_overlap) -> None:
    """Under overlap a constrained batch's masks are filled once its forward is launched, after the
    previous step's tokens are read (`Pipeline.deferred_mask`): the previous forward is still in
    flight when the step is prepared, and the outputs are those of a scheduler without overlap."""
    sched = llm32.scheduler
    prompts = [chat(llm32, QUESTIONS["person"]), chat(llm32, "Give the date of the moon landing.")]
    params = [
        SamplingParams(json_schema=PERSON, max_tokens=MAX_TOKENS),
        SamplingParams(regex=DATE, max_tokens=MAX_TOKENS),
    ]
    deferred, calls = sched.pipeline.deferred_mask, []

    def counted(states):
        calls.append(sched.pipeline.in_flight is not None)
        return deferred(states)

    sched.pipeline.deferred_mask = counted
    try:
        outs = llm32.generate(prompts, params)
    finally:
        del sched.pipeline.deferred_mask
    assert len(calls) > 10 and all(calls)  # every decode step of theirs overlapped the one before
    assert [o.token_ids for o in outs] == [o.token_ids for o in no_overlap.generate(prompts, params)]
    jsonschema.validate(json.loads(finished(outs[0])), PERSON)
    assert re.fullmatch(DATE, finished(outs[1]))
    llm_clean(llm32)


def test_a_batch_without_a_grammar_gets_no_mask_and_plain_generation_no_xgrammar(llm32, tmp_path) -> None:
    from minisgl.scheduler import RequestState

    states = [RequestState(i, [1, 2], SamplingParams(), 0.0) for i in range(3)]
    assert llm32.scheduler.grammars.token_mask(states, torch.device("cpu")) is None
    code = (
        "import sys; from minisgl.llm import LLM; from minisgl.core import SamplingParams\n"
        "llm = LLM(device='cpu', dtype='float32', max_running_req=2)\n"
        "out = llm.generate(['Hello'], SamplingParams(max_tokens=3, ignore_eos=True))[0]\n"
        "assert len(out.token_ids) == 3\n"
        "print('xgrammar' in sys.modules)\n"
        "llm.shutdown()\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == "False"


def test_the_mask_comes_before_top_k_and_the_bias(llm32) -> None:
    """Top-k 1 of the masked logits is the masked argmax: were the mask applied after top-k, the one
    token kept would mostly be outside the grammar and the row would have nothing left. A bias of -100
    on the greedy reply's first token moves the reply to another token the grammar allows."""
    prompt = chat(llm32, "Is the sky blue? Answer yes or no and one word why.")
    greedy = llm32.generate([prompt], SamplingParams(regex=ANSWER, max_tokens=MAX_TOKENS))[0]
    top1 = SamplingParams(regex=ANSWER, max_tokens=MAX_TOKENS, temperature=1.5, top_k=1, seed=11)
    assert llm32.generate([prompt], top1)[0].token_ids == greedy.token_ids
    first = greedy.token_ids[0]
    biased = SamplingParams(regex=ANSWER, max_tokens=MAX_TOKENS, logit_bias={first: -100})
    out = llm32.generate([prompt], biased)[0]
    assert out.token_ids[0] != first and re.fullmatch(ANSWER, finished(out))


def test_eos_comes_where_the_grammar_ends_and_max_tokens_still_cuts(llm32) -> None:
    prompt = chat(llm32, "Say something.")
    eos = llm32.scheduler.output.eos_token_ids
    out = llm32.generate([prompt], SamplingParams(regex="ok", max_tokens=MAX_TOKENS))[0]
    assert finished(out) == "ok" and out.token_ids[-1] in eos and not eos & set(out.token_ids[:-1])
    # a grammar that cannot end within max_tokens: "length", with the tokens so far in the language
    out = llm32.generate([prompt], SamplingParams(regex="[a-z]{40}", max_tokens=3))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3
    assert re.fullmatch("[a-z]+", out.text) and not eos & set(out.token_ids)


def test_min_tokens_past_the_grammars_end_fails_that_request_alone(llm32) -> None:
    prompts = [chat(llm32, "Say something."), "The capital of France is"]
    params = [
        SamplingParams(regex="ok", min_tokens=5, max_tokens=MAX_TOKENS),
        SamplingParams(max_tokens=6, ignore_eos=True),
    ]
    bad, good = llm32.generate(prompts, params)
    assert bad.finish_reason == "error" and "min_tokens=5" in bad.error and bad.text == "ok"
    assert good.finish_reason == "length" and len(good.token_ids) == 6
    # min_tokens the grammar can meet: EOS waits for it
    out = llm32.generate([prompts[0]], SamplingParams(regex="[a-z]{1,20}", min_tokens=3, max_tokens=30))[0]
    assert len(out.token_ids) >= 4 and re.fullmatch("[a-z]{1,20}", finished(out))
    llm_clean(llm32)


def test_a_preempted_constrained_request_resumes_where_it_stopped(smollm2_path) -> None:
    """Two constrained requests on a KV pool too small for both at once (24 pages of 4 tokens, no prefix
    cache to share the chat template's pages): the scheduler preempts one, recomputes it later, and
    both outputs equal the ones they get alone."""
    pool = {"page_size": 4, "num_page_override": 24, "cache_type": "naive"}
    llm = LLM(str(smollm2_path), device="cpu", dtype="float32", max_running_req=4, **pool)
    try:
        names = ["person", "enums"]
        prompts = [chat(llm, QUESTIONS[n]) for n in names]
        params = [SamplingParams(json_schema=SCHEMAS[n], max_tokens=28) for n in names]
        alone = [llm.generate([p], [sp])[0] for p, sp in zip(prompts, params)]
        assert llm.scheduler.preemptions == 0
        together = llm.generate(prompts, params)
        assert llm.scheduler.preemptions > 0  # every running request is constrained: one of them was
        assert [o.token_ids for o in together] == [o.token_ids for o in alone]
        for name, out in zip(names, together):
            jsonschema.validate(json.loads(finished(out)), SCHEMAS[name])
        llm_clean(llm)
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    ("params", "words"),
    [
        (dict(json_schema={"type": "object", "properties": {"a": {"type": "nonsense"}}}), "json_schema"),
        (dict(json_schema={"$ref": "#/definitions/missing"}), "json_schema"),
        (dict(regex="(unclosed"), "regex"),
        (dict(regex="[z-a]"), "regex"),
        (dict(ebnf='root ::= undefined_rule "x"'), "ebnf"),
        (dict(ebnf="not a grammar"), "ebnf"),
    ],
)
def test_grammars_xgrammar_cannot_compile_raise_before_anything_is_queued(llm32, params, words) -> None:
    good = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match=rf"^{words} is not an? .* xgrammar can compile: \S"):
        llm32.generate(["Hello", "Hi"], [good, SamplingParams(**params)])
    llm_clean(llm32)  # nothing was queued, not even the good request
    with pytest.raises(ValueError, match=rf"^{words} "):  # the same error again, from the cache
        llm32.stream("Hi", SamplingParams(**params))
    assert llm32.generate(["Hello"], good)[0].finish_reason == "length"


def test_a_grammar_without_a_first_token_raises_up_front(llm32) -> None:
    """An empty language, or only the empty text while min_tokens asks for more: refused at the check
    (a grammar that runs out later, past its end, fails its request instead: see above)."""
    for params, words in (
        (SamplingParams(regex=r"[^\s\S]"), r"^regex allows no output at all"),
        (SamplingParams(ebnf=r"root ::= [^\x00-\U0010FFFF]"), r"^ebnf allows no output at all"),
        (SamplingParams(regex="", min_tokens=1), r"^regex allows only the empty output, and min_tokens=1"),
    ):
        with pytest.raises(ValueError, match=words):
            llm32.generate(["Hi"], params)
        llm_clean(llm32)
    out = llm32.generate(["Hi"], SamplingParams(regex="", max_tokens=4))[0]  # the empty text: EOS at once
    assert finished(out) == "" and len(out.token_ids) == 1


# 'a', then a character outside the Basic Multilingual Plane that no token of SmolLM2's vocabulary
# starts: the grammar has no token to go on with after one token, and may not end there
DEAD_END_REGEX = "a\U0009a78a"


def test_a_grammar_that_leads_where_no_token_continues_fails_that_request_alone(llm32, caplog) -> None:
    """Such a row is never drawn from: the request ends with "error" naming the dead end, logged as a
    warning without a traceback (the request's doing), and the free request beside it is unaffected."""
    prompts = ["Hi", "The capital of France is"]
    params = [
        SamplingParams(regex=DEAD_END_REGEX, max_tokens=8),
        SamplingParams(max_tokens=6, ignore_eos=True),
    ]
    with caplog.at_level("WARNING", logger="minisgl.scheduler.scheduler"):
        bad, good = llm32.generate(prompts, params)
    assert bad.finish_reason == "error" and bad.text == "a", (bad.finish_reason, bad.text)
    assert "its regex allows no token after 1 tokens, not even the end" in bad.error, bad.error
    assert good.token_ids == llm32.generate([prompts[1]], params[1])[0].token_ids
    [record] = [r for r in caplog.records if "allows no token" in r.getMessage()]
    assert record.levelname == "WARNING" and record.exc_info is None
    llm_clean(llm32)


def test_bad_structured_output_parameters_name_the_field() -> None:
    for kwargs, words in [
        (dict(regex="a", ebnf="root ::= 'a'"), "regex and ebnf were both given"),
        (dict(json_schema={}, json_object=True), "json_schema and json_object"),
        (dict(regex="a", ignore_eos=True), "regex cannot be combined with ignore_eos"),
        (dict(json_schema="{not json"), "json_schema is not valid JSON"),
        (dict(json_schema=[1, 2]), "json_schema must be a JSON schema"),
        (dict(json_schema={"maximum": float("inf")}), "json_schema must hold JSON values"),
        (dict(regex=5), "regex must be a string"),
        (dict(json_object="yes"), "json_object must be True or False"),
    ]:
        with pytest.raises((TypeError, ValueError), match=words):
            SamplingParams(**kwargs)
    # the schema is kept as compact JSON text in the key order given: equal schemas, one cache entry
    a = SamplingParams(json_schema={"type": "object", "properties": {"b": {}, "a": {}}})
    b = SamplingParams(json_schema='{ "type": "object", "properties": {"b": {}, "a": {}} }')
    assert a == b and hash(a) == hash(b) and a.grammar == ("json_schema", a.json_schema)
    assert list(json.loads(a.json_schema)["properties"]) == ["b", "a"]


def test_grammars_compile_once_in_a_bounded_cache(llm32) -> None:
    vocab = llm32.engine.config.model_config.vocab_size
    grammars = Grammars(llm32.tokenizer, vocab, llm32.scheduler.output.eos_token_ids, cache_size=2)
    for regex in ("a+", "b+", "a+", "c+", "a+", "b+"):
        grammars.check(SamplingParams(regex=regex))
    # a+ b+ (hit) c+ evicts b+ (hit a+) b+ again: four compiles, two kept
    assert grammars.compiled == 4 and len(grammars._cache) == 2
    before = llm32.scheduler.grammars.compiled
    params = SamplingParams(regex="(red|blue)", max_tokens=8)
    for _ in range(2):
        assert finished(llm32.generate([chat(llm32, "A color?")], params)[0]) in ("red", "blue")
    assert llm32.scheduler.grammars.compiled == before + 1


def test_no_tokenizer_or_tensor_parallelism_refuses_grammars(llm32) -> None:
    vocab, eos = llm32.engine.config.model_config.vocab_size, [2]
    with pytest.raises(ValueError, match="^regex needs the model's tokenizer"):
        Grammars(None, vocab, eos).check(SamplingParams(regex="a"))
    with pytest.raises(ValueError, match="^json_object: structured output is not supported under tensor"):
        Grammars(llm32.tokenizer, vocab, eos, tensor_parallel=True).check(SamplingParams(json_object=True))
    Grammars(None, vocab, eos).check(SamplingParams())  # no grammar: nothing to refuse


def test_the_token_mask_allows_only_the_grammars_tokens(llm32) -> None:
    """The host mask of a fresh `.*` matcher: EOS allowed (the empty text is in the language), the
    tokenizer's other special tokens never; applied, it leaves the allowed logits as they were."""
    from minisgl.scheduler import BatchPreparer, RequestState

    sched = llm32.scheduler
    eos = sorted(sched.output.eos_token_ids)
    vocab = llm32.engine.config.model_config.vocab_size
    states = [RequestState(i, [1, 2, 3], SamplingParams(regex=r), 0.0) for i, r in enumerate([".*", "[0-9]"])]
    states.append(RequestState(2, [1, 2, 3], SamplingParams(), 0.0))
    prep = BatchPreparer(llm32.engine)
    for state in states:
        state.grammar = sched.grammars.new_state(state.params)
        state.req = prep.add_request(state.prompt_ids, state.params)
    try:
        mask = sched.grammars.token_mask(states, torch.device("cpu"))
    finally:
        prep.release([s.req for s in states])
    allowed = unpack_mask(mask, vocab)
    special = set(llm32.tokenizer.all_special_ids) - set(eos)
    assert allowed[0, eos].all() and not allowed[0, sorted(special)].any()
    digits = {t for t in range(vocab) if re.fullmatch("[0-9]", llm32.tokenizer.decode([t]))}
    assert set(allowed[1].nonzero().flatten().tolist()) == digits
    assert allowed[2].all()  # a request without a grammar: every token
    logits = torch.randn(3, vocab)
    masked = apply_token_mask(logits, mask)
    assert torch.equal(masked[allowed], logits[allowed]) and (masked[~allowed] == float("-inf")).all()


def test_a_large_batchs_mask_is_each_requests_own(llm32) -> None:
    """From `BATCH_FILL_ROWS` constrained rows on, xgrammar fills them in one call: each row is still
    exactly the mask of that request's matcher alone (mixed grammars, places, an unconstrained row)."""
    from minisgl.scheduler import BatchPreparer, RequestState
    from minisgl.scheduler.grammar import BATCH_FILL_ROWS

    sched = llm32.scheduler
    grammars = sched.grammars
    prefixes = ['{"name": "Ad', '{"name": "Ada", "age": 3', "", "12, 3", '{"name', "1"]
    params = [SamplingParams(json_schema=PERSON), SamplingParams(regex=r"[0-9]+(, [0-9]+)*")]
    states = []
    for i, prefix in enumerate(prefixes):
        state = RequestState(i, [1, 2, 3], params[prefix[:1].isdigit()], 0.0)
        state.grammar = grammars.new_state(state.params)
        assert state.grammar.matcher.accept_string(prefix)
        states.append(state)
    states.insert(2, RequestState(9, [1, 2, 3], SamplingParams(), 0.0))
    assert len(prefixes) >= BATCH_FILL_ROWS
    prep = BatchPreparer(llm32.engine)
    for state in states:
        state.req = prep.add_request(state.prompt_ids, state.params)
    try:
        mask = grammars.token_mask(states, torch.device("cpu"))
    finally:
        prep.release([s.req for s in states])
    for i, state in enumerate(states):
        if state.grammar is None:
            assert (mask[i] == -1).all()
            continue
        alone = torch.empty((1, grammars.words), dtype=torch.int32)
        state.grammar.matcher.fill_next_token_bitmask(alone, 0)
        grammars._clear_tail(alone)
        assert torch.equal(mask[i], alone[0]) and alone.any()


# Grammars' pool (`Grammars.threads` >= 2): the accepts and fills of a step split in chunks over threads
POOL_DOCUMENT = json.dumps({"name": "Ada Lovelace", "age": 36})  # an output of PERSON


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(smollm2_path)


def _pool_batch(grammars: Grammars) -> tuple[list, list[int]]:
    """66 decode-step requests under PERSON and their next tokens: 64 standing at different places of a
    valid output with its next token (every 9th: a token the grammar refuses there, EOS mid-document;
    every 8th holds its end back with min_tokens), one at the output's end (only EOS allowed) and one at
    the end with min_tokens (dead), then an unconstrained request."""
    from minisgl.core import Req
    from minisgl.scheduler import RequestState

    ids = grammars.tokenizer.encode(POOL_DOCUMENT, add_special_tokens=False)
    eos = min(grammars.eos_token_ids)
    plain, held = SamplingParams(json_schema=PERSON), SamplingParams(json_schema=PERSON, min_tokens=500)
    places = [(i * 5) % len(ids) for i in range(64)] + [len(ids), len(ids)]
    states, tokens = [], []
    for i, cut in enumerate([*places, None]):
        params = SamplingParams() if cut is None else held if i % 8 == 7 or i == 65 else plain
        state = RequestState(i, [1, 2, 3], params, 0.0)
        state.req = Req(
            input_ids=[1, 2, 3], table_idx=i, cached_len=3, output_len=64, uid=i, sampling_params=params
        )
        state.req.device_len = 4  # a decode step's request
        states.append(state)
        if cut is None:
            continue
        state.grammar = grammars.new_state(params)
        for token in ids[:cut]:
            assert state.grammar.matcher.accept_token(token)
        tokens.append(eos if cut == len(ids) or i % 9 == 4 else ids[cut])
    return states, tokens


@pytest.mark.parametrize("threads", [2, 3, 8])
def test_the_pool_gives_the_masks_and_accepts_of_one_thread(tokenizer, threads) -> None:
    """With `threads` >= 2 the 66 rows are split in chunks over a pool (named minisgl-grammar); the masks
    are bitwise those of one thread (`threads=1`, no pool), before and after the accepts, and so are the
    accepts (refused tokens, the dead row left alone) and the dead rows."""
    cpu = torch.device("cpu")
    vocab = len(tokenizer)
    runs = []
    for grammars in (
        Grammars(tokenizer, vocab, [2], threads=1),
        Grammars(tokenizer, vocab, [2], threads=threads),
    ):
        states, tokens = _pool_batch(grammars)
        first = grammars.token_mask(states, cpu)
        grammars.accept_ahead(zip(states, tokens))
        second = grammars.token_mask(states, cpu)
        runs.append(
            (first, second, [(s.grammar and s.grammar.ahead, s.grammar and s.grammar.dead) for s in states])
        )
        assert (grammars._pool is None) == (grammars.threads == 1)
    assert any(t.name.startswith("minisgl-grammar") for t in threading.enumerate())
    (first, second, outcomes), (pooled_first, pooled_second, pooled_outcomes) = runs
    assert torch.equal(first, pooled_first) and torch.equal(second, pooled_second)
    assert outcomes == pooled_outcomes
    aheads = [ahead for ahead, _ in outcomes[:66]]
    assert aheads[65] is None and outcomes[65][1] and aheads.count(None) == 1  # only the dead row's
    assert {ok for _, ok in aheads[:65]} == {True, False}  # accepted and refused tokens
    assert (first[65] == -1).all() and (first[66] == -1).all()  # dead, unconstrained


class _Broken:
    """A matcher xgrammar cannot use (no handle): its chunk raises in the pool's thread."""

    def is_terminated(self) -> bool:
        return False


def test_a_chunks_exception_reaches_the_caller_once_every_chunk_is_done(tokenizer) -> None:
    """A worker's exception is raised by the step's call; chunk 0's (the calling thread's) too, once the
    workers' chunks have finished (none still writes the mask)."""
    grammars = Grammars(tokenizer, len(tokenizer), [2], threads=4)
    states, tokens = _pool_batch(grammars)
    states[63].grammar.matcher = _Broken()  # the last chunk's: a worker's
    with pytest.raises(AttributeError):
        grammars.token_mask(states, torch.device("cpu"))
    with pytest.raises(AttributeError):
        grammars.accept_ahead(zip(states, tokens))
    assert all(s.grammar is None or s.grammar.ahead is None for s in states)
    # chunk 0 (the calling thread) raises only once the workers' chunks have begun: they still finish first
    begun, done = threading.Event(), []

    def run(k: int, start: int, stop: int) -> None:
        if k == 0:
            begun.set()
            raise RuntimeError("chunk 0")
        assert begun.wait(30)
        done.append(k)

    with pytest.raises(RuntimeError, match="chunk 0"):
        grammars._spread(16, run)
    assert sorted(done) == [1, 2, 3]


def test_request_fields_map_onto_sampling_params() -> None:
    from minisgl.server.protocol import parse_chat_request, parse_completion_request
    from minisgl.server.sampling import sampling_params

    def params(**fields) -> SamplingParams:
        chat = parse_chat_request(
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, **fields}, "m"
        )
        completion = parse_completion_request({"model": "m", "prompt": "x", "max_tokens": 4, **fields}, "m")
        [a], [b] = sampling_params(chat, 3, 64), sampling_params(completion, 3, 64)
        assert a == b  # both endpoints take the same fields
        return a

    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    got = params(response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}})
    assert got.grammar == ("json_schema", json.dumps(schema, separators=(",", ":")))
    assert params(response_format={"type": "json_object"}).grammar == ("json_object", "")
    assert (
        params(regex="a+").grammar == ("regex", "a+") and params(ebnf='root ::= "a"').ebnf == 'root ::= "a"'
    )
    assert params(response_format={"type": "text"}) == params()
    assert params().grammar is None


# ------------------------------------------------------------------------------------------------- HTTP


@pytest.fixture(scope="module")
def server(smollm2_server):
    """The session's server of the default model (conftest.py; float32 on the CPU)."""
    return smollm2_server


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key="unused", timeout=300, max_retries=0)


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def test_chat_and_completions_take_response_format_regex_and_ebnf(client, llm32) -> None:
    messages = [{"role": "user", "content": QUESTIONS["person"]}]
    fmt = _schema_format(PERSON)
    request = dict(model=MODEL, messages=messages, temperature=0, max_tokens=MAX_TOKENS, response_format=fmt)
    got = client.chat.completions.create(**request)
    assert got.choices[0].finish_reason == "stop"
    # the same tokens as LLM (the server runs the same float32 model)
    want = llm32.chat(messages, SamplingParams(json_schema=PERSON, max_tokens=MAX_TOKENS))
    assert got.choices[0].message.content == finished(want)
    stream = client.chat.completions.create(**request, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want.text
    got = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": 'Return {"ok": true} as JSON.'}],
        temperature=0,
        max_tokens=MAX_TOKENS,
        response_format={"type": "json_object"},
    )
    assert got.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(got.choices[0].message.content), dict)
    code = SCHEMAS["pattern"]
    for extra, check in (
        ({"response_format": _schema_format(code)}, lambda text: jsonschema.validate(json.loads(text), code)),
        ({"regex": DATE}, lambda text: re.fullmatch(DATE, text) is not None),
        ({"ebnf": FRUITS}, is_fruit_list),
    ):
        done = client.completions.create(
            model=MODEL,
            prompt="The code, the date or the fruit:",
            temperature=0,
            max_tokens=MAX_TOKENS,
            extra_body=extra,
        )
        assert done.choices[0].finish_reason == "stop", (extra, done)
        assert check(done.choices[0].text) is not False, (extra, done)
    # {"type": "text"} asks for nothing: the reply of a request without it
    plain = [
        client.completions.create(model=MODEL, prompt="Hi", temperature=0, max_tokens=3, extra_body=extra)
        for extra in ({"response_format": {"type": "text"}}, {})
    ]
    assert plain[0].choices[0].text == plain[1].choices[0].text


BAD_REQUESTS = [
    (
        {"response_format": _schema_format({"type": "nonsense"})},
        "response_format.json_schema.schema",
        "xgrammar",
    ),
    ({"regex": "(unclosed"}, "regex", "xgrammar"),
    ({"ebnf": "root ::= missing"}, "ebnf", "xgrammar"),
    ({"regex": "a", "ebnf": 'root ::= "a"'}, "ebnf", "at most one"),
    ({"response_format": {"type": "json_object"}, "regex": "a"}, "regex", "at most one"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "missing"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        "response_format.json_schema.schema",
        "missing",
    ),
    (
        {"response_format": {"type": "json_object", "json_schema": {"schema": {}}}},
        "response_format.json_schema",
        "goes with",
    ),
    ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": []}}},
        "response_format.json_schema.schema",
        "dict",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "x": 1}}},
        "response_format.json_schema.x",
        "unknown",
    ),
    ({"regex": 5}, "regex", "string"),
    ({"regex": "a", "ignore_eos": True}, "regex", "ignore_eos"),
    ({"regex": r"[^\s\S]"}, "regex", "allows no output at all"),
    ({"regex": "", "min_tokens": 1}, "regex", "min_tokens=1"),
]


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_bad_structured_output_is_a_400_naming_the_field(server, route) -> None:
    """Streamed or not: the front end reads the grammar with xgrammar before it answers anything."""
    prompt = {"prompt": "Hi"} if route == "completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    for stream in (False, True):
        for extra, param, words in BAD_REQUESTS:
            body = {"model": MODEL, "max_tokens": 4, "stream": stream, **prompt, **extra}
            r = httpx.post(f"{server.url}/{route}", json=body, timeout=60)
            assert r.status_code == 400, (extra, r.text)
            error = r.json()["error"]
            assert error["param"] == param and words in error["message"], (extra, error)
            assert error["type"] == "invalid_request_error"
    ok = httpx.post(f"{server.url}/{route}", json={"model": MODEL, "max_tokens": 2, **prompt}, timeout=120)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"


def test_a_grammars_dead_end_is_a_400_or_an_error_event_naming_it(server) -> None:
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 8, "regex": DEAD_END_REGEX}
    r = httpx.post(f"{server.url}/completions", json=body, timeout=120)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "grammar_dead_end" and error["type"] == "invalid_request_error", error
    assert "its regex allows no token after 1 tokens" in error["message"], error
    r = httpx.post(f"{server.url}/completions", json={**body, "stream": True}, timeout=120)
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n"), r.text
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events if "choices" in e) == "a"
    assert events[-1]["error"]["code"] == "grammar_dead_end", events[-1]
    assert "Traceback" not in server.output()
