"""GPU path: FlashInfer backends against the torch backend, CUDA graph replay against the same compiled
code without a graph, transformers on a tiny model, seeded sampling on the GPU. Skips without CUDA.

All tests use one attention shape (head_dim 128, 16 query / 8 KV heads, bf16: Qwen3-0.6B's), so the
FlashInfer kernels compile once. Run them all with `python -m pytest tests/gpu`.
"""

import gc
import importlib.util
import weakref

import pytest
import torch
import transformers
from conftest import GPU_PROMPT_LENS as PROMPT_LENS
from conftest import GPU_STEPS as STEPS
from conftest import (
    check_clean,
    gpu_seqs,
    one_decode_step,
    rel_err,
    teacher_forced_logits,
)
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

from minisgl.core import SamplingParams
from minisgl.engine import Engine, EngineConfig
from minisgl.scheduler import BatchPreparer, Scheduler, SchedulerConfig, generate

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="needs flashinfer"),
]
BF16_TOL = 2e-2


def _engine(folder, **kw) -> Engine:
    kw.setdefault("dtype", torch.bfloat16)
    kw.setdefault("device", "cuda")
    kw.setdefault("max_running_req", 64)
    kw.setdefault("num_page_override", 2048)
    return Engine(EngineConfig(model_path=str(folder), **kw))


def _tf(engine: Engine, seqs, prompt_lens) -> torch.Tensor:
    return teacher_forced_logits(engine, seqs, prompt_lens, STEPS)


# "fi/cc": `fi` with FlashInfer's CUDA-core decode kernel instead of the tensor-core one; "+triton": the
# Triton decode kernel for these decode batches (of 5), FlashInfer for prefill
@pytest.mark.parametrize("backend", ["fi", "fi/cc", "fa,fi", "fa", "fa,fi+triton"])
@pytest.mark.parametrize("page_size", [1, 16, 256])
def test_flashinfer_matches_torch_backend(tiny_qwen3, backend, page_size):
    extra = {"decode_triton_max_bs": 0}  # FlashInfer's decode kernels, which small batches skip by default
    if backend == "fi/cc":
        backend, extra["tensor_core_min_group"] = "fi", 1000
    if backend.endswith("+triton"):
        backend, extra["decode_triton_max_bs"] = backend.removesuffix("+triton"), 8
    seqs = gpu_seqs(512)
    ref = _tf(_engine(tiny_qwen3, attention_backend="torch", page_size=page_size), seqs, PROMPT_LENS)
    got = _tf(
        _engine(tiny_qwen3, attention_backend=backend, page_size=page_size, cuda_graph_max_bs=0, **extra),
        seqs,
        PROMPT_LENS,
    )
    assert rel_err(got, ref) < BF16_TOL


@pytest.mark.parametrize("backend", ["fi", "fa,fi"])
def test_compiled_prefill_and_graphs_match_torch_backend(tiny_qwen3, backend):
    """With graphs on, prefill runs the compiled forward (several requests, and one) and decode replays
    graphs (of 1 to 5 rows): against the eager torch backend. The forward compiled once for all of it:
    one entry in dynamo's cache of the model's forward (emptied first: engines of one model class share
    their compiled code, the weights being inputs of the graph)."""
    seqs = gpu_seqs(512)
    ref_engine = _engine(tiny_qwen3, attention_backend="torch", page_size=16)
    ref = _tf(ref_engine, seqs, PROMPT_LENS)
    code = type(ref_engine.model).forward.__code__
    torch._dynamo.reset()
    engine = _engine(
        tiny_qwen3, attention_backend=backend, page_size=16, cuda_graph_max_bs=8, prefill_graph_max_tokens=0
    )
    assert engine.graph_runner.enabled and not engine.graph_runner.prefill_sizes
    calls = []
    run = engine.graph_runner.run_compiled
    engine.graph_runner.run_compiled = lambda batch: calls.append(len(batch.reqs)) or run(batch)
    assert rel_err(_tf(engine, seqs, PROMPT_LENS), ref) < BF16_TOL
    assert rel_err(_tf(engine, seqs[3:4], PROMPT_LENS[3:4]), ref[3:4]) < BF16_TOL
    assert calls == [len(PROMPT_LENS), 1]  # the two prefills; every decode step replayed a graph
    assert len(_debug_get_cache_entry_list(code)) == 1


@pytest.mark.parametrize("backend", ["fi", "fa,fi"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_prefill_graphs_match_torch_backend(tiny_qwen3, backend, page_size):
    """Prefill batches of up to prefill_graph_max_tokens (here 256: the five prompts' layout takes 304
    tokens, so it runs compiled, and each one alone replays a graph) against the eager torch backend;
    a prompt in two chunks (the second behind a cached prefix of 100 tokens) replays two graphs; a
    sequence past prefill_graph_max_context runs compiled."""
    seqs = gpu_seqs(512)
    ref = _tf(_engine(tiny_qwen3, attention_backend="torch", page_size=page_size), seqs, PROMPT_LENS)
    engine = _engine(
        tiny_qwen3,
        attention_backend=backend,
        page_size=page_size,
        cuda_graph_max_bs=8,
        prefill_graph_max_tokens=256,
        prefill_graph_max_context=160,
    )
    runner = engine.graph_runner
    assert runner.prefill_sizes == [16, 32, 64, 128, 256]
    compiled, replayed = [], []
    run, replay = runner.run_compiled, runner.replay_prefill
    runner.run_compiled = lambda batch: compiled.append(batch.num_tokens) or run(batch)
    runner.replay_prefill = lambda batch: replayed.append(batch.num_tokens) or replay(batch)
    assert rel_err(_tf(engine, seqs, PROMPT_LENS), ref) < BF16_TOL
    assert compiled == [sum(PROMPT_LENS)] and replayed == []
    for i, n in enumerate(PROMPT_LENS):
        assert rel_err(_tf(engine, seqs[i : i + 1], [n]), ref[i : i + 1]) < BF16_TOL
    assert compiled == [sum(PROMPT_LENS)] and replayed == PROMPT_LENS
    # two requests in one graph (7 + 33 tokens: 16 + 48 of the layout, the 64-token graph)
    assert rel_err(_tf(engine, seqs[:2], PROMPT_LENS[:2]), ref[:2]) < BF16_TOL
    assert replayed[-1] == 40
    # the 150-token prompt in chunks of 100 and 50, then decoded; then past the context limit
    prep, got = BatchPreparer(engine), []
    req = prep.add_request(seqs[3][:150], SamplingParams(max_tokens=4))
    got.append(engine.forward_logits(prep.prefill([req], 100)))
    got.append(engine.forward_logits(prep.prefill([req], 100)))
    prep.release(req)
    assert replayed[-2:] == [100, 50]
    assert rel_err(got[1].float(), ref[3, 0:1]) < BF16_TOL
    long_seq = gpu_seqs(512, [170])
    _tf(engine, long_seq, [170])
    assert compiled[-1] == 170


def test_decode_graphs_without_split_kv_match_torch_backend(tiny_qwen3):
    """`decode_split_kv_max_bs=2`: the graphs of 1 and 2 rows split the KV and merge, those of 4 and 8
    run one block per request and KV head; each replays batches of its size against the torch backend."""
    seqs = gpu_seqs(512)
    ref = _tf(_engine(tiny_qwen3, attention_backend="torch", page_size=16), seqs, PROMPT_LENS)
    engine = _engine(
        tiny_qwen3,
        attention_backend="fi",
        page_size=16,
        cuda_graph_bs=(1, 2, 4, 8),
        decode_split_kv_max_bs=2,
        decode_triton_max_bs=0,  # FlashInfer's kernels at every size
        prefill_graph_max_tokens=0,  # the prefills run compiled (counted below)
    )
    backend = engine.attn_backend
    assert [backend.graph_splits_kv(bs) for bs in (1, 2, 4, 8)] == [True, True, False, False]
    calls = []
    run = engine.graph_runner.run_compiled
    engine.graph_runner.run_compiled = lambda batch: calls.append(len(batch.reqs)) or run(batch)
    for rows in (slice(3, 4), slice(0, 2), slice(0, 3), slice(0, 5)):  # graphs 1, 2, 4, 8
        got = _tf(engine, seqs[rows], PROMPT_LENS[rows])
        assert rel_err(got, ref[rows]) < BF16_TOL, rows
    assert calls == [1, 2, 3, 5]  # the prefills only: every decode step replayed a graph


@pytest.mark.parametrize("backend", ["fi", "fa,fi"])
@pytest.mark.parametrize("graphs", [True, False])
def test_triton_decode_matches_torch_backend(tiny_qwen3, backend, graphs):
    """`decode_triton_max_bs=4`: decode batches of up to 4 (graphs 1, 2 and 4, or eager batches of 1 to 3)
    attend with the Triton split-KV kernel, larger ones with FlashInfer's; each against the torch backend."""
    seqs = gpu_seqs(512)
    ref = _tf(_engine(tiny_qwen3, attention_backend="torch", page_size=16), seqs, PROMPT_LENS)
    graph_kw = dict(cuda_graph_bs=(1, 2, 4, 8)) if graphs else dict(cuda_graph_max_bs=0)
    engine = _engine(tiny_qwen3, attention_backend=backend, page_size=16, decode_triton_max_bs=4, **graph_kw)
    attn = engine.attn_backend
    assert attn.triton_decode_max_bs == 4 and sorted(attn._graph_wrappers) == ([8] if graphs else [])
    seen = []
    real = attn.attend
    attn.attend = lambda q, layer_id, batch: (
        seen.append(batch.attn_metadata.wrapper is None) or real(q, layer_id, batch)
    )
    for rows in (slice(3, 4), slice(0, 2), slice(0, 3), slice(0, 5)):
        seen.clear()
        got = _tf(engine, seqs[rows], PROMPT_LENS[rows])
        assert rel_err(got, ref[rows]) < BF16_TOL, rows
        if not graphs:  # eager: every layer's call is seen (graph replays call nothing)
            assert (True in seen) == (rows.stop - rows.start <= 4), rows


def test_transformers_logits_within_bf16(tiny_qwen3):
    seqs = gpu_seqs(512, [40, 12])
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()
    with torch.no_grad():
        full = [model(torch.tensor([s])).logits[0] for s in seqs]
    want = torch.stack(
        [torch.stack([f[n - 1 + i] for i in range(STEPS + 1)]) for f, n in zip(full, [40, 12])]
    )
    got = _tf(_engine(tiny_qwen3, attention_backend="fi", page_size=16), seqs, [40, 12])
    assert rel_err(got.cpu(), want) < BF16_TOL


def test_chunked_prefill_matches_whole(tiny_qwen3):
    engine = _engine(tiny_qwen3, attention_backend="fi", page_size=16, cuda_graph_max_bs=0)
    prompts = [s[:n] for s, n in zip(gpu_seqs(512), PROMPT_LENS)]
    whole = generate(engine, prompts, SamplingParams(max_tokens=8))
    assert generate(engine, prompts, SamplingParams(max_tokens=8), chunk_size=40) == whole


@pytest.mark.parametrize("backend", ["fi", "fa"])
def test_graph_replay_bit_identical_to_compiled(tiny_qwen3, backend):
    """The same compiled forward with and without a CUDA graph, on captured and uncaptured sizes."""
    graphs = _engine(
        tiny_qwen3,
        attention_backend=backend,
        page_size=16,
        cuda_graph_bs=(1, 2, 4, 8, 16),
        cuda_graph_max_bs=16,
        prefill_graph_max_tokens=0,  # prefill as plain runs it (a prefill graph attends with Triton)
    )
    plain = _engine(tiny_qwen3, attention_backend=backend, page_size=16, cuda_graph_max_bs=0)
    # both run the same compiled function outside graphs (prefill, uncaptured sizes): only the graph differs
    plain.model.forward = graphs.model.forward = graphs.graph_runner.compiled_forward
    graphs.graph_runner.can_run_compiled = lambda batch: False  # no padded prefill: plain has none
    assert graphs.graph_runner.batch_sizes == [1, 2, 4, 8, 16]
    g = torch.Generator().manual_seed(2)
    for bs in (1, 2, 3, 4, 7, 8, 16, 17, 30):  # every captured graph replays, padded or not
        prompts = [
            torch.randint(3, 512, (int(torch.randint(1, 90, (1,), generator=g)),), generator=g).tolist()
            for _ in range(bs)
        ]
        out = [generate(e, prompts, SamplingParams(max_tokens=6)) for e in (graphs, plain)]
        assert out[0] == out[1], f"bs={bs}"
        # logits of one decode step, bit for bit
        logits = []
        for e in (graphs, plain):
            step_logits, replayed = one_decode_step(e, prompts)
            assert replayed == (e is graphs and bs <= 16)
            logits.append(step_logits)
        assert torch.equal(logits[0], logits[1]), f"bs={bs}"


def test_fused_kernels_match_unfused_on_gpu(tiny_qwen3):
    """The fused kernels (q/k-norm + RoPE + KV store; for one row, add + RMSNorm and SiLU-and-multiply
    in the GEMV) against the unfused layers: a batch (compiled prefill, graph replays) and one request
    (the one-row graph), teacher-forced, within bf16; the fused path is what the engines run."""
    seqs = gpu_seqs(512)
    for lens, rows in ((PROMPT_LENS, slice(None)), (PROMPT_LENS[3:4], slice(3, 4))):
        logits = []
        for fused in (True, False):
            engine = _engine(
                tiny_qwen3, attention_backend="fi", page_size=16, cuda_graph_max_bs=8, use_fused_kernels=fused
            )
            assert engine.ctx.use_fused_kernels is fused
            logits.append(_tf(engine, seqs[rows], lens))
            engine.shutdown()
        assert rel_err(logits[0], logits[1]) < BF16_TOL


def test_seeded_sampling_batch_invariant_on_gpu(tiny_qwen3):
    """With `batch_invariant` (cuBLAS for every row count, eager prefill). By default a row decoded alone
    takes the GEMV kernel and a prefill the compiled graph, whose roundings differ from a batch's: on the
    H200 two or three of these five requests then diverged (perf/gpu_ablation.py)."""
    engine = _engine(tiny_qwen3, attention_backend="fi", page_size=16, batch_invariant=True)
    prompts = [s[:n] for s, n in zip(gpu_seqs(512), PROMPT_LENS)]
    params = [
        SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=12) for i in range(len(prompts))
    ]
    together = generate(engine, prompts, params)
    alone = [generate(engine, [p], [sp])[0] for p, sp in zip(prompts, params)]
    assert together == alone


def test_overlap_scheduling_equals_plain_on_gpu(tiny_qwen3):
    """Overlap scheduling (decode inputs read from the device, tokens read one step late) with CUDA graphs
    and chunked prefill gives the tokens the plain loop gives, and frees every page and table_idx."""
    engine = _engine(tiny_qwen3, attention_backend="fa,fi", page_size=16)
    prompts = [s[:n] for s, n in zip(gpu_seqs(512), PROMPT_LENS)] * 3
    params = [
        SamplingParams(max_tokens=5 + 3 * i, ignore_eos=i % 2 == 0, temperature=0.0 if i % 3 else 0.8, seed=i)
        for i in range(len(prompts))
    ]
    results = []
    for overlap in (False, True):
        sched = Scheduler(
            engine, SchedulerConfig(max_prefill_tokens=64, overlap_scheduling=overlap), eos_token_ids=[2]
        )
        requests = [sched.add_request(p, sp) for p, sp in zip(prompts, params)]
        while sched.has_work():
            sched.step()
        check_clean(sched)  # the prefix cache may keep pages, unreferenced
        results.append([(r.output_ids, r.finish_reason) for r in requests])
    assert results[0] == results[1]


def test_a_cuda_engine_runs_its_host_work_on_one_thread(tiny_qwen3):
    """A process driving a GPU uses CUDA_HOST_THREADS intra-op threads unless host_threads says."""
    from minisgl.engine.config import CUDA_HOST_THREADS

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        _engine(tiny_qwen3, cuda_graph_max_bs=0).shutdown()
        assert torch.get_num_threads() == CUDA_HOST_THREADS
        _engine(tiny_qwen3, cuda_graph_max_bs=0, host_threads=3).shutdown()
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_shutdown_gives_back_the_device_memory_while_the_engine_is_held(tiny_qwen3):
    """`Engine.shutdown` gives back the device memory the engine took, its weights too, while the caller
    still holds the engine: the graph runner's compiled forward (`torch.compile` of the bound
    `model.forward`) kept the model until its `destroy` let go of it. Decode, prefill and sampler graphs
    were captured, and a prefill and a decode step replayed the model's. (cuBLAS keeps a workspace per
    stream for the process: let go of on both sides of the comparison.)"""
    gc.collect()
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    engine = _engine(
        tiny_qwen3, cuda_graph_max_bs=8, prefill_graph_max_tokens=64, prefill_graph_max_context=64
    )
    assert engine.graph_runner.prefill_sizes and one_decode_step(engine, [[5, 6, 7], [8, 9]])[1]
    held = [weakref.ref(t) for t in (*engine.model.parameters(), *engine.model.buffers())]
    engine.shutdown()
    gc.collect()
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    assert [ref() for ref in held] == [None] * len(held)
    assert torch.cuda.memory_allocated() - before < 4 << 20
