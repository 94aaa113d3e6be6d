"""`python -m perf.busy_host`: a command runs beside N busy processes, bounded in time, and they stop."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _busy_host(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "perf.busy_host", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_the_command_runs_beside_busy_processes_which_stop_with_it():
    probe = "import time; time.sleep(2); raise SystemExit(3)"
    out = _busy_host("--busy", "2", "--seconds", "60", "--", sys.executable, "-c", probe)
    assert out.returncode == 3, out.stderr  # the command's exit code
    assert "busy_host: 2 busy processes, at most 60 s" in out.stderr
    assert "busy_host: 2 busy processes were still running at the end; stopped" in out.stderr


def test_a_command_past_the_limit_is_stopped():
    out = _busy_host(
        "--busy", "1", "--seconds", "2", "--", sys.executable, "-c", "import time; time.sleep(60)"
    )
    assert out.returncode == 124 and "ran past 2 s and was stopped" in out.stderr
