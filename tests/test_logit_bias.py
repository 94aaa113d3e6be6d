"""`logit_bias` (the penalties: test_penalties.py): added to the logits before anything else, per
request, for greedy and sampled rows; checked against transformers' logits plus the same bias, token
for token; over HTTP the same tokens as through `LLM`."""

from __future__ import annotations

import openai
import pytest
import torch
import transformers
from test_server import MODEL

from minisgl.core import SamplingParams
from minisgl.engine.draw import uniform_from_hash

PROMPT = "The capital of France is"
STEPS = 64


@pytest.fixture(scope="module")
def biases(llm32) -> dict[int, float]:
    """A bias that changes the greedy reply: its first two tokens banned, a later one raised."""
    plain = llm32.generate([PROMPT], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
    return {plain[0]: -100.0, plain[1]: -100, plain[5]: 2.5}


@pytest.fixture(scope="module")
def reference(smollm2_path, llm32):
    """Transformers' float32 logits (float64) after the prompt and each given token but the last, plus a
    bias {token id: value}: (tokens, vocab)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_path, torch_dtype=torch.float32)
    prompt = llm32.tokenizer(PROMPT)["input_ids"]

    def logits(tokens: list[int], biases: dict[int, float]) -> torch.Tensor:
        with torch.no_grad():
            out = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].double()
        for token, b in biases.items():
            out[:, token] += b
        return out

    return logits


def test_greedy_with_a_bias_is_transformers_argmax_of_the_biased_logits(llm32, biases, reference) -> None:
    params = SamplingParams(max_tokens=STEPS, ignore_eos=True, logit_bias=biases)
    both = llm32.generate([PROMPT] * 2, [params, SamplingParams(max_tokens=STEPS, ignore_eos=True)])
    out, plain = (o.token_ids for o in both)
    assert out != plain and not set(out[:1]) & {t for t, b in biases.items() if b == -100}
    biased = reference(out, biases)
    best = biased.max(dim=1).values
    chosen = biased[torch.arange(STEPS), torch.tensor(out)]
    assert (best - chosen).max().item() < 1e-4  # every token is the argmax, or within a near-tie


def test_a_mixed_batch_gives_each_request_its_own_tokens(llm32, biases, reference) -> None:
    """Each request of a batch gets the tokens it gets alone: its own bias, none of its neighbours'.
    A request may part from its run alone only at a near-tie (float32 products of a batch of three and
    of one row round differently on the CPU: with one thread the seeded request's 12th token is one),
    and the same tokens follow then only by chance, so the check ends there. A near-tie: for a greedy
    request the two tokens' logits (transformers', biased) within 1e-4; for a seeded one the step's
    uniform (the sampler's hash of the seed and the position) within 1e-4 of the cumulative
    probability at a token between the two."""
    biased = SamplingParams(max_tokens=16, ignore_eos=True, logit_bias=biases)
    plain = SamplingParams(max_tokens=16, ignore_eos=True)
    sampled = SamplingParams(max_tokens=16, ignore_eos=True, temperature=1.0, seed=7, logit_bias=biases)
    alone = [llm32.generate([PROMPT], p)[0].token_ids for p in (biased, plain, sampled)]
    together = [o.token_ids for o in llm32.generate([PROMPT] * 3, [biased, plain, sampled])]
    prompt_len = len(llm32.tokenizer(PROMPT)["input_ids"])
    for params, want, got in zip((biased, plain, sampled), alone, together):
        assert len(got) == len(want) == 16
        if got == want:
            continue
        i = next(i for i, (a, b) in enumerate(zip(want, got)) if a != b)
        logits = reference(want[: i + 1], dict(params.logit_bias))[i]
        a, b = sorted((want[i], got[i]))
        if params.is_greedy:
            gap = abs(logits[a] - logits[b]).item()
        else:
            seed, offset = torch.tensor([params.seed]), torch.tensor([prompt_len + i])
            u = uniform_from_hash(seed, offset).item()
            cdf = torch.softmax(logits / params.temperature, dim=-1).cumsum(dim=-1)
            gap = (cdf[a:b] - u).abs().min().item()
        assert gap < 1e-4, (params, i, want, got, gap)


def test_banned_tokens_are_never_drawn(llm32) -> None:
    top = llm32.generate([PROMPT], SamplingParams(max_tokens=1))[0].token_ids[0]
    params = SamplingParams(max_tokens=32, ignore_eos=True, temperature=1.5, seed=3, logit_bias={top: -100})
    seeded = [SamplingParams(**{**params.__dict__, "seed": seed}) for seed in range(4)]
    for out in llm32.generate([PROMPT] * 4, seeded):
        assert top not in out.token_ids


def test_bad_biases_raise_before_anything_is_queued(llm32) -> None:
    vocab = llm32.engine.config.model_config.vocab_size
    with pytest.raises(ValueError, match=rf"logit_bias token id {vocab} is outside the vocabulary"):
        llm32.generate([PROMPT], SamplingParams(logit_bias={vocab: 1.0}))
    with pytest.raises(ValueError, match=r"logit_bias values must be in \[-100, 100\]"):
        SamplingParams(logit_bias={1: 100.5})
    assert not llm32.scheduler.waiting and not llm32.scheduler.running


def test_logit_bias_over_http_equals_llm(llm32, biases, smollm2_server) -> None:
    """On the session's server of the default model (conftest.py), which must exit 0 at its end."""
    client = openai.OpenAI(base_url=smollm2_server.url, api_key="x", timeout=120, max_retries=0)
    want = llm32.generate([PROMPT], SamplingParams(max_tokens=12, ignore_eos=True, logit_bias=biases))[0]
    bias = {str(t): b for t, b in biases.items()}
    got = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        logit_bias=bias,
        extra_body={"ignore_eos": True},
    )
    assert got.choices[0].text == want.text
    vocab = llm32.engine.config.model_config.vocab_size
    for bad, words in (
        ({str(vocab): 1}, "outside the vocabulary"),
        ({"1": 101}, r"\[-100, 100\]"),
        ({"x": 1}, "token ids"),
    ):
        with pytest.raises(openai.BadRequestError, match=words):
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, logit_bias=bad)
