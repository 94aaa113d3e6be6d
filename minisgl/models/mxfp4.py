"""MXFP4 expert weights (gpt-oss checkpoints, `quantization_config.quant_method: mxfp4`), dequantized at load.

The format (OCP microscaling): each run of 32 consecutive values along a weight's input dimension shares
one e8m0 scale, a byte `s` meaning 2^(s - 127); each value is an e2m1 FP4 code, a nibble whose high bit
is the sign and whose low three bits index 0, 0.5, 1, 1.5, 2, 3, 4, 6. A checkpoint stores a weight
(rows, cols) of experts as `NAME_blocks` (E, rows, cols / 32, 16) uint8, two codes a byte, the low
nibble first (value 2j in the low nibble of byte j, value 2j + 1 in the high one), and `NAME_scales`
(E, rows, cols / 32) uint8. minisgl has no FP4 kernel: the weights become the model's dtype at load
(exact: every MXFP4 value is a bfloat16). docs/quantization.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from minisgl.models.weights import BadTensor, source_dtype

MXFP4_BLOCK = 32  # values per scale
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E8M0_BIAS = 127


def fp4_table(device: torch.device | str = "cpu") -> torch.Tensor:
    """(16,) float32: the value of each e2m1 code (codes 8 to 15 are the negatives of 0 to 7)."""
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    return torch.cat([values, -values])


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks (..., G, 16) uint8 and scales (..., G) uint8 -> (..., G * 32) in `dtype` (see the module
    docstring)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != MXFP4_BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks (..., G, 16) and scales (..., G) do not match: {tuple(blocks.shape)} and "
            f"{tuple(scales.shape)}"
        )
    table = fp4_table(blocks.device)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()  # (..., G, 32)
    scale = torch.exp2(scales.to(torch.float32) - E8M0_BIAS).unsqueeze(-1)
    return (table[codes] * scale).flatten(-2).to(dtype)


@dataclass
class Mxfp4Weight:
    """One expert weight read from its `_blocks` and `_scales` tensors (two checkpoint entries, `part`
    "blocks" / "scales", in either order): once both are read it is dequantized (E, rows, cols) and
    `place` puts it where it goes (the rows this rank keeps, in the model's layout)."""

    shape: tuple[int, int, int]  # (E, rows, cols) of the checkpoint's weight
    place: Callable[[int, torch.Tensor], None]  # (expert, its float32 weight (rows, cols))
    read: dict[str, torch.Tensor] = field(default_factory=dict)

    def part(self, kind: str) -> _Mxfp4Part:
        return _Mxfp4Part(self, kind)

    def take(self, kind: str, tensor: torch.Tensor) -> None:
        self.read[kind] = tensor
        if len(self.read) == 2:
            blocks, scales = self.read.pop("blocks"), self.read.pop("scales")
            for e in range(self.shape[0]):  # an expert at a time: the float copy stays small
                self.place(e, dequantize_mxfp4(blocks[e], scales[e], torch.float32))


@dataclass(frozen=True)
class _Mxfp4Part:
    weight: Mxfp4Weight
    kind: str  # "blocks" or "scales"

    @property
    def full_shape(self) -> tuple[int, ...]:
        experts, rows, cols = self.weight.shape
        groups = cols // MXFP4_BLOCK
        return (experts, rows, groups, MXFP4_BLOCK // 2) if self.kind == "blocks" else (experts, rows, groups)

    def load(self, source: Any) -> None:
        dtype = source_dtype(source)
        if dtype not in ("U8", "uint8"):
            raise BadTensor(f"has dtype {dtype}; MXFP4 {self.kind} are uint8 (U8)")
        self.weight.take(self.kind, source if isinstance(source, torch.Tensor) else source[:])


def check_mxfp4_shape(name: str, cols: int) -> None:
    """An MXFP4 weight's input dimension must be whole blocks of 32."""
    if cols % MXFP4_BLOCK:
        raise ValueError(
            f"{name}={cols} is not a multiple of {MXFP4_BLOCK}: its MXFP4 expert weights cannot be read; "
            "use a checkpoint with unquantized experts"
        )
