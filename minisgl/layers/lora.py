"""The LoRA op of a batch that mixes adapters: each row adds the delta of its adapter slot (or none).

`lora_add(x, out, a, b, batch, sizes)` adds, for every row t of slot s >= 0 and output segment i,
(x[t] @ a[s, iR:(i+1)R]^T) @ b[s, rows_i]^T to out[t, rows_i], with a (slots, n_seg * R, K) and b
(slots, N, R) one layer's buffers of `minisgl.lora.LoraPool` and `sizes` its segments' rows. On CUDA it
runs the Triton kernels of `minisgl.kernels.lora` (under torch.compile as the op `minisgl::lora_add`);
elsewhere a torch path: on the CPU over the slots the rows name, each on its rows; on another device
over every slot with a row mask. The kernels read nothing on the host, and their shapes depend on the
batch's rows T and segments S (and the pool's dims) only, so the op runs inside CUDA graphs and
torch.compile (the slot indices are tensors). A row-parallel projection (o,
down) adds its delta before the all-reduce.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from minisgl.kernels import lora as kernels

NO_ADAPTER = -1  # the slot of rows that get nothing added


@dataclass(frozen=True)
class LoraBatch:
    """The adapter slots of a batch's rows, as int32 device tensors: segments of consecutive rows of one
    slot, `seg_starts` (S + 1) and `seg_slots` (S) (`NO_ADAPTER`: base model only); each row's slot,
    `row_slots` (T), for the torch path; and for the kernels the rows grouped by slot, `order` (T,)
    (stable; base-only rows last), and `tiles` (cdiv(T, TILE_ROWS) + min(S, max_loras), 3), (first,
    end, slot) of each block of up to `TILE_ROWS` entries of `order` of one slot, padded with slot -1."""

    seg_starts: torch.Tensor
    seg_slots: torch.Tensor
    row_slots: torch.Tensor
    order: torch.Tensor
    tiles: torch.Tensor

    @classmethod
    def build(
        cls,
        rows: Sequence[int],
        slots: Sequence[int],
        device: torch.device | str,
        max_loras: int | None = None,
    ) -> LoraBatch:
        """From each request's row count and slot, in batch order (prefill: its tokens; decode: 1), with
        one copy to the device. `max_loras`, the pool's slots where given, bounds the slots and the tiles
        (so that a CUDA graph's batch of S requests has few padding tiles)."""
        top = max_loras if max_loras is not None else float("inf")
        if len(rows) != len(slots) or any(n < 0 for n in rows) or not all(-1 <= s < top for s in slots):
            raise ValueError(
                f"rows {list(rows)} and slots {list(slots)}: one count >= 0 and one slot in [-1, "
                f"{max_loras}) each"
            )
        slots_t = torch.tensor(slots, dtype=torch.int32)
        row_slots = torch.repeat_interleave(slots_t, torch.tensor(rows, dtype=torch.int64))
        total, tile_rows = row_slots.numel(), kernels.TILE_ROWS
        last = torch.iinfo(torch.int32).max  # base-only rows sort after every slot
        order = torch.argsort(row_slots.masked_fill(row_slots == NO_ADAPTER, last), stable=True)
        counts: dict[int, int] = {}
        for n, slot in zip(rows, slots):
            counts[slot] = counts.get(slot, 0) + n
        tiles, first = [], 0
        for slot in sorted(s for s in counts if s != NO_ADAPTER):
            end = first + counts[slot]
            tiles += [[row, min(row + tile_rows, end), slot] for row in range(first, end, tile_rows)]
            first = end
        max_tiles = -(-total // tile_rows) + min(len(rows), max_loras or len(rows))
        tiles += [[0, 0, NO_ADAPTER]] * (max_tiles - len(tiles))
        starts = torch.tensor([0, *rows], dtype=torch.int64).cumsum(0).to(torch.int32)
        parts = (starts, slots_t, row_slots, order.to(torch.int32), torch.tensor(tiles, dtype=torch.int32))
        host = torch.cat([part.flatten() for part in parts])
        if torch.device(device).type == "cuda":
            host = host.pin_memory()
        fields = host.to(device, non_blocking=True).split([p.numel() for p in parts])
        return cls(*fields[:4], tiles=fields[4].view(max_tiles, 3))


def kernel_applies(x: torch.Tensor) -> bool:
    """Whether `lora_add` runs the Triton kernels: on CUDA, where Triton is installed."""
    return x.is_cuda and kernels.triton is not None


def lora_add(
    x: torch.Tensor,
    out: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    batch: LoraBatch,
    sizes: Sequence[int],
    ranks: torch.Tensor | None = None,
) -> torch.Tensor:
    """out (T, N) plus each row's LoRA delta of x (T, K) (see the module docstring), added in place into
    `out` (the projection's fresh output), which is returned. `ranks` (slots,) int32, where given, is
    each slot's adapter rank (`minisgl.lora.LoraPool.ranks`): the kernels skip the zero padding past it."""
    if kernel_applies(x):
        # torch.compile sees the op; eager calls skip the dispatcher's tens of microseconds per call
        add = torch.ops.minisgl.lora_add if torch.compiler.is_compiling() else kernels.lora_add_kernels
        add(x, out, a, b, batch.tiles, batch.order, list(sizes), ranks)
        return out
    return lora_add_reference(x, out, a, b, batch.row_slots, sizes)


def lora_add_reference(
    x: torch.Tensor,
    out: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    row_slots: torch.Tensor,
    sizes: Sequence[int],
) -> torch.Tensor:
    """`lora_add` in torch, in float32 (x A^T rounded to the weights' dtype). On the CPU, eagerly, each
    slot the rows name computes the delta of its rows (the slots read on the host, where they are);
    elsewhere (and under torch.compile) every slot's delta of every row, kept where the row names the
    slot (max_loras times the work of one adapter, but no host sync and no branch on the batch)."""
    rank = b.shape[2]
    x32 = x.float()

    def delta_of(slot: int, rows: torch.Tensor) -> torch.Tensor:
        y = (rows @ a[slot].float().T).to(b.dtype).float()  # (rows, n_seg * R), rounded as the kernels do
        parts = [
            y[:, i * rank : (i + 1) * rank] @ b_i.T
            for i, b_i in enumerate(b[slot].float().split(list(sizes)))
        ]
        return torch.cat(parts, dim=1)

    delta = torch.zeros(out.shape, dtype=torch.float32, device=out.device)
    if row_slots.device.type == "cpu" and not torch.compiler.is_compiling():
        for slot in row_slots.unique().tolist():
            if slot != NO_ADAPTER:
                rows = (row_slots == slot).nonzero().squeeze(1)
                delta[rows] = delta_of(slot, x32[rows])
    else:
        for slot in range(a.shape[0]):
            delta = torch.where((row_slots == slot)[:, None], delta_of(slot, x32), delta)
    out.copy_(out.float() + delta)
    return out
