"""The engine's LoRA part (docs/lora.md): the device pool of adapter slots, and each forward's
`LoraBatch`, the slot of every row, which the model's projections read.

The batch is an argument of the model's forward (`lora=`), not state on the context: under
torch.compile its tensors are graph inputs whose sizes are unbacked (one compiled forward serves every
batch), and a CUDA graph captures a static one whose contents are rewritten before each replay
(`StaticLoraBatch`), so one graph serves any mix of adapters.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from minisgl.core import Batch
from minisgl.layers.lora import NO_ADAPTER, LoraBatch
from minisgl.lora import LoraAdapter, LoraPool, load_adapter
from minisgl.models.config import ModelConfig


def pool_bytes(cfg: ModelConfig, max_loras: int, max_rank: int, dtype: torch.dtype, tp_size: int) -> int:
    """The device bytes of the pool an engine of these settings keeps (on each rank)."""
    return LoraPool.nbytes(cfg, max_loras=max_loras, max_rank=max_rank, dtype=dtype, tp_size=tp_size)


def batch_rows(batch: Batch) -> tuple[list[int], list[int]]:
    """Each request's rows (the tokens it computes: a prefill's chunk, a decode's 1, a verify step's
    token and drafts) and its slot, in batch order."""
    return [req.extend_len for req in batch.reqs], [req.lora_slot for req in batch.reqs]


def has_adapter_rows(batch: Batch) -> bool:
    """Whether any request of the batch runs under an adapter (read from the requests, on the host)."""
    return any(req.lora_slot != NO_ADAPTER for req in batch.reqs)


def host_fields(batch: LoraBatch) -> torch.Tensor:
    """A host LoraBatch's tensors, flattened into one (the layout of `StaticLoraBatch`'s buffer)."""
    return torch.cat([getattr(batch, f.name).flatten() for f in dataclasses.fields(batch)])


class StaticLoraBatch:
    """The LoraBatch a CUDA graph captures: `requests` requests of `rows` rows in all (the dimensions
    its tensors' sizes follow), views of one device buffer. `refresh` rewrites it (one copy, no sync)
    with a batch of fewer requests padded to them: one base-only request takes the rows left, zero-row
    ones make up the count."""

    def __init__(self, rows: int, requests: int, max_loras: int, device: torch.device) -> None:
        self.rows, self.requests, self.max_loras = rows, requests, max_loras
        host = LoraBatch.build([rows] + [0] * (requests - 1), [NO_ADAPTER] * requests, "cpu", max_loras)
        self.buffer = host_fields(host).to(device)
        fields = self.buffer.split([getattr(host, f.name).numel() for f in dataclasses.fields(host)])
        self.batch = LoraBatch(*fields[:4], tiles=fields[4].view(host.tiles.shape))

    def refresh(self, rows: Sequence[int], slots: Sequence[int]) -> None:
        """Makes it the batch of requests of `rows` rows and `slots`, in order, padded (see the class)."""
        pad_rows, pad_reqs = self.rows - sum(rows), self.requests - len(rows)
        assert pad_rows >= 0 and pad_reqs >= 1, (self.rows, self.requests, list(rows))
        rows = [*rows, pad_rows, *[0] * (pad_reqs - 1)]
        slots = [*slots, *[NO_ADAPTER] * pad_reqs]
        host = host_fields(LoraBatch.build(rows, slots, "cpu", self.max_loras))
        self.buffer.copy_(host.pin_memory() if self.buffer.is_cuda else host, non_blocking=True)


class EngineLora:
    """An engine's adapter slots (`pool`) and what loading one into a slot needs on CUDA: the host
    tensors of a copy in flight are kept until an event says it is done."""

    def __init__(self, cfg: ModelConfig, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device, tp_rank: int, tp_size: int) -> None:  # fmt: skip
        self.cfg, self.dtype, self.device = cfg, dtype, device
        self.pool = LoraPool(
            cfg, max_loras=max_loras, max_rank=max_rank, dtype=dtype, device=device, tp_rank=tp_rank,
            tp_size=tp_size,
        )  # fmt: skip
        self._in_flight: list[tuple[torch.cuda.Event, LoraAdapter]] = []

    def read(self, name: str, path: str) -> LoraAdapter:
        """The adapter at `path` read for this engine's model, dtype, rank limit and tensor-parallel rank
        (raises `minisgl.lora.LoraError`)."""
        pool = self.pool
        return load_adapter(
            name, path, self.cfg, max_rank=pool.max_rank, dtype=self.dtype, tp_rank=pool.tp_rank,
            tp_size=pool.tp_size,
        )  # fmt: skip

    def load(self, slot: int, adapter: LoraAdapter) -> None:
        """Copies `adapter` into `slot` on the current stream: after the forwards already queued (which
        may still read the slot's old adapter), before any later one."""
        self._in_flight = [(event, held) for event, held in self._in_flight if not event.query()]
        self.pool.load(slot, adapter)
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            self._in_flight.append((event, adapter))

    def clear(self, slot: int) -> None:
        """Zeros `slot` on the current stream (ordered as `load`)."""
        self.pool.clear(slot)

    def batch(self, batch: Batch) -> LoraBatch:
        """The LoraBatch of a batch's rows (one copy to the device, no sync), made of normal tensors
        (the compiled forward would copy inference ones)."""
        rows, slots = batch_rows(batch)
        with torch.inference_mode(False):
            return LoraBatch.build(rows, slots, self.device, self.pool.max_loras)
