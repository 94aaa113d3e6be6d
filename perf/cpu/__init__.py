"""pytest-benchmark suites on the CPU: `python -m pytest perf/cpu --benchmark-only` (or `nox -s perf`)."""
