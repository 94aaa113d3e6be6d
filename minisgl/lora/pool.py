"""The device slots of the adapters being served: per packed projection, one buffer of every layer's A
and B for `max_loras` adapters of rank up to `max_rank`.

    a[p]: (layers, max_loras, n_seg * max_rank, in_local)    b[p]: (layers, max_loras, out_local, max_rank)

n_seg is the projection's row segments (qkv_proj: q, k, v; gate_up_proj: gate, up; o_proj, down_proj:
one); output segment i (`sizes[p][i]` rows) reads shrink rows [i * max_rank, (i + 1) * max_rank). A
smaller rank or an absent target is zero padding, so every slot is one shape and `minisgl.layers.lora`
takes a slot index per row; `ranks` (max_loras,) int32 on the device holds each slot's adapter rank
(0 when empty), so that the kernels skip the padding. A mixture-of-experts model has the attention two
only.
"""

from __future__ import annotations

import torch

from minisgl.lora.adapter import LoraAdapter, lora_projections
from minisgl.models.config import ModelConfig


def _dims(cfg: ModelConfig, tp_rank: int, tp_size: int) -> dict[str, tuple[tuple[int, ...], int]]:
    """Packed projection -> (rows of each output segment, input columns), on this rank."""
    return {
        p: (tuple(segment.size for segment in proj.segments), proj.cols.size)
        for p, proj in lora_projections(cfg, tp_rank, tp_size).items()
    }


class LoraPool:
    """`max_loras` adapter slots on `device` (see the module docstring); `load` fills one, `clear`
    empties one. The caller keeps a loaded adapter alive until its copies are done (they are
    asynchronous from pinned memory)."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device | str,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"max_loras={max_loras} and max_lora_rank={max_rank} must be at least 1")
        self.max_loras, self.max_rank, self.num_layers = max_loras, max_rank, cfg.num_layers
        self.tp_rank, self.tp_size = tp_rank, tp_size
        # packed projection -> the rows of each output segment (this rank's)
        self.sizes: dict[str, tuple[int, ...]] = {}
        self.a: dict[str, torch.Tensor] = {}
        self.b: dict[str, torch.Tensor] = {}
        self.ranks = torch.zeros(max_loras, dtype=torch.int32, device=device)
        for p, (sizes, cols) in _dims(cfg, tp_rank, tp_size).items():
            self.sizes[p] = sizes
            shape = (cfg.num_layers, max_loras)
            self.a[p] = torch.zeros(*shape, len(sizes) * max_rank, cols, dtype=dtype, device=device)
            self.b[p] = torch.zeros(*shape, sum(sizes), max_rank, dtype=dtype, device=device)

    @staticmethod
    def nbytes(
        cfg: ModelConfig, *, max_loras: int, max_rank: int, dtype: torch.dtype, tp_size: int = 1
    ) -> int:
        """The bytes of device memory a pool of these dimensions takes on each rank."""
        elements = sum(
            len(sizes) * max_rank * cols + sum(sizes) * max_rank
            for sizes, cols in _dims(cfg, 0, tp_size).values()
        )
        return elements * cfg.num_layers * max_loras * dtype.itemsize

    def weights(self, layer: int, projection: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(a, b) of every slot for `layer`'s `projection`: (max_loras, n_seg * R, in), (max_loras, out, R)."""
        return self.a[projection][layer], self.b[projection][layer]

    def load(self, slot: int, adapter: LoraAdapter) -> None:
        """Copies `adapter` into `slot` (zeros where it has no weights), non-blocking from pinned memory."""
        self._check_slot(slot)
        if adapter.rank > self.max_rank:
            raise ValueError(
                f"LoRA adapter {adapter.name!r} has rank {adapter.rank}, above the pool's max_lora_rank="
                f"{self.max_rank}"
            )
        if (adapter.tp_rank, adapter.tp_size) != (self.tp_rank, self.tp_size) or len(
            adapter.layers
        ) != self.num_layers:
            raise ValueError(
                f"LoRA adapter {adapter.name!r} was read for {len(adapter.layers)} layers on rank "
                f"{adapter.tp_rank} of {adapter.tp_size}; the pool holds {self.num_layers} layers on rank "
                f"{self.tp_rank} of {self.tp_size}"
            )
        rank = adapter.rank
        for p, sizes in self.sizes.items():
            for layer, projections in enumerate(adapter.layers):
                a, b = self.a[p][layer, slot], self.b[p][layer, slot]
                a.zero_()
                b.zero_()
                packed = projections.get(p)
                if packed is None:
                    continue
                host_a, host_b = packed
                a.view(len(sizes), self.max_rank, -1)[:, :rank].copy_(host_a, non_blocking=True)
                b[:, :rank].copy_(host_b, non_blocking=True)
        self.ranks[slot] = rank

    def clear(self, slot: int) -> None:
        """Zeros `slot` (an empty slot adds nothing to the rows that name it)."""
        self._check_slot(slot)
        for p in self.sizes:
            self.a[p][:, slot].zero_()
            self.b[p][:, slot].zero_()
        self.ranks[slot] = 0

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_loras:
            raise ValueError(f"LoRA slot {slot} is outside the pool's {self.max_loras} slots")
