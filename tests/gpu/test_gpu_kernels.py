"""The Triton kernels (`minisgl.kernels`) on the GPU: the GEMV (one row and several) against F.linear in float32 (also under
torch.compile and in a CUDA graph), the fused KV store against `index_copy_`. Skipped without CUDA and
Triton; the dispatch tests that run anywhere are in tests/test_kernels.py."""

import importlib.util

import pytest
import torch
import torch.nn.functional as F
from conftest import replay_matches

from minisgl.kernels import gemv as G
from minisgl.kernels import kv_store as S
from minisgl.kvcache import MHAKVCachePool
from minisgl.layers import linear

HAVE_GPU = torch.cuda.is_available() and importlib.util.find_spec("triton") is not None


def gpu(test):
    """Marks a test `cuda` and skips it without a CUDA GPU and Triton."""
    return pytest.mark.cuda(pytest.mark.skipif(not HAVE_GPU, reason="needs a CUDA GPU and Triton")(test))


@pytest.mark.parametrize(
    "n,k,bias,dtype",
    [
        (4096, 1024, False, torch.bfloat16),
        (1024, 3072, False, torch.bfloat16),
        (1000, 3000, True, torch.bfloat16),  # neither a power of two nor a multiple of the blocks
        (151936, 1024, False, torch.bfloat16),
        (7, 5, True, torch.float16),
        (6144, 1024, True, torch.float16),
        (2048, 4096, False, torch.bfloat16),  # one row: a row a program, eight warps (`_config`)
        (4100, 4096, True, torch.bfloat16),
    ],
)
@pytest.mark.parametrize("rows", [1, 3, 16])
@gpu
def test_gemv_matches_float32_reference(n, k, bias, dtype, rows):
    torch.manual_seed(n + k + rows)
    dev = torch.device("cuda")
    x = torch.randn(rows, k, dtype=dtype, device=dev)
    w = torch.randn(n, k, dtype=dtype, device=dev) / k**0.5
    b = torch.randn(n, dtype=dtype, device=dev) if bias else None
    assert G.gemv_applies(x, w, max_rows=rows)
    out = linear(x, w, b) if rows == 1 else G.gemv(x, w, b)  # the layer sends one row to the kernel
    assert out.shape == (rows, n) and out.dtype == dtype
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    err = ((out.float() - ref).norm() / ref.norm()).item()
    # only the output's rounding to 8 (bf16) or 11 (fp16) mantissa bits separates them
    assert err < (4e-3 if dtype == torch.bfloat16 else 1e-3), err
    cublas = F.linear(x, w, b).float()
    assert ((cublas - ref).norm() / ref.norm()).item() < (4e-3 if dtype == torch.bfloat16 else 1e-3)
    if rows > 1:  # a row among several: its one-row launch's result, up to the order of additions
        alone = G.gemv(x[1:2], w, b).float()
        assert ((out[1:2].float() - alone).norm() / alone.norm()).item() < (
            4e-3 if dtype == torch.bfloat16 else 1e-3
        )


@pytest.mark.parametrize(
    "prologue,n,k",
    [
        ("silu_mul", 4096, 12288),  # Qwen3-8B's down: four output rows a program
        ("silu_mul", 2050, 6000),  # the same with a partial last block of rows
        ("silu_mul", 1000, 3000),  # below 2,048 rows: two a program, eight warps
        ("add_rms_norm", 6144, 4096),
    ],
)
@gpu
def test_fused_gemv_one_row_matches_float32_reference(prologue, n, k):
    """The one-row GEMV with each prologue, in the configurations `_config` gives these shapes, against
    the float32 norm or SiLU-and-multiply and F.linear."""
    torch.manual_seed(n + k)
    dev, dt = torch.device("cuda"), torch.bfloat16
    w = torch.randn(n, k, dtype=dt, device=dev) / k**0.5
    if prologue == "silu_mul":
        gate_up = torch.randn(1, 2 * k, dtype=dt, device=dev)
        out = G.silu_mul_gemv(gate_up, w)
        gate, up = gate_up.float().chunk(2, dim=-1)
        ref = F.linear(F.silu(gate) * up, w.float())
    else:
        x, residual = torch.randn(2, 1, k, dtype=dt, device=dev)
        norm_w = torch.rand(k, dtype=dt, device=dev) + 0.5
        out, h = G.add_rms_norm_gemv(x, residual, norm_w, w, None, 1e-6)
        h32 = x.float() + residual.float()
        ref = F.linear(
            h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_w.float(), w.float()
        )
        assert torch.equal(h, h32.to(dt))
    assert out.shape == (1, n)
    assert ((out.float() - ref).norm() / ref.norm()).item() < 4e-3


@gpu
def test_gemv_under_compile_and_graph():
    dev = torch.device("cuda")
    w1 = torch.randn(512, 256, dtype=torch.bfloat16, device=dev) / 16
    w2 = torch.randn(256, 512, dtype=torch.bfloat16, device=dev) / 16

    def f(x):
        return linear(torch.relu(linear(x, w1)), w2)

    x = torch.randn(1, 256, dtype=torch.bfloat16, device=dev)
    eager = f(x)
    compiled = torch.compile(f, fullgraph=True)
    assert torch.equal(compiled(x), eager)  # the same kernel, opaque to the compiler
    assert replay_matches(compiled, x, torch.randn_like(x))


@pytest.mark.parametrize("tokens", [0, 1, 5, 300])
@gpu
def test_kv_store_matches_index_copy(tokens):
    dev = torch.device("cuda")
    heads, dim, page = 8, 128, 16
    pools = [MHAKVCachePool(2, 40, page, heads, dim, torch.bfloat16, dev) for _ in range(2)]
    qkv = torch.randn(tokens, (16 + 2 * heads) * dim, dtype=torch.bfloat16, device=dev)
    k = torch.randn(tokens, heads, dim, dtype=torch.bfloat16, device=dev)
    v = qkv[:, (16 + heads) * dim :].view(tokens, heads, dim)  # a strided view, as in the model
    out_loc = torch.randperm(41 * page, device=dev)[:tokens]
    assert S.kv_store_applies(k, v, pools[0].k_cache(1).flatten(0, 1))
    pools[0].store_kv(k, v, out_loc, 1)
    pools[1].k_cache(1).flatten(0, 1).index_copy_(0, out_loc, k)
    pools[1].v_cache(1).flatten(0, 1).index_copy_(0, out_loc, v)
    assert torch.equal(pools[0].buffer, pools[1].buffer)
    if tokens:
        assert torch.equal(pools[0].k_cache(1).flatten(0, 1)[out_loc], k)
