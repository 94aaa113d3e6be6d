"""Tensor parallelism on two GPUs: teacher-forced logits of TP=2 within the bf16 bound of TP=1 and the
same on both ranks, with the one-shot all-reduce and with NCCL alone; `LLM(tp=2)` with overlap
scheduling, CUDA graphs and sampling, both ways of keeping the ranks' tokens equal (the shared seeded
sampler, or rank 0's tokens broadcast)."""

import queue
import socket

import pytest
import torch
import torch.multiprocessing as mp
from conftest import GPU_PROMPT_LENS as PROMPT_LENS
from conftest import GPU_STEPS as STEPS
from conftest import gpu_seqs, rel_err, teacher_forced_logits
from test_gpu import BF16_TOL
from test_gpu import pytestmark as one_gpu_marks

from minisgl.core import SamplingParams
from minisgl.distributed import DistributedInfo
from minisgl.engine import Engine, EngineConfig

pytestmark = [
    *one_gpu_marks,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]


def _engine(folder, rank: int = 0, size: int = 1, port: int = 0, one_shot: bool = True) -> Engine:
    return Engine(
        EngineConfig(
            model_path=str(folder),
            tp_info=DistributedInfo(rank, size),
            device=f"cuda:{rank}",
            dtype=torch.bfloat16,
            max_running_req=64,
            num_page_override=2048,
            cuda_graph_max_bs=4,  # decode batches of 5 run compiled: both paths are checked
            distributed_addr=f"tcp://127.0.0.1:{port}",
            distributed_timeout=120,
            one_shot_all_reduce_max_bytes=(2 << 20) if one_shot else 0,
        )
    )


def _rank(rank: int, size: int, folder, port: int, one_shot: bool, results) -> None:
    from minisgl import distributed

    engine = _engine(folder, rank, size, port, one_shot)
    try:
        used = distributed._one_shot is not None
        results.put((rank, used, teacher_forced_logits(engine, gpu_seqs(), PROMPT_LENS, STEPS).cpu()))
    finally:
        engine.shutdown()


@pytest.mark.parametrize("one_shot", [True, False])
def test_tp2_teacher_forced_logits_match_tp1_and_agree_between_ranks(tiny_qwen3, one_shot):
    single = _engine(tiny_qwen3)
    try:
        want = teacher_forced_logits(single, gpu_seqs(), PROMPT_LENS, STEPS).cpu()
    finally:
        single.shutdown()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_rank, args=(r, 2, tiny_qwen3, port, one_shot, results), daemon=True)
        for r in range(2)
    ]
    for p in procs:
        p.start()
    try:
        reported = [results.get(timeout=300) for _ in range(2)]
        got = {rank: logits for rank, _, logits in reported}
        assert [used for _, used, _ in reported] == [one_shot, one_shot]
    except queue.Empty:
        pytest.fail(f"TP=2 ranks gave no logits (exit codes {[p.exitcode for p in procs]})")
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    err = rel_err(got[0], want)
    print(
        f"TP=2 (one-shot all-reduce: {one_shot}) teacher-forced logits against TP=1: relative error {err:.2e}"
    )
    assert err < BF16_TOL
    assert torch.equal(got[0], got[1])  # all-gathered: every rank samples from the same logits


@pytest.mark.parametrize("broadcast,one_shot", [(False, False), (True, False), (False, True)])
def test_llm_tp2_with_overlap_graphs_and_sampling(tiny_qwen3, broadcast, one_shot):
    """Greedy and unseeded sampled requests over two GPUs: every request runs to max_tokens with CUDA
    graphs replayed; the follower checks its tokens against rank 0's every step and ends cleanly."""
    from minisgl.llm import LLM

    llm = LLM(
        str(tiny_qwen3),
        tp=2,
        dtype="bfloat16",
        max_running_req=32,
        num_page_override=2048,
        cuda_graph_max_bs=8,
        tp_broadcast_tokens=broadcast,
        one_shot_all_reduce_max_bytes=(2 << 20) if one_shot else 0,
    )
    workers = list(llm.group.workers)
    try:
        assert llm.scheduler.overlap
        llm.scheduler.record_steps = 200
        prompts = [s[:n] for s, n in zip(gpu_seqs(), PROMPT_LENS)] * 4
        # lengths that differ, so the batch shrinks below cuda_graph_max_bs and graphs replay
        lengths = [12 + i for i in range(len(prompts))]
        params = [
            SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0 if i % 2 else 0.8)
            for i, n in enumerate(lengths)
        ]
        outs = llm.generate(prompts, params)
        assert [len(o.token_ids) for o in outs] == lengths
        assert all(o.finish_reason == "length" for o in outs)
        assert any(r.mode == "cuda_graph" for r in llm.scheduler.step_records)
    finally:
        llm.shutdown()
    assert [p.exitcode for p in workers] == [0]
