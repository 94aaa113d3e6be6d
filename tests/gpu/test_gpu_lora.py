"""The LoRA kernels compiled for the GPU (minisgl.kernels.lora) against the torch path, at a real model's
widths: prefill segments and one-row decode segments, captured in a CUDA graph and replayed on other
adapter mixes, and under torch.compile. Skips without CUDA."""

import dataclasses

import pytest
import torch

from minisgl.layers.lora import LoraBatch, lora_add, lora_add_reference

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
# a Llama-3-8B-like QKV projection (32 query / 8 KV heads of 128) on one rank
SIZES, HIDDEN, SLOTS = [4096, 1024, 1024], 4096, 4


def _weights(rank, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(SLOTS, len(SIZES) * rank, HIDDEN, generator=g, device="cuda") / HIDDEN**0.5
    b = torch.randn(SLOTS, sum(SIZES), rank, generator=g, device="cuda") / rank**0.5
    b[2] = 0  # slot 2 is empty
    return a.to(dtype), b.to(dtype)


def _mix(rows, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-1, SLOTS, (len(rows),), generator=g).tolist()


def _check(x, base, a, b, batch, tol):
    want = lora_add_reference(x, base.clone(), a, b, batch.row_slots, SIZES)
    got = lora_add(x, base.clone(), a, b, batch, SIZES)
    err = ((got.float() - want.float()).norm() / (want.float() - base.float()).norm()).item()
    assert err < tol, err
    untouched = batch.row_slots == -1
    assert torch.equal(got[untouched], base[untouched])
    return got


@pytest.mark.parametrize("rank", [8, 16, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [[1] * 64, [300, 1, 45, 7, 160, 33, 2]], ids=["decode", "prefill"])
def test_kernels_match_the_torch_path(rank, dtype, rows):
    a, b = _weights(rank, dtype)
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(sum(rows), HIDDEN, generator=g, device="cuda").to(dtype)
    base = torch.randn(sum(rows), sum(SIZES), generator=g, device="cuda").to(dtype)
    batch = LoraBatch.build(rows, _mix(rows, rank), "cuda")
    _check(x, base, a, b, batch, 1e-2 if dtype == torch.bfloat16 else 1e-5)


def test_a_cuda_graph_serves_every_adapter_mix():
    rows = [1] * 48
    a, b = _weights(16, torch.bfloat16)
    x = torch.randn(len(rows), HIDDEN, device="cuda", dtype=torch.bfloat16)
    base = torch.randn(len(rows), sum(SIZES), device="cuda", dtype=torch.bfloat16)
    static = LoraBatch.build(rows, _mix(rows, 0), "cuda", max_loras=SLOTS)
    out = base.clone()
    lora_add(x, out, a, b, static, SIZES)  # warm up (compiles the kernels)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(base)
        lora_add(x, out, a, b, static, SIZES)
    for seed in (1, 2, 3):
        batch = LoraBatch.build(rows, _mix(rows, seed), "cuda", max_loras=SLOTS)
        for field in dataclasses.fields(static):
            getattr(static, field.name).copy_(getattr(batch, field.name))
        graph.replay()
        assert torch.equal(out, lora_add(x, base.clone(), a, b, batch, SIZES))


def test_torch_compile_traces_the_op_once_for_every_mix():
    rows = [5, 1, 9, 1]
    a, b = _weights(16, torch.bfloat16)
    w = torch.randn(sum(SIZES), HIDDEN, device="cuda", dtype=torch.bfloat16) / HIDDEN**0.5

    def qkv(x, batch):
        return lora_add(x, x @ w.T, a, b, batch, SIZES).float().square().sum(dim=1)

    compiled = torch.compile(qkv, fullgraph=True, dynamic=False)
    x = torch.randn(sum(rows), HIDDEN, device="cuda", dtype=torch.bfloat16)
    for seed in range(3):
        batch = LoraBatch.build(rows, _mix(rows, seed), "cuda", max_loras=SLOTS)
        torch.testing.assert_close(compiled(x, batch), qkv(x, batch), rtol=2e-2, atol=1e-1)
