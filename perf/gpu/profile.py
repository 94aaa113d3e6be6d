"""Where a decode step's time goes on the GPU, with and without overlap scheduling.

    python perf/gpu_profile.py [--config configs/h200-qwen3-0.6b.yaml] [--out DIR] [--skip-workload]

Reports, for decode batches of 1 and 256 requests: the wall time per step as the scheduler runs it
(overlap on and off), the GPU time of the same step alone (the graph replayed back to back: the floor
the host overheads add to), the sampler's GPU time, and a torch.profiler table of a few steps (written
to DIR with a Chrome trace). Then the offline workload and the single request with overlap on and off.
A plain script, not a test: numbers vary between machines.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import time
import traceback

import torch

from minisgl.bench import CPU_SHAPE, WorkloadShape, make_workload, run_pass, run_single
from minisgl.core import SamplingParams
from minisgl.llm import LLM


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _gpu_ms(fn, iters: int = 50) -> float:
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


def decode_steps(llm: LLM, bs: int, prompt_len: int, out_dir: str, tag: str) -> dict:
    """Fills `bs` requests, then times decode steps with overlap on and off and profiles a few."""
    sched = llm.scheduler
    vocab = llm.engine.config.model_config.vocab_size
    row: dict = {"bs": bs}
    for overlap in (True, False):
        sched.overlap = overlap
        params = SamplingParams(max_tokens=2000 if bs == 1 else 400, ignore_eos=True, temperature=0.0)
        reqs = [
            sched.add_request([(7 * i + j) % vocab for j in range(prompt_len)], params) for i in range(bs)
        ]
        while not all(r.prefilled for r in reqs):
            sched.step()
        for _ in range(5):
            sched.step()
        _sync()
        n = 100 if torch.cuda.is_available() else 5
        started = time.perf_counter()
        for _ in range(n):
            sched.step()
        _sync()
        row[f"step_ms_overlap={overlap}"] = (time.perf_counter() - started) / n * 1e3
        if overlap:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + (
                [ProfilerActivity.CUDA] if torch.cuda.is_available() else []
            )
            with profile(activities=activities) as prof:
                for _ in range(10):
                    sched.step()
                _sync()
            with open(os.path.join(out_dir, f"profile_{tag}.txt"), "w") as f:
                f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40))
                f.write("\n\n")
                f.write(prof.key_averages().table(sort_by="cpu_time_total", row_limit=40))
            prof.export_chrome_trace(os.path.join(out_dir, f"trace_{tag}.json"))
        for r in reqs:  # finish them quickly: drop the rest of their tokens
            if not r.finished:
                sched._finish(r, "length", time.perf_counter(), False, False)
        if sched._launched is not None:
            sched._collect(sched._launched)
            sched._launched = None
        assert not sched.has_work()
    # the same step on the GPU alone: graph replay (no planning) back to back, and the sampler
    engine = llm.engine
    runner = engine.graph_runner
    if runner.enabled and bs <= runner.batch_sizes[-1]:
        graph_bs = min(b for b in runner.batch_sizes if b >= bs)
        graph, logits = runner.graphs[graph_bs]
        row["graph_replay_ms"] = _gpu_ms(graph.replay)
        args_greedy = engine.sampler.prepare(_FakeBatch(bs, greedy=True))
        args_t = engine.sampler.prepare(_FakeBatch(bs, greedy=False))
        row["sample_greedy_ms"] = _gpu_ms(lambda: engine.sampler.sample(logits[:bs], args_greedy))
        row["sample_t0.6_ms"] = _gpu_ms(lambda: engine.sampler.sample(logits[:bs], args_t))
    return row


def timed_pass(llm: LLM, prompts, max_tokens, temperature: float, host_profile: str | None = None):
    """One workload pass with each scheduler step timed: returns the pass and a table of where its wall
    time went (prefill steps; decode steps by batch size), each step split into the host's launch (schedule,
    batch tensors, planning, enqueueing the forward), the wait for the previous forward's tokens (the GPU
    being the bottleneck) and their processing. With `host_profile` (a file name), the pass also runs
    under cProfile and the 30 functions of most own host time are written there."""
    sched, steps = llm.scheduler, []
    step, launch, collect = sched.step, sched._launch, sched._collect
    parts = {"launch": 0.0, "wait": 0.0}

    def timed_launch():
        t = time.perf_counter()
        out = launch()
        parts["launch"] = time.perf_counter() - t
        return out

    def timed_collect(launched):
        t = time.perf_counter()
        launched.output.copy_done_event.synchronize()
        parts["wait"] = time.perf_counter() - t
        return collect(launched)

    def timed_step():
        parts["launch"] = parts["wait"] = 0.0
        t = time.perf_counter()
        out = step()
        launched = sched._launched
        size = len(launched.chosen) if launched is not None else 0
        steps.append((sched.last_phase, size, time.perf_counter() - t, parts["launch"], parts["wait"]))
        return out

    sched.step, sched._launch, sched._collect = timed_step, timed_launch, timed_collect
    profiler = cProfile.Profile() if host_profile else None
    try:
        if profiler is not None:
            profiler.enable()
        p = run_pass(llm, prompts, max_tokens, temperature)
    finally:
        if profiler is not None:
            profiler.disable()
        del sched.step, sched._launch, sched._collect
    if profiler is not None:
        with open(host_profile, "w") as f:
            pstats.Stats(profiler, stream=f).sort_stats("tottime").print_stats(30)
    buckets: dict[str, list[tuple[float, float, float]]] = {}
    for phase, size, seconds, launched_s, wait_s in steps:
        if phase == "prefill":
            key = "prefill"
        else:
            low = next(b for b in (256, 192, 128, 64, 32, 16, 8, 4, 2, 1, 0) if size >= b)
            key = f"decode bs>={low}"
        buckets.setdefault(key, []).append((seconds, launched_s, wait_s))
    lines = [
        f"{'steps':>16} {'count':>6} {'total s':>8} {'mean ms':>8} {'launch ms':>9} {'wait ms':>8} {'rest ms':>8}"
    ]
    for key, rows in sorted(buckets.items(), key=lambda kv: -sum(r[0] for r in kv[1])):
        n = len(rows)
        total, launch_s, wait_s = (sum(r[i] for r in rows) for i in range(3))
        lines.append(
            f"{key:>16} {n:>6} {total:>8.3f} {total / n * 1e3:>8.3f} {launch_s / n * 1e3:>9.3f} "
            f"{wait_s / n * 1e3:>8.3f} {(total - launch_s - wait_s) / n * 1e3:>8.3f}"
        )
    return p, "\n".join(lines)


class _FakeBatch:
    def __init__(self, bs: int, greedy: bool) -> None:
        from minisgl.core import Req

        params = SamplingParams(temperature=0.0 if greedy else 0.6)
        self.reqs = [Req([1], 0, 0, 1, i, params) for i in range(bs)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="configs/h200-qwen3-0.6b.yaml")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--skip-workload", action="store_true")
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument("--timeline", action="store_true", help="also: step timeline, T=0 and T=0.6")
    parser.add_argument("--host-profile", action="store_true", help="also: a cProfile of one timed pass")
    opts = parser.parse_args()
    os.makedirs(opts.out, exist_ok=True)
    started = time.perf_counter()
    llm = LLM(config=opts.config)
    results: dict = {"startup_s": time.perf_counter() - started}
    print(f"startup {results['startup_s']:.1f} s", flush=True)
    llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=8, ignore_eos=True))
    rows = []
    shapes = ((1, 128), (64, 512), (256, 512)) if torch.cuda.is_available() else ((1, 16), (4, 16))
    for bs, prompt_len in () if opts.skip_decode else shapes:
        try:
            rows.append(decode_steps(llm, bs, prompt_len, opts.out, f"bs{bs}"))
            print(rows[-1], flush=True)
        except Exception:
            traceback.print_exc()
    results["decode"] = rows
    if not opts.skip_workload:
        shape = WorkloadShape() if torch.cuda.is_available() else CPU_SHAPE
        prompts, max_tokens = make_workload(shape, llm.engine.config.model_config.vocab_size)
        for overlap in (True, False):
            llm.scheduler.overlap = overlap
            try:
                results[f"single_overlap={overlap}"] = run_single(llm)["tokens_per_s"]
                p = run_pass(llm, prompts, max_tokens, shape.temperature)
                results[f"workload_overlap={overlap}"] = p.tokens_per_s
                print(
                    f"overlap={overlap}: workload {p.tokens_per_s:.0f} tok/s ({p.seconds:.2f} s)", flush=True
                )
            except Exception:
                traceback.print_exc()
        llm.scheduler.overlap = True
        if opts.timeline:
            for temperature in (shape.temperature, 0.0):
                p, table = timed_pass(llm, prompts, max_tokens, temperature)
                results[f"workload_T={temperature}"] = p.tokens_per_s
                print(f"T={temperature}: {p.tokens_per_s:.0f} tok/s ({p.seconds:.2f} s)\n{table}", flush=True)
        if opts.host_profile:
            path = os.path.join(opts.out, "host_profile.txt")
            p, table = timed_pass(llm, prompts, max_tokens, shape.temperature, host_profile=path)
            print(f"under cProfile: {p.tokens_per_s:.0f} tok/s ({p.seconds:.2f} s)\n{table}", flush=True)
    with open(os.path.join(opts.out, "profile.json"), "w") as f:
        json.dump(results, f, indent=2)
    print(json.dumps(results, indent=2))
    llm.shutdown()


if __name__ == "__main__":
    sys.exit(main())
