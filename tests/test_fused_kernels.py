"""The fused Triton kernels against the unfused torch reference: q/k-norm + RoPE + KV store
(`minisgl.kernels.rope_store`), the GEMV kernel's add + RMSNorm and SiLU-and-multiply prologues
(`minisgl.kernels.gemv`), and the row kernels and row-count dispatching ops of `minisgl.kernels.linear`.

On a CUDA machine the kernels run compiled on the GPU; without one they run on CPU tensors under
Triton's interpreter (conftest sets TRITON_INTERPRET=1), so CI checks them too. The last tests run a
whole tiny model through the fused path (on the CPU: the kernels' CUDA-only gates opened for the test)
and compare it with the unfused path of the same engine settings, and with transformers.
"""

import os

import pytest
import torch
import torch.nn.functional as F
from conftest import reference_logits, rel_err, teacher_forced_logits
from hypothesis import given, settings
from hypothesis import strategies as st

from minisgl.engine import Engine, EngineConfig
from minisgl.kernels import gemv as G
from minisgl.kernels import linear as L
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


# -- the GEMV kernel and its prologues ------------------------------------------------------------------

# (rows of x, N, K, output rows per program): one block of K; two blocks with a ragged end (BLOCK_K is
# 1024); two output rows per program (the kernel's choice from N = 4096 up) with N odd; then several
# rows of x (one program per row and block of output rows)
GEMV_SHAPES = [(1, 48, 64, 1), (1, 33, 1500, 1), (1, 33, 96, 2), (3, 33, 96, 2), (5, 48, 64, 1)]


@pytest.fixture
def rows_per_program(monkeypatch, request):
    m, n, k, block_n = request.param
    monkeypatch.setattr(G, "_block_n", lambda n: block_n)
    return m, n, k


gemv_shapes = pytest.mark.parametrize(
    "rows_per_program",
    GEMV_SHAPES,
    indirect=True,
    ids=["one-block", "two-blocks", "two-rows", "3x-two-rows", "5x-one-block"],
)


def _each_row_as_alone(fn, batched, *row_args):
    """Each row of a kernel's result for several rows equals that row's result alone, bit for bit (its
    program computes exactly what the one-row launch's does). `fn` takes the one-row slices of `row_args`
    (None stays None); `batched`: its result for all rows (a tensor or a tuple of them)."""
    batched = batched if isinstance(batched, tuple) else (batched,)
    for i in range(batched[0].shape[0]):
        alone = fn(*(a[i : i + 1] if a is not None else None for a in row_args))
        for got, want in zip(batched, alone if isinstance(alone, tuple) else (alone,), strict=True):
            assert torch.equal(got[i : i + 1], want), i


def _weights(n, k, dtype, g):
    return (torch.randn(n, k, generator=g) / k**0.5).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [True, False], ids=["add", "first-layer"])
@gemv_shapes
def test_add_rms_norm_gemv_matches_unfused(rows_per_program, with_residual, dtype):
    m, n, k = rows_per_program
    g = _gen(n + k + m)
    x = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
    residual = torch.randn(m, k, generator=g).to(dtype).to(DEVICE) if with_residual else None
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
    assert y.shape == (m, n) and y.dtype == dtype and new_residual.shape == (m, k)
    assert rel_err(y.float().cpu(), ref) < TOL[dtype]
    assert rel_err(new_residual.float().cpu(), ref_residual) < TOL[dtype]
    if not with_residual:
        assert torch.equal(new_residual, x)
    # keep_normed: the same y and h, and the normalised rows as its first program writes them
    y2, kept, h2 = G.add_rms_norm_gemv(x, residual, norm_w, w, bias, 1e-6, keep_normed=True)
    assert torch.equal(y2, y) and torch.equal(h2, new_residual) and kept.dtype == dtype
    assert rel_err(kept.float().cpu(), normed) < TOL[dtype]
    if m > 1:
        alone = lambda x, r: G.add_rms_norm_gemv(x, r, norm_w, w, bias, 1e-6, keep_normed=True)  # noqa: E731
        _each_row_as_alone(alone, (y, kept, new_residual), x, residual)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@gemv_shapes
def test_silu_mul_gemv_matches_unfused(rows_per_program, dtype):
    m, n, k = rows_per_program
    g = _gen(n * k + m)
    gate_up = torch.randn(m, 2 * k, generator=g).to(dtype).to(DEVICE)
    w = _weights(n, k, dtype, g)
    y = G.silu_mul_gemv(gate_up, w)
    gate, up = gate_up.float().cpu().chunk(2, dim=-1)
    ref = F.linear(F.silu(gate) * up, w.float().cpu())
    assert y.shape == (m, n) and rel_err(y.float().cpu(), ref) < TOL[dtype]
    if m > 1:
        _each_row_as_alone(lambda gate_up: G.silu_mul_gemv(gate_up, w), y, gate_up)


@gemv_shapes
def test_plain_gemv_matches_linear(rows_per_program):
    m, n, k = rows_per_program
    g = _gen(7 + m)
    x, w = torch.randn(m, k, generator=g).to(DEVICE), _weights(n, k, torch.float32, g)
    bias = torch.randn(n, generator=g).to(DEVICE)
    y = G.gemv(x, w, bias)
    assert y.shape == (m, n) and rel_err(y.cpu(), F.linear(x, w, bias).cpu()) < TOL[torch.float32]
    if m > 1:
        _each_row_as_alone(lambda x: G.gemv(x, w, bias), y, x)


def test_gemv_takes_strided_rows_and_refuses_too_many():
    """Rows that are views into wider tensors give what their contiguous copies give; more rows than
    `GEMV_MAX_ROWS` are refused with an error that names the count."""
    g = _gen(11)
    wide = torch.randn(3, 2 * 64 + 8, generator=g).to(DEVICE)
    x, residual = wide[:, :64], wide[:, 70:134]
    norm_w, w = (torch.rand(64, generator=g) + 0.5).to(DEVICE), _weights(24, 64, torch.float32, g)
    y, h = G.add_rms_norm_gemv(x, residual, norm_w, w, None, 1e-6)
    want_y, want_h = G.add_rms_norm_gemv(x.contiguous(), residual.contiguous(), norm_w, w, None, 1e-6)
    assert torch.equal(y, want_y) and torch.equal(h, want_h)
    gate_up = wide[:, : 2 * 64]
    assert torch.equal(G.silu_mul_gemv(gate_up, w), G.silu_mul_gemv(gate_up.contiguous(), w))
    too_many = G.GEMV_MAX_ROWS + 1
    with pytest.raises(ValueError, match=f"1 to {G.GEMV_MAX_ROWS} rows, got {too_many}"):
        G.gemv(torch.zeros(too_many, 64, device=DEVICE), w)


# -- the row kernels and the ops that pick kernels by row count --------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [True, False], ids=["add", "first-layer"])
@pytest.mark.parametrize("rows, k", [(3, 64), (5, 1500)], ids=["pow2", "ragged"])
def test_add_rms_norm_rows_matches_unfused(rows, k, with_residual, dtype):
    g = _gen(rows * k)
    x = torch.randn(rows, k, generator=g).to(dtype).to(DEVICE)
    residual = torch.randn(rows, k, generator=g).to(dtype).to(DEVICE) if with_residual else None
    norm_w = (torch.rand(k, generator=g) + 0.5).to(dtype).to(DEVICE)
    normed, new_residual = L.add_rms_norm_rows(x, residual, norm_w, 1e-6)
    if with_residual:
        ref, ref_residual = add_rms_norm(x, residual, norm_w, 1e-6)
    else:
        ref, ref_residual = rms_norm(x, norm_w, 1e-6), x
    assert normed.shape == (rows, k) and normed.dtype == dtype
    # the same roundings as the unfused layers: float32 equal to a few ulps; bf16 as close as the
    # interpreter allows (it truncates to bf16 where a GPU rounds), and the residual bit-equal on a GPU
    assert rel_err(normed.cpu(), ref.cpu()) < (1e-6 if dtype == torch.float32 else TOL[dtype])
    if dtype == torch.float32 or DEVICE == "cuda":
        assert torch.equal(new_residual, ref_residual)
    else:
        assert rel_err(new_residual.cpu(), ref_residual.cpu()) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, k", [(2, 48), (4, 1500)], ids=["one-block", "two-blocks"])
def test_silu_mul_rows_matches_unfused(rows, k, dtype):
    gate_up = torch.randn(rows, 2 * k, generator=_gen(k)).to(dtype).to(DEVICE)
    gate, up = gate_up.float().chunk(2, dim=-1)
    out = L.silu_mul_rows(gate_up)
    assert out.shape == (rows, k) and out.dtype == dtype
    assert rel_err(out.float().cpu(), (F.silu(gate) * up).cpu()) < TOL[dtype]


def test_row_kernels_take_no_rows():
    x = torch.zeros(0, 8, device=DEVICE)
    normed, residual = L.add_rms_norm_rows(x, x, torch.ones(8, device=DEVICE), 1e-6)
    assert normed.shape == residual.shape == (0, 8)
    assert L.silu_mul_rows(torch.zeros(0, 16, device=DEVICE)).shape == (0, 8)


@pytest.mark.parametrize("rows, gemv_rows", [(1, 1), (3, 1), (3, 4)])
def test_ops_pick_kernels_by_row_count(monkeypatch, rows, gemv_rows):
    """1 to `LINEAR_GEMV_ROWS` rows run the GEMV kernels, more rows the row kernels and F.linear; both
    agree with the unfused layers (float32)."""
    monkeypatch.setattr(L, "LINEAR_GEMV_ROWS", gemv_rows)
    calls = []
    for name in ("gemv", "add_rms_norm_gemv", "silu_mul_gemv", "add_rms_norm_rows", "silu_mul_rows"):
        fn = getattr(L, name)
        monkeypatch.setattr(L, name, lambda *a, fn=fn, name=name: calls.append(name) or fn(*a))
    g = _gen(rows)
    n, k = 40, 96
    x, residual = (torch.randn(rows, k, generator=g).to(DEVICE) for _ in range(2))
    norm_w = (torch.rand(k, generator=g) + 0.5).to(DEVICE)
    w, w_down = _weights(n, k, torch.float32, g), _weights(k, n // 2, torch.float32, g)
    bias = torch.randn(n, generator=g).to(DEVICE)

    y = torch.ops.minisgl.linear(x, w, bias)
    y2, h, empty = torch.ops.minisgl.norm_linear(x, residual, norm_w, w, bias, 1e-6)
    y3 = torch.ops.minisgl.silu_mul_linear(y2, w_down)
    y4, h4, kept = torch.ops.minisgl.norm_linear(x, residual, norm_w, w, bias, 1e-6, keep_normed=True)

    normed, ref_h = add_rms_norm(x, residual, norm_w, 1e-6)
    ref2 = F.linear(normed, w, bias)
    gate, up = ref2.chunk(2, dim=-1)
    assert rel_err(y.cpu(), F.linear(x, w, bias).cpu()) < TOL[torch.float32]
    assert rel_err(y2.cpu(), ref2.cpu()) < TOL[torch.float32]
    assert rel_err(h.cpu(), ref_h.cpu()) < TOL[torch.float32]
    assert rel_err(y3.cpu(), F.linear(F.silu(gate) * up, w_down).cpu()) < TOL[torch.float32]
    assert torch.equal(y4, y2) and torch.equal(h4, h) and empty.numel() == 0
    assert rel_err(kept.cpu(), normed.cpu()) < TOL[torch.float32]
    gemv_kernels = ["gemv", "add_rms_norm_gemv", "silu_mul_gemv", "add_rms_norm_gemv"]
    row_kernels = ["add_rms_norm_rows", "silu_mul_rows", "add_rms_norm_rows"]
    assert calls == (gemv_kernels if rows <= gemv_rows else row_kernels)


def test_ops_send_several_rows_to_the_gemv_only_for_the_shapes_in_the_table(monkeypatch):
    """`GEMV_ROWS_BY_SHAPE` raises the GEMV's row limit for its weight shapes only: 3 rows take the GEMV
    for a (40, 96) weight listed at 4 rows, the row kernel + F.linear for a (96, 20) weight not listed."""
    monkeypatch.setattr(L, "GEMV_ROWS_BY_SHAPE", {(40, 96): 4})
    calls = []
    for name in ("gemv", "silu_mul_gemv", "silu_mul_rows"):
        fn = getattr(L, name)
        monkeypatch.setattr(L, name, lambda *a, fn=fn, name=name: calls.append(name) or fn(*a))
    g = _gen(3)
    x, w, w_down = (
        torch.randn(3, 96, generator=g).to(DEVICE),
        _weights(40, 96, torch.float32, g),
        _weights(96, 20, torch.float32, g),
    )
    y = torch.ops.minisgl.linear(x, w, None)
    y2 = torch.ops.minisgl.silu_mul_linear(y, w_down)
    gate, up = y.chunk(2, dim=-1)
    assert rel_err(y.cpu(), F.linear(x, w).cpu()) < TOL[torch.float32]
    assert rel_err(y2.cpu(), F.linear(F.silu(gate) * up, w_down).cpu()) < TOL[torch.float32]
    assert calls == ["gemv", "silu_mul_rows"]
    assert L.gemv_rows(w) == 4 and L.gemv_rows(w_down) == L.LINEAR_GEMV_ROWS == 1


# -- the whole model through the fused path -------------------------------------------------------------


def _open_gates(monkeypatch):
    """Lets the fused kernels run on CPU float32 tensors (under the interpreter): their gates check for
    CUDA and half precision. Returns the counts of fused calls, by kernel."""
    import importlib

    import minisgl.layers.basic as basic
    import minisgl.models.llama as llama

    # (`minisgl.layers.attention` as an attribute is the function the package exports)
    attention_layer = importlib.import_module("minisgl.layers.attention")

    calls = {name: 0 for name in ("rope_store", *FUSED_GEMV_KERNELS)}

    def counted(name, fn):
        def run(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return run

    monkeypatch.setattr(llama, "rope_store_applies", lambda qkv, head_dim: head_dim % 2 == 0)
    monkeypatch.setattr(
        basic, "gemv_fits", lambda x, w: x.dim() == 2 and w.shape[1] == x.shape[1] and w.is_contiguous()
    )
    monkeypatch.setattr(
        attention_layer, "qk_norm_rope_store", counted("rope_store", attention_layer.qk_norm_rope_store)
    )
    for name in FUSED_GEMV_KERNELS:
        monkeypatch.setattr(L, name, counted(name, getattr(L, name)))
    monkeypatch.setattr(G, "_config", _two_programs(G._config))
    return calls


def _two_programs(config):
    """`gemv._config` with as many output rows per program as make two programs: the interpreter runs a
    launch's programs one after another in Python (about 25 ms each at these sizes), and the GPU's one
    or two rows per program made this test's launches 128 programs each. The second program's rows are
    masked where n is odd (the odd shapes); the kernel's narrow blocks have their own tests above
    (`gemv_shapes`)."""

    def wide(m, n, k, *prologue):
        _, block_k, warps = config(m, n, k, *prologue)
        return 1 << (-(-n // 2) - 1).bit_length(), block_k, warps  # the power of two >= n / 2

    return wide


# the kernels that the ops of `minisgl.kernels.linear` pick from, for one row and for more
FUSED_GEMV_KERNELS = ("add_rms_norm_gemv", "silu_mul_gemv", "add_rms_norm_rows", "silu_mul_rows")


SEQ_LENS = [[9], [6, 11]]  # one request (one-row decode: the fused GEMVs), then a batch


# odd shapes: no power of two in the hidden size, the head_dim or the intermediate size, 2 and 3 query
# heads per KV head (the masks of every kernel)
ODD_SHAPES = {
    "qwen3-odd": ("qwen3", dict(hidden_size=72, num_attention_heads=6, num_key_value_heads=3, head_dim=20,
                                intermediate_size=100)),
    "llama-odd": ("llama", dict(hidden_size=96, num_attention_heads=3, num_key_value_heads=1,
                                intermediate_size=136)),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="runs the kernels on CPU tensors, under Triton's interpreter (a CPU machine); the GPU tests "
    "run the fused path on the GPU (tests/gpu/test_gpu.py)",
)
@pytest.mark.parametrize(
    "arch, gemv_rows",
    [(arch, 1) for arch in ["qwen3", "llama", "qwen2", "qwen3_moe", *ODD_SHAPES]] + [("qwen3", 2)],
)
def test_model_through_fused_kernels_matches_unfused_and_transformers(
    tiny_model, monkeypatch, arch, gemv_rows
):
    """Teacher-forced logits of a tiny model with the fused kernels equal the unfused path's (float32)
    and transformers'. One request decodes one row a step (the GEMV kernels and their prologues); its
    prefill, and every step of a batch of two, run the row kernels with plain GEMMs, except that with
    `LINEAR_GEMV_ROWS` 2 the batch's steps run the GEMV kernels too; every forward runs the fused RoPE
    kernel."""
    arch, overrides = ODD_SHAPES.get(arch, (arch, {}))
    folder = tiny_model(arch, **overrides)
    steps = 2
    g = _gen(3)
    for lens in SEQ_LENS:
        seqs = [torch.randint(3, 320, (n + steps,), generator=g).tolist() for n in lens]
        if len(lens) == 1 and gemv_rows > 1:
            # one row takes the GEMV kernels whatever LINEAR_GEMV_ROWS is (and a prefill of more rows than
            # it the row kernels): the same code path as the (arch, 1) case, which runs it
            continue

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
            m.setattr(L, "LINEAR_GEMV_ROWS", gemv_rows)
            fused = run(True)
        layers = 3
        forwards = steps + 1
        assert calls["rope_store"] == layers * forwards
        gemv_steps = steps if len(lens) <= gemv_rows else 0
        dense_layers = 1 if arch == "qwen3_moe" else 3  # the MoE model's layer 1 alone is dense
        # per forward, each layer's two norms: before attention, and before the MLP or the MoE router
        # (`norm_linear_keep`)
        norms = 2 * layers
        assert calls["add_rms_norm_gemv"] == norms * gemv_steps
        assert calls["silu_mul_gemv"] == dense_layers * gemv_steps
        assert calls["add_rms_norm_rows"] == norms * (forwards - gemv_steps)
        assert calls["silu_mul_rows"] == dense_layers * (forwards - gemv_steps)
        assert rel_err(fused, unfused) < 1e-5
        assert rel_err(fused, reference_logits(folder, seqs, lens, steps)) < 1e-4
