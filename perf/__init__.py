"""Benchmarks. `perf/cpu`: pytest-benchmark suites (`nox -s perf`, or
`python -m pytest perf/cpu --benchmark-only`). `perf/gpu`: plain scripts, run from the repository root
as modules (`python -m perf.gpu.NAME`), sharing `perf.gpu.timing`."""
