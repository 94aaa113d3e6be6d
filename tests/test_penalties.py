"""Presence, frequency and repetition penalties: each against its published
definition on transformers' logits, greedy and token for token over 64 steps; `repetition_penalty`
against transformers' own `RepetitionPenaltyLogitsProcessor` (through `generate`); mixed batches;
HTTP. Preemption (the per-slot counts made again at a re-admission): tests/test_preemption.py."""

from __future__ import annotations

import openai
import pytest
import torch
import transformers
from test_server import MODEL

from minisgl.core import SamplingParams

PROMPT = "Write a list of fruits: apple, banana, apple, banana,"
STEPS = 64


@pytest.fixture(scope="module")
def hf(smollm2_path):
    return transformers.AutoModelForCausalLM.from_pretrained(smollm2_path, torch_dtype=torch.float32).eval()


PRESENCE_FREQUENCY = [(1.5, 0.0), (0.0, 1.0), (0.6, 0.4), (-0.5, 0.0)]
CASES = [{}, {"repetition_penalty": 1.3}]
CASES += [{"presence_penalty": p, "frequency_penalty": f} for p, f in PRESENCE_FREQUENCY]


@pytest.fixture(scope="module")
def greedy(llm32):
    """`greedy(**penalties)`: PROMPT's STEPS greedy tokens under those penalties (one of CASES). The
    cases run as one batch (a request's tokens are those it gets alone:
    `test_a_mixed_batch_gives_each_request_its_own_tokens`), a 64-step run instead of one per test."""
    params = [SamplingParams(max_tokens=STEPS, ignore_eos=True, **case) for case in CASES]
    outs = llm32.generate([PROMPT] * len(CASES), params)
    table = {tuple(sorted(case.items())): out.token_ids for case, out in zip(CASES, outs)}
    return lambda **penalties: table[tuple(sorted(penalties.items()))]


def test_repetition_penalty_is_transformers_processor(llm32, hf, greedy) -> None:
    """Each token is the argmax (or within a near-tie of 1e-4) of transformers' logits after its own
    RepetitionPenaltyLogitsProcessor over the prompt and the tokens before it."""
    processor = transformers.RepetitionPenaltyLogitsProcessor(1.3)
    out = greedy(repetition_penalty=1.3)
    prompt = llm32.tokenizer(PROMPT)["input_ids"]
    ids = torch.tensor([prompt + out])
    with torch.no_grad():
        logits = hf(ids).logits[0, len(prompt) - 1 : -1]
    for step, token in enumerate(out):
        row = processor(ids[:, : len(prompt) + step], logits[step : step + 1].clone())[0].double()
        assert row.max().item() - row[token].item() < 1e-4, step
    assert out != greedy()


@pytest.mark.parametrize(("presence", "frequency"), PRESENCE_FREQUENCY)
def test_presence_and_frequency_follow_openais_definition(llm32, hf, greedy, presence, frequency) -> None:
    """logit[t] -= presence * (count[t] > 0) + frequency * count[t], counts over the tokens generated
    before the step: each of our tokens is the argmax of transformers' logits so penalised (or within a
    near-tie of 1e-4)."""
    out = greedy(presence_penalty=presence, frequency_penalty=frequency)
    prompt = llm32.tokenizer(PROMPT)["input_ids"]
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + out])).logits[0, len(prompt) - 1 : -1].double()
    counts = torch.zeros(logits.shape[1], dtype=torch.float64)
    for step, token in enumerate(out):
        row = logits[step] - frequency * counts - presence * (counts > 0).double()
        assert row.max().item() - row[token].item() < 1e-4, step
        counts[token] += 1
    if presence > 0 or frequency > 0:  # a reply that repeats itself changes
        assert out != greedy()


def test_a_mixed_batch_gives_each_request_its_own_tokens(llm32) -> None:
    params = [
        SamplingParams(max_tokens=24, ignore_eos=True, repetition_penalty=1.2, frequency_penalty=0.5),
        SamplingParams(max_tokens=24, ignore_eos=True),
        SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.8, seed=5, presence_penalty=1.0),
        SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.8, seed=5),
    ]
    alone = [llm32.generate([PROMPT], p)[0].token_ids for p in params]
    assert [o.token_ids for o in llm32.generate([PROMPT] * 4, params)] == alone


def test_out_of_range_penalties_are_refused() -> None:
    for bad, words in (
        ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\]"),
        ({"frequency_penalty": -3}, r"frequency_penalty must be in \[-2, 2\]"),
        ({"repetition_penalty": 0}, r"repetition_penalty must be in \(0, 10\]"),
    ):
        with pytest.raises(ValueError, match=words):
            SamplingParams(**bad)


def test_penalties_over_http_equal_llm(llm32, smollm2_server) -> None:
    """On the session's server of the default model (conftest.py), which must exit 0 at its end."""
    client = openai.OpenAI(base_url=smollm2_server.url, api_key="x", timeout=120, max_retries=0)
    penalties = {"presence_penalty": 0.5, "frequency_penalty": 0.3}
    want = llm32.generate(
        [PROMPT], SamplingParams(max_tokens=16, ignore_eos=True, repetition_penalty=1.2, **penalties)
    )[0]
    got = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=16,
        temperature=0,
        **penalties,
        extra_body={"ignore_eos": True, "repetition_penalty": 1.2},
    )
    assert got.choices[0].text == want.text
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, presence_penalty=3)
