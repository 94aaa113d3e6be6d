"""Timing helpers shared by the GPU scripts: device time of a call or of a CUDA graph of it, and a
workload pass split by step (host-side helpers: `perf.common`).

`timed_pass` reads the scheduler's public step records (`Scheduler.record_steps` and `step_records`,
one `minisgl.scheduler.StepRecord` per forward): nothing here wraps or replaces scheduler methods.
Only torch is imported at load (the kernel scripts start no engine).
"""

from __future__ import annotations

import cProfile
import pstats
import statistics
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from minisgl.bench.offline import PassResult
    from minisgl.llm import LLM

# decode batch sizes a step is grouped under (the largest one <= its size)
DECODE_BUCKETS = (256, 192, 128, 64, 32, 16, 8, 4, 2, 1, 0)
# step records kept for one timed pass (more than any workload pass takes)
MAX_RECORDS = 1 << 20


def gpu_ms(fn: Callable[[], Any], iters: int = 50) -> float:
    """Milliseconds of device time per call, calls back to back (no host gaps between them)."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def median_ms(fn: Callable[[], Any], iters: int, warmup: int = 3) -> float:
    """Median milliseconds of `fn()` on the current stream, each call between two CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def capture(fn: Callable[[], Any], warmup: int = 2) -> tuple[torch.cuda.CUDAGraph, Any]:
    """`fn` captured in a CUDA graph, after `warmup` calls on a side stream: the graph, and what `fn`
    returned while captured (its output buffers, which each replay writes)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = fn()
    return graph, out


def graph_us(fn: Callable[[], Any], reps: int = 20) -> float:
    """Microseconds per replay of a CUDA graph of `fn` (`gpu_ms` of the replays)."""
    return gpu_ms(capture(fn)[0].replay, reps) * 1e3


def sync(device: torch.device | str | None = None) -> None:
    """Waits for the work queued on `device` (None: the current CUDA device, if any); a CPU runs its
    work as it is called."""
    cuda = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)


def step_group(phase: str, batch_size: int) -> str:
    """'prefill', or 'decode bs>=N' for the largest N of `DECODE_BUCKETS` not above the batch size."""
    if phase == "prefill":
        return "prefill"
    return f"decode bs>={next(b for b in DECODE_BUCKETS if batch_size >= b)}"


def step_table(records: Iterable[Any]) -> str:
    """Where the host time of the recorded steps went, by `step_group`, largest total first: per step,
    the launch (schedule, batch tensors, planning, enqueueing the forward), the wait for its tokens
    (the device being the bottleneck), their processing, and the device time of the forward (when
    recorded: CUDA). `records` are `StepRecord`s (or anything with their fields)."""
    groups: dict[str, list[Any]] = {}
    for record in records:
        groups.setdefault(step_group(record.phase, record.batch_size), []).append(record)
    lines = [
        f"{'steps':>16} {'count':>6} {'total s':>8} {'mean ms':>8} {'launch ms':>9} {'wait ms':>8} "
        f"{'process ms':>10} {'device ms':>9}"
    ]
    rows = []
    for key, group in groups.items():
        n = len(group)
        launch, wait, process = (
            sum(getattr(r, name) for r in group) for name in ("launch_s", "wait_s", "process_s")
        )
        device = [r.device_ms for r in group if r.device_ms is not None]
        device_ms = f"{sum(device) / len(device):>9.3f}" if device else f"{'-':>9}"
        total = launch + wait + process
        rows.append(
            (
                total,
                f"{key:>16} {n:>6} {total:>8.3f} {total / n * 1e3:>8.3f} {launch / n * 1e3:>9.3f} "
                f"{wait / n * 1e3:>8.3f} {process / n * 1e3:>10.3f} {device_ms}",
            )
        )
    lines += [line for _, line in sorted(rows, key=lambda row: -row[0])]
    return "\n".join(lines)


def timed_pass(
    llm: LLM,
    prompts: list[list[int]],
    max_tokens: list[int],
    temperature: float,
    host_profile: str | None = None,
) -> tuple[PassResult, str]:
    """One workload pass (`minisgl.bench.offline.run_pass`) with every step recorded: returns the pass and the
    `step_table` of its steps. With `host_profile` (a file name), the pass also runs under cProfile and
    the 30 functions of most own host time are written there."""
    from minisgl.bench.offline import run_pass

    sched = llm.scheduler
    kept = sched.record_steps
    sched.record_steps = MAX_RECORDS
    sched.step_records.clear()
    profiler = cProfile.Profile() if host_profile else None
    try:
        if profiler is not None:
            profiler.enable()
        result = run_pass(llm, prompts, max_tokens, temperature)
    finally:
        if profiler is not None:
            profiler.disable()
        records = list(sched.step_records)
        sched.record_steps = kept
    if profiler is not None:
        with open(host_profile, "w") as f:
            pstats.Stats(profiler, stream=f).sort_stats("tottime").print_stats(30)
    return result, step_table(records)
