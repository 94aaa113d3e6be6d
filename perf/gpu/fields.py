"""Issue 29's serving goals on a GPU: the rate-inf workload with none of the new sampling fields, with
presence, frequency and repetition penalties on every request (goal: at least 0.9x the plain run), and
with `logprobs: 5` on every request, served with text (goal: at least 0.85x).

    python -m perf.gpu.fields MODEL_DIR [--config YAML] [--before SRC] [--reps 3] [--out DIR]

MODEL_DIR as `perf.gpu.serving`'s (config.json and a tokenizer; dummy weights from the preset).
`--before SRC`: the source tree of an earlier build (e.g. `git archive` of the commit before issue 29),
served beside the current one, both at `MINISGL_MEMORY_RATIO=0.42` so they fit one GPU together; each
round then runs the earlier build's plain workload and the current build's plain, penalties and
logprobs workloads back to back (`--reps` rounds, medians). Servers bind to 127.0.0.1; every run is
bounded by `bench_serving`'s timeout. A plain script, not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from perf.gpu.serving import PRESET, WARM_UP, Proc, _free_port, _line, bench_serving

VARIANTS = {
    "plain": None,
    "penalties": {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1},
    "logprobs": {"logprobs": 5},
}
GOALS = {"penalties": 0.9, "logprobs": 0.85}


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
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model", help="model folder: config.json and a tokenizer")
    parser.add_argument("--config", default=str(PRESET))
    parser.add_argument("--before", default=None, help="an earlier build's source tree, served beside")
    parser.add_argument("--site", default=None, help="a folder of packages to put first on the servers' path")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default="fields-out")
    args = parser.parse_args()
    args.model, args.config = str(Path(args.model).resolve()), str(Path(args.config).resolve())
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    servers = [("current", *serve(args, out, "current", Path(__file__).resolve().parents[2]))]
    if args.before:
        servers.insert(0, ("before", *serve(args, out, "before", Path(args.before).resolve())))
    runs: dict[str, list[dict]] = {}
    try:
        for i in range(args.reps):
            for name, _, base in servers:
                for variant, body in VARIANTS.items():
                    if name == "before" and body is not None:
                        continue
                    extra = [] if body is None else ["--extra-body", json.dumps(body)]
                    report = bench_serving(base, *extra)
                    key = f"{name}/{variant}"
                    runs.setdefault(key, []).append(report)
                    print(_line(f"{key} #{i + 1}", report), flush=True)
                    (out / "fields.json").write_text(json.dumps(runs, indent=1))
    finally:
        for _, proc, _ in servers:
            proc.stop()
    tok_s = {key: [r["output_throughput"] for r in reports] for key, reports in runs.items()}
    plain = statistics.median(tok_s["current/plain"])
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
