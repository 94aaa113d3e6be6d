"""The sampling parameters OpenAI clients send, on CUDA: penalties and logit bias in mixed
batches (CUDA graphs, the compiled sampler), and log probabilities through the compiled prefill (every
scored row) and the decode graphs, against transformers. Skips without CUDA or flashinfer."""

import importlib.util

import pytest
import torch
import transformers
from conftest import GPU_SHAPE, make_tiny_model, teacher_forced_logits

from minisgl.core import SamplingParams
from minisgl.llm import LLM

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="needs flashinfer"),
]
PROMPT = [5, 17, 42, 99, 3, 7, 7, 7, 12, 250, 31, 8, 400, 2, 77, 91, 6]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("models"), "qwen3", randomize=(), **GPU_SHAPE)


@pytest.fixture(scope="module")
def llm(folder):
    with LLM(str(folder), device="cuda", dtype="bfloat16", max_running_req=16, batch_invariant=True) as llm:
        yield llm


def test_penalties_and_bias_in_a_mixed_batch_equal_each_alone(llm) -> None:
    params = [
        SamplingParams(max_tokens=48, ignore_eos=True),
        SamplingParams(
            max_tokens=48,
            ignore_eos=True,
            repetition_penalty=1.3,
            frequency_penalty=0.5,
            presence_penalty=0.3,
        ),
        SamplingParams(max_tokens=48, ignore_eos=True, temperature=0.9, seed=3, frequency_penalty=0.7),
        SamplingParams(max_tokens=48, ignore_eos=True, logit_bias={7: 5.0, 12: -100}),
        SamplingParams(
            max_tokens=48, ignore_eos=True, temperature=0.9, seed=4, top_k=20, logit_bias={7: 3.0}, logprobs=3
        ),
    ]
    alone = [llm.generate([PROMPT], p)[0].token_ids for p in params]
    together = [o.token_ids for o in llm.generate([PROMPT] * len(params), params)]
    assert together == alone
    assert alone[1] != alone[0] and 12 not in alone[3]


def test_penalised_greedy_follows_the_definitions_on_the_engines_logits(llm) -> None:
    frequency, presence, repetition = 0.5, 0.3, 1.3
    params = SamplingParams(
        max_tokens=48,
        ignore_eos=True,
        repetition_penalty=repetition,
        frequency_penalty=frequency,
        presence_penalty=presence,
    )
    out = llm.generate([PROMPT], params)[0].token_ids
    logits = teacher_forced_logits(llm.engine, [PROMPT + out], [len(PROMPT)], len(out) - 1)[0].double()
    counts = torch.zeros(logits.shape[1], dtype=torch.float64, device=logits.device)
    seen = torch.zeros_like(counts, dtype=torch.bool)
    seen[PROMPT] = True
    for step, token in enumerate(out):
        row = torch.where(
            seen,
            torch.where(logits[step] > 0, logits[step] / repetition, logits[step] * repetition),
            logits[step],
        )
        row = row - frequency * counts - presence * (counts > 0).double()
        assert (row.max() - row[token]).item() < 1e-3, step
        counts[token] += 1
        seen[token] = True


def test_logprobs_through_the_compiled_prefill_and_the_decode_graphs(llm, folder) -> None:
    """Greedy tokens are their rows' most likely; every log probability is transformers' (float32, on
    the same sequence) within bf16's error; chunks of 4 prompt tokens give the whole prompt's."""
    [out] = llm.generate(
        [PROMPT], SamplingParams(max_tokens=12, ignore_eos=True, logprobs=5, prompt_logprobs=3)
    )
    for token, entry in zip(out.token_ids, out.logprobs):
        assert entry.token_id == token and entry.top[0] == (token, entry.logprob)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).cuda().eval()
    ids = PROMPT + out.token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids], device="cuda")).logits[0].double(), dim=-1)
    entries = out.prompt_logprobs[1:] + out.logprobs
    assert out.prompt_logprobs[0] is None and len(entries) == len(ids) - 1
    for p, entry in enumerate(entries):
        assert abs(entry.logprob - ref[p, ids[p + 1]].item()) < 5e-2, p
        assert len(entry.top) == (3 if p < len(PROMPT) - 1 else 5)
    saved = llm.scheduler.policy.prompt_logprob_chunk
    llm.scheduler.policy.prompt_logprob_chunk = 4
    try:
        [chunked] = llm.generate([PROMPT], SamplingParams(max_tokens=0, prompt_logprobs=3))
    finally:
        llm.scheduler.policy.prompt_logprob_chunk = saved
    for a, b in zip(chunked.prompt_logprobs[1:], out.prompt_logprobs[1:]):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 5e-2
