"""The 4- and 8-bit projection on the GPU (`minisgl.kernels.packed_gemm`, docs/quantization.md "The GPU
kernels"): the op at every row count from 1 to 256 against dequantize-then-multiply, in a CUDA graph and
compiled, and a tiny Qwen3 AWQ checkpoint on CUDA against its CPU reference. Skips without CUDA and
Triton; the CPU tests are tests/test_quant4.py (the kernels under Triton's interpreter there).

Bound: the kernels add the float32 products in another order than cuBLAS, and the GEMM rounds the
dequantized weights to bf16 as the reference does: 1e-2 of the output's norm (relative error).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from conftest import GPU_PROMPT_LENS as PROMPT_LENS
from conftest import GPU_STEPS as STEPS
from conftest import gpu_seqs, rel_err, replay_matches, teacher_forced_logits

from minisgl.kernels.packed import pack_words
from minisgl.kernels.packed_gemm import packed_linear_op, packed_reference

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
    reason="needs CUDA and Triton",
)


def packed_weight(n: int, k: int, bits: int, group: int | None, act_order: bool, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    groups = k // (group or k)
    top = 1 << bits
    qweight = pack_words(torch.randint(0, top, (n, k), generator=g, device="cuda"), bits)
    scales = (torch.rand(n, groups, generator=g, device="cuda") * 0.04 / top).half()
    zeros = torch.randint(0, top, (n, groups), generator=g, device="cuda").to(torch.uint8)
    perm = torch.randperm(k, generator=g, device="cuda") if act_order else None
    return qweight, scales, zeros, perm


# (bits, group, act order, bias)
CASES = [(4, 128, False, False), (4, 32, True, True), (8, None, False, True), (8, 64, True, False)]


@pytest.mark.parametrize(("bits", "group", "act_order", "bias"), CASES)
def test_op_matches_dequantize_then_matmul_at_every_row_count(bits, group, act_order, bias):
    n, k = 384, 1024
    qweight, scales, zeros, perm = packed_weight(n, k, bits, group, act_order)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias else None
    x_all = torch.randn(320, k, device="cuda", dtype=torch.bfloat16)
    worst = 0.0
    for m in [*range(1, 257), 320]:  # the GEMV, the tensor-core GEMM, dequantize-then-cuBLAS
        args = (x_all[:m], qweight, scales, zeros, perm, b, bits)
        err = rel_err(packed_linear_op(*args), packed_reference(*args))
        worst = max(worst, err)
        assert err < 1e-2, f"{m} rows: relative error {err:.2e}"
    print(f"bits {bits} group {group} act order {act_order}: worst relative error {worst:.2e}")


@pytest.mark.parametrize("reshape", [True, False])
def test_tensor_core_gemm_both_pairings(reshape, monkeypatch):
    """`packed_mma` with the tile unpacked in the columns' order and value by value (x de-interleaved),
    4-bit act order with a bias and 8-bit, at 5 to 130 rows."""
    from minisgl.kernels import packed_gemm

    default = packed_gemm.mma_config
    monkeypatch.setattr(packed_gemm, "mma_config", lambda m: (*default(m)[:5], reshape))
    for bits, group, act_order in ((4, 128, True), (8, 64, False)):
        qweight, scales, zeros, perm = packed_weight(384, 1024, bits, group, act_order)
        b = torch.randn(384, device="cuda", dtype=torch.bfloat16)
        for m in (5, 16, 33, 64, 130):
            args = (
                torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16),
                qweight,
                scales,
                zeros,
                perm,
                b,
                bits,
            )
            err = rel_err(packed_gemm.packed_mma(*args), packed_reference(*args))
            assert err < 1e-2, f"{bits} bits, {m} rows: relative error {err:.2e}"


@pytest.mark.parametrize("n", [256, 32768])
def test_op_in_a_cuda_graph_and_compiled(n):
    """The op's three kernels in a CUDA graph and compiled: the GEMV (1 row), the tensor-core GEMM (20
    rows of the wide weight, `mma_fills`) and dequantize-then-cuBLAS (5 and 40 rows of the narrow one,
    40 of the wide)."""
    from minisgl.kernels.packed_gemm import mma_fills

    assert mma_fills(n, torch.device("cuda", torch.cuda.current_device())) == (n == 32768)
    qweight, scales, zeros, perm = packed_weight(n, 512, 4, 128, True)
    for m in (1, 5, 20, 40):
        x, x2 = (torch.randn(m, 512, device="cuda", dtype=torch.bfloat16) for _ in range(2))

        def fn(t):
            return packed_linear_op(t, qweight, scales, zeros, perm, None, 4)

        assert replay_matches(fn, x, x2), m
        compiled = torch.compile(fn, fullgraph=True)
        assert torch.equal(compiled(x2), fn(x2)), m
        assert rel_err(fn(x2), packed_reference(x2, qweight, scales, zeros, perm, None, 4)) < 1e-2, m


def test_graph_capture_of_the_gemm_allocates_no_weight_buffer():
    """More rows than the tensor-core GEMM takes dequantize into the reserved buffer: capturing a graph
    of them adds only the output to the graph's pool, not an (N, K) weight (which once filled the card
    as the graphs of every batch size each kept one)."""
    from minisgl.kernels.packed_gemm import MMA_MAX_ROWS, reserve_workspace

    n, k, m = 2048, 4096, MMA_MAX_ROWS + 64  # past the tensor-core GEMM: the buffer's path
    qweight, scales, zeros, perm = packed_weight(n, k, 4, 128, False)
    reserve_workspace(n * k, torch.bfloat16, torch.device("cuda"))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    packed_linear_op(x, qweight, scales, zeros, perm, None, 4)  # Triton's compile, outside the capture
    torch.cuda.synchronize()
    pool = torch.cuda.graph_pool_handle()
    graph = torch.cuda.CUDAGraph()
    before = torch.cuda.memory_reserved()
    with torch.cuda.graph(graph, pool=pool):
        y = packed_linear_op(x, qweight, scales, zeros, perm, None, 4)
    grew = torch.cuda.memory_reserved() - before
    assert grew < n * k * 2 // 2, f"the capture reserved {grew} bytes; the weight is {n * k * 2}"
    graph.replay()
    assert rel_err(y, packed_reference(x, qweight, scales, zeros, perm, None, 4)) < 1e-2


def test_tiny_qwen3_awq_on_cuda_matches_the_cpu_reference(tmp_path, tiny_qwen3):
    """Packed projections, bf16, CUDA graphs (and PDL on sm90) against the CPU's float32 path on the
    dequantized weights."""
    from test_quant4 import write_checkpoint

    from minisgl.engine import Engine, EngineConfig
    from minisgl.layers.packed import PackedLinear

    folder = write_checkpoint(tiny_qwen3, tmp_path / "awq", "awq-g32")
    seqs = gpu_seqs()
    logits = {}
    for device, dtype in (("cpu", torch.float32), ("cuda", torch.bfloat16)):
        config = EngineConfig(
            model_path=str(folder), dtype=dtype, device=device, cuda_graph_max_bs=8, attention_backend="torch"
        )
        eng = Engine(config)
        packed = [m for m in eng.model.modules() if isinstance(m, PackedLinear)]
        assert bool(packed) == (device == "cuda")
        logits[device] = teacher_forced_logits(eng, seqs, PROMPT_LENS, STEPS).cpu()
        eng.shutdown()
    err = rel_err(logits["cuda"], logits["cpu"])
    same = (logits["cuda"].argmax(-1) == logits["cpu"].argmax(-1)).float().mean().item()
    print(f"tiny Qwen3 AWQ on CUDA (bf16) against the CPU (float32): {err:.2e} relative, top-1 {same:.0%}")
    assert err < 5e-2 and same > 0.8


def test_a_4bit_load_leaves_no_cached_blocks(tmp_path):
    """After a 4-bit model loads (Qwen3-0.6B's shapes, AWQ group 128, dummy weights), the allocator keeps
    no blocks of the load's transients: the KV cache's budget counts the weights only, so cached blocks
    came off the activations' room (an 8B's first prefills once ran out of memory that way)."""
    import json
    from pathlib import Path

    from minisgl.engine import EngineConfig
    from minisgl.engine.start import load_model

    config = json.loads((Path(__file__).parents[2] / "configs/models/qwen3-0.6b/config.json").read_text())
    awq = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": awq}))
    torch.cuda.empty_cache()
    allocated_before = torch.cuda.memory_allocated()
    model, weights = load_model(
        EngineConfig(model_path=str(tmp_path), use_dummy_weight=True, device="cuda", dtype=torch.bfloat16)
    )
    kept = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    held = torch.cuda.memory_allocated() - allocated_before
    assert kept < 32 * 2**20, f"the allocator kept {kept} bytes of the load's transients"
    # what the budget counts is what the model holds (parameters, buffers and the packed
    # GEMM's buffer, which may predate this test)
    assert held <= weights + 8 * 2**20, f"the model holds {held} bytes, the budget counts {weights}"
    del model


# -- packed MoE experts (minisgl.kernels.moe_gemv / moe_gemm, the weights dequantized in registers) ---


def packed_experts(experts: int, rows: int, cols: int, bits: int, group: int | None, seed: int):
    """Random packed experts (`PackedWeights`) on CUDA."""
    from minisgl.kernels.packed import PackedWeights

    words, scales, zeros, _ = zip(
        *(packed_weight(rows, cols, bits, group, False, seed * 1000 + e) for e in range(experts))
    )
    return PackedWeights(torch.stack(words), torch.stack(scales), torch.stack(zeros), bits)


@pytest.mark.parametrize(("bits", "group"), [(4, 128), (8, None), (4, 32)])
def test_packed_experts_match_their_dequantized_weights_at_every_token_count(bits, group):
    """The fused backend on packed experts (the few-token kernels, then the grouped GEMMs) against the
    same backend on the experts dequantized to bf16, at 1 to 80 tokens and 300, bf16; 16 experts, top 4,
    hidden 512, intermediate 256 (Qwen3-30B-A3B's proportions)."""
    from minisgl.moe import fused_moe

    w13, w2 = packed_experts(16, 512, 512, bits, group, 1), packed_experts(16, 512, 256, bits, group, 2)
    plain13, plain2 = w13.dequantize(torch.bfloat16), w2.dequantize(torch.bfloat16)
    x_all = torch.randn(300, 512, device="cuda", dtype=torch.bfloat16)
    logits_all = torch.randn(300, 16, device="cuda", dtype=torch.bfloat16)
    for t in [*range(1, 81), 300]:
        x, logits = x_all[:t], logits_all[:t]
        err = rel_err(fused_moe(x, logits, w13, w2, 4, True), fused_moe(x, logits, plain13, plain2, 4, True))
        assert err < 1e-2, f"{t} tokens: relative error {err:.2e}"


def test_packed_experts_in_a_cuda_graph_and_compiled(monkeypatch):
    """The packed experts' kernels captured (2 tokens: the few-token kernels; 40: the grouped GEMMs)
    and compiled (the `minisgl::moe_packed` op), against eager."""
    from minisgl.moe import FusedMoeBackend, moe
    from minisgl.moe import op as moe_op

    w13, w2 = packed_experts(16, 512, 512, 4, 128, 3), packed_experts(16, 512, 256, 4, 128, 4)
    backend = FusedMoeBackend()
    monkeypatch.setattr(moe_op, "_backend", lambda: backend)  # what an engine's forward sets
    for t in (2, 40):
        x, x2 = (torch.randn(t, 512, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        logits = torch.randn(t, 16, device="cuda", dtype=torch.bfloat16)

        def fn(v, logits=logits):
            return moe(v, logits, w13, w2, 4, True)

        assert replay_matches(fn, x, x2), t
        assert torch.equal(torch.compile(fn, fullgraph=True)(x2), fn(x2)), t


def test_tiny_qwen3_moe_awq_on_cuda_matches_the_cpu_reference(tmp_path, tiny_model):
    """A Qwen3-MoE AWQ checkpoint with its experts packed on CUDA (bf16, the fused backend, CUDA graphs)
    against the CPU's float32 path on the dequantized weights."""
    from test_quant4 import write_checkpoint

    from minisgl.engine import Engine, EngineConfig
    from minisgl.layers.packed import PackedLinear

    folder = write_checkpoint(tiny_model("qwen3_moe"), tmp_path / "awq", "awq-g32")
    seqs = gpu_seqs(vocab=320)  # make_tiny_model's
    logits = {}
    for device, dtype in (("cpu", torch.float32), ("cuda", torch.bfloat16)):
        config = EngineConfig(
            model_path=str(folder), dtype=dtype, device=device, cuda_graph_max_bs=8, attention_backend="torch"
        )  # the tiny model's head size (16) is not one of FlashInfer's
        eng = Engine(config)
        experts = [m for m in eng.model.modules() if isinstance(m, PackedLinear) and m.experts]
        assert bool(experts) == (device == "cuda")
        logits[device] = teacher_forced_logits(eng, seqs, PROMPT_LENS, STEPS).cpu()
        eng.shutdown()
    err = rel_err(logits["cuda"], logits["cpu"])
    same = (logits["cuda"].argmax(-1) == logits["cpu"].argmax(-1)).float().mean().item()
    print(
        f"tiny Qwen3-MoE AWQ on CUDA (bf16) against the CPU (float32): {err:.2e} relative, top-1 {same:.0%}"
    )
    assert err < 5e-2 and same > 0.8
