"""The weight of an FP8 linear layer: e4m3 values and float32 block scales (formats: minisgl.kernels.fp8).

`Fp8Linear` only holds tensors; `minisgl.layers.linear` (and `norm_linear`, `silu_mul_linear`) take it in
place of a weight tensor and run `minisgl.kernels.fp8_gemm.fp8_linear`. A merged projection (Q/K/V,
gate/up) is one `Fp8Linear` over its checkpoint tensors (`segments`), in their block grid or, where
they do not fill whole blocks, one scale row per weight row: docs/quantization.md ("The formats").
"""

from __future__ import annotations

import torch
from torch import nn

from minisgl.kernels.fp8 import FP8_DTYPE, activation_group


class Fp8Linear(nn.Module):
    """`weight` (N, K) float8_e4m3fn and `scale` (ceil(N / block[0]), ceil(K / block[1])) float32, made on
    the current default device; `segments`: the rows of each checkpoint tensor merged into it, in order;
    `group`: the activation group width (`minisgl.kernels.fp8.activation_group`)."""

    def __init__(self, segments: tuple[int, ...], cols: int, block: tuple[int, int]) -> None:
        super().__init__()
        rows = sum(segments)
        block_n, block_k = block
        self.segments, self.block, self.group = tuple(segments), (block_n, block_k), activation_group(block_k)
        self.weight = nn.Parameter(torch.empty(rows, cols, dtype=FP8_DTYPE), requires_grad=False)
        scale_shape = (-(-rows // block_n), -(-cols // block_k))
        self.scale = nn.Parameter(torch.empty(scale_shape, dtype=torch.float32), requires_grad=False)

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def segment_rows(self, index: int) -> slice:
        """The rows of segment `index` in `weight`."""
        start = sum(self.segments[:index])
        return slice(start, start + self.segments[index])

    def segment_scale_rows(self, index: int) -> slice:
        """The rows of `scale` that segment `index` uses (each segment starts on a block boundary)."""
        rows, block_n = self.segment_rows(index), self.block[0]
        return slice(rows.start // block_n, -(-rows.stop // block_n))

    def extra_repr(self) -> str:
        return (
            f"segments={self.segments}, cols={self.weight.shape[1]}, block={self.block}, group={self.group}"
        )
