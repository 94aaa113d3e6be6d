"""Failure isolation on the GPU path: a fault injected into a step (the sampler, the model, the wait for
the tokens' copy) with overlap scheduling, CUDA graphs and pinned copies finishes that step's requests
with "error"; the others, and the same requests run again, give their single-run tokens (a
batch-invariant engine, so a request's tokens do not depend on its batch). Skips without CUDA."""

import importlib.util

import pytest
import torch
from conftest import GPU_SHAPE, check_clean, make_tiny_model
from test_failures import FAULT, GREEDY, OFFENDER, PEERS, inject_fault

from minisgl.engine import Engine, EngineConfig
from minisgl.scheduler import Scheduler, SchedulerConfig, generate

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="needs flashinfer"),
]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    folder = make_tiny_model(tmp_path_factory.mktemp("models"), "qwen3", randomize=(), **GPU_SHAPE)
    config = EngineConfig(
        model_path=str(folder),
        dtype=torch.bfloat16,
        device="cuda",
        max_running_req=8,
        num_page_override=256,
        batch_invariant=True,
    )
    engine = Engine(config)
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("phase", ["prefill", "decode"])
@pytest.mark.parametrize("stage", ["model", "sampler", "device"])
def test_a_failing_step_on_the_gpu_leaves_the_others_and_the_graphs_intact(engine, stage, phase):
    expected = {tuple(p): generate(engine, [p], GREEDY)[0] for p in [*PEERS, OFFENDER]}
    sched = Scheduler(
        engine, SchedulerConfig(max_prefill_tokens=16, overlap_scheduling=True), eos_token_ids=[2]
    )
    hit = inject_fault(sched, stage, phase, OFFENDER)
    try:
        peers = [sched.add_request(p, GREEDY) for p in PEERS]
        for _ in range(3):
            sched.step()
        offender = sched.add_request(OFFENDER, GREEDY)
        for _ in range(200):
            if not sched.has_work():
                break
            sched.step()
    finally:  # the engine is shared: take the injected wrappers off again
        for obj in (engine, engine.forward_path, engine.sampler):
            for name in ("run", "forward_batch", "sample"):
                obj.__dict__.pop(name, None)
    assert hit and not sched.has_work()
    assert offender.finish_reason == "error" and FAULT in offender.error
    for state in peers:
        assert state.finish_reason in ("length", "error")
        if state.finish_reason == "length":
            assert state.output_ids == expected[tuple(state.prompt_ids)]
    assert (phase == "prefill") == all(state.finish_reason == "length" for state in peers)
    check_clean(sched)
    # the engine (KV pool, page table, graphs) is intact: the same requests again, in a new scheduler
    sched = Scheduler(
        engine, SchedulerConfig(max_prefill_tokens=16, overlap_scheduling=True), eos_token_ids=[2]
    )
    again = [sched.add_request(p, GREEDY) for p in [*PEERS, OFFENDER]]
    while sched.has_work():
        sched.step()
    assert [s.output_ids for s in again] == [expected[tuple(p)] for p in [*PEERS, OFFENDER]]
