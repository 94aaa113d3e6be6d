"""Issue 29's serving goals on a GPU: the rate-inf workload with none of the new sampling fields, with
presence, frequency and repetition penalties on every request (goal: at least 0.9x the plain run), and
with `logprobs: 5` on every request, served with text (goal: at least 0.85x).

    python -m perf.gpu.fields MODEL_DIR [--config YAML] [--before SRC] [--reps 3] [--out DIR]

MODEL_DIR as `perf.gpu.serving`'s (config.json and a tokenizer; dummy weights from the preset);
`--shape cpu` runs `perf.gpu.serving`'s scaled-down workload (a dry run on a CPU with a CPU config).
`--before SRC`: the source tree of an earlier build (e.g. `git archive` of the commit before issue 29),
served beside the current one, both at `MINISGL_MEMORY_RATIO=0.42` so they fit one GPU together; each
round then runs the earlier build's plain workload and the current build's plain, penalties and
logprobs workloads back to back (`--reps` rounds, medians). Servers bind to 127.0.0.1. A run that takes
longer than `--run-timeout` seconds is stopped and recorded as timed out, after `py-spy dump` of the
server's processes and of the client (where py-spy is on PATH: perf/gpu/wheels.txt) and a copy of the
server's /metrics, under --out: where it waits. A plain script, not a test.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from perf.gpu.serving import (
    CPU_ARGS,
    ROOT,
    WARM_UP,
    Proc,
    _children,
    _free_port,
    _get,
    _last_json,
    _line,
    bench_serving,
    model_parser,
    stop_servers_on_sigterm,
)

VARIANTS = {
    "plain": None,
    "penalties": {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1},
    "logprobs": {"logprobs": 5},
}
GOALS = {"penalties": 0.9, "logprobs": 0.85}


def _tree(pid: int) -> list[int]:
    """pid and its descendants."""
    pids = [pid]
    for child in _children(pid):
        pids += _tree(child)
    return pids


def bench_or_dump(
    base: str, server: Proc, out: Path, key: str, extra: list[str], timeout: float
) -> dict | None:
    """`minisgl-run bench-serving --json` against `base` (its report), or None when it runs past
    `timeout`: then the stacks of the server's and the client's processes (py-spy dump) and the server's
    /metrics go to out/KEY-timeout-*.txt first, and the client is stopped."""
    cmd = [sys.executable, "-m", "minisgl.cli", "bench-serving", "--base-url", base, "--json", *extra]
    client = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        stdout, stderr = client.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        name = key.replace("/", "-")
        spy = shutil.which("py-spy")
        if spy is not None:
            for pid in _tree(server.proc.pid) + _tree(client.pid):
                dump = subprocess.run(
                    [spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60
                )
                (out / f"{name}-timeout-spy-{pid}.txt").write_text(dump.stdout + dump.stderr)
        (out / f"{name}-timeout-metrics.txt").write_text(_get(base.removesuffix("/v1") + "/metrics")[1])
        client.kill()
        client.communicate()
        print(f"{key}: no answer in {timeout:.0f} s (stacks and metrics under {out})", flush=True)
        return None
    if client.returncode != 0:
        raise RuntimeError(f"bench-serving failed: {stderr[-3000:]}")
    report = _last_json(stdout)
    report.pop("requests", None)
    return report


def serve(args: argparse.Namespace, out: Path, name: str, tree: Path) -> tuple[Proc, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "minisgl.cli", "serve", "--config", args.config, "--model", args.model]
    env = {"MINISGL_MEMORY_RATIO": "0.42", "PYTHONPATH": f"{args.site}:{tree}" if args.site else str(tree)}
    proc = Proc(
        [*cmd, "--port", str(port)], out / f"{name}.log", f"http://127.0.0.1:{port}/health", env, tree
    )
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
                    print(_line(f"{key} #{i + 1}", report), flush=True)
                    (out / "fields.json").write_text(json.dumps(runs, indent=1))
    finally:
        for _, proc, _ in servers:
            proc.stop()
    tok_s = {key: [r["output_throughput"] for r in reports] for key, reports in runs.items()}
    plain = statistics.median(tok_s.get("current/plain", [float("nan")]))
    print(f"\n--- sampling fields, rate inf, {args.reps} rounds ---")
    for key, values in tok_s.items():
        ratio = statistics.median(values) / plain
        variant = key.split("/")[1]
        goal = (
            f" (goal >= {GOALS[variant]}x: {'met' if ratio >= GOALS[variant] else 'NOT met'})"
            if variant in GOALS
            else ""
        )
        runs_text = ", ".join(f"{v:,.0f}" for v in values)
        print(
            f"{key:>20}: median {statistics.median(values):,.0f} tok/s ({runs_text}), {ratio:.3f}x plain{goal}"
        )


if __name__ == "__main__":
    main()
