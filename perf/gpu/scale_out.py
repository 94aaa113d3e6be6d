"""The replica goals: the serving workload over HTTP against one server, against `minisgl-run serve --dp N`
and against SGLang's router in front of N single-GPU servers (at N = 2: `--dp 2` at least 1.9x one
server, the router at least 1.8x; docs/scale-out.md).

    python -m perf.gpu.scale_out MODEL_DIR [--config YAML] [--parts one,dp,router,router-cache]
        [--replicas 2] [--prompts-per-replica 256] [--concurrency-per-replica 256] [--reps 3]
        [--shape cpu] [--out DIR]

MODEL_DIR as `perf.gpu.serving`'s. Each part runs the workload scaled by its replica count (prompts and
concurrency per replica x N, rate inf, `--reps` runs on one start of its servers, prompts sent as text:
the router refuses token ids); `one` is the 1x. The router parts need sglang-router (its wheels:
perf/gpu/wheels.txt). `--shape cpu`: a dry run on a CPU. Servers bind to 127.0.0.1 and are stopped at
the end of their part; every run is bounded (`--run-timeout`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from perf.common import (
    CPU_ARGS,
    WARM_UP,
    ServerProcess,
    bench_serving,
    free_port,
    model_parser,
    ratio_lines,
    report_line,
    serve_command,
)

KEY = "scale-out-bench-key"
GOALS = {"dp": 1.9, "router": 1.8, "router-cache": 1.8}


def _serve(
    args: argparse.Namespace, out: Path, name: str, *extra: str, env: dict | None = None
) -> ServerProcess:
    port = free_port()
    cmd = serve_command(args.config, port, *args.device_args, *extra, model=args.model)
    proc = ServerProcess(
        cmd, out / f"{name}.log", f"http://127.0.0.1:{port}/health", {"MINISGL_API_KEY": KEY, **(env or {})}
    )
    proc.base = f"http://127.0.0.1:{port}"
    print(f"{name}: up in {proc.start_s:.0f} s", flush=True)
    return proc


def _router(out: Path, name: str, workers: list[ServerProcess], policy: str) -> ServerProcess:
    port = free_port()
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    cmd += ["--worker-urls", *[w.base for w in workers], "--api-key", KEY, "--policy", policy]
    cmd += ["--log-level", "warn", "--shutdown-grace-period-secs", "5"]
    proc = ServerProcess(cmd, out / f"{name}.log", f"http://127.0.0.1:{port}/health")
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
    procs: list[ServerProcess] = []
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
            print(report_line(f"{part} #{i + 1}", report), flush=True)
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
    print(f"\n--- scale-out, {args.replicas} replicas, {os.cpu_count()} CPUs ---")
    print("\n".join(ratio_lines(tok_s, "one", "one", GOALS.get)))


if __name__ == "__main__":
    main()
