"""One request's decode speed and its batch-1 step, cheap enough to A/B two checkouts of a large model in
one GPU call.

    python -m perf.gpu.one_request [--config YAML | --model DIR] [--new-tokens 1024] [--reps 3]
                                   [--profile] [--no-pdl]

One engine with a CUDA graph for batch 1 only (what one request replays; a full preset captures up to
256), a warm-up request, then `--reps` requests of 128 random prompt tokens and `--new-tokens` greedy
ones, one after another (`minisgl.bench.offline.run_single`, what `minisgl-run bench
--single-request` times): each one's tokens/s and their median. Then the batch-1 decode step's CUDA
graph replayed back to back (its device time), and with `--profile` its kernels by device time
(torch.profiler over 20 replays; with PDL on, a kernel's span includes its wait for the one before, so
`--no-pdl` for per-kernel figures). `--model DIR` runs that folder with dummy weights in bf16 and pages
of 256 tokens; a `--config` file's settings are kept but for the CUDA graphs and request slots. For an
A/B, copy this file into the other checkout's perf/gpu and run the module there too (run as a file,
`python perf/gpu/one_request.py`, its folder's profile.py would shadow the standard library's
`profile`). The step graph is replayed on the last request's buffers. A plain script, not a test.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from minisgl.bench.offline import run_single
from minisgl.core import SamplingParams
from minisgl.llm import LLM
from perf.gpu.timing import gpu_ms


def kernel_table(fn, steps: int = 20) -> list[tuple[str, float, float]]:
    """(kernel name, device us per call of fn, calls per fn) over `steps` calls, most time first."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name][0] += event.device_time_total
            totals[event.name][1] += 1
    rows = [(name, t / steps, n / steps) for name, (t, n) in totals.items()]
    return sorted(rows, key=lambda row: -row[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", help="a YAML settings file (configs/h200-*.yaml)")
    source.add_argument("--model", help="a model folder, run with dummy weights")
    parser.add_argument("--new-tokens", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="the batch-1 step's kernels")
    parser.add_argument("--no-pdl", action="store_true", help="programmatic dependent launch off")
    args = parser.parse_args()
    if args.config:
        settings = dict(config=args.config)
    else:
        settings = dict(
            model=args.model, use_dummy_weight=True, device="cuda", dtype="bfloat16", page_size=256
        )
    if args.no_pdl:
        settings["use_pdl"] = False
    start = time.perf_counter()
    llm = LLM(**settings, cuda_graph_max_bs=1, max_running_req=8)
    print(f"startup {time.perf_counter() - start:.1f} s", flush=True)
    llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=8, ignore_eos=True))
    rates = [run_single(llm, new_tokens=args.new_tokens)["tokens_per_s"] for _ in range(args.reps)]
    print("one request, tokens/s: " + ", ".join(f"{r:.1f}" for r in rates), flush=True)
    graph, _ = llm.engine.graph_runner.graphs[1]
    replay_us = gpu_ms(graph.replay) * 1e3
    if args.profile:
        print(f"{'us':>8} {'calls':>6} {'us/call':>8}  kernel")
        for name, us, calls in kernel_table(graph.replay):
            print(f"{us:8.1f} {calls:6.1f} {us / max(calls, 1e-9):8.2f}  {name[:90]}")
    print(
        f"median {statistics.median(rates):.1f} tokens/s; batch-1 step graph {replay_us:.0f} us", flush=True
    )


if __name__ == "__main__":
    main()
