"""All-reduce at decode sizes inside CUDA graphs: NCCL against one-shot kernels over peer memory.

    python -m perf.gpu.allreduce [--ranks 2] [--hidden 1024 4096] [--batch 1 8 32 64 128 256]

One process per GPU. For each (hidden, batch) every rank captures a graph of REPS all-reduces of a
(batch, hidden) bf16 tensor and replays it; the table gives microseconds per all-reduce, and what the
all-reduces of one decode step cost (two per layer: Qwen3-0.6B has 28 layers of hidden 1024, Qwen3-8B
36 of hidden 4096). The one-shot kernels copy their input into a buffer every rank can read (CUDA IPC)
and each rank sums all ranks' buffers in one pass: FlashInfer's custom all-reduce (`custom`) and torch's
symmetric-memory `one_shot_all_reduce_copy_out` (`symm`); each result is checked against NCCL's.
Prints one JSON line per measurement and a table last.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from perf.common import free_port
from perf.gpu.timing import graph_us

REPS = 50
LAYERS = {1024: ("Qwen3-0.6B", 28), 4096: ("Qwen3-8B", 36)}
MAX_BYTES = 8 << 20


def _time_graph(fn, x: torch.Tensor) -> float:
    """Microseconds per call of `fn(x)`, from a graph of REPS calls."""
    return graph_us(lambda: [fn(x) for _ in range(REPS)]) / REPS


def _custom(rank: int, group) -> tuple | None:
    try:
        import flashinfer.comm as fc

        meta = fc.create_shared_buffer(fc.vllm_meta_size() + MAX_BYTES, group)
        buffers = fc.create_shared_buffer(MAX_BYTES, group)
        rank_data = torch.empty(8 << 20, dtype=torch.uint8, device="cuda")
        handle = fc.vllm_init_custom_ar(meta, rank_data, rank, True)
        fc.vllm_register_buffer(handle, buffers)
        return fc, handle, buffers[rank]
    except Exception as e:  # noqa: BLE001  (reported in the table)
        print(json.dumps({"rank": rank, "custom_all_reduce_unavailable": f"{type(e).__name__}: {e}"}))
        return None


def _symm(group_name: str, shape: tuple[int, int]):
    """A one-shot all-reduce over torch symmetric memory for tensors of `shape`, or None."""
    try:
        import torch.distributed._symmetric_memory as symm_mem

        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            symm_mem.enable_symm_mem_for_group(group_name)
        buffer = symm_mem.empty(*shape, dtype=torch.bfloat16, device="cuda")
        symm_mem.rendezvous(buffer, group_name)
        out = torch.empty(shape, dtype=torch.bfloat16, device="cuda")

        def reduce(t):
            torch.ops.symm_mem.one_shot_all_reduce_copy_out(buffer, t, "sum", group_name, out)

        return reduce, out
    except Exception as e:  # noqa: BLE001  (reported in the table)
        print(json.dumps({"symm_unavailable": f"{type(e).__name__}: {e}"}), flush=True)
        return None


def _worker(rank: int, size: int, port: int, hiddens: list[int], batches: list[int], ctas: int) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    gloo = dist.new_group(backend="gloo")
    custom = _custom(rank, gloo)
    rows = []
    for hidden in hiddens:
        for batch in batches:
            x = torch.randn(batch, hidden, dtype=torch.bfloat16, device="cuda") * (rank + 1)
            row = {
                "hidden": hidden,
                "batch": batch,
                "nccl_us": _time_graph(lambda t: dist.all_reduce(t), x.clone()),
            }
            if custom is not None:
                fc, handle, buffer = custom
                out = torch.empty_like(x)

                def reduce(t, out=out, fc=fc, handle=handle, buffer=buffer):
                    fc.vllm_all_reduce(handle, t, out, buffer, MAX_BYTES, ctas)

                _measure(row, "custom", reduce, out, x)
            symm = _symm(dist.group.WORLD.group_name, (batch, hidden))
            if symm is not None:
                _measure(row, "symm", *symm, x)
            rows.append(row)
            if rank == 0:
                print(json.dumps(row), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        _table(rows)


def _measure(row: dict, name: str, reduce, out: torch.Tensor, x: torch.Tensor) -> None:
    """Times `reduce` (which writes the sum of x into `out`) and checks its sum against NCCL's."""
    row[f"{name}_us"] = _time_graph(reduce, x)
    want = x.clone()
    dist.all_reduce(want)
    reduce(x)
    torch.cuda.synchronize()
    row[f"{name}_max_abs_diff"] = (out.float() - want.float()).abs().max().item()


def _table(rows: list[dict]) -> None:
    kinds = ("nccl", "custom", "symm")
    print(f"{'hidden':>6} {'batch':>5}" + "".join(f"{k + ' us':>10}" for k in kinds) + "   per step (us)")
    for row in rows:
        name, layers = LAYERS.get(row["hidden"], ("", 0))
        times = [row.get(f"{k}_us") for k in kinds]
        cells = "".join(f"{t:>10.1f}" if t is not None else f"{'-':>10}" for t in times)
        step = " / ".join(f"{2 * layers * t:.0f}" if t is not None else "-" for t in times)
        print(f"{row['hidden']:>6} {row['batch']:>5}{cells}   {step} {name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--hidden", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    parser.add_argument("--ctas", type=int, default=36, help="blocks of the custom kernel (at most 36)")
    args = parser.parse_args()
    if torch.cuda.device_count() < args.ranks:
        raise SystemExit(f"needs {args.ranks} GPUs, found {torch.cuda.device_count()}")
    port = free_port()
    os.environ.setdefault("NCCL_DEBUG", "WARN")
    mp.spawn(_worker, args=(args.ranks, port, args.hidden, args.batch, args.ctas), nprocs=args.ranks)


if __name__ == "__main__":
    main()
