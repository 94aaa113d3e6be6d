"""Where a decode step's time goes on the GPU, with and without overlap scheduling.

    python -m perf.gpu.profile [--config configs/h200-qwen3-0.6b.yaml] [--out DIR] [--skip-workload]

Reports, for decode batches of 1, 64 and 256 requests: the wall time per step as the scheduler runs it
(overlap on and off), the GPU time of the same step alone (the graph replayed back to back: the floor
the host overheads add to), the sampler's GPU time, and a torch.profiler table of a few steps (written
to DIR with a Chrome trace). Then the offline workload and the single request with overlap on and off;
`--timeline` and `--host-profile` add passes split by step (the scheduler's step records, see
`perf.gpu.timing`). Without a GPU it runs small shapes on the CPU (e.g. `--config
configs/cpu-smollm2.yaml`). A plain script, not a test: numbers vary between machines.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch
from torch.profiler import ProfilerActivity, profile

from minisgl.bench.offline import CPU_SHAPE, WorkloadShape, make_workload, run_pass, run_single
from minisgl.core import Batch, Req, SamplingParams
from minisgl.llm import LLM
from minisgl.scheduler import Scheduler
from perf.gpu.timing import gpu_ms, sync, timed_pass


def _profile_steps(sched: Scheduler, out_dir: str, tag: str) -> None:
    """torch.profiler over 10 steps: tables by device and host time, and a Chrome trace, in `out_dir`."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        for _ in range(10):
            sched.step()
        sync()
    with open(os.path.join(out_dir, f"profile_{tag}.txt"), "w") as f:
        f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40))
        f.write("\n\n")
        f.write(prof.key_averages().table(sort_by="cpu_time_total", row_limit=40))
    prof.export_chrome_trace(os.path.join(out_dir, f"trace_{tag}.json"))


def _step_ms(sched: Scheduler, bs: int, prompt_len: int, out_dir: str, tag: str) -> float:
    """Fills `bs` requests, then returns the wall time per decode step as the scheduler runs it (and
    profiles a few steps when `tag`); aborts the requests after."""
    vocab = sched.engine.config.model_config.vocab_size
    params = SamplingParams(max_tokens=2000 if bs == 1 else 400, ignore_eos=True, temperature=0.0)
    reqs = [sched.add_request([(7 * i + j) % vocab for j in range(prompt_len)], params) for i in range(bs)]
    while not all(r.prefilled for r in reqs):
        sched.step()
    for _ in range(5):
        sched.step()
    sync()
    n = 100 if torch.cuda.is_available() else 5
    started = time.perf_counter()
    for _ in range(n):
        sched.step()
    sync()
    seconds = (time.perf_counter() - started) / n
    if tag:
        _profile_steps(sched, out_dir, tag)
    for r in reqs:  # finish them quickly: drop the rest of their tokens
        sched.abort(r)
    while sched.has_work():  # with overlap, collects the forward still in flight
        sched.step()
    return seconds * 1e3


def _sampling_batch(bs: int, temperature: float) -> Batch:
    params = SamplingParams(temperature=temperature)
    return Batch(
        reqs=[
            Req(input_ids=[1], table_idx=0, cached_len=0, output_len=1, uid=i, sampling_params=params)
            for i in range(bs)
        ],
        phase="decode",
    )


def _device_alone(llm: LLM, bs: int) -> dict:
    """GPU time of the decode step alone (its graph replayed back to back) and of the sampler on its
    logits, greedy and at T=0.6; empty without a graph for `bs`."""
    engine = llm.engine
    runner = engine.graph_runner
    if not runner.enabled or bs > runner.batch_sizes[-1]:
        return {}
    graph, logits = runner.graphs[min(b for b in runner.batch_sizes if b >= bs)]
    sampler = engine.sampler
    greedy, sampled = (sampler.prepare(_sampling_batch(bs, t)) for t in (0.0, 0.6))
    return {
        "graph_replay_ms": gpu_ms(graph.replay),
        "sample_greedy_ms": gpu_ms(lambda: sampler.sample(logits[:bs], greedy)),
        "sample_t0.6_ms": gpu_ms(lambda: sampler.sample(logits[:bs], sampled)),
    }


def decode_steps(llm: LLM, bs: int, prompt_len: int, out_dir: str, tag: str) -> dict:
    """Decode steps of `bs` requests with overlap on and off (profiled with overlap on), then the same
    step on the device alone."""
    sched, row = llm.scheduler, {"bs": bs}
    for overlap in (True, False):
        sched.overlap = overlap
        row[f"step_ms_overlap={overlap}"] = _step_ms(sched, bs, prompt_len, out_dir, tag if overlap else "")
    sched.overlap = True
    return {**row, **_device_alone(llm, bs)}


def _workload(llm: LLM, opts: argparse.Namespace, results: dict) -> None:
    """The offline workload and the single request with overlap on and off; the step tables asked for."""
    shape = WorkloadShape() if torch.cuda.is_available() else CPU_SHAPE
    prompts, max_tokens = make_workload(shape, llm.engine.config.model_config.vocab_size)
    for overlap in (True, False):
        llm.scheduler.overlap = overlap
        try:
            results[f"single_overlap={overlap}"] = run_single(llm)["tokens_per_s"]
            p = run_pass(llm, prompts, max_tokens, shape.temperature)
            results[f"workload_overlap={overlap}"] = p.tokens_per_s
            print(f"overlap={overlap}: workload {p.tokens_per_s:.0f} tok/s ({p.seconds:.2f} s)", flush=True)
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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
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
        _workload(llm, opts, results)
    with open(os.path.join(opts.out, "profile.json"), "w") as f:
        json.dump(results, f, indent=2)
    print(json.dumps(results, indent=2))
    llm.shutdown()


if __name__ == "__main__":
    sys.exit(main())
