"""Helpers the perf scripts share: free loopback ports, servers in subprocesses and their shutdown,
`minisgl-run bench-serving` runs, medians, decode rates and goal lines (docs/performance.md).

Only the standard library is imported here, so the CPU scripts and the stub server load no engine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PRESET = ROOT / "configs" / "h200-qwen3-0.6b.yaml"
# nothing a benchmark starts may reach a model hub
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
START_TIMEOUT_S = 480

# -- ports and processes


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    """(status, body) of a GET; status 0 when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""
    except OSError:
        return 0, ""


def wait_ready(url: str, timeout: float, proc: subprocess.Popen | None = None, interval: float = 0.5) -> None:
    """Polls `url` until it answers 200: RuntimeError when `proc` exits first, TimeoutError after
    `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the process exited with {proc.returncode} before {url} answered")
        if http_get(url, 2)[0] == 200:
            return
        time.sleep(interval)
    raise TimeoutError(f"{url} did not answer 200 in {timeout:.0f} s")


def stop_process(proc: subprocess.Popen, group: bool = True, grace: float = 60.0) -> int | None:
    """SIGTERM to `proc` (its whole process group with `group`), SIGKILL after `grace` seconds; its
    exit code."""
    if proc.poll() is None:
        send = (lambda sig: os.killpg(proc.pid, sig)) if group else proc.send_signal
        send(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            send(signal.SIGKILL)
            proc.wait(30)
    return proc.returncode


class ServerProcess:
    """A server in a subprocess, ready once `ready_url` answers 200 (`start_s`: how long that took);
    stopped by `stop` or on leaving a `with` block. With `group` it runs in a process group of its own
    and is stopped as a group (its scheduler processes too). Output goes to `log` (None: discarded)."""

    def __init__(
        self,
        cmd: list[str],
        log: Path | None,
        ready_url: str,
        env: dict[str, str] | None = None,
        cwd: Path = ROOT,
        group: bool = True,
        timeout: float = START_TIMEOUT_S,
    ) -> None:
        self.group = group
        self.log = open(log, "w") if log is not None else None  # noqa: SIM115
        started = time.monotonic()
        self.proc = subprocess.Popen(
            cmd,
            stdout=self.log or subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            cwd=cwd,
            start_new_session=group,
        )
        try:
            wait_ready(ready_url, timeout, self.proc)
        except (RuntimeError, TimeoutError) as e:
            self.stop()
            raise RuntimeError(f"{cmd[:4]}: {e}" + (f" (see {log})" if log else "")) from None
        self.start_s = time.monotonic() - started

    def stop(self) -> int | None:
        """Stops the server (bounded); its exit code."""
        code = stop_process(self.proc, self.group)
        if self.log is not None:
            self.log.close()
        return code

    def wait_gone(self, timeout: float = 60.0) -> None:
        """Waits (bounded) until the stopped server's process group is gone: its scheduler processes
        hold device memory until they exit, and an engine started next sizes its KV pool from what is
        free."""
        deadline = time.monotonic() + timeout
        while self.group and time.monotonic() < deadline:
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def serve_command(config: str | Path, port: int, *extra: str, model: str | None = None) -> list[str]:
    """`minisgl-run serve` with settings file `config` on 127.0.0.1:`port` (`model`: another folder)."""
    cmd = [sys.executable, "-m", "minisgl.cli", "serve", "--config", str(config), "--port", str(port)]
    return cmd + (["--model", model] if model else []) + list(extra)


def children(pid: int) -> list[int]:
    """The process ids of `pid`'s children (Linux; none where /proc cannot say)."""
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants."""
    pids = [pid]
    for child in children(pid):
        pids += process_tree(child)
    return pids


def dump_stalled(server_pid: int, client_pid: int, base: str, out: Path, name: str) -> None:
    """What a stalled run leaves to read: the stacks of the server's and the client's processes (py-spy
    dump, where py-spy is on PATH) and the server's /metrics, in out/NAME-timeout-*.txt."""
    spy = shutil.which("py-spy")
    if spy is not None:
        for pid in process_tree(server_pid) + process_tree(client_pid):
            done = subprocess.run(
                [spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60
            )
            (out / f"{name}-timeout-spy-{pid}.txt").write_text(done.stdout + done.stderr)
    (out / f"{name}-timeout-metrics.txt").write_text(http_get(base.removesuffix("/v1") + "/metrics")[1])


def stop_servers_on_sigterm() -> None:
    """SIGTERM (`timeout`'s signal) exits through the `with` blocks, so the servers are stopped: killed
    by default, a script would leave them running and holding GPU memory for the next command."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))


# -- the serving scripts: their command line and `minisgl-run bench-serving` runs

WARM_UP = ["--num-prompts", "16", "--min-output", "16", "--max-output", "64"]  # before a server's runs
# --shape cpu: the workload scaled down as `minisgl-run bench` does on a CPU (a dry run of a script)
CPU_ARGS = ["--num-prompts", "32", "--min-input", "16", "--max-input", "128"]
CPU_ARGS += ["--min-output", "16", "--max-output", "128"]


def model_parser(doc: str) -> argparse.ArgumentParser:
    """The serving scripts' command line: `doc` as its help, a model folder and `--config`."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="model folder: config.json and a tokenizer")
    parser.add_argument("--config", default=str(PRESET))
    return parser


def last_json(text: str) -> Any:
    """The last line of `text` that parses as a JSON object (or the whole text if it does)."""
    try:
        return json.loads(text)
    except ValueError:
        pass
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    raise ValueError(f"no JSON in the output: {text[-2000:]}")


def bench_serving(
    base_url: str, *args: str, timeout: float = 900, on_timeout: Callable[[int], None] | None = None
) -> dict[str, Any] | None:
    """`minisgl-run bench-serving --json` against `base_url`: its report, minus the per-request list.
    Past `timeout` seconds the client is killed: subprocess.TimeoutExpired is raised, or with
    `on_timeout` that is called first (with the client's pid) and None returned."""
    cmd = [sys.executable, "-m", "minisgl.cli", "bench-serving", "--base-url", base_url, "--json", *args]
    client = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        stdout, stderr = client.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        if on_timeout is not None:
            on_timeout(client.pid)
        client.kill()
        client.communicate()
        if on_timeout is None:
            raise
        return None
    if client.returncode != 0:
        raise RuntimeError(f"bench-serving failed: {stderr[-3000:]}")
    report = last_json(stdout)
    report.pop("requests", None)
    return report


def report_line(name: str, report: dict[str, Any]) -> str:
    """One line of a bench-serving report: throughput, TTFT, ITL, TPOT, failures."""
    return (
        f"{name}: {report['output_throughput']:,.0f} tok/s, TTFT p50 {report['ttft_ms']['p50']:.0f} ms "
        f"p99 {report['ttft_ms']['p99']:.0f} ms, ITL p99 {report['itl_ms']['p99']:.1f} ms, "
        f"TPOT p50 {report['tpot_ms']['p50']:.2f} ms, failed {report['failed']}"
    )


# -- figures


def median(values: Iterable[float | None], empty: Any = None) -> Any:
    """The median of the values that are not None; `empty` when there are none."""
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else empty


def goal_note(ratio: float, goal: float | None, at_most: bool = False) -> str:
    """' (goal >= 1.9x: met)', or '<=' with `at_most`; '' without a goal."""
    if goal is None:
        return ""
    met = ratio <= goal if at_most else ratio >= goal
    return f" (goal {'<=' if at_most else '>='} {goal}x: {'met' if met else 'NOT met'})"


def ratio_lines(
    rates: dict[str, list[float]],
    base: str,
    base_name: str,
    goals: Callable[[str], float | None],
    width: int = 13,
    digits: int = 2,
) -> list[str]:
    """Per key of `rates` (tokens/s of each run): its median, the runs, its median over `base`'s and the
    goal `goals(key)` for that ratio."""
    base_rate = median(rates.get(base, []), math.nan)
    lines = []
    for key, values in rates.items():
        rate = median(values, math.nan)
        ratio = rate / base_rate
        runs = ", ".join(f"{v:,.0f}" for v in values)
        lines.append(
            f"{key:>{width}}: median {rate:,.0f} tok/s ({runs}), {ratio:.{digits}f}x {base_name}"
            + goal_note(ratio, goals(key))
        )
    return lines


def decode_rate(llm: Any, prompts: Sequence[list[int]], params: Any) -> tuple[float, list[list[int]]]:
    """Decode tokens per second of `prompts` run one at a time through `llm.generate` (each request's
    tokens after its first, over its time after its first token), and each one's output token ids."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.synchronize()  # nothing queued before counts
    tokens, seconds, outputs = 0, 0.0, []
    for ids in prompts:
        started = time.perf_counter()
        out = llm.generate([ids], params)[0]
        seconds += time.perf_counter() - started - (out.time_to_first_token or 0.0)
        tokens += len(out.token_ids) - 1
        outputs.append(out.token_ids)
    return tokens / seconds, outputs
