"""The order of the test files: the slowest first, by each file's measured duration kept in
tests/durations.json (docs/testing.md, "The slowest files"). A pytest plugin, its hooks imported by
conftest.py.

A file's duration is the sum of its tests' setup, call and teardown times (its module fixtures
included, and a session fixture's start in the file whose test first asks for it), as pytest's reports
give them: on the controller of an xdist run (`pytest_runtest_logreport` receives every worker's
reports), or in the one process. `nox -s durations` runs the suite with `--record-durations` and so
rewrites the file."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pytest

# the repository's measured durations: seconds a file, keyed by the file's path from the root
DURATIONS_FILE = Path(__file__).with_name("durations.json")


def file_of(nodeid: str) -> str:
    """The test file of a node id (`tests/test_x.py::test_y[1]` -> `tests/test_x.py`)."""
    return nodeid.split("::", 1)[0]


def load_durations(path: Path) -> dict[str, float]:
    """The durations in `path` ({} when it is missing)."""
    if not path.is_file():
        return {}
    return {str(name): float(seconds) for name, seconds in json.loads(path.read_text()).items()}


def slowest_first(items: list[Any], durations: Mapping[str, float]) -> list[Any]:
    """`items` (anything with a `nodeid`) grouped by file, the files in decreasing measured duration; a
    file that `durations` lacks (a new one: its time is unknown) goes before every measured one; files
    of equal duration keep their collection order, and each file's tests theirs. The same collection
    and durations give the same order in every process (xdist's workers must agree)."""
    groups: dict[str, list[Any]] = {}
    for item in items:
        groups.setdefault(file_of(item.nodeid), []).append(item)
    files = sorted(groups, key=lambda name: -durations.get(name, math.inf))
    return [item for name in files for item in groups[name]]


def sum_by_file(reports: Iterable[tuple[str, float]]) -> dict[str, float]:
    """Seconds by file of (nodeid, duration) pairs."""
    totals: dict[str, float] = {}
    for nodeid, duration in reports:
        totals[file_of(nodeid)] = totals.get(file_of(nodeid), 0.0) + duration
    return totals


def merge_durations(old: Mapping[str, float], measured: Mapping[str, float], root: Path) -> dict[str, float]:
    """`old` with the files just measured replaced and the files no longer under `root` dropped, sorted
    by path, the seconds rounded to 0.1 (a stable diff)."""
    merged = {**old, **measured}
    return {name: round(merged[name], 1) for name in sorted(merged) if (root / name).is_file()}


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("durations", "the test files' order, the slowest first")
    group.addoption(
        "--durations-file",
        metavar="PATH",
        default=str(DURATIONS_FILE),
        help="the JSON of each test file's seconds that orders the files (default: tests/durations.json)",
    )
    group.addoption(
        "--record-durations",
        action="store_true",
        help="rewrite --durations-file with each file's seconds in this run (setup + call + teardown of "
        "its tests), the files this run did not measure kept: `nox -s durations`",
    )


def pytest_configure(config: pytest.Config) -> None:
    # xdist hands out `--dist loadfile`'s files in the collection's order (the slowest first, below) only
    # without its reorder by test count, its default; an explicit --loadscope-reorder keeps that
    if (
        hasattr(config.option, "loadscopereorder")
        and "--loadscope-reorder" not in config.invocation_params.args
    ):
        config.option.loadscopereorder = False


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items[:] = slowest_first(items, load_durations(Path(config.getoption("--durations-file"))))


# (nodeid, seconds) of every setup, call and teardown reported in this process: on xdist's controller,
# every worker's
_REPORTED: list[tuple[str, float]] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _REPORTED.append((report.nodeid, report.duration))


def pytest_sessionfinish(session: pytest.Session) -> None:
    config = session.config
    if not config.getoption("--record-durations") or hasattr(config, "workerinput"):
        return  # not asked, or an xdist worker (its controller writes)
    path = Path(config.getoption("--durations-file"))
    merged = merge_durations(load_durations(path), sum_by_file(_REPORTED), config.rootpath)
    path.write_text(json.dumps(merged, indent=1) + "\n")
