"""The fused Triton kernels against the unfused torch reference: q/k-norm + RoPE + KV store
(`minisgl.kernels.rope_store`), and the GEMV kernel's add + RMSNorm and SiLU-and-multiply prologues
(`minisgl.kernels.gemv`).

On a CUDA machine the kernels run compiled on the GPU; without one they run on CPU tensors under
Triton's interpreter (conftest sets TRITON_INTERPRET=1), so CI checks them too. The last tests run a
whole tiny model through the fused path (on the CPU: the kernels' CUDA-only gates opened for the test)
and compare it with the unfused path of the same engine settings, and with transformers.
"""

import os

import pytest
import torch
import torch.nn.functional as F
from conftest import make_tiny_model, reference_logits, rel_err, teacher_forced_logits
from hypothesis import given, settings
from hypothesis import strategies as st

from minisgl.engine import Engine, EngineConfig
from minisgl.kernels import gemv as G
from minisgl.kernels import rope_store as R
from minisgl.layers import add_rms_norm, apply_rope, build_rope_cache, rms_norm, rope_cos_sin
from minisgl.layers.rope import RopeConfig

pytestmark = pytest.mark.skipif(R.triton is None, reason="needs triton (its interpreter on a CPU)")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# float32 on both devices; bfloat16 against a float32 reference, within a few bf16 roundings
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _reference_rope(qkv, positions, table, q_norm, k_norm, num_heads, num_kv_heads, head_dim, eps=1e-6):
    """The unfused layers in float32: split, per-head RMSNorm, RoPE."""
    kv_size = num_kv_heads * head_dim
    q, k, v = qkv.float().split([num_heads * head_dim, kv_size, kv_size], dim=-1)
    shape = (qkv.shape[0], -1, head_dim)
    q, k, v = q.reshape(shape), k.reshape(shape), v.reshape(shape)
    if q_norm is not None:
        q, k = rms_norm(q, q_norm.float(), eps), rms_norm(k, k_norm.float(), eps)
    q, k = apply_rope(q, k, rope_cos_sin(positions, table, torch.float32))
    return q, k, v


def _check_rope_store(tokens, num_heads, num_kv_heads, head_dim, norm, dtype, seed, eps=1e-6):
    g = _gen(seed)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = (torch.randn(tokens, width, generator=g) * 3).to(dtype).to(DEVICE)
    table = build_rope_cache(head_dim, 4096, RopeConfig(theta=10000.0), DEVICE)
    positions = torch.randint(0, 4096, (tokens,), generator=g).to(DEVICE)
    slots = 2 * tokens + 3
    out_loc = torch.randperm(slots, generator=g)[:tokens].to(DEVICE)
    weights = [(torch.rand(head_dim, generator=g) + 0.5).to(dtype).to(DEVICE) for _ in range(2)]
    q_norm, k_norm = weights if norm else (None, None)
    k_cache = torch.zeros(slots, num_kv_heads, head_dim, dtype=dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)

    q = R.qk_norm_rope_store(
        qkv, positions, table, q_norm, k_norm, eps, out_loc, k_cache, v_cache, num_heads, num_kv_heads,
        head_dim,
    )  # fmt: skip

    ref_q, ref_k, ref_v = _reference_rope(
        qkv, positions, table, q_norm, k_norm, num_heads, num_kv_heads, head_dim, eps
    )
    assert q.shape == (tokens, num_heads, head_dim) and q.dtype == dtype
    assert rel_err(q.float().cpu(), ref_q.cpu()) < TOL[dtype]
    assert rel_err(k_cache[out_loc].float().cpu(), ref_k.cpu()) < TOL[dtype]
    assert torch.equal(v_cache[out_loc].float().cpu(), ref_v.cpu())  # values are copied exactly
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[out_loc.cpu()] = False
    assert not k_cache.cpu()[untouched].any() and not v_cache.cpu()[untouched].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [True, False], ids=["qk-norm", "no-norm"])
@pytest.mark.parametrize(
    "num_heads, num_kv_heads, head_dim", [(4, 2, 16), (3, 1, 12), (2, 2, 64)], ids=["gqa", "odd", "mha"]
)
def test_rope_store_matches_unfused_layers(num_heads, num_kv_heads, head_dim, norm, dtype):
    _check_rope_store(7, num_heads, num_kv_heads, head_dim, norm, dtype, seed=0)


@settings(max_examples=12, deadline=None)
@given(
    tokens=st.integers(1, 9),
    num_kv_heads=st.integers(1, 3),
    group=st.integers(1, 3),
    half=st.sampled_from([2, 3, 8, 10, 32]),
    norm=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_rope_store_matches_unfused_layers_any_shape(tokens, num_kv_heads, group, half, norm, seed):
    _check_rope_store(tokens, group * num_kv_heads, num_kv_heads, 2 * half, norm, torch.float32, seed)


def test_rope_store_no_tokens_and_one_sided_norm():
    qkv = torch.zeros(0, 4 * 16, device=DEVICE)
    table = build_rope_cache(16, 8, RopeConfig(theta=10000.0), DEVICE)
    cache = torch.zeros(4, 1, 16, device=DEVICE)
    empty = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    q = R.qk_norm_rope_store(qkv, empty, table, None, None, 1e-6, empty, cache, cache, 2, 1, 16)
    assert q.shape == (0, 2, 16)
    w = torch.ones(16, device=DEVICE)
    with pytest.raises(ValueError, match="q_norm and k_norm"):
        R.qk_norm_rope_store(qkv[:0] + 1, empty, table, w, None, 1e-6, empty, cache, cache, 2, 1, 16)


def test_rope_store_applies_only_on_cuda_half_precision():
    assert not R.rope_store_applies(torch.zeros(2, 64, dtype=torch.bfloat16), 16)  # CPU
    if torch.cuda.is_available():
        x = torch.zeros(2, 64, dtype=torch.bfloat16, device="cuda")
        assert R.rope_store_applies(x, 16)
        assert not R.rope_store_applies(x.float(), 16)
        assert not R.rope_store_applies(x, 15)
        assert not R.rope_store_applies(x.t(), 16)


# -- the GEMV prologues ---------------------------------------------------------------------------------

# (N, K, output rows per program): one block of K; two blocks with a ragged end (BLOCK_K is 1024); two
# rows per program (the kernel's choice from N = 4096 up) with N odd
GEMV_SHAPES = [(48, 64, 1), (33, 1500, 1), (33, 96, 2)]


@pytest.fixture
def rows_per_program(monkeypatch, request):
    n, k, block_n = request.param
    monkeypatch.setattr(G, "_block_n", lambda n: block_n)
    return n, k


gemv_shapes = pytest.mark.parametrize(
    "rows_per_program", GEMV_SHAPES, indirect=True, ids=["one-block", "two-blocks", "two-rows"]
)


def _weights(n, k, dtype, g):
    return (torch.randn(n, k, generator=g) / k**0.5).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [True, False], ids=["add", "first-layer"])
@gemv_shapes
def test_add_rms_norm_gemv_matches_unfused(rows_per_program, with_residual, dtype):
    n, k = rows_per_program
    g = _gen(n + k)
    x = torch.randn(1, k, generator=g).to(dtype).to(DEVICE)
    residual = torch.randn(1, k, generator=g).to(dtype).to(DEVICE) if with_residual else None
    norm_w = (torch.rand(k, generator=g) + 0.5).to(dtype).to(DEVICE)
    w = _weights(n, k, dtype, g)
    bias = torch.randn(n, generator=g).to(dtype).to(DEVICE) if with_residual else None

    y, new_residual = G.add_rms_norm_gemv(x, residual, norm_w, w, bias, 1e-6)

    f = [t.float().cpu() if t is not None else None for t in (x, residual, norm_w, w, bias)]
    if with_residual:
        normed, ref_residual = add_rms_norm(f[0], f[1], f[2], 1e-6)
    else:
        normed, ref_residual = rms_norm(f[0], f[2], 1e-6), f[0]
    ref = F.linear(normed, f[3], f[4])
    assert y.shape == (1, n) and y.dtype == dtype
    assert rel_err(y.float().cpu(), ref) < TOL[dtype]
    assert rel_err(new_residual.float().cpu(), ref_residual) < TOL[dtype]
    if not with_residual:
        assert torch.equal(new_residual, x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@gemv_shapes
def test_silu_mul_gemv_matches_unfused(rows_per_program, dtype):
    n, k = rows_per_program
    g = _gen(n * k)
    gate_up = torch.randn(1, 2 * k, generator=g).to(dtype).to(DEVICE)
    w = _weights(n, k, dtype, g)
    y = G.silu_mul_gemv(gate_up, w)
    gate, up = gate_up.float().cpu().chunk(2, dim=-1)
    ref = F.linear(F.silu(gate) * up, w.float().cpu())
    assert y.shape == (1, n) and rel_err(y.float().cpu(), ref) < TOL[dtype]


@gemv_shapes
def test_plain_gemv_matches_linear(rows_per_program):
    n, k = rows_per_program
    g = _gen(7)
    x, w = torch.randn(1, k, generator=g).to(DEVICE), _weights(n, k, torch.float32, g)
    bias = torch.randn(n, generator=g).to(DEVICE)
    assert rel_err(G.gemv(x, w, bias).cpu(), F.linear(x, w, bias).cpu()) < TOL[torch.float32]


# -- the whole model through the fused path -------------------------------------------------------------


def _open_gates(monkeypatch):
    """Lets the fused kernels run on CPU float32 tensors (under the interpreter): their gates check for
    CUDA and half precision. Returns the counts of fused calls, by kernel."""
    import importlib

    import minisgl.layers.basic as basic
    import minisgl.models.llama as llama

    # (`minisgl.layers.attention` as an attribute is the function the package exports)
    attention_layer = importlib.import_module("minisgl.layers.attention")

    calls = {"rope_store": 0, "add_rms_norm_gemv": 0, "silu_mul_gemv": 0}

    def counted(name, fn):
        def run(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return run

    monkeypatch.setattr(llama, "rope_store_applies", lambda qkv, head_dim: head_dim % 2 == 0)
    monkeypatch.setattr(
        basic,
        "gemv_applies",
        lambda x, w: x.dim() == 2 and x.shape[0] == 1 and w.shape[1] == x.shape[1] and w.is_contiguous(),
    )
    monkeypatch.setattr(
        attention_layer, "qk_norm_rope_store", counted("rope_store", attention_layer.qk_norm_rope_store)
    )
    for name in ("add_rms_norm_gemv", "silu_mul_gemv"):
        monkeypatch.setattr(basic, name, counted(name, getattr(basic, name)))
    return calls


SEQ_LENS = [[9], [6, 11]]  # one request (one-row decode: the fused GEMVs), then a batch


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="runs the kernels on CPU tensors, under Triton's interpreter (a CPU machine); the GPU tests "
    "run the fused path on the GPU (tests/gpu/test_gpu.py)",
)
@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2", "qwen3_moe"])
def test_model_through_fused_kernels_matches_unfused_and_transformers(tmp_path, monkeypatch, arch):
    """Teacher-forced logits of a tiny model with the fused kernels equal the unfused path's (float32)
    and transformers'. One request decodes one row a step (all three fused kernels), a batch of two
    runs the fused RoPE kernel with plain GEMMs."""
    folder = make_tiny_model(tmp_path, arch)
    steps = 2
    g = _gen(3)
    for lens in SEQ_LENS:
        seqs = [torch.randint(3, 320, (n + steps,), generator=g).tolist() for n in lens]

        def run(fused: bool, seqs=seqs, lens=lens) -> torch.Tensor:
            config = EngineConfig(
                model_path=str(folder), device="cpu", dtype=torch.float32, use_fused_kernels=fused
            )
            engine = Engine(config)
            try:
                return teacher_forced_logits(engine, seqs, lens, steps)
            finally:
                engine.shutdown()

        unfused = run(False)
        with monkeypatch.context() as m:
            calls = _open_gates(m)
            fused = run(True)
        layers = 3
        forwards = steps + 1
        assert calls["rope_store"] == layers * forwards
        one_row_steps = steps if len(lens) == 1 else 0
        dense_layers = 1 if arch == "qwen3_moe" else 3  # the MoE model's layer 1 alone is dense
        assert calls["add_rms_norm_gemv"] == (layers + dense_layers) * one_row_steps
        assert calls["silu_mul_gemv"] == dense_layers * one_row_steps
        assert rel_err(fused, unfused) < 1e-5
        assert rel_err(fused, reference_logits(folder, seqs, lens, steps)) < 1e-4
