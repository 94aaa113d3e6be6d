"""Tensor parallelism: rank information, process-group setup, the two collectives and head sharding.

The Engine records its rank as the process's current TP info (`set_tp_info`); the model and layers ask
`get_tp_info()`. With one rank every collective is a Python no-op, so torch.compile sees no
communication. On CUDA, small all-reduces (up to `one_shot_all_reduce_max_bytes`) skip NCCL through
symmetric memory, summed in rank order on every rank: docs/tensor-parallel-and-moe.md.
"""

from __future__ import annotations

import datetime
import logging
import socket
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


@dataclass
class _OneShot:
    """The symmetric-memory buffers of this process's one-shot all-reduces, used in turn.

    A one-shot all-reduce copies this rank's part into its buffer, waits until every rank has copied,
    then reads every rank's buffer. Were there one buffer, a rank that finished could copy the next
    all-reduce's part over data a slower peer is still reading. With two used alternately, the buffer
    written by all-reduce n + 2 was last read in all-reduce n, which every peer finished before it
    reached the wait of all-reduce n + 1. Every rank makes the same calls, so they agree on the turn.
    """

    buffers: tuple[torch.Tensor, torch.Tensor]
    group_name: str
    calls: int = 0

    @property
    def buffer(self) -> torch.Tensor:
        return self.buffers[0]


_one_shot: _OneShot | None = None


def init_one_shot_all_reduce(max_bytes: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Sets up one-shot all-reduces of up to `max_bytes` of `dtype` for this rank (collective: every rank
    of the group calls it). Returns False, leaving NCCL in charge, where it cannot be used (one rank,
    no CUDA, `max_bytes` 0, or the buffer cannot be shared)."""
    global _one_shot
    _one_shot = None
    if _current.size == 1 or device.type != "cuda" or max_bytes <= 0:
        return False
    try:
        import torch.distributed._symmetric_memory as symm_mem

        group_name = dist.group.WORLD.group_name
        buffers = tuple(symm_mem.empty(max_bytes // dtype.itemsize, dtype=dtype, device=device) for _ in "ab")
        for buffer in buffers:
            symm_mem.rendezvous(buffer, group_name)
    except Exception as e:  # noqa: BLE001  (an old torch, no peer access: NCCL does it all)
        logger.warning(
            "one-shot all-reduce unavailable (%s: %s): NCCL for every all-reduce", type(e).__name__, e
        )
        return False
    _one_shot = _OneShot(buffers, group_name)
    logger.info("all-reduce: one-shot over symmetric memory up to %d bytes, NCCL above", max_bytes)
    return True


def close_one_shot_all_reduce() -> None:
    global _one_shot
    _one_shot = None


@torch.library.custom_op("minisgl::one_shot_all_reduce", mutates_args=())
def one_shot_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of x over the ranks, in a new tensor: by the one-shot kernel when x fits its buffer (see
    the module docstring), else by NCCL on a copy. The size is checked here, when the op runs, so that
    a compiled graph whose token count is symbolic serves decode steps and prefills alike."""
    assert _one_shot is not None
    if x.numel() > _one_shot.buffer.numel():
        out = x.clone()
        dist.all_reduce(out)
        return out
    buffer = _one_shot.buffers[_one_shot.calls % 2][: x.numel()].view(x.shape)
    _one_shot.calls += 1  # at capture time for a CUDA graph: its calls keep the turns they had
    out = torch.empty_like(x)
    torch.ops.symm_mem.one_shot_all_reduce_copy_out(buffer, x.contiguous(), "sum", _one_shot.group_name, out)
    return out


@one_shot_all_reduce.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sums x over the tensor-parallel ranks; returns the sum (x itself, summed in place, unless the
    one-shot op took it). No-op for a single rank."""
    if _current.size == 1:
        return x
    one_shot = _one_shot
    if one_shot is not None and x.device == one_shot.buffer.device and x.dtype == one_shot.buffer.dtype:
        return torch.ops.minisgl.one_shot_all_reduce(x)
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
    if info.rank == 0 and addr.startswith("tcp://"):
        _check_port_free(addr)  # before torch tries: a failed try leaves state behind (see below)
    try:
        dist.init_process_group(
            backend=backend,
            init_method=addr,
            rank=info.rank,
            world_size=info.size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    except Exception as e:
        # torch counted a group that does not exist: the next try in this process would look for its
        # peers under another key of the rendezvous and wait for ever (torch 2.11 to 2.13)
        world = getattr(dist.distributed_c10d, "_world", None)
        if not dist.is_initialized() and hasattr(world, "group_count"):
            world.group_count = 0
        if isinstance(e, dist.DistNetworkError):  # e.g. EADDRINUSE: the port is taken
            raise RuntimeError(
                f"tensor-parallel rank {info.rank} could not meet its group at distributed_addr={addr!r} "
                f"({e}); use a free port, or leave distributed_addr unset (auto) when LLM(tp=N) starts "
                "the ranks"
            ) from e
        raise
    logger.info("communication: %s group of %d ranks at %s (rank %d)", backend, info.size, addr, info.rank)
    # created now, while the ranks are together: its first use comes after each rank built its engine,
    # which may take one rank minutes longer than another (compilation), hence the start-up timeout
    global _cpu_group
    _cpu_group = dist.new_group(
        backend="gloo", timeout=datetime.timedelta(seconds=max(timeout_s, STARTUP_TIMEOUT_S))
    )
    return True


def _check_port_free(addr: str) -> None:
    """Raises the error of a taken port for rank 0's tcp://HOST:PORT (where the group's store listens)."""
    from urllib.parse import urlparse

    url = urlparse(addr)
    if url.port is None:
        return
    with socket.socket() as probe:
        try:
            probe.bind((url.hostname or "", url.port))
        except OSError as e:
            raise RuntimeError(
                f"tensor-parallel rank 0 could not meet its group at distributed_addr={addr!r} (port "
                f"{url.port} is taken: {e.strerror}); use a free port, or leave distributed_addr unset "
                "(auto) when LLM(tp=N) starts the ranks"
            ) from e


STARTUP_TIMEOUT_S = 1800.0  # how long the CPU group waits for the slowest rank's engine at start
_cpu_group = None


def cpu_group():
    """A gloo group of the tensor-parallel ranks for host data (the lockstep's start-up exchange)."""
    if _cpu_group is None:
        raise RuntimeError("no tensor-parallel group: the engine runs a single rank")
    return _cpu_group


def destroy_process_group(abort: bool = False) -> None:
    """Leaves the process group. NCCL's destroy is collective (every rank flushes and finalizes its
    communicators together), so a rank that stops normally calls this while its peers do too; with
    `abort` (a peer is dead or stuck) the communicators are aborted instead, which waits for no one."""
    global _cpu_group
    _cpu_group = None
    if not dist.is_initialized():
        return
    if abort:
        try:
            dist.distributed_c10d._abort_process_group()
            return
        except Exception as e:  # a backend without abort (gloo): its destroy waits for no peer either
            logger.debug("process group abort failed (%s); destroying it instead", e)
    dist.destroy_process_group()
