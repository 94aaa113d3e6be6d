"""Mistral's sliding window on the GPU: a tiny Mistral of the GPU tests' attention shape
(tests/conftest.py GPU_SHAPE: head_dim 128, 16 query / 8 KV heads, bf16) with a window of 64 tokens. Its
prompts of 1 to 150 tokens and 6 decode steps after each (the 150- and 64-token ones pass the window)
run through every attention path against the torch backend on the GPU, whose mask tests/test_mistral.py
checks against transformers on the CPU: FlashInfer's FA2 prefill with its tensor-core and CUDA-core
decode, FA3 prefill and decode, the Triton decode kernel (eager and in CUDA graphs), the Triton prefill
kernel of the prefill graphs, chunked prefill behind a cached prefix (FA3 and FA2); and transformers in
float32. The same weights without the window give logits 0.4 away (relative; 20x the bound), so a path
that ignored the window would fail. Skips without CUDA or flashinfer:

    python -m pytest tests/gpu/test_gpu_mistral.py
"""

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from conftest import GPU_PROMPT_LENS as PROMPT_LENS
from conftest import GPU_SHAPE, gpu_seqs, make_tiny_model, rel_err, teacher_forced_logits
from conftest import GPU_STEPS as STEPS

from minisgl.core import SamplingParams
from minisgl.engine import Engine, EngineConfig
from minisgl.scheduler import BatchPreparer

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="needs flashinfer"),
]
BF16_TOL = 2e-2
WINDOW = 64


def _engine(folder: Path, **kw) -> Engine:
    kw = {"dtype": torch.bfloat16, "device": "cuda", "max_running_req": 64, "num_page_override": 2048, **kw}
    return Engine(EngineConfig(model_path=str(folder), **kw))


def _tf(engine: Engine, rows: slice = slice(None)) -> torch.Tensor:
    return teacher_forced_logits(engine, gpu_seqs(512)[rows], PROMPT_LENS[rows], STEPS)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """The windowed model, and a copy of it (the same weights) without the window."""
    root = tmp_path_factory.mktemp("mistral")
    windowed = make_tiny_model(root, "mistral", randomize=(), sliding_window=WINDOW, **GPU_SHAPE)
    full = root / "full"
    shutil.copytree(windowed, full)
    config = json.loads((full / "config.json").read_text())
    (full / "config.json").write_text(json.dumps({**config, "sliding_window": None}))
    return {"windowed": windowed, "full": full}


@pytest.fixture(scope="module")
def reference(folders) -> torch.Tensor:
    """The torch backend's logits with the window (page size 16), checked against transformers in
    float32 and against the same model without its window."""
    engine = _engine(folders["windowed"], attention_backend="torch", page_size=16)
    assert engine.attn_backend.sliding_window == WINDOW
    ref = _tf(engine)
    engine.shutdown()
    model = transformers.AutoModelForCausalLM.from_pretrained(folders["windowed"], dtype=torch.float32)
    with torch.no_grad():
        full = [model.eval()(torch.tensor([s])).logits[0] for s in gpu_seqs(512)]
    want = torch.stack([f[n - 1 : n + STEPS] for f, n in zip(full, PROMPT_LENS)])
    assert rel_err(ref.cpu(), want) < BF16_TOL
    unwindowed = _engine(folders["full"], attention_backend="torch", page_size=16)
    assert unwindowed.attn_backend.sliding_window is None
    assert rel_err(_tf(unwindowed), ref) > 10 * BF16_TOL
    unwindowed.shutdown()
    return ref


# "fi/cc": `fi` with FlashInfer's CUDA-core decode kernel; "+triton": the Triton decode kernel for these
# decode batches (of 5), FlashInfer for prefill
@pytest.mark.parametrize("backend", ["fi", "fi/cc", "fa,fi", "fa", "fa,fi+triton", "fi+triton"])
@pytest.mark.parametrize("page_size", [1, 16, 256])
def test_every_backend_applies_the_window(folders, reference, backend, page_size):
    extra = {"decode_triton_max_bs": 0}
    if backend == "fi/cc":
        backend, extra["tensor_core_min_group"] = "fi", 1000
    if backend.endswith("+triton"):
        backend, extra["decode_triton_max_bs"] = backend.removesuffix("+triton"), 8
    engine = _engine(
        folders["windowed"], attention_backend=backend, page_size=page_size, cuda_graph_max_bs=0, **extra
    )
    assert engine.attn_backend.window_left == WINDOW - 1  # FlashInfer's count: the keys left of the query
    assert rel_err(_tf(engine), reference) < BF16_TOL
    engine.shutdown()


@pytest.mark.parametrize("backend", ["fi", "fa,fi"])
def test_graphs_and_the_triton_kernels_apply_the_window(folders, reference, backend):
    """CUDA graphs on: decode graphs of 1 to 8 (those up to 4 with the Triton decode kernel, 8 with
    FlashInfer's), each prompt alone as a prefill graph (the Triton prefill kernel), the five together
    compiled; every decode step replayed a graph."""
    engine = _engine(
        folders["windowed"],
        attention_backend=backend,
        page_size=16,
        cuda_graph_bs=(1, 2, 4, 8),
        decode_triton_max_bs=4,
        prefill_graph_max_tokens=256,
        prefill_graph_max_context=512,
    )
    runner = engine.graph_runner
    compiled, replayed = [], []
    run, replay = runner.run_compiled, runner.replay_prefill
    runner.run_compiled = lambda batch: compiled.append(batch.num_tokens) or run(batch)
    runner.replay_prefill = lambda batch: replayed.append(batch.num_tokens) or replay(batch)
    assert rel_err(_tf(engine), reference) < BF16_TOL  # decode graph 8 (FlashInfer)
    for i in range(len(PROMPT_LENS)):  # decode graph 1 (Triton)
        assert rel_err(_tf(engine, slice(i, i + 1)), reference[i : i + 1]) < BF16_TOL, i
    # the five prompts' layout takes 304 tokens: compiled; each alone replays a prefill graph
    assert compiled == [sum(PROMPT_LENS)] and replayed == PROMPT_LENS
    assert rel_err(_tf(engine, slice(1, 4)), reference[1:4]) < BF16_TOL  # decode graph 4 (Triton)
    assert replayed[-1] == sum(PROMPT_LENS[1:4])  # 48 + 16 + 160 tokens of layout: the 256 graph
    engine.shutdown()


@pytest.mark.parametrize("backend", ["fi", "fa,fi"])
@pytest.mark.parametrize("graphs", [False, True])
def test_chunked_prefill_behind_the_window(folders, reference, backend, graphs):
    """The 150-token prompt in chunks of 40 (each chunk's queries behind a cached prefix longer than the
    window), then decoded: the last chunk's logits and each step's are the whole prompt's. With graphs
    the chunks replay prefill graphs (the Triton prefill kernel), without them FlashInfer's prefill."""
    kw = dict(cuda_graph_max_bs=8, prefill_graph_max_tokens=64) if graphs else dict(cuda_graph_max_bs=0)
    engine = _engine(folders["windowed"], attention_backend=backend, page_size=16, **kw)
    seq, n = gpu_seqs(512)[3], PROMPT_LENS[3]
    prep = BatchPreparer(engine)
    req = prep.add_request(seq[:n], SamplingParams(max_tokens=STEPS + 1))
    for _ in range(3):
        engine.forward_logits(prep.prefill([req], 40))
    got = [engine.forward_logits(prep.prefill([req], 40))]
    assert req.cached_len == n
    for step in range(STEPS):
        req.input_ids.append(seq[n + step])
        got.append(engine.forward_logits(prep.decode([req])))
    prep.release(req)
    assert rel_err(torch.cat(got).float(), reference[3]) < BF16_TOL
    engine.shutdown()
