"""The host's share of a decode step at batch 256: the scheduler's step with the model forward and the
sampler replaced by a stub that returns the tokens at once, so what is timed is only the host work
the GPU path also does each step (scheduling, the decode batch and its page-table writes, the sampling
arguments and the suppressed-token rows, reading the tokens, the per-token processing with its
metrics; with `logprobs5`, each request's log probability and 5 alternatives read as well). The FlashInfer plan, the other host cost of a GPU step, needs a GPU
(`python -m perf.gpu.attention`).

Run with `nox -s perf -- -k host_step` (or `python -m pytest perf/cpu/test_host_step.py
--benchmark-only`). Overlap scheduling on, as by default.
"""

import pytest
import torch

from minisgl.core import SamplingParams
from minisgl.engine import Engine, EngineConfig
from minisgl.engine.forward import CompletedEvent, ForwardOutput
from minisgl.models import default_model_path
from minisgl.scheduler import Scheduler, SchedulerConfig

BATCH = 256
ROUNDS = 60
MAX_LEN = 16 + ROUNDS + 24  # prompt, timed rounds, warm-up and the prefill's steps


def _stub_forward(batch, args):
    """The engine's bookkeeping of a forward (each request's tokens become cached), and token 7 for
    every request, already on the host."""
    for req in batch.reqs:
        req.complete_one()
    tokens = torch.full((len(batch.reqs),), 7, dtype=torch.int32)
    scoring, logprobs = args.logprobs, None
    if scoring is not None:  # log probabilities of the scored rows, as `Sampler.logprobs` shapes them
        rows = len(scoring.lp_rows)
        logprobs = (
            torch.full((rows,), -0.5),
            torch.arange(scoring.top).repeat(rows, 1),
            torch.full((rows, scoring.top), -1.0),
        )
    return ForwardOutput(tokens, tokens, CompletedEvent(), logprobs)


@pytest.mark.parametrize("page_size", [16, 256])
@pytest.mark.parametrize(
    ("temperature", "logprobs"), [(0.0, None), (0.6, None), (0.6, 5)], ids=["greedy", "sampled", "logprobs5"]
)
def test_host_step_batch_256(benchmark, temperature, logprobs, page_size):
    engine = Engine(
        EngineConfig(
            model_path=str(default_model_path()),
            dtype=torch.bfloat16,  # the forward is stubbed; half the KV pool of float32
            device="cpu",
            max_running_req=BATCH,
            page_size=page_size,
            num_page_override=2 * BATCH * -(-MAX_LEN // page_size),  # room to spare: no preemption
        )
    )
    try:
        sched = Scheduler(engine, SchedulerConfig(overlap_scheduling=True), eos_token_ids=[2])
        params = SamplingParams(
            max_tokens=MAX_LEN - 16, temperature=temperature, ignore_eos=True, logprobs=logprobs
        )
        for i in range(BATCH):
            sched.add_request([5 + i % 50] * 16, params)
        for _ in range(20):  # the real prefill (the default chunk takes them in a few steps)
            sched.step()
            if len(sched.running) == BATCH and not sched.waiting:
                break
        assert len(sched.running) == BATCH and not sched.waiting
        engine.forward_batch = _stub_forward
        benchmark.extra_info["batch_size"] = BATCH
        benchmark.pedantic(sched.step, rounds=ROUNDS, warmup_rounds=5)
        assert len(sched.running) == BATCH  # every round was a decode step of all 256
    finally:
        engine.shutdown()
