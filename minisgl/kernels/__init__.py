"""Triton kernels for the CUDA path: GEMVs and the projection ops that choose by row count, the KV
store, q/k-norm + RoPE + KV store, small-batch decode and graph prefill attention, programmatic
dependent launch, and FP8 numerics and projections (the list: docs/architecture.md, "Components").
Without Triton (CPU installs) every caller falls back to plain torch ops; the tests run the kernels on
CPU tensors under Triton's interpreter.
"""
