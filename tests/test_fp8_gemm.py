"""The FP8 projection's Triton kernels (`minisgl.kernels.fp8_gemm`) on CPU tensors under Triton's
interpreter, against the float32 emulation (`minisgl.kernels.fp8`): the activation quantizer bit for bit,
the GEMV and the block-scaled GEMM within float32 summation order, the op `minisgl::fp8_linear`'s choice
by row count, and the errors for operands the kernels do not take. On CUDA: tests/gpu/test_gpu_fp8.py.

Shapes tile partially everywhere: N = 200 output rows (not a multiple of any BLOCK_N), K = 320 columns
(two whole groups of 128 and one of 64), M = 1, 3, 16 (GEMV) and 1, 3, 17, 70 (GEMM) rows.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from minisgl.kernels import fp8_gemm as G
from minisgl.kernels.fp8 import FP8_DTYPE, fp8_linear, quantize_blocks, quantize_groups

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")

N, K = 200, 320
# float32 summation order: the kernels sum the emulation's products in another order
ORDER_TOL = 1e-5


def weights(block: tuple[int, int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8 weight (N, K) in blocks of `block`, rows of different magnitudes."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=gen) * torch.rand(N, 1, generator=gen) * 0.1
    return quantize_blocks(w, block)


def activations(m: int, seed: int = 1, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, K, generator=gen) * torch.rand(m, 1, generator=gen) * 4
    x[:, 130] = 40.0  # one large value: the rest of its group rounds at a coarser scale
    return x.to(dtype)


def reference(x, q, scale, block, bias) -> torch.Tensor:
    """The emulation in float32 (x's values are exact in float32)."""
    return fp8_linear(x.float(), q, scale, block, 128, None if bias is None else bias.float())


def assert_within_order(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == torch.float32
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err <= ORDER_TOL, err


def assert_within_one_ulp(got: torch.Tensor, want32: torch.Tensor) -> None:
    """got (bf16 / fp16) is want32 (float32) rounded, or its neighbour: within one unit in the last place
    of got's dtype (plus the summation-order tolerance, for values near zero)."""
    _, exponent = torch.frexp(want32)  # |want32| in [2^(exponent - 1), 2^exponent)
    ulp = torch.ldexp(torch.full_like(want32, torch.finfo(got.dtype).eps), exponent - 1)
    slack = ORDER_TOL * want32.abs().max()
    assert ((got.float() - want32).abs() <= ulp + slack).all()
    # rounded to nearest (even) as the emulation rounds: the same value but where float32 summation
    # order moves a value across a rounding midpoint
    assert (got == want32.to(got.dtype)).float().mean().item() > 0.98


# -- the activation quantizer ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m,k", [(1, 320), (3, 320), (17, 256), (5, 1000)])
def test_quantize_rows_equals_quantize_groups(m, k, dtype):
    gen = torch.Generator().manual_seed(m * k)
    x = torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 100
    x[0, :128] = 0.0  # a group of zeros
    x[-1, 5] = 3e4  # a group whose other values fall into e4m3's subnormals or to zero
    x[-1, 6] = -1e-3
    x = x.to(dtype)
    q, s = G.quantize_rows(x)
    want_q, want_s = quantize_groups(x, 128)
    assert q.dtype == FP8_DTYPE and s.dtype == torch.float32
    assert s.shape == (m, -(-k // 128)) and s.stride() == (1, m)  # column-major, as _scaled_mm wants
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(s, want_s)


def test_quantize_rows_rounds_every_e4m3_midpoint_as_torch():
    """Every e4m3 value, the midpoints between neighbours and the float32 values next to them (one group
    of scale 1: the row's largest magnitude is 448)."""
    values = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    values = values[values.isfinite()].unique()
    mids = (values[1:] + values[:-1]) / 2
    above, below = mids.nextafter(torch.tensor(1e9)), mids.nextafter(torch.tensor(-1e9))
    x = torch.cat([values, mids, above, below])
    k = -(-x.numel() // 128) * 128
    x = torch.cat([x, torch.full((k - x.numel(),), 448.0)]).view(-1, 128)
    x[:, 0] = 448.0
    q, s = G.quantize_rows(x)
    want_q, want_s = quantize_groups(x, 128)
    assert torch.equal(s, want_s) and (s == 1.0).all()
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


def test_quantize_rows_takes_a_strided_view():
    x = activations(4).float()
    wide = torch.cat([x, x], dim=1)[:, K:]  # rows with stride 2 K
    q, s = G.quantize_rows(wide)
    want_q, want_s = quantize_groups(x, 128)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s, want_s)


# -- the GEMV and the GEMM against the emulation --------------------------------------------------

# (M, weight blocks, bias): 128x128 blocks, one-row blocks (small models' merged projections),
# per-tensor-like blocks (one row, all K columns) and 256-column blocks
# fmt: off
GEMV_CASES = [(1, (128, 128), True), (1, (1, 128), False), (3, (1, 128), True), (3, (128, 128), False),
              (16, (128, 128), True), (2, (1, K), False)]
GEMM_CASES = [(1, (128, 128), False), (3, (1, 128), True), (17, (128, 128), True), (17, (1, 128), False),
              (70, (128, 256), True), (5, (1, K), False)]
# fmt: on


def case(m: int, block: tuple[int, int], bias: bool):
    """A case's operands (x, weight, scale, bias) and the emulation's output on them."""
    q, scale = weights(block)
    x = activations(m)
    b = torch.randn(N, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16) if bias else None
    return (x, q, scale, block, b), reference(x, q, scale, block, b)


@pytest.mark.parametrize("m,block,bias", GEMV_CASES)
def test_gemv_matches_emulation(m, block, bias):
    operands, want = case(m, block, bias)
    assert_within_order(G.fp8_gemv(*operands, out_dtype=torch.float32), want)


@pytest.mark.parametrize("m,block,bias", GEMM_CASES)
def test_triton_gemm_matches_emulation(m, block, bias):
    operands, want = case(m, block, bias)
    assert_within_order(G.fp8_gemm_triton(*operands, out_dtype=torch.float32), want)
    for config in G.GEMM_CONFIGS[:2]:  # another tile shape: the same numbers within summation order
        assert_within_order(G.fp8_gemm_triton(*operands, out_dtype=torch.float32, config=config), want)


def test_gemm_configs_cover_the_rows():
    assert G.gemm_config(1)[0] >= 1 and G.gemm_config(10_000) == G.GEMM_CONFIGS[-1]
    for m in (1, 16, 17, 64, 65, 128, 129):
        block_m = G.gemm_config(m)[0]
        assert block_m >= 16 and (block_m >= m or G.gemm_config(m) == G.GEMM_CONFIGS[-1])


# -- the op: choice by row count, output dtype -----------------------------------------------------


def spy(monkeypatch, name: str) -> list[int]:
    """Records the row count of each call of `minisgl.kernels.fp8_gemm.<name>`."""
    calls: list[int] = []
    original = getattr(G, name)

    def wrapper(x, *args, **kwargs):
        calls.append(x.shape[0])
        return original(x, *args, **kwargs)

    monkeypatch.setattr(G, name, wrapper)
    return calls


@pytest.mark.parametrize("backend", ["scaled_mm", "triton"])
def test_op_picks_the_kernel_by_rows_and_rounds_once(monkeypatch, backend):
    monkeypatch.setattr(G, "GEMM_BACKEND", backend)
    monkeypatch.setattr(G, "GEMV_MAX_ROWS", 2)
    gemv, gemm = spy(monkeypatch, "fp8_gemv"), spy(monkeypatch, "fp8_gemm_triton")
    q, scale = weights((128, 128))
    b = torch.randn(N, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    for m in (2, 3):
        x = activations(m)
        y = torch.ops.minisgl.fp8_linear(x, q, scale, b, 128, 128, 128)
        assert y.shape == (m, N) and y.dtype == torch.bfloat16
        assert_within_one_ulp(y, reference(x, q, scale, (128, 128), b))
    # on the CPU torch._scaled_mm is refused (and K = 320 is no multiple of 4 blocks): the Triton GEMM
    assert gemv == [2] and gemm == [3]
    x = activations(2)
    torch.ops.minisgl.fp8_linear(x, q, scale, None, 128, 128, 128, True)  # invariant: the GEMM
    assert gemv == [2] and gemm == [3, 2]
    assert torch.ops.minisgl.fp8_linear(x[:0], q, scale, None, 128, 128, 128).shape == (0, N)


def test_scaled_mm_takes_weights_of_whole_scale_rows_and_pads_the_rows(monkeypatch):
    """cuBLASLt misreads the weight scales unless a weight row holds a multiple of 4 blocks: others run
    the Triton GEMM on the rows as they are. The rest pad the rows to a multiple of 4 (torch refuses
    others); on the CPU torch refuses every call: the Triton GEMM takes the padded rows once, then (the
    refusal cached) the rows as they are. The outputs have the rows asked for, the emulation's numbers."""
    gemm = spy(monkeypatch, "fp8_gemm_triton")
    q, scale = weights((128, 128))  # K = 320: 3 blocks a row
    assert not G.scaled_mm_fits(q)
    x = activations(3)
    assert_within_one_ulp(G.fp8_gemm_scaled_mm(x, q, scale), reference(x, q, scale, (128, 128), None))
    assert gemm == [3]
    gen = torch.Generator().manual_seed(3)
    wide, wide_scale = quantize_blocks(torch.randn(N, 512, generator=gen) * 0.1, (128, 128))
    x = (torch.randn(3, 512, generator=gen) * 2).to(torch.bfloat16)
    assert G.scaled_mm_fits(wide) and G.SCALED_MM_ROWS == 4
    for calls in ([3, 4], [3, 4, 3]):
        y = G.fp8_gemm_scaled_mm(x, wide, wide_scale)
        assert y.shape == (3, N) and gemm == calls
        assert_within_one_ulp(y, reference(x, wide, wide_scale, (128, 128), None))


def test_op_in_half_precision_and_under_the_fake_tensor_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, scale = weights((1, 128))
    x = activations(3, dtype=torch.float16)
    y = torch.ops.minisgl.fp8_linear(x, q, scale, None, 1, 128, 128)
    assert y.dtype == torch.float16
    assert_within_one_ulp(y, reference(x, q, scale, (1, 128), None))
    with FakeTensorMode() as mode:
        fake = torch.ops.minisgl.fp8_linear(
            mode.from_tensor(x), mode.from_tensor(q), mode.from_tensor(scale), None, 1, 128, 128
        )
    assert fake.shape == (3, N) and fake.dtype == torch.float16


def test_fp8_linear_runs_the_emulation_off_cuda():
    """On the CPU (and for formats the kernels do not take) the layers' `fp8_linear` is the emulation."""
    q, scale = weights((128, 128))
    x = activations(3).view(1, 3, K)
    assert not G.fp8_kernels_fit(x, q, scale, (128, 128), 128)
    assert torch.equal(G.fp8_linear(x, q, scale, (128, 128), 128), fp8_linear(x, q, scale, (128, 128), 128))


def test_block_fits():
    assert G.block_fits((128, 128), 128, 4096) and G.block_fits((1, 128), 128, 4096)
    assert G.block_fits((1, 4096), 128, 4096) and G.block_fits((1, 320), 128, 320)
    assert not G.block_fits((128, 64), 64, 4096)  # groups of 64
    assert not G.block_fits((128, 192), 128, 4096)  # a group would straddle two blocks


def test_bad_operands_are_refused():
    q, scale = weights((128, 128))
    x = activations(2)
    with pytest.raises(ValueError, match="scale must be contiguous float32"):
        G.fp8_gemv(x, q, scale[:1], (128, 128))
    with pytest.raises(ValueError, match="do not multiply"):
        G.fp8_gemm_triton(x[:, :128], q, scale, (128, 128))
    with pytest.raises(ValueError, match="must be contiguous"):
        G.fp8_gemv(x, q.float(), scale, (128, 128))
    with pytest.raises(ValueError, match="at most 16 rows"):
        G.fp8_gemv(activations(17), q, scale, (128, 128))
    with pytest.raises(ValueError, match="activation groups of 128"):
        torch.ops.minisgl.fp8_linear(x, q, scale, None, 128, 128, 64)
    with pytest.raises(ValueError, match="group must be 128"):
        G.quantize_rows(x, 64)
