"""The FP8 KV cache in minisgl's Triton kernels and the backend choice (the GPU side), on CPU.

The kernels run on CPU tensors under Triton's interpreter (conftest sets TRITON_INTERPRET=1); on a CUDA
machine they run compiled on the GPU, and tests/gpu/test_gpu_fp8_kv.py runs whole models there.

- the KV-store and the fused q/k-norm + RoPE + KV-store kernels write `quantize_kv`'s bytes, bit for bit
  (every e4m3 value and every midpoint between two, subnormals, saturation, -0, NaN, scales != 1);
- the Triton decode kernel reads FP8 pages as the torch backend's FP8 path does, within float32
  rounding;
- a tiny model with the FP8 cache written by the KV-store kernel equals the `index_copy_` path bit for
  bit, and through the fused RoPE kernel agrees with the unfused path;
- which attention backends take an FP8 cache: `auto` picks FA2 prefill on sm90, `fa` is refused.
"""

import math
import os

import pytest
import torch
from conftest import rel_err, teacher_forced_logits

from minisgl.attention import TorchAttnBackend, resolve_attention_backend
from minisgl.core import Batch, Req
from minisgl.engine import Engine, EngineConfig
from minisgl.kernels import decode_attention as DA
from minisgl.kernels import kv_store as S
from minisgl.kernels import rope_store as R
from minisgl.kernels.fp8 import quantize_kv
from minisgl.kvcache import MHAKVCachePool
from minisgl.layers import build_rope_cache
from minisgl.layers.rope import RopeConfig

pytestmark = pytest.mark.skipif(S.triton is None, reason="needs triton (its interpreter on a CPU)")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E4M3 = torch.float8_e4m3fn


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _hard_values() -> torch.Tensor:
    """Every finite e4m3 value, the midpoints between neighbours (ties: to even) and the float32 values
    on either side of each, beyond the range (saturation), infinities, zeros of both signs, tiny values."""
    codes = torch.arange(256, dtype=torch.uint8).view(E4M3).float()
    values = codes[~codes.isnan()].sort().values
    mids = ((values[1:].double() + values[:-1].double()) / 2).float()
    below = torch.nextafter(mids, torch.tensor(-math.inf))
    above = torch.nextafter(mids, torch.tensor(math.inf))
    special = torch.tensor([0.0, -0.0, 449.0, 464.0, -480.0, 1e9, math.inf, -math.inf, 1e-30, -1e-30, 2**-10])
    return torch.cat([values, mids, below, above, special])


def _store(k, v, scales, cache_dtype, slots, seed=0):
    """Runs the KV-store kernel into fresh caches of `slots` rows at scattered slots; returns the caches
    and the slots."""
    out_loc = torch.randperm(slots, generator=_gen(seed))[: k.shape[0]].to(DEVICE)
    k_cache = torch.zeros(slots, *k.shape[1:], dtype=cache_dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    S.store_kv(k, v, out_loc, k_cache, v_cache, scales)
    return k_cache, v_cache, out_loc


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8).cpu(), b.view(torch.uint8).cpu())


@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.37, 3.0), (1e-3, 0.05)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kv_store_writes_quantize_kv_bytes(dtype, scales):
    g = _gen(1)
    tokens, heads, dim = 24, 2, 48
    x = torch.randn(2, tokens, heads, dim, generator=g) * torch.exp(
        torch.randn(2, tokens, heads, dim, generator=g) * 3
    )
    k, v = x.to(dtype).to(DEVICE)
    scale_t = torch.tensor(scales, dtype=torch.float32, device=DEVICE)
    k_cache, v_cache, out_loc = _store(k, v, scale_t, E4M3, 40)
    assert _same_bytes(k_cache[out_loc], quantize_kv(k, scale_t[0]))
    assert _same_bytes(v_cache[out_loc], quantize_kv(v, scale_t[1]))
    untouched = torch.ones(40, dtype=torch.bool)
    untouched[out_loc.cpu()] = False
    assert not k_cache.view(torch.uint8).cpu()[untouched].any()


@pytest.mark.parametrize("scale", [1.0, 0.5, 2.0**-7])
def test_kv_store_rounds_every_hard_value_as_torch(scale):
    """Ties to even, subnormals, saturation at 448, -0 and NaN: the kernel's rounding is torch's."""
    values = _hard_values()
    values = torch.cat([values, torch.tensor([math.nan])])
    row = 64
    values = torch.cat([values, torch.zeros(-values.numel() % row)]).view(-1, 1, row).to(DEVICE)
    scale_t = torch.tensor([scale, scale], device=DEVICE)
    k_cache, v_cache, out_loc = _store(values, values.flip(0), scale_t, E4M3, values.shape[0] + 3)
    assert _same_bytes(k_cache[out_loc], quantize_kv(values, scale_t[0]))
    assert _same_bytes(v_cache[out_loc], quantize_kv(values.flip(0), scale_t[1]))


def test_kv_store_fp8_from_a_strided_value_view():
    """V a slice of the fused QKV output, as the engine gives it."""
    qkv = torch.randn(5, 6 * 16, generator=_gen(2)).to(torch.bfloat16).to(DEVICE) * 30
    k = qkv[:, 2 * 16 : 4 * 16].view(5, 2, 16)
    v = qkv[:, 4 * 16 :].view(5, 2, 16)
    assert not v.is_contiguous()
    scale_t = torch.tensor([0.25, 4.0], device=DEVICE)
    k_cache, v_cache, out_loc = _store(k, v, scale_t, E4M3, 9)
    assert _same_bytes(k_cache[out_loc], quantize_kv(k, scale_t[0]))
    assert _same_bytes(v_cache[out_loc], quantize_kv(v, scale_t[1]))


def test_kv_store_scales_go_with_fp8_only():
    k = torch.randn(2, 1, 4, device=DEVICE)
    fp8_cache = torch.zeros(4, 1, 4, dtype=E4M3, device=DEVICE)
    with pytest.raises(ValueError, match="FP8 cache needs the layer's"):
        S.store_kv(k, k, torch.arange(2, device=DEVICE), fp8_cache, fp8_cache)
    with pytest.raises(ValueError, match="float32 cache and scales=\\(2,\\)"):
        S.store_kv(
            k, k, torch.arange(2, device=DEVICE), k.new_zeros(4, 1, 4), k.new_zeros(4, 1, 4), k.new_ones(2)
        )
    with pytest.raises(ValueError, match="contiguous \\(2,\\) float32"):
        S.store_kv(k, k, torch.arange(2, device=DEVICE), fp8_cache, fp8_cache, k.new_ones(2).double())


def test_kv_store_applies_to_fp8_caches():
    k = torch.randn(3, 2, 4, dtype=torch.bfloat16)
    assert not S.kv_store_applies(k, k, torch.zeros(10, 2, 4, dtype=E4M3))  # CPU
    if torch.cuda.is_available():
        kc = k.cuda()
        assert S.kv_store_applies(kc, kc, torch.zeros(10, 2, 4, dtype=E4M3, device="cuda"))
        assert not S.kv_store_applies(kc, kc, torch.zeros(10, 2, 4, dtype=torch.float16, device="cuda"))


@pytest.mark.parametrize("norm", [True, False], ids=["qk-norm", "no-norm"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_store_fp8_is_quantize_kv_of_the_plain_store(dtype, norm):
    """The fused kernel into an FP8 cache stores `quantize_kv` of what it stores into a cache of the
    model's dtype, bit for bit; the queries are the same."""
    g = _gen(4)
    tokens, heads, kv_heads, dim = 6, 4, 2, 32
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g) * 8).to(dtype).to(DEVICE)
    table = build_rope_cache(dim, 4096, RopeConfig(theta=10000.0), DEVICE)
    positions = torch.randint(0, 4096, (tokens,), generator=g).to(DEVICE)
    out_loc = torch.randperm(2 * tokens, generator=g)[:tokens].to(DEVICE)
    weights = [(torch.rand(dim, generator=g) + 0.5).to(dtype).to(DEVICE) for _ in range(2)]
    q_norm, k_norm = weights if norm else (None, None)
    scales = torch.tensor([0.3, 1.7], device=DEVICE)

    def run(cache_dtype, kv_scales):
        k_cache = torch.zeros(2 * tokens, kv_heads, dim, dtype=cache_dtype, device=DEVICE)
        v_cache = torch.zeros_like(k_cache)
        q = R.qk_norm_rope_store(
            qkv, positions, table, q_norm, k_norm, 1e-6, out_loc, k_cache, v_cache, heads, kv_heads, dim,
            kv_scales,
        )  # fmt: skip
        return q, k_cache, v_cache

    q_plain, k_plain, v_plain = run(dtype, None)
    q_fp8, k_fp8, v_fp8 = run(E4M3, scales)
    assert torch.equal(q_plain, q_fp8)
    assert _same_bytes(k_fp8, quantize_kv(k_plain, scales[0]))  # unwritten rows: 0 both
    assert _same_bytes(v_fp8, quantize_kv(v_plain, scales[1]))
    with pytest.raises(ValueError, match="FP8 cache needs the layer's"):
        run(E4M3, None)


def _fp8_pool_case(lens, kv_heads, dim, scales, page_size=4, seed=0):
    """An FP8 pool of two layers holding random K and V everywhere, and a page table mapping requests of
    `lens` tokens to pages in a shuffled order (row i: request i; one spare row)."""
    g = _gen(seed)
    pages_per_req = [-(-n // page_size) for n in lens]
    num_pages = sum(pages_per_req) + 3
    pool = MHAKVCachePool(2, num_pages, page_size, kv_heads, dim, E4M3, torch.device(DEVICE), scales=scales)
    width = max(pages_per_req) * page_size
    table = torch.zeros(len(lens) + 1, width, dtype=torch.int32)
    order = torch.randperm(num_pages, generator=g).tolist()
    for i, count in enumerate(pages_per_req):
        pages = [order.pop() for _ in range(count)]
        locs = (
            torch.tensor(pages).repeat_interleave(page_size) * page_size
            + torch.arange(len(pages) * page_size) % page_size
        )
        table[i, : len(locs)] = locs.to(torch.int32)
    table = table.to(DEVICE)
    for layer in range(2):
        locations = (num_pages + 1) * page_size
        k = torch.randn(locations, kv_heads, dim, generator=g) * 3
        v = torch.randn(locations, kv_heads, dim, generator=g)
        pool.store_kv(k.to(DEVICE), v.to(DEVICE), torch.arange(locations, device=DEVICE), layer)
    return pool, table


def test_triton_decode_reads_fp8_pages_as_the_torch_backend():
    """The Triton decode kernel over an FP8 pool (scales != 1, every split count) against the torch
    backend's FP8 path (`MHAKVCachePool.gather` dequantizes) on the same pages, in float32."""
    lens, heads, kv_heads, dim = [1, 7, 70, 130], 8, 2, 32
    scales = torch.tensor([[0.05, 0.4], [2.0, 0.01]])
    pool, table = _fp8_pool_case(lens, kv_heads, dim, scales)
    backend = TorchAttnBackend(pool, table, torch.device(DEVICE))
    batch = Batch(
        reqs=[
            Req(input_ids=[0] * n, table_idx=i, cached_len=n - 1, output_len=1, uid=i)
            for i, n in enumerate(lens)
        ],
        phase="decode",
    )
    backend.prepare_metadata(batch)
    q = torch.randn(len(lens), heads, dim, generator=_gen(5)).to(DEVICE)
    rows = torch.arange(len(lens), dtype=torch.int32, device=DEVICE)
    n = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    for layer in range(2):
        want = backend.attend(q, layer, batch)
        k, v = pool.flat(layer)
        for splits in (1, 4):
            got = DA.decode_attention(
                q, k, v, table, rows, n, splits=splits, kv_scales=pool.layer_scales(layer)
            )
            assert got.dtype == q.dtype
            err = (got - want).abs().max().item()
            assert err < 1e-5 * want.abs().max().item() + 1e-6, (layer, splits, err)


def test_triton_decode_fp8_needs_the_scales():
    k = torch.zeros(8, 1, 16, dtype=E4M3, device=DEVICE)
    q = torch.zeros(1, 2, 16, device=DEVICE)
    table = torch.zeros(1, 8, dtype=torch.int32, device=DEVICE)
    one = torch.ones(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="FP8 K and V need the layer's"):
        DA.decode_attention(q, k, k, table, one, one, splits=1)
    with pytest.raises(ValueError, match="contiguous \\(2,\\) float32"):
        DA.decode_attention(
            q, k, k, table, one, one, splits=1, kv_scales=torch.ones(2, 2, device=DEVICE)[:, 0]
        )


# -- a model -----------------------------------------------------------------------------------------


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="opens the kernels' CUDA-only gates on CPU tensors (Triton's interpreter); the GPU tests run "
    "the same on the GPU (tests/gpu/test_gpu_fp8_kv.py)",
)
def test_tiny_model_through_the_fp8_store_kernels(tiny_model, monkeypatch):
    """A tiny Qwen3 with kv_cache_dtype fp8_e4m3 and checkpoint-like scales: the KV-store kernel gives the
    logits of the `index_copy_` path bit for bit; the fused q/k-norm + RoPE + KV-store kernel agrees with
    the unfused path (its float32 norm and rotation differ in rounding only)."""
    import importlib

    import minisgl.kvcache.pool as pool_module
    import minisgl.models.llama as llama

    folder = tiny_model("qwen3")
    g = _gen(6)
    lens, steps = [5, 11], 2
    seqs = [torch.randint(3, 320, (n + steps,), generator=g).tolist() for n in lens]
    scales = torch.tensor([[0.02, 0.05], [0.5, 0.01], [1.0, 1.0]])

    def run(fused: bool) -> torch.Tensor:
        config = EngineConfig(
            model_path=str(folder), device="cpu", dtype=torch.float32, kv_cache_dtype="fp8_e4m3",
            use_fused_kernels=fused, page_size=4,
        )  # fmt: skip
        engine = Engine(config)
        engine.kv_cache.scales.copy_(scales)
        try:
            return teacher_forced_logits(engine, seqs, lens, steps)
        finally:
            engine.shutdown()

    plain = run(False)
    stored = []
    with monkeypatch.context() as m:
        real = pool_module.store_kv
        m.setattr(pool_module, "kv_store_applies", lambda k, v, cache: True)
        m.setattr(pool_module, "store_kv", lambda *a: stored.append(1) or real(*a))
        kernel = run(False)
    assert stored and torch.equal(kernel, plain)
    attention_layer = importlib.import_module("minisgl.layers.attention")
    fused_calls = []
    with monkeypatch.context() as m:
        real_fused = attention_layer.qk_norm_rope_store
        m.setattr(llama, "rope_store_applies", lambda qkv, head_dim: True)
        m.setattr(
            attention_layer, "qk_norm_rope_store", lambda *a: fused_calls.append(a[-1]) or real_fused(*a)
        )
        fused = run(True)
    assert fused_calls and all(s is not None and s.dtype == torch.float32 for s in fused_calls)
    assert rel_err(fused, plain) < 1e-4


# -- which backends take an FP8 cache ---------------------------------------------------------------


@pytest.mark.parametrize(
    "major, fp8, want", [(9, False, ("fa", "fi")), (9, True, ("fi", "fi")), (8, True, ("fi", "fi"))]
)
def test_auto_picks_fa2_prefill_for_fp8_kv_on_sm90(monkeypatch, major, fp8, want):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, 0))
    kv_dtype = E4M3 if fp8 else torch.bfloat16
    assert resolve_attention_backend("auto", torch.device("cuda", 0), kv_dtype) == want


@pytest.mark.parametrize("name", ["fa", "fa,fi", "fi,fa"])
def test_fa3_is_refused_with_an_fp8_cache(monkeypatch, name, tiny_model):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    with pytest.raises(ValueError, match=rf"attention_backend={name!r} cannot read the FP8 KV cache.*'fi'"):
        resolve_attention_backend(name, torch.device("cuda", 0), E4M3)
    assert resolve_attention_backend(name, torch.device("cuda", 0), torch.bfloat16)
    folder = tiny_model("llama")
    with pytest.raises(ValueError, match=rf"attention_backend={name!r} cannot read the FP8 KV cache"):
        EngineConfig(model_path=str(folder), device="cpu", kv_cache_dtype="fp8_e4m3", attention_backend=name)


class _FakeWrapper:
    """Stands in for FlashInfer's wrappers (not installed on CPU machines): records plan() and run()."""

    def __init__(self, *args, **kwargs):
        self.plans, self.runs = [], []

    def plan(self, *args, **kwargs):
        self.plans.append(kwargs)

    def run(self, q, kv, **kwargs):
        self.runs.append((kv[0].dtype, kwargs))
        return q


@pytest.mark.skipif(torch.cuda.is_available(), reason="a stand-in for flashinfer, for CPU machines")
def test_flashinfer_backend_plans_and_runs_fp8_kv(monkeypatch):
    """The FlashInfer backend over an FP8 pool, with a stand-in flashinfer module: plans with q in the
    model's dtype and KV in e4m3, runs each layer with its scales as numbers (read once at creation);
    decode batches up to `triton_decode_max_bs` run the Triton kernel over the FP8 pages with the
    layer's scales, as the torch backend reads them."""
    import sys
    import types

    from minisgl.attention.flashinfer_backend import FlashInferAttnBackend

    fake = types.ModuleType("flashinfer")
    fake.BatchPrefillWithPagedKVCacheWrapper = fake.BatchDecodeWithPagedKVCacheWrapper = _FakeWrapper
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: types.SimpleNamespace(record=lambda: None))
    lens, heads, kv_heads, dim = [5, 9], 4, 2, 16
    scales = torch.tensor([[0.25, 0.5], [0.03, 3.0]])
    pool, table = _fp8_pool_case(lens, kv_heads, dim, scales.clone())
    device = torch.device(DEVICE)
    with pytest.raises(ValueError, match="FP8 KV pool needs q_dtype"):
        FlashInferAttnBackend(pool, table, device, heads, kv_heads, dim, "fi", "fi")
    with pytest.raises(ValueError, match="attention_backend='fa,fi' cannot read the FP8 KV cache"):
        FlashInferAttnBackend(pool, table, device, heads, kv_heads, dim, "fa", "fi", q_dtype=torch.float32)
    backend = FlashInferAttnBackend(
        pool, table, device, heads, kv_heads, dim, "fi", "fi", q_dtype=torch.float32, triton_decode_max_bs=1
    )
    want = [{"k_scale": k, "v_scale": v} for k, v in scales.tolist()]  # the float32 values, as numbers
    assert backend.layer_scales == want
    pool.scales.fill_(7.0)  # read once at creation: later changes do not reach FlashInfer
    assert backend.layer_scales == want
    pool.scales.copy_(scales)
    q = torch.randn(len(lens), heads, dim, generator=_gen(7)).to(DEVICE)
    prefill = Batch(
        reqs=[
            Req(input_ids=[0] * n, table_idx=i, cached_len=0, output_len=1, uid=i) for i, n in enumerate(lens)
        ],
        phase="prefill",
    )
    decode = Batch(
        reqs=[
            Req(input_ids=[0] * n, table_idx=i, cached_len=n - 1, output_len=1, uid=i)
            for i, n in enumerate(lens)
        ],
        phase="decode",
    )
    for batch, wrapper in ((prefill, backend.prefill_wrapper), (decode, backend.decode_wrapper)):
        backend.prepare_metadata(batch)
        assert wrapper.plans[-1]["q_data_type"] == torch.float32 and wrapper.plans[-1]["kv_data_type"] == E4M3
        for layer in range(2):
            backend.attend(q, layer, batch)
            assert wrapper.runs[-1] == (
                E4M3,
                want[layer],
            )
    one = Batch(
        reqs=[Req(input_ids=[0] * lens[1], table_idx=1, cached_len=lens[1] - 1, output_len=1, uid=1)],
        phase="decode",
    )  # the Triton kernel
    backend.prepare_metadata(one)
    assert one.attn_metadata.wrapper is None
    torch_backend = TorchAttnBackend(pool, table, device)
    ref = Batch(reqs=one.reqs, phase="decode")
    torch_backend.prepare_metadata(ref)
    for layer in range(2):
        got, want = backend.attend(q[:1], layer, one), torch_backend.attend(q[:1], layer, ref)
        assert (got - want).abs().max().item() < 1e-5 * want.abs().max().item() + 1e-6
