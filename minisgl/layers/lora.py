"""The LoRA op of a batch that mixes adapters: each row adds the delta of its adapter slot (or none).

`lora_add(x, out, a, b, batch, sizes)` adds, for every row t of slot s >= 0 and output segment i,
(x[t] @ a[s, iR:(i+1)R]^T) @ b[s, rows_i]^T to out[t, rows_i], with a (slots, n_seg * R, K) and b
(slots, N, R) one layer's buffers of `minisgl.lora.LoraPool` and `sizes` its segments' rows. On CUDA it
runs the Triton kernels of `minisgl.kernels.lora` (the op `minisgl::lora_add`); elsewhere a torch path
that loops over the slots with a row mask. Neither reads anything on the host, and the shapes depend on
the batch's rows T and segments S only, so the op runs inside CUDA graphs and torch.compile (the slot
indices are tensors). A row-parallel projection (o, down) adds its delta before the all-reduce.
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
    `row_slots` (T), for the torch path; and the kernels' `tiles` (cdiv(T, TILE_ROWS) + S, 3), (first
    row, end row, slot) of each block of up to `TILE_ROWS` rows of one slot (neighbouring segments of
    one slot merged, base-only rows left out), padded with slot -1."""

    seg_starts: torch.Tensor
    seg_slots: torch.Tensor
    row_slots: torch.Tensor
    tiles: torch.Tensor

    @classmethod
    def build(cls, rows: Sequence[int], slots: Sequence[int], device: torch.device | str) -> LoraBatch:
        """From each request's row count and slot, in batch order (prefill: its tokens; decode: 1), with
        one copy to the device."""
        if len(rows) != len(slots) or any(n < 0 for n in rows) or any(s < NO_ADAPTER for s in slots):
            raise ValueError(f"rows {list(rows)} and slots {list(slots)}: one count >= 0 and slot >= -1 each")
        starts = [0]
        for n in rows:
            starts.append(starts[-1] + n)
        runs: list[list[int]] = []  # [first row, end row, slot] of each run of rows of one slot
        for first, n, slot in zip(starts, rows, slots):
            if runs and runs[-1][2] == slot:
                runs[-1][1] += n
            elif n:
                runs.append([first, first + n, slot])
        total, tile_rows = starts[-1], kernels.TILE_ROWS
        tiles = [
            [row, min(row + tile_rows, end), slot]
            for first, end, slot in runs
            if slot != NO_ADAPTER
            for row in range(first, end, tile_rows)
        ]
        max_tiles = -(-total // tile_rows) + len(rows)
        tiles += [[0, 0, NO_ADAPTER]] * (max_tiles - len(tiles))
        slots_t = torch.tensor(slots, dtype=torch.int32)
        row_slots = torch.repeat_interleave(slots_t, torch.tensor(rows, dtype=torch.int64))
        parts = (
            torch.tensor(starts, dtype=torch.int32),
            slots_t,
            row_slots,
            torch.tensor(tiles, dtype=torch.int32),
        )
        host = torch.cat([part.flatten() for part in parts])
        if torch.device(device).type == "cuda":
            host = host.pin_memory()
        flat = host.to(device, non_blocking=True)
        s = len(rows)
        return cls(
            seg_starts=flat[: s + 1],
            seg_slots=flat[s + 1 : 2 * s + 1],
            row_slots=flat[2 * s + 1 : 2 * s + 1 + total],
            tiles=flat[2 * s + 1 + total :].view(max_tiles, 3),
        )


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
) -> torch.Tensor:
    """out (T, N) plus each row's LoRA delta of x (T, K) (see the module docstring), added in place into
    `out` (the projection's fresh output), which is returned."""
    if kernel_applies(x):
        torch.ops.minisgl.lora_add(x, out, a, b, batch.tiles, list(sizes))
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
    """`lora_add` in torch, in float32 (x A^T rounded to the weights' dtype): every slot's delta of every row, kept where the row names the
    slot (max_loras times the work of one adapter; no host sync, no branch on the batch)."""
    rank = b.shape[2]
    x32 = x.float()
    delta = torch.zeros(out.shape, dtype=torch.float32, device=out.device)
    for slot in range(a.shape[0]):
        y = (x32 @ a[slot].float().T).to(b.dtype).float()  # (T, n_seg * R), rounded as the kernels do
        parts = [
            y[:, i * rank : (i + 1) * rank] @ b_i.T
            for i, b_i in enumerate(b[slot].float().split(list(sizes)))
        ]
        delta = torch.where((row_slots == slot)[:, None], torch.cat(parts, dim=1), delta)
    out.copy_(out.float() + delta)
    return out
