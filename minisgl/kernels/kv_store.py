"""The KV store as one Triton kernel: token t's K and V rows go to slot `out_loc[t]` of one layer's
K and V caches in a single launch (two `index_copy_` kernels otherwise). K and V may be strided views
(V is a slice of the fused QKV output); each row's heads and dims must be dense. An FP8 cache gets
`quantize_kv`'s bytes (`minisgl.kernels.kv_fp8`). docs/gpu.md#attention-backends, docs/quantization.md.
"""

from __future__ import annotations

import torch

from minisgl.kernels.fp8 import FP8_DTYPE

try:
    import triton
    import triton.language as tl

    from minisgl.kernels.kv_fp8 import e4m3_bits
except ImportError:  # CPU-only installs: index_copy_ serves
    triton = None


def kv_store_applies(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """True when `store_kv` can run: Triton, CUDA, (T, H, D) rows with dense heads, K and V of one
    dtype, the cache's or (an FP8 cache) a floating one."""
    return (
        triton is not None
        and k.is_cuda
        and k.dim() == 3
        and k.shape == v.shape
        and k.dtype == v.dtype
        and (k_cache.dtype == k.dtype or (k_cache.dtype == FP8_DTYPE and k.dtype.is_floating_point))
        and k.stride(2) == 1
        and v.stride(2) == 1
        and k.stride(1) == k.shape[2]
        and v.stride(1) == v.shape[2]
        and k_cache.is_contiguous()
    )


if triton is not None:

    @triton.jit
    def _kv_store_kernel(
        k_ptr,
        v_ptr,
        loc_ptr,
        k_cache_ptr,
        v_cache_ptr,
        scales_ptr,
        k_row_stride,
        v_row_stride,
        ROW: tl.constexpr,
        BLOCK: tl.constexpr,
        FP8: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        loc = tl.load(loc_ptr + t).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < ROW
        k = tl.load(k_ptr + t * k_row_stride + cols, mask=mask)
        v = tl.load(v_ptr + t * v_row_stride + cols, mask=mask)
        if FP8:  # the caches are given as bytes: e4m3 of k / k_scale and v / v_scale
            k = e4m3_bits(k, tl.load(scales_ptr))
            v = e4m3_bits(v, tl.load(scales_ptr + 1))
        tl.store(k_cache_ptr + loc * ROW + cols, k, mask=mask)
        tl.store(v_cache_ptr + loc * ROW + cols, v, mask=mask)


def cache_views(
    kernel: str, name: str, k_cache: torch.Tensor, v_cache: torch.Tensor, scales: torch.Tensor | None
) -> tuple[bool, torch.Tensor, torch.Tensor]:
    """(whether the cache is FP8, the caches as the store kernels write them: FP8 as bytes). An FP8
    cache needs the layer's K and V scales (`scales`, the argument `name` of `kernel`: a contiguous (2,)
    float32 tensor) and another takes none: a ValueError otherwise."""
    fp8 = k_cache.dtype == FP8_DTYPE
    if fp8 != (scales is not None):
        raise ValueError(
            f"{kernel}: an FP8 cache needs the layer's (2,) K and V scales and another takes none; got a "
            f"{k_cache.dtype} cache and {name}={None if scales is None else tuple(scales.shape)}"
        )
    if not fp8:
        return False, k_cache, v_cache
    if scales.dtype != torch.float32 or scales.shape != (2,) or not scales.is_contiguous():
        raise ValueError(
            f"{kernel}: {name} must be a contiguous (2,) float32 tensor, got "
            f"{tuple(scales.shape)} {scales.dtype} (strides {scales.stride()})"
        )
    return True, k_cache.view(torch.uint8), v_cache.view(torch.uint8)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    out_loc: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scales: torch.Tensor | None = None,
) -> None:
    """k_cache[out_loc[t]] = k[t] and v_cache[out_loc[t]] = v[t] for every token t, in one launch.

    k, v: (T, H, D); out_loc: (T,) int64 slots; k_cache, v_cache: (slots, H, D), contiguous. FP8 caches
    store `quantize_kv(k, scales[0])` and `quantize_kv(v, scales[1])`: `scales` is the layer's two
    float32 scales (a contiguous (2,) tensor on k's device), needed then and only then.
    """
    fp8, k_cache, v_cache = cache_views("store_kv", "scales", k_cache, v_cache, scales)
    tokens = k.shape[0]
    if tokens == 0:
        return
    row = k.shape[1] * k.shape[2]
    _kv_store_kernel[(tokens,)](
        k,
        v,
        out_loc,
        k_cache,
        v_cache,
        scales if fp8 else k,  # not read
        k.stride(0),
        v.stride(0),
        ROW=row,
        BLOCK=triton.next_power_of_2(row),
        FP8=fp8,
        num_warps=4,
    )
