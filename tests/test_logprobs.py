"""Log probabilities: each generated and prompt token's log probability and top-k
alternatives against `torch.log_softmax` of transformers' logits on the same sequence (float32, within
1e-4; top-k sets equal up to ties within 1e-5), before temperature, bias and penalties; prompt log
probabilities in chunks and after a prefix-cache hit; mixed batches; errors; over HTTP in OpenAI's
shapes (the openai package's types) with the numbers `LLM` gives. Preemption: tests/test_preemption.py."""

from __future__ import annotations

import httpx2 as httpx
import openai
import pytest
import torch
import transformers
from test_server import MODEL

from minisgl.core import SamplingParams, TokenLogprob
from minisgl.server.logprobs import TokenTexts

PROMPT = "The capital of France is Paris. The capital of Germany is"
TOL = 1e-4


@pytest.fixture(scope="module")
def hf(smollm2_path):
    return transformers.AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()


def _reference(hf, ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits over `ids`: row p scores token p + 1."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), dim=-1)


def _check(entry: TokenLogprob, row: torch.Tensor, token: int, k: int) -> None:
    assert entry.token_id == token
    assert abs(entry.logprob - row[token].item()) < TOL
    assert len(entry.top) == k
    if k:
        values = torch.tensor([lp for _, lp in entry.top], dtype=torch.float64)
        ids = torch.tensor([t for t, _ in entry.top])
        assert torch.allclose(values, row[ids], atol=TOL)
        assert (values[:-1] >= values[1:] - 1e-6).all()  # most likely first
        # the set is the reference's top k, but for tokens tied within 1e-5 at its edge
        threshold = row.topk(k).values[-1].item()
        assert all(row[t].item() >= threshold - 1e-5 for t, _ in entry.top)
        assert {t for t in row.topk(k).indices.tolist() if row[t].item() > threshold + 1e-5} <= set(
            ids.tolist()
        )


def _check_output(hf, llm, out, k: int | None, prompt_k: int | None) -> None:
    prompt = out.prompt_token_ids
    ids = prompt + out.token_ids
    ref = _reference(hf, ids)
    if k is None:
        assert out.logprobs is None
    else:
        assert len(out.logprobs) == len(out.token_ids)
        for j, entry in enumerate(out.logprobs):
            _check(entry, ref[len(prompt) + j - 1], ids[len(prompt) + j], k)
    if prompt_k is None:
        assert out.prompt_logprobs is None
    else:
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        for p in range(1, len(prompt)):
            _check(out.prompt_logprobs[p], ref[p - 1], prompt[p], prompt_k)


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=0.0, logprobs=5),
        dict(temperature=0.7, seed=3, logprobs=0, prompt_logprobs=3),
        # the model's distribution whatever transforms the draw: bias, penalties, temperature, filters
        dict(
            temperature=1.5,
            top_k=5,
            seed=9,
            logit_bias={11: 5.0, 30: -100},
            repetition_penalty=1.3,
            frequency_penalty=0.5,
            logprobs=20,
            prompt_logprobs=1,
        ),
    ],
)
def test_logprobs_equal_transformers_log_softmax(llm32, hf, params) -> None:
    [out] = llm32.generate([PROMPT], SamplingParams(max_tokens=12, ignore_eos=True, **params))
    _check_output(hf, llm32, out, params.get("logprobs"), params.get("prompt_logprobs"))


def test_prompt_logprobs_in_chunks_and_after_a_prefix_cache_hit(llm32, hf) -> None:
    """A prompt's log probabilities are the same whole, in chunks of 4 tokens, and when the prefix cache
    holds the prompt (it is computed again: a hit gives no logits)."""
    long = " ".join([PROMPT] * 4)  # several pages: the prefix cache holds whole pages
    params = SamplingParams(max_tokens=0, prompt_logprobs=2)
    [first] = llm32.generate([long], params)
    assert first.finish_reason == "length" and first.token_ids == [] and first.logprobs is None
    _check_output(hf, llm32, first, None, 2)
    before = llm32.scheduler.prefix_cached_tokens
    [cached] = llm32.generate([long + " Berlin"], SamplingParams(max_tokens=1))  # found in the cache
    assert llm32.scheduler.prefix_cached_tokens > before
    saved = llm32.scheduler.policy.prompt_logprob_chunk
    llm32.scheduler.policy.prompt_logprob_chunk = 4
    try:
        [chunked, hit] = llm32.generate(
            [long, long + " Berlin"], SamplingParams(max_tokens=0, prompt_logprobs=2)
        )
    finally:
        llm32.scheduler.policy.prompt_logprob_chunk = saved
    _check_output(hf, llm32, chunked, None, 2)
    _check_output(hf, llm32, hit, None, 2)
    for a, b in zip(first.prompt_logprobs[1:], chunked.prompt_logprobs[1:]):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < TOL


def test_a_mixed_batch_gives_each_request_what_it_gets_alone(llm32) -> None:
    prompts = [PROMPT, "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]
    params = [
        SamplingParams(max_tokens=10, logprobs=3),
        SamplingParams(max_tokens=10),
        SamplingParams(max_tokens=10, temperature=0.8, seed=5, prompt_logprobs=1),
        SamplingParams(max_tokens=0, prompt_logprobs=0),
    ]
    together = llm32.generate(prompts, params)
    for prompt, p, out in zip(prompts, params, together):
        [alone] = llm32.generate([prompt], p)
        assert out.token_ids == alone.token_ids
        for got, want in ((out.logprobs, alone.logprobs), (out.prompt_logprobs, alone.prompt_logprobs)):
            assert (got is None) == (want is None)
            for a, b in zip(got or (), want or ()):
                assert (a is None and b is None) or abs(a.logprob - b.logprob) < TOL
    assert together[1].logprobs is None and together[1].prompt_logprobs is None
    assert together[3].token_ids == [] and len(together[3].prompt_logprobs) == len(
        together[3].prompt_token_ids
    )


@pytest.mark.parametrize(
    ("field", "value"),
    [("logprobs", 21), ("logprobs", -1), ("prompt_logprobs", 21), ("max_tokens", -1)],
)
def test_bad_values_raise_before_anything_is_queued(llm32, field, value) -> None:
    with pytest.raises(ValueError, match=field):
        llm32.generate([PROMPT], SamplingParams(**{field: value}))
    with pytest.raises(TypeError, match="logprobs"):
        SamplingParams(logprobs=True)
    assert not llm32.scheduler.has_work()


def test_token_texts_give_each_tokens_bytes(llm32) -> None:
    """Every token's bytes, decoded, are what the tokenizer decodes for it alone, and a text's tokens'
    bytes join into its UTF-8 (characters split across byte tokens included)."""
    tokenizer = llm32.tokenizer
    texts = TokenTexts(tokenizer)
    for token in range(len(tokenizer)):
        text, data = texts.get(token)
        assert bytes(data).decode("utf-8", errors="replace") == text == tokenizer.decode([token])
    sample = "héllo wörld 日本語 🎉"
    ids = tokenizer(sample)["input_ids"]
    assert b"".join(bytes(texts.get(t)[1]) for t in ids).decode() == sample
    assert TokenTexts(None).get(7) == ("token_id:7", None)


# ------------------------------------------------------------------------------------------------ HTTP


@pytest.fixture(scope="module")
def server(smollm2_server):
    """The session's server of the default model (conftest.py; float32 on the CPU)."""
    return smollm2_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def test_completions_echo_logprobs_max_tokens_0_score_the_prompt(client, llm32) -> None:
    """An evaluation harness's request: the prompt's log probabilities, nothing generated; the same
    numbers as `LLM`'s."""
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    choice = r.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length" and r.usage.completion_tokens == 0
    [want] = llm32.generate([PROMPT], SamplingParams(max_tokens=0, prompt_logprobs=1))
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert "".join(lp.tokens) == PROMPT
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for got, top, entry in zip(lp.token_logprobs[1:], lp.top_logprobs[1:], want.prompt_logprobs[1:]):
        assert abs(got - entry.logprob) < 1e-5
        assert 1 <= len(top) <= 2  # the best alternative, and the token itself if it is another


def test_completions_logprobs_streamed_and_not(client, llm32) -> None:
    body = dict(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    [want] = llm32.generate([PROMPT], SamplingParams(max_tokens=6, logprobs=3))
    whole = client.completions.create(**body).choices[0]
    assert whole.logprobs.token_logprobs == pytest.approx([e.logprob for e in want.logprobs], abs=TOL)
    assert "".join(whole.logprobs.tokens) == whole.text == want.text
    assert all(len(top) in (3, 4) for top in whole.logprobs.top_logprobs)
    text, tokens, offsets, values = "", [], [], []
    for chunk in client.completions.create(**body, stream=True, echo=True):
        c = chunk.choices[0]
        text += c.text
        if c.logprobs is not None:
            tokens += c.logprobs.tokens
            offsets += c.logprobs.text_offset
            values += c.logprobs.token_logprobs
    assert text == PROMPT + whole.text and "".join(tokens) == text
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    assert values[-6:] == pytest.approx(whole.logprobs.token_logprobs, abs=TOL) and values[0] is None


def test_chat_logprobs_streamed_and_not(client) -> None:
    messages = [{"role": "user", "content": "Name a color."}]
    body = dict(model=MODEL, messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**body).choices[0]
    content = whole.logprobs.content
    assert "".join(e.token for e in content) == whole.message.content
    for e in content:
        assert bytes(e.bytes).decode() == e.token
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        assert e.logprob <= e.top_logprobs[0].logprob + 1e-6
    streamed = []
    for chunk in client.chat.completions.create(**body, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=TOL)
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("completions", {"logprobs": 21}, "logprobs"),
        ("completions", {"logprobs": -1}, "logprobs"),
        ("completions", {"logprobs": True}, "logprobs"),
        ("completions", {"max_tokens": 0}, "max_tokens"),
        ("chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("chat/completions", {"logprobs": 1}, "logprobs"),
    ],
)
def test_bad_logprob_fields_get_a_400_naming_them(server, client, route, body, param) -> None:
    prompt = {"prompt": "hi"} if route == "completions" else {"messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(
        f"{server.url}/{route}", json={"model": MODEL, "max_tokens": 2, **prompt, **body}, timeout=60
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices[0].text is not None
