"""Triton kernels for the CUDA path: the one-row GEMV (plain, or with an add + RMSNorm or a
SiLU-and-multiply prologue; `gemv`), the projections as custom ops that pick the GEMV kernels or the row
kernels and cuBLAS by row count when they run (`linear`), the fused KV store (`kv_store`), q/k-norm +
RoPE + KV store in one kernel (`rope_store`), split-KV decode attention for small batches
(`decode_attention`), and programmatic dependent launch of the decode step's kernels (`pdl`); and FP8
numerics (`fp8`: block and per-token-group quantization, `fp8_linear` emulated in float32, the
reference) with the GPU FP8 projection (`fp8_gemm`: activation quantization, an FP8 GEMV, a
block-scaled Triton GEMM, `torch._scaled_mm`, and the op `minisgl::fp8_linear` that picks by row count).
Without
Triton (CPU installs) every caller falls back to plain torch ops; the tests run the kernels on CPU
tensors under Triton's interpreter."""
