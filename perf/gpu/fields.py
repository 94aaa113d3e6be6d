"""The sampling fields' serving goals on a GPU: the rate-inf workload plain, with presence, frequency and
repetition penalties on every request (goal: at least 0.9x the plain run), and with `logprobs: 5` on
every request, served with text (goal: at least 0.85x); figures in docs/performance.md.

    python -m perf.gpu.fields MODEL_DIR [--config YAML] [--before SRC] [--reps 3] [--shape cpu] [--out DIR]

MODEL_DIR as `perf.gpu.serving`'s. `--before SRC`: the source tree of an earlier build, served beside
the current one (both at `MINISGL_MEMORY_RATIO=0.42`); each round runs its plain workload, then the
current build's three, back to back (`--reps` rounds, medians). A run past `--run-timeout` is recorded
as timed out, after `py-spy dump` of the server's and the client's processes and a copy of /metrics
under --out: where it waits.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from perf.common import (
    CPU_ARGS,
    WARM_UP,
    ServerProcess,
    bench_serving,
    dump_stalled,
    free_port,
    model_parser,
    ratio_lines,
    report_line,
    serve_command,
    stop_servers_on_sigterm,
)

VARIANTS = {
    "plain": None,
    "penalties": {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1},
    "logprobs": {"logprobs": 5},
}
GOALS = {"penalties": 0.9, "logprobs": 0.85}


def bench_or_dump(
    base: str, server: ServerProcess, out: Path, key: str, extra: list[str], timeout: float
) -> dict | None:
    """`minisgl-run bench-serving --json` against `base` (its report), or None when it runs past
    `timeout`: then the stacks of the server's and the client's processes (py-spy dump) and the server's
    /metrics go to out/KEY-timeout-*.txt first, and the client is stopped."""
    name = key.replace("/", "-")

    def dump(client: int) -> None:
        dump_stalled(server.proc.pid, client, base, out, name)

    report = bench_serving(base, *extra, timeout=timeout, on_timeout=dump)
    if report is None:
        print(f"{key}: no answer in {timeout:.0f} s (stacks and metrics under {out})", flush=True)
    return report


def serve(args: argparse.Namespace, out: Path, name: str, tree: Path) -> tuple[ServerProcess, str]:
    port = free_port()
    cmd = serve_command(args.config, port, model=args.model)
    env = {"MINISGL_MEMORY_RATIO": "0.42", "PYTHONPATH": f"{args.site}:{tree}" if args.site else str(tree)}
    proc = ServerProcess(cmd, out / f"{name}.log", f"http://127.0.0.1:{port}/health", env, tree)
    print(f"{name}: up in {proc.start_s:.0f} s", flush=True)
    base = f"http://127.0.0.1:{port}/v1"
    bench_serving(base, *WARM_UP)
    return proc, base


def main() -> None:
    stop_servers_on_sigterm()
    parser = model_parser(__doc__)
    parser.add_argument("--before", default=None, help="an earlier build's source tree, served beside")
    parser.add_argument("--site", default=None, help="a folder of packages to put first on the servers' path")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default="fields-out")
    parser.add_argument("--run-timeout", type=float, default=120, help="seconds a run may take")
    parser.add_argument(
        "--shape", choices=["full", "cpu"], default="full", help="cpu: the scaled-down workload"
    )
    args = parser.parse_args()
    args.workload = CPU_ARGS if args.shape == "cpu" else []
    if Path(args.model).exists():  # a folder (a name like smollm2-135m stays a name)
        args.model = str(Path(args.model).resolve())
    args.config = str(Path(args.config).resolve())
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    servers = [("current", *serve(args, out, "current", Path(__file__).resolve().parents[2]))]
    if args.before:
        servers.insert(0, ("before", *serve(args, out, "before", Path(args.before).resolve())))
    runs: dict[str, list[dict]] = {}
    try:
        for i in range(args.reps):
            for name, proc, base in servers:
                for variant, body in VARIANTS.items():
                    if name == "before" and body is not None:
                        continue
                    extra = [*args.workload] + ([] if body is None else ["--extra-body", json.dumps(body)])
                    key = f"{name}/{variant}"
                    report = bench_or_dump(base, proc, out, key, extra, args.run_timeout)
                    if report is None:
                        continue
                    runs.setdefault(key, []).append(report)
                    print(report_line(f"{key} #{i + 1}", report), flush=True)
                    (out / "fields.json").write_text(json.dumps(runs, indent=1))
    finally:
        for _, proc, _ in servers:
            proc.stop()
    tok_s = {key: [r["output_throughput"] for r in reports] for key, reports in runs.items()}
    print(f"\n--- sampling fields, rate inf, {args.reps} rounds ---")
    lines = ratio_lines(tok_s, "current/plain", "plain", lambda key: GOALS.get(key.split("/")[1]), 20, 3)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
