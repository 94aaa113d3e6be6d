"""Run a command beside N busy host processes: how a benchmark holds up when the machine is not idle.

    python -m perf.busy_host --busy 8 --seconds 900 -- \\
        python -m minisgl bench --config configs/h200-qwen3-0.6b.yaml --single-request --json

Each busy process spins a Python loop on one core (what other Python services on a shared host do)
until the command ends, and in any case stops by itself after ``--seconds``, also if this process is
killed. The command's own limit is ``--seconds`` too; its exit code is this script's. Run the same line
with Mini-SGLang's benchmark as the command to keep both figures from one machine state. On the 16-core
one-GPU host, 8 busy processes leave half the cores idle (the busy-host goal's setting,
docs/performance.md); on the 32-core two-GPU host, 16.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import subprocess
import sys
import time


def spin(deadline: float, parent: int) -> None:
    """Busy until `deadline` (time.time()) or until the parent process is gone."""
    n = 0
    while time.time() < deadline:
        for _ in range(100_000):
            n += 1
        if os.getppid() != parent:  # the parent died: a busy process never outlives it
            return


def run(command: list[str], busy: int, seconds: float) -> int:
    deadline = time.time() + seconds
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=spin, args=(deadline, os.getpid()), daemon=True) for _ in range(busy)]
    for proc in procs:
        proc.start()
    print(f"busy_host: {busy} busy processes, at most {seconds:.0f} s", file=sys.stderr, flush=True)
    try:
        return subprocess.run(command, timeout=seconds).returncode
    except subprocess.TimeoutExpired:
        print(f"busy_host: the command ran past {seconds:.0f} s and was stopped", file=sys.stderr)
        return 124
    finally:
        alive = sum(proc.is_alive() for proc in procs)
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.join(10)
        print(f"busy_host: {alive} busy processes were still running at the end; stopped", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--busy", type=int, default=os.cpu_count() // 2, help="busy processes [half the cores]"
    )
    parser.add_argument("--seconds", type=float, default=900.0, help="limit of everything [900]")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    if args.busy < 0 or args.seconds <= 0:
        parser.error("--busy must be >= 0 and --seconds > 0")
    sys.exit(run(command, args.busy, args.seconds))


if __name__ == "__main__":
    main()
