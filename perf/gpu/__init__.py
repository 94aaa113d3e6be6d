"""GPU benchmark scripts (`python -m perf.gpu.NAME` from the repository root; `sampler_ops` runs on the
CPU): ablation, attention, gemv, moe, prefill, profile, sampler_ops. Shared helpers: `perf.gpu.timing`."""
