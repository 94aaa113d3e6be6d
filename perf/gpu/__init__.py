"""GPU benchmark scripts (`python -m perf.gpu.NAME` from the repository root; docs/performance.md lists
them). Shared helpers: `perf.gpu.timing` (device time), `perf.common` (ports, servers, figures)."""
