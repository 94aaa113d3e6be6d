"""FP8 (float8_e4m3fn) numerics: block-scaled weights, per-token-group activations, FP8 KV values.

`quantize_blocks`, `quantize_groups` and `quantize_kv` make the formats of docs/quantization.md ("The
formats"); every division rounds to e4m3 once, after clamping to [-448, 448]. `fp8_linear` here is the
float32 emulation, the reference the GPU kernels are tested against and what runs where they do not
(`minisgl.kernels.fp8_gemm.fp8_linear` chooses).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
INV_FP8_MAX = 1.0 / FP8_MAX  # a block's scale is its amax times this, in float32
# a block or group of zeros gets this amax, so that its scale is no zero to divide by (its values stay 0)
MIN_AMAX = 1e-12
# activation group width: per token, in groups of this many columns (or of the weight's block width,
# where that is narrower, so that a group never straddles two weight blocks)
ACTIVATION_GROUP = 128


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def to_fp8(x: torch.Tensor) -> torch.Tensor:
    """x (float32) clamped to e4m3's range and rounded to e4m3 (nearest even)."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def expand_scale(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """The (N, K) float32 tensor holding each entry's block scale, from `scale` (ceil(N / bn), ceil(K / bk))."""
    (n, k), (bn, bk) = shape, block
    return scale.float().repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]


def block_amax(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The largest magnitude of each (bn, bk) block of x (N, K), partial blocks included: (Nb, Kb)."""
    (n, k), (bn, bk) = x.shape, block
    nb, kb = _cdiv(n, bn), _cdiv(k, bk)
    padded = F.pad(x.float().abs(), (0, kb * bk - k, 0, nb * bn - n))  # zeros leave the maxima alone
    return padded.view(nb, bn, kb, bk).amax(dim=(1, 3))


def quantize_blocks(x: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """x (N, K) -> (e4m3 (N, K), float32 scales (ceil(N / bn), ceil(K / bk))): each block divided by its
    largest magnitude / 448."""
    # times the float32 reciprocal, not / 448: torch on CUDA divides by a Python scalar that way (on the
    # CPU truly), so one multiplication is the formula every device and the Triton kernels share
    scale = block_amax(x, block).clamp(min=MIN_AMAX) * INV_FP8_MAX
    return to_fp8(x.float() / expand_scale(scale, x.shape, block)), scale


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The float32 values of e4m3 `q` (N, K) with block scales `scale`."""
    return q.float() * expand_scale(scale, q.shape, block)


def activation_group(block_k: int) -> int:
    """Columns per activation scale for a weight of `block_k`-column blocks: 128, or block_k if narrower."""
    return min(ACTIVATION_GROUP, block_k)


def quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token-group quantization of x (T, K): (e4m3 (T, K), float32 scales (T, ceil(K / group)))."""
    return quantize_blocks(x, (1, group))


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    group: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x (.., K) @ W^T (+ bias) -> (.., N) in x's dtype, for the FP8 weight W = `weight` (N, K) e4m3 with
    block scales `scale` (ceil(N / block[0]), ceil(K / block[1])) float32; x is quantized per token in
    groups of `group` columns first. The float32 emulation, the reference (the layers run
    `minisgl.kernels.fp8_gemm.fp8_linear`, which calls this where the GPU kernels do not apply)."""
    rows = x.reshape(-1, x.shape[-1])
    xq, xs = quantize_groups(rows, group)
    y = dequantize_blocks(xq, xs, (1, group)) @ dequantize_blocks(weight, scale, block).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).view(*x.shape[:-1], weight.shape[0])


def quantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """K or V values in e4m3, as the FP8 KV cache stores them: x / scale (a float32 scalar tensor)."""
    return to_fp8(x.float() / scale)


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Stored e4m3 K or V values back in `dtype`: q * scale."""
    return (q.float() * scale).to(dtype)
