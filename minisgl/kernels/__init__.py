"""Triton kernels for the CUDA path (one-row GEMV, fused KV store). Without Triton (CPU installs)
every caller falls back to plain torch ops."""
