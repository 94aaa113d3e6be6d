"""minisgl's one layout of integer (4- and 8-bit) weights, whatever checkpoint format they came from, and
its reference dequantization. The GPU kernels that read it: minisgl.kernels.packed_gemm.

A weight W (N, K) of `bits` b in {4, 8}, P = 32 / b values an int32 word, groups of g input columns
(K % g == 0; one group of all K per channel):

- ``qweight`` int32 (N, K / P): the unsigned values u in [0, 2^b), along the input dimension, the first
  of a word in its lowest bits: u[n, k] = (qweight[n, k // P] >> (b * (k % P))) & (2^b - 1). A program
  that owns output rows reads each row's words contiguously (the GEMV), a GEMM tile is rows x words.
- ``scales`` (N, K / g) in the checkpoint's float dtype (float16, bfloat16 or float32);
- ``zeros`` (N, K / g) uint8: each group's zero point, resolved at load (GPTQ's v1 offset added,
  symmetric formats' 2^(b-1), compressed-tensors' signed offset undone), so that every format reads
  W[n, perm[k]] = (u[n, k] - zeros[n, k // g]) * scales[n, k // g], computed in float32;
- ``perm`` int64 (K,) or None: the input column that packed column k multiplies. GPTQ's act order
  (`g_idx`) is resolved at load by sorting the columns by group once; the kernels read x through it.

docs/quantization.md ("The internal layout").
"""

from __future__ import annotations

from typing import NamedTuple

import torch


def unpack_words(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 words (..., W) -> their values (..., W * 32 / bits) as int32, each word's first value in its
    lowest bits."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=words.device)
    values = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return values.reshape(*words.shape[:-1], -1)


def pack_words(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Values in [0, 2^bits) (..., K), K a multiple of 32 / bits -> int32 words (..., K * bits / 32),
    the inverse of `unpack_words`."""
    per = 32 // bits
    v = values.to(torch.int64).reshape(*values.shape[:-1], -1, per)
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=values.device)
    words = (v << shifts).sum(-1)  # < 2^32: exact in int64
    return (words - ((words >> 31) << 32)).to(torch.int32)  # the same bits as a signed int32


def dequantize(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    bits: int,
    perm: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The weight (..., N, K) of the layout above (leading dims: a MoE layer's experts), computed in
    float32 and rounded to `dtype` once, its columns in the input's order."""
    u = unpack_words(qweight, bits).float()
    group = u.shape[-1] // scales.shape[-1]
    s = scales.float().repeat_interleave(group, dim=-1)
    z = zeros.float().repeat_interleave(group, dim=-1)
    w = ((u - z) * s).to(dtype)
    if perm is not None:
        w = torch.empty_like(w).index_copy_(-1, perm, w)
    return w


class PackedWeights(NamedTuple):
    """A MoE layer's experts in the layout above: qweight (E, N, K / P), scales and zeros (E, N, K / g);
    the experts' kernels (minisgl.kernels.moe_gemv, moe_gemm) read them packed."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    bits: int

    @property
    def shape(self) -> tuple[int, ...]:
        """The weights' logical shape (E, N, K)."""
        *lead, words = self.qweight.shape
        return (*lead, words * 32 // self.bits)

    @property
    def group(self) -> int:
        """Input columns a scale covers."""
        return self.shape[-1] // self.scales.shape[-1]

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.qweight, self.scales, self.zeros, self.bits, dtype=dtype)
