"""Embeddings on CUDA (docs/embeddings.md): a tiny Qwen3 in bfloat16, inputs of several lengths (chunked
and not) against transformers' AutoModel in float32, and embedding inputs in the same steps as greedy
generations (their tokens as alone). Skips without CUDA."""

import pytest
import torch
from conftest import gpu_seqs, llm_clean

from minisgl.core import SamplingParams
from minisgl.llm import LLM

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_embeddings_match_transformers_beside_generation(tiny_qwen3, pooling) -> None:
    import transformers

    inputs = [s[:n] for s, n in zip(gpu_seqs(), [7, 33, 1, 150, 64])]
    model = transformers.AutoModel.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()
    settings = dict(device="cuda", dtype="bfloat16", max_prefill_tokens=64, batch_invariant=True)
    with LLM(str(tiny_qwen3), pooling=pooling, **settings) as llm:
        greedy = SamplingParams(max_tokens=16, ignore_eos=True)
        alone = [out.token_ids for out in llm.generate(inputs[:2], greedy)]
        ids, params = llm.embedding_requests(inputs)
        states = [llm.scheduler.add_request(p, greedy) for p in inputs[:2]]
        states += [llm.scheduler.add_request(item, params) for item in ids]
        llm._run_until_finished(states, progress=False)
        assert [s.output_ids for s in states[:2]] == alone
        for state, item in zip(states[2:], inputs):
            with torch.no_grad():
                hidden = model(torch.tensor([item])).last_hidden_state[0]
            expected = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[pooling]
            cos = torch.nn.functional.cosine_similarity(torch.tensor(state.embedding), expected, dim=0)
            assert cos.item() >= 0.999
        llm_clean(llm)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_pool_from_the_prefill_graphs_and_the_compiled_forward(tiny_qwen3, pooling) -> None:
    """With CUDA graphs (the default engine): inputs that fit a prefill graph pool from its hidden-state
    output, longer ones from the compiled forward's, none from the eager model; the vectors agree with
    transformers' and a greedy generation in the same steps gives its tokens."""
    import transformers

    inputs = [s[:n] for s, n in zip(gpu_seqs(), [7, 33, 1, 150, 64])]
    model = transformers.AutoModel.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()
    settings = dict(device="cuda", dtype="bfloat16", prefill_graph_max_tokens=128, max_prefill_tokens=512)
    with LLM(str(tiny_qwen3), pooling=pooling, **settings) as llm:
        runner = llm.engine.graph_runner
        assert runner.prefill_sizes, "the engine has prefill graphs"
        calls = []
        replay, compiled = runner.replay_prefill, runner.run_compiled_hidden
        runner.replay_prefill = lambda batch, hidden=False: (
            calls.append(("graph", hidden)) or replay(batch, hidden)
        )
        runner.run_compiled_hidden = lambda batch: calls.append(("compiled", True)) or compiled(batch)
        eager = llm.engine.forward_path._eager
        llm.engine.forward_path._eager = lambda batch, pool: (
            calls.append(("eager", pool is not None)) or eager(batch, pool)
        )
        try:
            short = llm.embed(inputs[:3])  # 41 tokens: one prefill graph
            long = llm.embed(inputs[3:])  # 214 tokens: above the largest graph, the compiled forward
        finally:
            runner.replay_prefill, runner.run_compiled_hidden = replay, compiled
            llm.engine.forward_path._eager = eager
        assert ("graph", True) in calls and ("compiled", True) in calls
        assert not [c for c in calls if c[0] == "eager"], calls
        for vector, item in zip(short + long, inputs):
            with torch.no_grad():
                hidden = model(torch.tensor([item])).last_hidden_state[0]
            expected = {"last": hidden[-1], "mean": hidden.mean(0)}[pooling]
            cos = torch.nn.functional.cosine_similarity(torch.tensor(vector), expected, dim=0)
            assert cos.item() >= 0.999, cos
        llm_clean(llm)
