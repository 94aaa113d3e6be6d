"""The weight of a 4- or 8-bit linear layer in minisgl's packed layout (minisgl.kernels.packed).

`PackedLinear` only holds tensors; `minisgl.layers.linear` takes it in place of a weight tensor and runs
`minisgl.kernels.packed_gemm.packed_linear`. A merged projection (Q/K/V, gate/up) is one `PackedLinear`
over its checkpoint tensors (`segments`, rows in order); its segments share the input columns' order
(`perm`). With `experts` E, it holds a MoE layer's E experts of one projection, each (N, K)
(`PackedWeights` hands them to the experts' kernels). On the CPU minisgl dequantizes such weights at
load instead (minisgl.models.packed).
"""

from __future__ import annotations

import torch
from torch import nn

from minisgl.kernels.packed import PackedWeights


class PackedLinear(nn.Module):
    """`qweight` int32 (N, K * bits / 32), `scales` (N, K / group) in `scale_dtype`, `zeros` uint8
    (N, K / group), `perm` int64 (K,) or None (set at load where the checkpoint orders its columns by
    group), made on the current default device. `group` None: one group per row (per channel).
    `experts` > 0: each tensor gets a leading dimension of that size, and `perm` stays None."""

    def __init__(
        self,
        segments: tuple[int, ...],
        cols: int,
        bits: int,
        group: int | None,
        scale_dtype: torch.dtype = torch.float16,
        experts: int = 0,
    ) -> None:
        super().__init__()
        rows = sum(segments)
        self.segments, self.bits, self.group = tuple(segments), bits, group if group is not None else cols
        groups = cols // self.group if self.group else 0
        self.experts = experts
        lead = (experts,) if experts else ()

        def param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
            return nn.Parameter(torch.empty(*lead, *shape, dtype=dtype), requires_grad=False)

        self.qweight = param(rows, cols * bits // 32, dtype=torch.int32)
        self.scales = param(rows, groups, dtype=scale_dtype)
        self.zeros = param(rows, groups, dtype=torch.uint8)
        self.register_parameter("perm", None)
        self._perm_set = False
        self.loaded = False  # a segment was loaded: the scales' dtype is the checkpoint's

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K) of the weight (of each expert's)."""
        return self.qweight.shape[-2], self.qweight.shape[-1] * 32 // self.bits

    def experts_weights(self) -> PackedWeights:
        """The experts' tensors as the MoE kernels take them."""
        return PackedWeights(self.qweight, self.scales, self.zeros, self.bits)

    def segment_rows(self, index: int) -> slice:
        """The rows of segment `index`."""
        start = sum(self.segments[:index])
        return slice(start, start + self.segments[index])

    def set_perm(self, perm: torch.Tensor | None, name: str) -> None:
        """Sets the input columns' order (None: as they are); every segment must give the same one."""
        current = None if self.perm is None else self.perm.data
        if self._perm_set:
            same = (perm is None) == (current is None) and (perm is None or torch.equal(perm, current))
            if not same:
                raise ValueError(
                    f"{name}: its g_idx orders the input columns unlike the other projections merged with it "
                    "(q/k/v or gate/up); minisgl needs one order per merged projection"
                )
            return
        self._perm_set = True
        if perm is not None:
            self.perm = nn.Parameter(perm.to(self.qweight.device, torch.int64), requires_grad=False)

    def extra_repr(self) -> str:
        n, k = self.shape
        experts = f"experts={self.experts}, " if self.experts else ""
        return f"{experts}segments={self.segments}, cols={k}, bits={self.bits}, group={self.group}, perm={self.perm is not None}"
