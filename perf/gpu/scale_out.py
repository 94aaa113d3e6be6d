"""Issue 32's replica goals: the serving workload over HTTP against one server, against `minisgl-run
serve --dp N`, and against SGLang's router in front of N single-GPU servers (goals at N = 2: `--dp 2` at
least 1.9x one server, the router at least 1.8x).

    python -m perf.gpu.scale_out MODEL_DIR [--config YAML] [--parts one,dp,router] [--replicas 2]
        [--prompts-per-replica 256] [--concurrency-per-replica 256] [--reps 3] [--shape cpu] [--out DIR]

MODEL_DIR as `perf.gpu.serving`'s (config.json and a tokenizer; the preset's dummy weights). Every part
runs the same workload scaled by its replica count: `--prompts-per-replica` x N requests at rate inf,
at most `--concurrency-per-replica` x N in flight (`minisgl-run bench-serving`), `--reps` runs on one
start of its servers, after a warm-up; one server is the 1x. The prompts are sent as text (decoded once
with MODEL_DIR's tokenizer) in every part: the router refuses token-id prompts on /v1/completions. Parts:

- one: `minisgl-run serve` (one GPU).
- dp: `minisgl-run serve --dp N` (replica i on GPU i).
- router: N servers, server i alone on GPU i (`CUDA_VISIBLE_DEVICES`), behind
  `python -m sglang_router.launch_router` (sglang-router 0.3.2; its wheel and those it needs:
  perf/gpu/wheels.txt), round-robin and cache-aware policies, the workers' API key on the router.

The parts cannot share the GPUs, so they run one after the other (their runs alternate only within a
part); the table gives each part's median, its spread and its ratio to `one`. Every server binds to
127.0.0.1 on a free port and is stopped at the end of its part; every run is bounded (`--run-timeout`).
`--shape cpu` is a dry run on a CPU (`perf.gpu.serving`'s scaled-down workload, `--device cpu`). A plain
script, not a test.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from perf.gpu.serving import CPU_ARGS, WARM_UP, Proc, _free_port, _line, bench_serving, model_parser

KEY = "scale-out-bench-key"
GOALS = {"dp": 1.9, "router": 1.8, "router-cache": 1.8}


def _serve(args: argparse.Namespace, out: Path, name: str, *extra: str, env: dict | None = None) -> Proc:
    port = _free_port()
    cmd = [sys.executable, "-m", "minisgl.cli", "serve", "--config", args.config, "--model", args.model]
    cmd += ["--port", str(port), *args.device_args, *extra]
    proc = Proc(
        cmd, out / f"{name}.log", f"http://127.0.0.1:{port}/health", {"MINISGL_API_KEY": KEY, **(env or {})}
    )
    proc.base = f"http://127.0.0.1:{port}"
    print(f"{name}: up in {proc.start_s:.0f} s", flush=True)
    return proc


def _router(out: Path, name: str, workers: list[Proc], policy: str) -> Proc:
    port = _free_port()
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(_free_port())]
    cmd += ["--worker-urls", *[w.base for w in workers], "--api-key", KEY, "--policy", policy]
    cmd += ["--log-level", "warn", "--shutdown-grace-period-secs", "5"]
    proc = Proc(cmd, out / f"{name}.log", f"http://127.0.0.1:{port}/health")
    proc.base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120  # the router lists the model once it has read a worker's info
    while time.monotonic() < deadline and not _models(proc.base):
        time.sleep(1)
    print(f"{name}: up in {proc.start_s:.0f} s", flush=True)
    return proc


def _models(base: str) -> list[str]:
    """The model ids `base`/v1/models lists with the key (none on any failure)."""
    request = urllib.request.Request(base + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return [m["id"] for m in json.loads(response.read())["data"]]
    except (OSError, ValueError, KeyError):
        return []


@contextlib.contextmanager
def _part(args: argparse.Namespace, out: Path, part: str) -> Iterator[str]:
    """The servers of `part`, up; yields the base URL the client talks to."""
    n = args.replicas
    procs: list[Proc] = []
    try:
        if part == "one":
            procs.append(_serve(args, out, "one"))
        elif part == "dp":
            procs.append(_serve(args, out, "dp", "--dp", str(n)))
        else:
            for i in range(n):
                env = {} if args.shape == "cpu" else {"CUDA_VISIBLE_DEVICES": str(i)}
                procs.append(_serve(args, out, f"worker{i}", env=env))
            policy = "cache_aware" if part == "router-cache" else "round_robin"
            procs.append(_router(out, part, procs[:n], policy))
        yield procs[-1].base
    finally:
        for proc in reversed(procs):
            proc.stop()


def run_part(args: argparse.Namespace, out: Path, part: str) -> list[dict[str, Any]]:
    n = 1 if part == "one" else args.replicas
    workload = [*args.workload, "--num-prompts", str(args.prompts_per_replica * n)]
    workload += ["--prompt-format", "text", "--tokenizer", args.model]
    workload += ["--max-concurrency", str(args.concurrency_per_replica * n), "--api-key", KEY]
    reports = []
    with _part(args, out, part) as base:
        bench_serving(base + "/v1", *WARM_UP, "--api-key", KEY)
        for i in range(args.reps):
            report = bench_serving(base + "/v1", *workload, timeout=args.run_timeout)
            reports.append(report)
            print(_line(f"{part} #{i + 1}", report), flush=True)
            (out / f"{part}.json").write_text(json.dumps(reports, indent=1))
    return reports


def main() -> None:
    parser = model_parser(__doc__)
    parser.add_argument("--parts", default="one,dp,router")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--prompts-per-replica", type=int, default=256)
    parser.add_argument("--concurrency-per-replica", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--run-timeout", type=float, default=600)
    parser.add_argument("--shape", choices=["full", "cpu"], default="full")
    parser.add_argument("--out", default="scale-out")
    args = parser.parse_args()
    if Path(args.model).exists():  # a folder (a name like smollm2-135m stays a name)
        args.model = str(Path(args.model).resolve())
    args.config = str(Path(args.config).resolve())
    args.workload = list(CPU_ARGS[2:]) if args.shape == "cpu" else []  # the prompt count is set per part
    args.device_args = ["--device", "cpu"] if args.shape == "cpu" else []
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    results = {part: run_part(args, out, part) for part in args.parts.split(",")}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    tok_s = {part: [r["output_throughput"] for r in reports] for part, reports in results.items()}
    base = statistics.median(tok_s["one"]) if tok_s.get("one") else float("nan")
    print(f"\n--- scale-out, {args.replicas} replicas, {os.cpu_count()} CPUs ---")
    for part, values in tok_s.items():
        ratio = statistics.median(values) / base
        goal = (
            f" (goal >= {GOALS[part]}x: {'met' if ratio >= GOALS[part] else 'NOT met'})"
            if part in GOALS
            else ""
        )
        runs = ", ".join(f"{v:,.0f}" for v in values)
        print(f"{part:>13}: median {statistics.median(values):,.0f} tok/s ({runs}), {ratio:.2f}x one{goal}")


if __name__ == "__main__":
    main()
