"""Tensor-parallel rank information and process-group setup."""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistributedInfo:
    """This process's place in the tensor-parallel group."""

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"tensor-parallel size must be >= 1, got size={self.size}")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank must be in [0, {self.size}), got rank={self.rank}")

    @property
    def is_primary(self) -> bool:
        return self.rank == 0


def init_process_group(info: DistributedInfo, addr: str, timeout_s: float, device: torch.device) -> bool:
    """Joins the tensor-parallel group: NCCL on CUDA, gloo on CPU. Returns True if a group was created.

    A single rank needs no collectives, so no group is created for size 1.
    """
    if info.size == 1:
        logger.info("communication: single rank, no process group")
        return False
    if dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is already initialized in this process; minisgl runs one engine per "
            "process. Start each rank in its own process."
        )
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend=backend,
        init_method=addr,
        rank=info.rank,
        world_size=info.size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    logger.info("communication: %s group of %d ranks at %s (rank %d)", backend, info.size, addr, info.rank)
    return True


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
