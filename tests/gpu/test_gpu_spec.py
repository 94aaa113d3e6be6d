"""Speculative decoding's verify step on the GPU (docs/speculative.md): the verify CUDA graphs give the
logits of every verified row as the compiled forward without a graph and the eager torch backend do;
greedy requests with 'ngram' decode as without speculation. Skips without CUDA and flashinfer."""

import importlib.util

import pytest
import torch
from conftest import check_clean, gpu_seqs, rel_err

from minisgl.core import SamplingParams
from minisgl.engine import Engine, EngineConfig
from minisgl.llm import LLM
from minisgl.scheduler import BatchPreparer

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="needs flashinfer"),
]
BF16_TOL = 2e-2
ROWS = 5  # k = 4


def _verify_logits(engine: Engine, seqs: list[list[int]], drafts: list[int]) -> torch.Tensor:
    """Prefills each sequence but its last `drafts[i] + 1` tokens, then runs them as one verify batch:
    the logits of every verified row, in batch order."""
    prep = BatchPreparer(engine)
    reqs = [prep.add_request(seq, SamplingParams(max_tokens=8)) for seq in seqs]
    try:
        batch = prep.prefill(reqs, [len(s) - n - 1 for s, n in zip(seqs, drafts)])
        engine.forward_logits(batch)
        batch = prep.prefill(reqs, [n + 1 for n in drafts])
        with torch.inference_mode():
            rows = torch.arange(batch.num_tokens, device="cuda")
            return engine.forward_path.run(batch, rows=rows, verify=True).logits.clone()
    finally:
        prep.release(reqs)


def _reference_and_engine(model, backend: str, seqs, drafts) -> tuple[torch.Tensor, Engine]:
    """The torch backend's verify logits of the batch, and an engine of `backend` with decode graphs up
    to 8 and the verify graphs captured."""
    kw = dict(
        model_path=str(model), dtype=torch.bfloat16, device="cuda", max_running_req=16, num_page_override=512
    )
    ref = _verify_logits(Engine(EngineConfig(attention_backend="torch", **kw)), seqs, drafts)
    engine = Engine(EngineConfig(attention_backend=backend, cuda_graph_max_bs=8, **kw))
    engine.graph_runner.capture_verify(ROWS, 4)
    return ref, engine


@pytest.mark.parametrize("backend", ["fi", "fa,fi"])
def test_verify_graphs_match_compiled_and_torch(tiny_qwen3, backend):
    seqs = gpu_seqs(512, [40, 90, 7, 200])
    drafts = [4, 0, 2, 4]
    ref, engine = _reference_and_engine(tiny_qwen3, backend, seqs, drafts)
    runner = engine.graph_runner
    assert sorted(runner.verify_graphs) == [16, 32, 64]
    replayed, replay = [], runner.replay_verify
    runner.replay_verify = lambda batch: replayed.append(batch.num_tokens) or replay(batch)
    got = _verify_logits(engine, seqs, drafts)
    assert replayed == [sum(drafts) + len(drafts)]
    assert got.shape == ref.shape and rel_err(got.float(), ref.float()) < BF16_TOL
    runner.verify_graphs = {}  # the compiled forward without a graph
    compiled = _verify_logits(engine, seqs, drafts)
    assert replayed == [sum(drafts) + len(drafts)]
    assert rel_err(compiled.float(), ref.float()) < BF16_TOL


@pytest.mark.parametrize("backend", ["fi", "fa,fi"])
def test_a_small_verify_batch_replays_the_decode_graph_of_its_rows(tiny_qwen3, backend):
    """One request's k + 1 rows replay the decode graph of k + 1 rows (`GraphRunner.as_decode_rows`:
    the Triton decode kernel, each row to its own length), with the logits of the torch backend and of
    the verify graph (`verify_as_decode` off)."""
    seqs, drafts = gpu_seqs(512, [90]), [4]
    ref, engine = _reference_and_engine(tiny_qwen3, backend, seqs, drafts)
    runner = engine.graph_runner
    decoded, replay = [], runner.replay
    runner.replay = lambda batch: (batch.is_decode and decoded.append(batch.size)) or replay(batch)
    got = _verify_logits(engine, seqs, drafts)
    assert decoded == [ROWS]
    assert got.shape == ref.shape and rel_err(got.float(), ref.float()) < BF16_TOL
    runner.verify_as_decode = False  # the verify graph (a 16-row block)
    blocks = _verify_logits(engine, seqs, drafts)
    assert decoded == [ROWS] and rel_err(blocks.float(), ref.float()) < BF16_TOL


def test_ngram_on_the_gpu_accepts_drafts_and_frees_everything(tiny_qwen3):
    """Random weights loop, so n-grams match: verify steps (graphs) accept drafts, every request gets its
    tokens, nothing is held at rest. (Token equality with speculation off is the CPU tests' check, in
    float32: in bfloat16 a verify row's kernels differ from a decode step's, so near-ties, frequent
    with random weights, flip as they do between batch sizes; seen on an H200: 6 of these 8 requests
    identical over 48 tokens, the verify logits within BF16_TOL of the torch backend above.)"""
    prompts = gpu_seqs(512, [8, 30, 12, 50, 9, 17, 64, 5])
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    with LLM(str(tiny_qwen3), device="cuda", memory_ratio=0.2, speculative_method="ngram") as llm:
        outs = llm.generate(prompts, params)
        assert llm.scheduler.spec.accepted > 0 and llm.scheduler.spec.verify_steps > 0
        assert [len(o.token_ids) for o in outs] == [48] * len(prompts)
        check_clean(llm.scheduler)
