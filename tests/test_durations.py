"""The order of the test files (tests/durations.py): the slowest first by tests/durations.json, new
files before them; on two xdist workers each worker takes its files in that order; `--record-durations`
writes each file's seconds as the controller receives the workers' reports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from durations import DURATIONS_FILE, load_durations, merge_durations, slowest_first, sum_by_file

TESTS = Path(__file__).parent


def _items(*nodeids: str) -> list[SimpleNamespace]:
    return [SimpleNamespace(nodeid=n) for n in nodeids]


def test_files_go_slowest_first_new_ones_before_them():
    items = _items(
        "t/a.py::x", "t/a.py::y", "t/b.py::x", "t/c.py::x[1]", "t/c.py::x[2]", "t/d.py::x", "t/e.py::x"
    )
    durations = {"t/a.py": 1.0, "t/b.py": 5.0, "t/c.py": 1.0, "t/e.py": 9.5}
    order = [i.nodeid for i in slowest_first(items, durations)]
    # d is new; a and c tie and keep their collection order; each file's tests keep theirs
    assert order == [
        "t/d.py::x",
        "t/e.py::x",
        "t/b.py::x",
        "t/a.py::x",
        "t/a.py::y",
        "t/c.py::x[1]",
        "t/c.py::x[2]",
    ]
    assert [i.nodeid for i in slowest_first(items, {})] == [i.nodeid for i in items]


def test_measured_files_replace_theirs_and_removed_files_go(tmp_path):
    for name in ("t/a.py", "t/b.py"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text("")
    measured = sum_by_file([("t/b.py::x", 1.04), ("t/b.py::x", 2.0), ("t/b.py::y[1]", 0.5)])
    assert measured == {"t/b.py": 3.54}
    merged = merge_durations({"t/gone.py": 3.0, "t/b.py": 7.0, "t/a.py": 2.25}, measured, tmp_path)
    assert list(merged.items()) == [("t/a.py", 2.2), ("t/b.py", 3.5)]


def test_the_repository_durations_are_sorted_seconds():
    durations = load_durations(DURATIONS_FILE)
    assert list(durations) == sorted(durations) and all(s >= 0 for s in durations.values())
    assert all((TESTS.parent / name).is_file() for name in durations)


def test_two_workers_take_the_files_slowest_first_and_record_their_seconds(tmp_path):
    """A run of its own (`-p durations`, two workers, `--dist loadfile` as nox's): the slowest file,
    which has the fewest tests (xdist's own order, by test count, would hand it out last), starts
    first; each worker runs its files in the order of durations.json, the new file before them; the
    rewritten JSON has every file's seconds, each at least what its tests sleep."""
    sleeps = {"slow": [0.4], "mid": [0.05] * 3, "fast": [0.0] * 6, "new": [0.0] * 2}
    for name, times in sleeps.items():
        body = "import os, time\n\n"
        for i, s in enumerate(times):
            body += (
                f"def test_{i}():\n    time.sleep({s})\n"
                f"    with open({str(tmp_path / 'log')!r}, 'a') as f:\n"
                f"        f.write(os.environ['PYTEST_XDIST_WORKER'] + ' {name}\\n')\n\n"
            )
        (tmp_path / f"test_{name}.py").write_text(body)
    order_file = tmp_path / "durations.json"
    order_file.write_text(json.dumps({"test_fast.py": 0.1, "test_mid.py": 5.0, "test_slow.py": 9.0}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "pytest", "-p", "durations", "-p", "no:cacheprovider", "-q"]
    options = ["-n", "2", "--dist", "loadfile", "--durations-file", str(order_file), "--record-durations"]
    done = subprocess.run(
        [*command, *options, "--rootdir", str(tmp_path), "-c", os.devnull, str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    runs = [line.split() for line in (tmp_path / "log").read_text().splitlines()]
    rank = {"new": 0, "slow": 1, "mid": 2, "fast": 3}
    by_worker = {w: [f for v, f in runs if v == w] for w in {w for w, _ in runs}}
    assert sorted(f for fs in by_worker.values() for f in fs) == sorted(
        n for n, t in sleeps.items() for _ in t
    )
    for files in by_worker.values():
        assert [rank[f] for f in files] == sorted(rank[f] for f in files)
    # the new file and the slowest went out first, one to each worker
    assert sorted(files[0] for files in by_worker.values()) == ["new", "slow"]
    recorded = json.loads(order_file.read_text())
    assert list(recorded) == sorted(f"test_{n}.py" for n in sleeps)
    assert all(recorded[f"test_{n}.py"] >= sum(t) - 0.05 for n, t in sleeps.items())  # rounded to 0.1
