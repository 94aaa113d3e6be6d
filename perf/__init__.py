"""Benchmarks (docs/performance.md names each one). `perf/cpu`: pytest-benchmark suites (`nox -s perf`).
The scripts run from the repository root as modules (`python -m perf.NAME`, `python -m perf.gpu.NAME`);
their shared helpers are `perf.common` and, for device timing, `perf.gpu.timing`."""
