"""CPU benchmarks of the engine on SmolLM2-135M-Instruct (float32): decode steps and a prefill.

Run with `nox -s perf` (or `python -m pytest perf/cpu --benchmark-only`).
"""

import pytest
import torch

from minisgl.core import SamplingParams
from minisgl.engine import Engine, EngineConfig
from minisgl.models import default_model_path
from minisgl.scheduler import BatchPreparer

CONTEXT = 128  # tokens already in the cache when a decode step runs


@pytest.fixture(scope="module")
def engine():
    engine = Engine(EngineConfig(model_path=str(default_model_path()), dtype=torch.float32, device="cpu"))
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("batch_size", [1, 16])
def test_decode_step(benchmark, engine, batch_size):
    """One decode step: batch preparation, forward, sampling, token copy."""
    prep = BatchPreparer(engine)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 49152, (CONTEXT,), generator=gen).tolist() for _ in range(batch_size)]
    reqs = [prep.add_request(p, SamplingParams(max_tokens=8)) for p in prompts]
    batch = prep.prefill(reqs)
    engine.forward_batch(batch, prep.sampling_args(batch))
    for req in reqs:
        req.input_ids.append(17)

    def step():
        for req in reqs:  # recompute the same position each round, so the context stays CONTEXT long
            req.cached_len = len(req.input_ids) - 1
        batch = prep.decode(reqs)
        out = engine.forward_batch(batch, prep.sampling_args(batch))
        out.copy_done_event.synchronize()

    benchmark.extra_info["tokens_per_round"] = batch_size
    benchmark.pedantic(step, rounds=20, warmup_rounds=2)
    prep.release(reqs)


def test_prefill_512(benchmark, engine):
    """A 512-token prompt prefilled in one forward."""
    prep = BatchPreparer(engine)
    prompt = torch.randint(0, 49152, (512,), generator=torch.Generator().manual_seed(1)).tolist()

    def prefill():
        req = prep.add_request(prompt, SamplingParams(max_tokens=1))
        batch = prep.prefill([req])
        out = engine.forward_batch(batch, prep.sampling_args(batch))
        out.copy_done_event.synchronize()
        prep.release(req)

    benchmark.extra_info["tokens_per_round"] = 512
    benchmark.pedantic(prefill, rounds=5, warmup_rounds=1)
