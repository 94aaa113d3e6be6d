"""Tensor parallelism: rank information, process-group setup, the two collectives and head sharding.

The Engine records its rank as the process's current TP info (`set_tp_info`) right after joining the
group; the layer functions and the model ask `get_tp_info()` instead of threading the size through every
call. With one rank every collective is a plain Python no-op, so `torch.compile(fullgraph=True)` sees
no communication at all.
"""

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


_current = DistributedInfo()


def set_tp_info(info: DistributedInfo) -> None:
    """Makes `info` this process's tensor-parallel rank (the Engine calls this at init)."""
    global _current
    _current = info


def get_tp_info() -> DistributedInfo:
    return _current


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sums x over the tensor-parallel ranks, in place; returns x. No-op for a single rank."""
    if _current.size > 1:
        dist.all_reduce(x)
    return x


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenates every rank's x along `dim`, in rank order. No-op for a single rank."""
    if _current.size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_current.size)]
    dist.all_gather(parts, x)
    return torch.cat(parts, dim=dim)


def divide(value: int, size: int, name: str) -> int:
    """value // size, or a ValueError naming the quantity when the tensor-parallel size does not divide it."""
    if value % size:
        raise ValueError(f"{name}={value} is not divisible by the tensor-parallel size {size}")
    return value // size


@dataclass(frozen=True)
class HeadShard:
    """The attention heads one rank holds. Query heads are always split; KV heads are split when there
    are at least as many as ranks, else each rank holds (a replica of) the one KV head its query heads
    use. The local KV rows are part `kv_part` of the checkpoint's KV rows cut into `kv_parts` parts."""

    num_heads: int  # local query heads
    num_kv_heads: int  # local KV heads
    kv_part: int
    kv_parts: int


def shard_heads(num_heads: int, num_kv_heads: int, info: DistributedInfo) -> HeadShard:
    local_heads = divide(num_heads, info.size, "num_attention_heads")
    if num_kv_heads >= info.size:
        local_kv = divide(num_kv_heads, info.size, "num_key_value_heads")
        return HeadShard(local_heads, local_kv, info.rank, info.size)
    if info.size % num_kv_heads:
        raise ValueError(
            f"num_key_value_heads={num_kv_heads} is smaller than the tensor-parallel size {info.size} and "
            "does not divide it, so KV heads cannot be replicated evenly"
        )
    group = num_heads // num_kv_heads  # query heads per KV head
    return HeadShard(local_heads, 1, info.rank * local_heads // group, num_kv_heads)


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
    if addr == "auto":
        raise ValueError(
            "distributed_addr='auto' is chosen by LLM(tp=N) and `minisgl-run --tp N`, which start the "
            "ranks; ranks started otherwise need one address: tcp://HOST:PORT, file:///PATH or env://"
        )
    backend = "nccl" if device.type == "cuda" else "gloo"
    try:
        dist.init_process_group(
            backend=backend,
            init_method=addr,
            rank=info.rank,
            world_size=info.size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    except dist.DistNetworkError as e:  # e.g. EADDRINUSE: the port is taken
        raise RuntimeError(
            f"tensor-parallel rank {info.rank} could not meet its group at distributed_addr={addr!r} ({e}); "
            "use a free port, or leave distributed_addr unset (auto) when LLM(tp=N) starts the ranks"
        ) from e
    logger.info("communication: %s group of %d ranks at %s (rank %d)", backend, info.size, addr, info.rank)
    return True


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
