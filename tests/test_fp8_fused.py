"""The FP8 projections' fused quantizers (`minisgl.kernels.fp8_gemm`: `norm_quantize_rows`,
`silu_mul_quantize_rows`) and the ops that run them before the GEMV (`minisgl::fp8_norm_linear`,
`minisgl::fp8_silu_mul_linear`), on CPU tensors under Triton's interpreter. The `check_*` functions take
a device: tests/gpu/test_gpu_fp8.py runs them on CUDA.

The fused kernels write the e4m3 values and scales that the unfused path (`add_rms_norm` / `rms_norm` or
`F.silu(gate) * up` in x's dtype, then `quantize_rows`) writes, bit for bit where the float32 operations
are the same:

- the norm's sum of squares is the one float32 sum that torch adds in an order of its own, so the
  bit-for-bit cases use rows whose squares float32 adds exactly in any order (`grid_rows`), and rows on
  which torch's way of taking the mean and the root shows (`rows_telling_roundings_apart`); random rows
  are checked the same but for a value in a thousand that may round to its e4m3 neighbour (a sum one
  unit in the last place off moves a value across a rounding midpoint of x's dtype);
- SiLU's exp is NumPy's under the interpreter and torch's vectorized one in the CPU reference: they
  give the same bf16 SiLU for every bf16 value (the exhaustive test); in fp16 three values of 63,488
  differ by one unit in the last place (none moves a byte here), so fp16 on the CPU is checked like
  random norm rows. On CUDA the kernel calls the same expf as torch: bit for bit in both.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F
from test_fp8_gemm import assert_within_one_ulp, spy

from minisgl.kernels import fp8_gemm as G
from minisgl.kernels.fp8 import FP8_DTYPE, dequantize_blocks, fp8_linear, quantize_blocks
from minisgl.layers import Fp8Linear, basic

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")

EPS = 1e-6
# output rows of the ops' weight: few, as the GEMV's programs are slow under the interpreter
N = 40
HALF = [torch.bfloat16, torch.float16]


def grid_rows(m: int, k: int, seed: int, dtype: torch.dtype, bound: int = 63) -> torch.Tensor:
    """x (m, k): multiples of 1/16 up to bound / 16 in magnitude, and 40 in column 130 (or the last),
    a group whose other values round at a coarser scale. The squares are multiples of 2^-8 whose sum
    over a row (k <= 4096) stays below 2^24 of them: float32 adds them exactly, in any order."""
    gen = torch.Generator().manual_seed(seed)
    n = (torch.randn(m, k, generator=gen) * 16).round().clamp(-bound, bound)
    n[:, min(130, k - 1)] = 640.0
    return (n / 16).to(dtype)


def random_rows(m: int, k: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 4
    x[:, min(130, k - 1)] = 40.0
    return x.to(dtype)


def rows(m: int, k: int, seed: int, dtype: torch.dtype, exact: bool, device: str = "cpu") -> torch.Tensor:
    """`grid_rows` of half the bound (x + residual stays within it), or `random_rows`."""
    x = grid_rows(m, k, seed, dtype, bound=31) if exact else random_rows(m, k, seed, dtype)
    return x.to(device)


def norm_weight(k: int, dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    return (1 + 0.3 * torch.randn(k, generator=torch.Generator().manual_seed(7))).to(device, dtype)


def rows_telling_roundings_apart(k: int, w: torch.Tensor, count: int = 2) -> torch.Tensor:
    """`count` grid rows (k > 131 columns, w's dtype and device) on which the float32 ways a norm may
    take the mean and the root (the sum of squares divided by k, as torch on the CPU, or times float32(1
    / k), as on CUDA; rsqrt, or 1 / sqrt as torch divides) give group 0's largest value, and so its
    scale, other bits: a kernel that takes another way than torch does on this device fails on one of
    them (random rows hold such a value about once in 2^16). Column 0 holds that value (300 / 16 to
    128), columns 1 to 3 (up to 63 / 16) move the sum of squares."""
    dtype, device = w.dtype, w.device
    base = grid_rows(1, k, 9, dtype, bound=31)[0].float()
    # squares in units of 2^-8: the row's without columns 0 to 3; each sum columns 1 to 3 can add, once
    rest = int((base[4:] * 16).square().sum().item())
    f = torch.arange(64)
    squares = (f[:, None, None] ** 2 + f[None, :, None] ** 2 + f**2).flatten()
    sums, inverse = squares.unique(return_inverse=True)
    first = torch.full_like(sums, squares.numel()).scatter_reduce_(
        0, inverse, torch.arange(squares.numel()), "amin"
    )
    v = torch.arange(300, 2048)
    v = v[v.to(torch.bfloat16).long() == v]  # those bf16 (and fp16) holds
    total = ((rest + sums)[:, None] + v.square()).flatten().to(device, torch.float32) / 256  # exact
    value = (v / 16).repeat(sums.numel()).to(device, torch.float32)
    bits = []
    for mean in (total / total.new_full((), k), total * torch.tensor(1 / k, dtype=torch.float32)):
        for root in (torch.rsqrt(mean + EPS), torch.ones_like(mean) / torch.sqrt(mean + EPS)):
            bits.append((w[0] * (value * root).to(dtype)).to(dtype))
    differ = torch.stack(bits).ne(bits[0]).any(dim=0).nonzero().flatten()[:count].cpu()
    assert differ.numel() == count, "too few rows tell the roundings apart"
    columns = first[differ // v.numel()]
    x = base.repeat(count, 1)
    x[:, 0] = v[differ % v.numel()] / 16
    x[:, 1:4] = torch.stack([columns // 4096, columns // 64 % 64, columns % 64], dim=1) / 16
    return x.to(device, dtype)


def unfused_norm(x, residual, w) -> tuple[torch.Tensor, torch.Tensor]:
    """The layers' unfused norm: (normalised, new residual)."""
    if residual is None:
        return basic.rms_norm(x, w, EPS), x
    return basic.add_rms_norm(x, residual, w, EPS)


def assert_same_bytes(
    got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]
) -> None:
    (q, s), (want_q, want_s) = got, want
    assert q.dtype == FP8_DTYPE and q.shape == want_q.shape and s.stride() == want_s.stride()
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(s, want_s)


def assert_nearly_same(
    got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]
) -> None:
    """All but one value in a thousand the same bytes; the others (and their groups' scales) one e4m3
    step apart at most: within 1/8 of the larger value (plus e4m3's subnormal spacing)."""
    (q, s), (want_q, want_s) = got, want
    assert q.shape == want_q.shape and s.stride() == want_s.stride()
    assert (q.view(torch.uint8) == want_q.view(torch.uint8)).float().mean().item() >= 0.999
    value, want_value = dequantize_blocks(q, s, (1, 128)), dequantize_blocks(want_q, want_s, (1, 128))
    slack = dequantize_blocks(torch.ones_like(q), want_s, (1, 128)) * 2.0**-9
    assert ((value - want_value).abs() <= value.abs().maximum(want_value.abs()) / 8 + slack).all()


# -- the quantizers against the unfused path --------------------------------------------------------


def check_norm_quantize(m: int, k: int, with_residual: bool, dtype: torch.dtype, device: str = "cpu") -> None:
    w = norm_weight(k, dtype, device)
    for exact in (True, False):
        x = rows(m, k, 1, dtype, exact, device)
        residual = rows(m, k, 2, dtype, exact, device) if with_residual else None
        q, s, h = G.norm_quantize_rows(x, residual, w, EPS)
        normed, want_h = unfused_norm(x, residual, w)
        assert torch.equal(h, want_h) and h.data_ptr() != x.data_ptr()  # a new tensor without residual
        (assert_same_bytes if exact else assert_nearly_same)((q, s), G.quantize_rows(normed))
        if exact:  # the same kernel unquantized (the ops' path past 2 rows)
            assert torch.equal(G._norm_rows(x, residual, w, EPS, quantize=False)[0], normed)
    x = rows_telling_roundings_apart(k, w) if k > 131 else x[:0]
    q, s, _ = G.norm_quantize_rows(x, None, w, EPS)
    assert_same_bytes((q, s), G.quantize_rows(basic.rms_norm(x, w, EPS)))


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("m,k", [(1, 128), (2, 320), (2, 1000), (5, 2560)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_norm_quantize_rows_is_the_norm_then_quantize_rows(m, k, with_residual, dtype):
    check_norm_quantize(m, k, with_residual, dtype)


def test_norm_quantize_rows_takes_strided_rows_and_no_rows():
    x, residual = grid_rows(3, 320, 1, torch.bfloat16), grid_rows(3, 320, 2, torch.bfloat16, bound=0)
    w = norm_weight(320, torch.bfloat16)
    wide = torch.cat([x, x], dim=1)[:, 320:]  # rows of stride 640
    q, s, h = G.norm_quantize_rows(wide, torch.cat([residual, residual], dim=1)[:, :320], w, EPS)
    normed, want_h = unfused_norm(x, residual, w)
    assert torch.equal(h, want_h)
    assert_same_bytes((q, s), G.quantize_rows(normed))
    q, s, h = G.norm_quantize_rows(x[:0], None, w, EPS)
    assert q.shape == (0, 320) and s.shape == (0, 3) and h.shape == (0, 320)
    with pytest.raises(ValueError, match="do not fit"):
        G.norm_quantize_rows(x, residual[:, :128], w, EPS)


def gate_values(dtype: torch.dtype) -> torch.Tensor:
    """Every value of a 16-bit float type below 1024 in magnitude (times up's, no product overflows)."""
    values = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    return values[values.abs() < 1024]


def check_silu_mul_quantize(gate_up: torch.Tensor) -> None:
    """`silu_mul_quantize_rows(gate_up)` against `F.silu(gate) * up` then `quantize_rows`: bit for bit
    but in fp16 on the CPU (see the module's docstring); on a strided view of gate_up too."""
    gate, up = gate_up.chunk(2, dim=-1)
    want = G.quantize_rows(F.silu(gate) * up)
    same = assert_nearly_same if gate.dtype == torch.float16 and not gate.is_cuda else assert_same_bytes
    same(G.silu_mul_quantize_rows(gate_up), want)
    if same is assert_same_bytes:  # the same kernel unquantized (the op's path past 2 rows), but near
        # float32's subnormals (the interpreter's bf16 conversions get them wrong, both ways; a GPU may
        # flush them; they quantize to zero anyway: a scale is at least 1e-12 / 448)
        keep = (gate.abs() >= 1e-30) | (gate == 0)
        assert torch.equal(G._silu_mul_rows(gate_up, quantize=False)[0][keep], (F.silu(gate) * up)[keep])
    wide = torch.cat([gate_up, gate_up[:, :64]], dim=1)[:, : gate_up.shape[1]]  # rows of stride 2 k + 64
    same(G.silu_mul_quantize_rows(wide), want)


def check_every_gate_value(dtype: torch.dtype, device: str = "cpu") -> None:
    """gate: every value of the dtype below 1024 in magnitude (exp overflows, subnormals, zeros of both
    signs), in rows of k = 8160 (not a multiple of 512); up random."""
    gate, k = gate_values(dtype), 8160
    gate = torch.cat([gate, gate[: -gate.numel() % k]]).view(-1, k)
    check_silu_mul_quantize(torch.cat([gate, random_rows(gate.shape[0], k, 3, dtype)], dim=1).to(device))


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")
@pytest.mark.parametrize("dtype", HALF)
def test_silu_mul_quantize_rows_on_every_gate_value(dtype):
    check_every_gate_value(dtype)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("m,k", [(1, 128), (2, 320), (3, 1000)])
def test_silu_mul_quantize_rows_is_silu_mul_then_quantize_rows(m, k, dtype):
    check_silu_mul_quantize(random_rows(m, 2 * k, 4, dtype))
    with pytest.raises(ValueError, match="even width"):
        G.silu_mul_quantize_rows(random_rows(m, 2 * k - 1, 4, dtype))


# -- the ops against the unfused path and the emulation ----------------------------------------------

# (M, K, weight blocks, residual, bias): K not a multiple of 512 (320, 1000) and one group (128), 1 and 2
# rows (the fused path) and 3 (the unfused one, in the op), 128x128 blocks and one-row blocks
# fmt: off
OP_CASES = [(1, 320, (128, 128), True, True), (2, 320, (1, 128), False, False), (1, 128, (1, 128), False, True),
            (2, 128, (128, 128), True, False), (2, 1000, (128, 128), True, False), (3, 320, (1, 128), True, True)]
# fmt: on


def fp8_weight(n: int, k: int, block: tuple[int, int], device: str = "cpu"):
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen) * 0.1
    return tuple(t.to(device) for t in quantize_blocks(w, block))


def bias_or_none(n: int, bias: bool, device: str = "cpu") -> torch.Tensor | None:
    return (
        torch.randn(n, generator=torch.Generator().manual_seed(6)).to(device, torch.bfloat16)
        if bias
        else None
    )


def emulation(x: torch.Tensor, q, scale, block, bias) -> torch.Tensor:
    """The float32 emulation on x (its values exact in float32)."""
    return fp8_linear(x.float(), q, scale, block, 128, None if bias is None else bias.float())


def check_ops(monkeypatch, m, k, block, with_residual, with_bias, n: int = N, device: str = "cpu") -> None:
    """Both ops on an (n, k) weight against the unfused path (the norm or `F.silu(gate) * up`, then the
    op `minisgl::fp8_linear`: the same e4m3 row and scales, then the same GEMV, so the same bits; past
    2 rows the same path) and, on the GEMV, the emulation (one unit in the last place)."""
    fused = spy(monkeypatch, "norm_quantize_rows"), spy(monkeypatch, "silu_mul_quantize_rows")
    q, scale = fp8_weight(n, k, block, device)
    bias, w = bias_or_none(n, with_bias, device), norm_weight(k, torch.bfloat16, device)
    x = rows(m, k, 1, torch.bfloat16, True, device)
    residual = rows(m, k, 2, torch.bfloat16, True, device) if with_residual else None
    y, h = torch.ops.minisgl.fp8_norm_linear(x, residual, w, EPS, q, scale, *block, 128, bias)
    normed, want_h = unfused_norm(x, residual, w)
    gate_up = random_rows(m, 2 * k, 4, torch.bfloat16).to(device)
    gate, up = gate_up.chunk(2, dim=-1)
    product = F.silu(gate) * up
    mlp = torch.ops.minisgl.fp8_silu_mul_linear(gate_up, q, scale, *block, 128)
    assert fused == (([m], [m]) if m <= G.GEMV_MAX_ROWS else ([], []))
    assert torch.equal(h, want_h)
    for got, activations, b in ((y, normed, bias), (mlp, product, None)):  # (the SiLU's op: no bias)
        assert got.shape == (m, n) and got.dtype == torch.bfloat16
        assert torch.equal(got, torch.ops.minisgl.fp8_linear(activations, q, scale, b, *block, 128))
        if m <= G.GEMV_MAX_ROWS:  # (more rows: the GEMMs, against the emulation in their own tests)
            assert_within_one_ulp(got, emulation(activations, q, scale, block, b))


@pytest.mark.parametrize("m,k,block,with_residual,with_bias", OP_CASES)
def test_fp8_fused_ops(monkeypatch, m, k, block, with_residual, with_bias):
    check_ops(monkeypatch, m, k, block, with_residual, with_bias)


def test_ops_take_no_rows_and_the_fake_tensor_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, scale = fp8_weight(N, 320, (1, 128))
    w = norm_weight(320, torch.float16)
    x = grid_rows(2, 320, 1, torch.float16)
    gate_up = torch.cat([x, x], dim=1)
    y, h = torch.ops.minisgl.fp8_norm_linear(x[:0], None, w, EPS, q, scale, 1, 128, 128)
    assert y.shape == (0, N) and h.shape == (0, 320)
    assert torch.ops.minisgl.fp8_silu_mul_linear(gate_up[:0], q, scale, 1, 128, 128).shape == (0, N)
    with FakeTensorMode() as mode:
        fx, fw, fq, fs, fgu = (mode.from_tensor(t) for t in (x, w, q, scale, gate_up))
        y, h = torch.ops.minisgl.fp8_norm_linear(fx, fx, fw, EPS, fq, fs, 1, 128, 128)
        assert y.shape == (2, N) and y.dtype == torch.float16 and h.shape == (2, 320)
        y = torch.ops.minisgl.fp8_silu_mul_linear(fgu, fq, fs, 1, 128, 128)
        assert y.shape == (2, N) and y.dtype == torch.float16
    with pytest.raises(ValueError, match="activation groups of 128"):
        torch.ops.minisgl.fp8_norm_linear(x, None, w, EPS, q, scale, 1, 128, 64)


# -- the layers' choice ----------------------------------------------------------------------------


def fp8_layer(n: int, k: int, block: tuple[int, int], device: str = "cpu") -> Fp8Linear:
    q, scale = fp8_weight(n, k, block, device)
    with torch.device(device):
        layer = Fp8Linear((n,), k, block)
    layer.weight.data.copy_(q)
    layer.scale.data.copy_(scale)
    return layer


def test_layers_route_fp8_weights_to_the_fused_ops(monkeypatch):
    """`norm_linear` and `silu_mul_linear` send an FP8 weight to the fused ops where the FP8 kernels
    take it (here: told so, on the CPU) with the engine's GEMV and fused kernels on; elsewhere, and
    with a norm weight in another dtype, the unfused path (on the CPU: the emulation)."""
    layer = fp8_layer(N, 320, (128, 128))
    w = norm_weight(320, torch.bfloat16)
    x, residual = rows(2, 320, 1, torch.bfloat16, True), rows(2, 320, 2, torch.bfloat16, True)
    gate_up = random_rows(2, 640, 4, torch.bfloat16)
    normed, want_h = unfused_norm(x, residual, w)
    gate, up = gate_up.chunk(2, dim=-1)
    want = emulation(normed, layer.weight, layer.scale, layer.block, None)
    want_mlp = emulation(F.silu(gate) * up, layer.weight, layer.scale, layer.block, None)

    def run():
        y, h = basic.norm_linear(x, residual, w, EPS, layer)
        assert torch.equal(h, want_h)
        return y, basic.silu_mul_linear(gate_up, layer)

    fused = spy(monkeypatch, "norm_quantize_rows"), spy(monkeypatch, "silu_mul_quantize_rows")
    y, mlp = run()  # on the CPU: the emulation
    assert fused == ([], []) and torch.equal(y, want.bfloat16()) and torch.equal(mlp, want_mlp.bfloat16())
    monkeypatch.setattr(basic, "fp8_kernels_fit", lambda *args, **kwargs: True)
    y, mlp = run()  # the switch is on by default
    assert fused == ([2], [2])
    assert_within_one_ulp(y, want)
    assert_within_one_ulp(mlp, want_mlp)
    monkeypatch.setattr(G, "FUSED_QUANTIZE", False)
    run()
    assert fused == ([2], [2])
    monkeypatch.setattr(G, "FUSED_QUANTIZE", True)
    for name in ("gemv_kernel_mode", "fused_kernels_mode"):
        with monkeypatch.context() as patch:
            patch.setattr(basic, name, lambda: False)
            run()
    basic.norm_linear(x, residual, w.float(), EPS, layer)
    assert fused == ([2], [2])


def fp8_mlp(device: str = "cpu"):
    """f(x, residual) -> (MLP output, new residual): the norm, an FP8 gate/up projection (128 x 256,
    128x128 blocks), the SiLU-and-multiply and an FP8 down projection (N x 64, one-row blocks), through
    the layers' functions."""
    gate_up, down = fp8_layer(128, 256, (128, 128), device), fp8_layer(N, 64, (1, 128), device)
    w = norm_weight(256, torch.bfloat16, device)

    def f(x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y, h = basic.norm_linear(x, residual, w, EPS, gate_up)
        return basic.silu_mul_linear(y, down), h

    return f


def test_layers_under_compile(monkeypatch):
    """Dynamo traces the layers' choice and the ops' fake implementations (the aot_eager backend: no
    code generated), one graph for 1 and 3 rows: the eager bits."""
    monkeypatch.setattr(basic, "fp8_kernels_fit", lambda *args, **kwargs: True)
    monkeypatch.setattr(G, "FUSED_QUANTIZE", True)
    fused = spy(monkeypatch, "norm_quantize_rows"), spy(monkeypatch, "silu_mul_quantize_rows")
    f = fp8_mlp()
    compiled = torch.compile(f, fullgraph=True, dynamic=True, backend="aot_eager")
    for m in (1, 3):
        x, residual = rows(m, 256, 1, torch.bfloat16, True), rows(m, 256, 2, torch.bfloat16, True)
        assert all(torch.equal(a, b) for a, b in zip(compiled(x, residual), f(x, residual)))
    assert fused == ([1, 1], [1, 1])
