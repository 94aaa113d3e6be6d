"""The Triton kernels (`minisgl.kernels`): one-row GEMV against F.linear in float32, the fused KV store
against `index_copy_`, when each applies, and the engine settings that switch them (and the other
ablation switches) off. The kernel tests skip without CUDA and Triton; the dispatch tests run anywhere."""

import importlib.util

import pytest
import torch
import torch.nn.functional as F
from conftest import make_tiny_model

from minisgl.core import SamplingParams, gemv_kernel_mode
from minisgl.engine import Engine, EngineConfig, generate
from minisgl.kernels import gemv as G
from minisgl.kernels import kv_store as S
from minisgl.kvcache import MHAKVCachePool
from minisgl.layers import linear

HAVE_GPU = torch.cuda.is_available() and importlib.util.find_spec("triton") is not None


def gpu(test):
    """Marks a test `cuda` and skips it without a CUDA GPU and Triton."""
    return pytest.mark.cuda(pytest.mark.skipif(not HAVE_GPU, reason="needs a CUDA GPU and Triton")(test))


def test_gemv_does_not_apply_off_its_shape():
    x, w = torch.randn(1, 64), torch.randn(32, 64)
    assert not G.gemv_applies(x, w)  # CPU (and float32)
    if torch.cuda.is_available() and G.triton is not None:
        xc, wc = x.cuda().bfloat16(), w.cuda().bfloat16()
        assert G.gemv_applies(xc, wc)
        assert not G.gemv_applies(torch.cat([xc, xc]), wc)  # two rows: cuBLAS
        assert not G.gemv_applies(xc.float(), wc.float())
        assert not G.gemv_applies(xc, wc.t().contiguous().t())  # a transposed weight


def test_kv_store_does_not_apply_on_cpu():
    k = torch.randn(3, 2, 4)
    assert not S.kv_store_applies(k, k, torch.zeros(10, 2, 4))


ABLATION_OFF = dict(
    compile_sampler=False,
    compile_prefill=False,
    use_gemv_kernel=False,
    use_kv_store_kernel=False,
    tensor_core_min_group=4,
)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("models"), "llama")


@pytest.mark.parametrize(
    "overrides, kv_kernel, gemv_setting, compiled_prefill, gemv_in_forward",
    [
        ({}, True, True, True, True),
        (ABLATION_OFF, False, False, False, False),
        (dict(batch_invariant=True), True, True, False, False),
    ],
    ids=["defaults", "all-off", "batch-invariant"],
)
def test_ablation_switches_reach_the_components(
    tiny_llama, monkeypatch, overrides, kv_kernel, gemv_setting, compiled_prefill, gemv_in_forward
):
    """The settings of the ablation block go to the KV pool, the context and the graph runner (which
    `batch_invariant` overrides); `linear` sees the GEMV switch while that engine's forward runs."""
    import minisgl.models.llama as llama

    seen, real = [], llama.linear
    monkeypatch.setattr(llama, "linear", lambda *a: seen.append(gemv_kernel_mode()) or real(*a))
    engine = Engine(EngineConfig(model_path=str(tiny_llama), device="cpu", dtype=torch.float32, **overrides))
    assert engine.kv_cache.use_kernel is kv_kernel
    assert engine.ctx.use_gemv_kernel is gemv_setting
    assert engine.graph_runner.compile_prefill is compiled_prefill
    assert not engine.sampler.compiled  # CPU: eager whatever compile_sampler says
    generate(engine, [[5, 6, 7]], SamplingParams(max_tokens=2))
    assert seen and set(seen) == {gemv_in_forward}
    engine.shutdown()
    assert gemv_kernel_mode()  # outside a forward


@pytest.mark.parametrize(
    "n,k,bias,dtype",
    [
        (4096, 1024, False, torch.bfloat16),
        (1024, 3072, False, torch.bfloat16),
        (1000, 3000, True, torch.bfloat16),  # neither a power of two nor a multiple of the blocks
        (151936, 1024, False, torch.bfloat16),
        (7, 5, True, torch.float16),
        (6144, 1024, True, torch.float16),
    ],
)
@gpu
def test_gemv_matches_float32_reference(n, k, bias, dtype):
    torch.manual_seed(n + k)
    dev = torch.device("cuda")
    x = torch.randn(1, k, dtype=dtype, device=dev)
    w = torch.randn(n, k, dtype=dtype, device=dev) / k**0.5
    b = torch.randn(n, dtype=dtype, device=dev) if bias else None
    assert G.gemv_applies(x, w)
    out = linear(x, w, b)
    assert out.shape == (1, n) and out.dtype == dtype
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    err = ((out.float() - ref).norm() / ref.norm()).item()
    # only the output's rounding to 8 (bf16) or 11 (fp16) mantissa bits separates them
    assert err < (4e-3 if dtype == torch.bfloat16 else 1e-3), err
    cublas = F.linear(x, w, b).float()
    assert ((cublas - ref).norm() / ref.norm()).item() < (4e-3 if dtype == torch.bfloat16 else 1e-3)


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
    static_x = x.clone()
    graph = torch.cuda.CUDAGraph()
    compiled(static_x)
    with torch.cuda.graph(graph):
        out = compiled(static_x)
    x2 = torch.randn_like(x)
    static_x.copy_(x2)
    graph.replay()
    assert torch.equal(out, f(x2))


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
