"""The fused MoE backend on the GPU: against the torch backend at Qwen3-30B-A3B's shapes, no host sync,
CUDA graph replay bit-identical to eager, and engines on Qwen3-MoE models capturing CUDA graphs with it.
Skips without CUDA (and the engine tests without flashinfer, whose attention backend the graphs need).

Run: `python -m pytest tests/gpu/test_gpu_moe.py`.
"""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from conftest import GPU_SHAPE, make_tiny_model, one_decode_step, rel_err, teacher_forced_logits

from minisgl.core import SamplingParams
from minisgl.engine import Engine, EngineConfig
from minisgl.moe import FusedMoeBackend, TorchMoeBackend, create_moe_backend, fused_moe
from minisgl.scheduler import generate

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
needs_flashinfer = pytest.mark.skipif(
    importlib.util.find_spec("flashinfer") is None, reason="needs flashinfer (CUDA graphs need its attention)"
)
needs_grouped_mm_kernel = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] not in (9, 10),
    reason="needs an sm90/sm100 GPU (where torch._grouped_mm has its sync-free kernel)",
)
BF16_TOL = 2e-2
QWEN3_30B_A3B = Path(__file__).resolve().parents[2] / "configs" / "models" / "qwen3-30b-a3b"
# Qwen3-30B-A3B's MoE layer: 128 experts, 8 per token, hidden 2048, expert intermediate 768
EXPERTS, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768


@pytest.fixture(scope="module")
def moe_weights():
    """One layer's expert weights, bf16 on the GPU, scaled like a trained layer's activations."""
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda", generator=g) / HIDDEN**0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", generator=g) / INTER**0.5
    return w13.bfloat16(), w2.bfloat16()


def _inputs(tokens: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, device="cuda", generator=g).bfloat16()
    router_logits = (torch.randn(tokens, EXPERTS, device="cuda", generator=g) * 2).bfloat16()
    return x, router_logits


def test_auto_picks_fused_on_this_gpu():
    device = torch.device("cuda")
    major = torch.cuda.get_device_capability()[0]
    backend = create_moe_backend("auto", device, torch.bfloat16)
    assert isinstance(backend, FusedMoeBackend if major in (9, 10) else TorchMoeBackend)
    assert isinstance(create_moe_backend("auto", device, torch.float16), TorchMoeBackend)


@needs_grouped_mm_kernel
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("tokens", [1, 8, 256, 2048])
def test_fused_matches_torch_backend_at_30b_shapes(moe_weights, tokens, renormalize):
    w13, w2 = moe_weights
    x, router_logits = _inputs(tokens)
    got = FusedMoeBackend().forward(x, router_logits, w13, w2, TOP_K, renormalize)
    want = TorchMoeBackend().forward(x, router_logits, w13, w2, TOP_K, renormalize)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    assert rel_err(got, want) < BF16_TOL
    # and against the reference in float32
    want32 = TorchMoeBackend().forward(
        x.float(), router_logits.float(), w13.float(), w2.float(), TOP_K, renormalize
    )
    assert rel_err(got, want32) < BF16_TOL


@needs_grouped_mm_kernel
def test_fused_empty_batch_and_empty_experts(moe_weights):
    w13, w2 = moe_weights
    x, router_logits = _inputs(0)
    assert FusedMoeBackend().forward(x, router_logits, w13, w2, TOP_K, True).shape == (0, HIDDEN)
    x, router_logits = _inputs(64, seed=2)
    router_logits[:, 16:] = -30.0  # 112 of the 128 experts get no token
    got = FusedMoeBackend().forward(x, router_logits, w13, w2, TOP_K, True)
    assert rel_err(got, TorchMoeBackend().forward(x, router_logits, w13, w2, TOP_K, True)) < BF16_TOL


@needs_grouped_mm_kernel
def test_fused_does_not_sync(moe_weights):
    """CUDA's sync debug mode raises on any device-to-host synchronization (the torch backend has one)."""
    w13, w2 = moe_weights
    x, router_logits = _inputs(256)
    fused_moe(x, router_logits, w13, w2, TOP_K, True)  # warm-up (lazy initialisations may sync once)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fused_moe(x, router_logits, w13, w2, TOP_K, True)
        with pytest.raises(RuntimeError, match="synchroniz"):
            TorchMoeBackend().forward(x, router_logits, w13, w2, TOP_K, True)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@needs_grouped_mm_kernel
@pytest.mark.parametrize("tokens", [1, 8, 256])
def test_fused_graph_replay_bit_identical_to_eager(moe_weights, tokens):
    """Captured once, replayed on new inputs (new routing) in the same static buffers: each replay equals
    eager on the same inputs bit for bit, so nothing of the routing is baked into the graph."""
    w13, w2 = moe_weights
    x, router_logits = _inputs(tokens, seed=3)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fused_moe(x, router_logits, w13, w2, TOP_K, True)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, router_logits, w13, w2, TOP_K, True)
    for seed in (3, 4, 5):
        new_x, new_logits = _inputs(tokens, seed=seed)
        x.copy_(new_x)
        router_logits.copy_(new_logits)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, fused_moe(new_x, new_logits, w13, w2, TOP_K, True)), f"seed {seed}"


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("tokens", [1, 2, 5, 8])
def test_few_token_kernels_at_30b_shapes(moe_weights, monkeypatch, tokens, renormalize):
    """The fused backend sends a decode batch to the few-token kernels (the table says up to 8 tokens
    at these shapes): against the torch backend and float32, and free of host syncs."""
    from minisgl.kernels.linear import gemv_rows
    from minisgl.kernels.moe_gemv import moe_gemv
    from minisgl.moe import fused_backend

    w13, w2 = moe_weights
    assert gemv_rows(w13) >= 8
    calls = []
    monkeypatch.setattr(fused_backend, "moe_gemv", lambda *a: calls.append(1) or moe_gemv(*a))
    x, router_logits = _inputs(tokens, seed=tokens)
    got = fused_moe(x, router_logits, w13, w2, TOP_K, renormalize)
    assert calls == [1]
    want = TorchMoeBackend().forward(x, router_logits, w13, w2, TOP_K, renormalize)
    assert got.dtype == torch.bfloat16 and rel_err(got, want) < BF16_TOL
    want32 = TorchMoeBackend().forward(
        x.float(), router_logits.float(), w13.float(), w2.float(), TOP_K, renormalize
    )
    assert rel_err(got, want32) < BF16_TOL
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fused_moe(x, router_logits, w13, w2, TOP_K, renormalize)
    finally:
        torch.cuda.set_sync_debug_mode("default")


# -- engines ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_qwen3_moe(tmp_path_factory):
    """2 sparse layers and a dense one; the GPU tests' attention shape (GPU_SHAPE: head_dim 128, 16/8
    heads). Top-2 routing: the torch backend's bf16 index_add of two terms rounds like the fused sum."""
    return make_tiny_model(
        tmp_path_factory.mktemp("models"),
        "qwen3_moe",
        randomize=("router", "lm_head"),  # a random router (it starts at zeros) and a decisive LM head
        **GPU_SHAPE,
        moe_intermediate_size=128,
        num_experts=16,
    )


def _engine(folder, **kw) -> Engine:
    kw.setdefault("dtype", torch.bfloat16)
    kw.setdefault("device", "cuda")
    kw.setdefault("attention_backend", "fi")
    kw.setdefault("page_size", 16)
    kw.setdefault("max_running_req", 64)
    kw.setdefault("num_page_override", 1024)
    return Engine(EngineConfig(model_path=str(folder), **kw))


def _prompts(n: int, vocab: int, seed: int = 2) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, vocab, (int(torch.randint(1, 60, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]


@needs_flashinfer
@needs_grouped_mm_kernel
def test_engine_fused_captures_graphs_and_matches_torch(tiny_qwen3_moe):
    fused = _engine(tiny_qwen3_moe, moe_backend="fused", cuda_graph_bs=(1, 2, 4, 8), cuda_graph_max_bs=8)
    assert isinstance(fused.moe_backend, FusedMoeBackend)
    assert fused.graph_runner.enabled and fused.graph_runner.batch_sizes == [1, 2, 4, 8]
    ref = _engine(tiny_qwen3_moe, moe_backend="torch", cuda_graph_bs=(1, 2, 4, 8), cuda_graph_max_bs=8)
    assert isinstance(ref.moe_backend, TorchMoeBackend) and not ref.graph_runner.enabled
    plain = _engine(tiny_qwen3_moe, moe_backend="fused", cuda_graph_max_bs=0)
    # the same compiled forward everywhere (the weights are equal): only the MoE backend and graphs differ
    ref.model.forward = plain.model.forward = fused.graph_runner.compiled_forward

    # graph replay against the same fused code without a graph: the same tokens. (Against the torch
    # backend tokens may part at a near-tie of this random model, bf16 sums in another order: seen at
    # bs=8 on the H200; that comparison is by logits below.)
    for bs in (1, 3, 8):  # captured, padded to 4, captured
        prompts = _prompts(bs, 512, seed=bs)
        params = SamplingParams(max_tokens=8, ignore_eos=True)
        assert generate(fused, prompts, params) == generate(plain, prompts, params), f"bs={bs}"

    # one decode step's logits: graph replay vs the same code without a graph, and vs the torch backend
    prompts = _prompts(5, 512, seed=7)
    logits = []
    for e in (fused, plain, ref):
        step_logits, replayed = one_decode_step(e, prompts)
        assert replayed == (e is fused)
        logits.append(step_logits.float())
    assert torch.equal(logits[0], logits[1])
    assert rel_err(logits[0], logits[2]) < BF16_TOL
    for e in (fused, ref, plain):
        e.shutdown()


@needs_flashinfer
@needs_grouped_mm_kernel
def test_engine_qwen3_30b_a3b_shapes_dummy_weights(tmp_path):
    """Qwen3-30B-A3B's config cut to 2 layers, dummy weights: the fused backend with CUDA graphs against
    the torch backend (same compiled forward), teacher-forced over prefill and decode steps."""
    raw = json.loads((QWEN3_30B_A3B / "config.json").read_text())
    folder = tmp_path / "qwen3-30b-a3b-2-layers"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**raw, "num_hidden_layers": 2}))
    common = dict(use_dummy_weight=True, num_page_override=256, max_running_req=16)
    fused = _engine(folder, moe_backend="auto", cuda_graph_bs=(1, 4, 8), cuda_graph_max_bs=8, **common)
    assert isinstance(fused.moe_backend, FusedMoeBackend) and fused.graph_runner.enabled
    ref = _engine(folder, moe_backend="torch", cuda_graph_max_bs=0, **common)
    ref.model.forward = fused.graph_runner.compiled_forward
    g = torch.Generator().manual_seed(3)
    lens, steps = [7, 1, 40, 19], 4
    seqs = [torch.randint(3, raw["vocab_size"], (n + steps,), generator=g).tolist() for n in lens]
    got = teacher_forced_logits(fused, seqs, lens, steps)
    want = teacher_forced_logits(ref, seqs, lens, steps)
    assert rel_err(got, want) < BF16_TOL
    fused.shutdown()
    ref.shutdown()
