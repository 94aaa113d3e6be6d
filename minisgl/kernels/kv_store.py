"""The KV store as one Triton kernel: token t's K and V rows go to slot `out_loc[t]` of one layer's
K and V caches in a single launch (two `index_copy_` kernels otherwise).

One program per token copies both rows (kv_heads * head_dim elements each). K and V may be strided
views (V is a slice of the fused QKV projection); each row's heads and dims must be dense. The KV pool
uses it where it applies unless built with `use_kernel=False` (the `use_kv_store_kernel` setting).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: index_copy_ serves
    triton = None


def kv_store_applies(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """True when `store_kv` can run: Triton, CUDA, (T, H, D) rows with dense heads, same dtype."""
    return (
        triton is not None
        and k.is_cuda
        and k.dim() == 3
        and k.shape == v.shape
        and k.dtype == v.dtype == k_cache.dtype
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
        k_row_stride,
        v_row_stride,
        ROW: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        loc = tl.load(loc_ptr + t).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < ROW
        k = tl.load(k_ptr + t * k_row_stride + cols, mask=mask)
        v = tl.load(v_ptr + t * v_row_stride + cols, mask=mask)
        tl.store(k_cache_ptr + loc * ROW + cols, k, mask=mask)
        tl.store(v_cache_ptr + loc * ROW + cols, v, mask=mask)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, out_loc: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> None:
    """k_cache[out_loc[t]] = k[t] and v_cache[out_loc[t]] = v[t] for every token t, in one launch.

    k, v: (T, H, D); out_loc: (T,) int64 slots; k_cache, v_cache: (slots, H, D), contiguous.
    """
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
        k.stride(0),
        v.stride(0),
        ROW=row,
        BLOCK=triton.next_power_of_2(row),
        num_warps=4,
    )
