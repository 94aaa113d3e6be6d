"""q/k RMSNorm, rotary embedding and the KV store in one Triton kernel (a program per token and head),
in place of three to five launches a layer on the unfused path.

The norm, its weight and the rotation are computed in float32 and rounded once at the store; an FP8 KV
cache gets `minisgl.kernels.fp8.quantize_kv` of what a cache in the model's dtype would hold. Runs on
CUDA, and on CPU under Triton's interpreter; the attention layer calls it where `rope_store_applies`.
docs/gpu.md ("Compiled forward and CUDA graphs", "Numerics").
"""

from __future__ import annotations

import torch

from minisgl.kernels.kv_store import cache_views
from minisgl.kernels.pdl import launch_options, pdl_enabled

try:
    import triton
    import triton.language as tl

    from minisgl.kernels.kv_fp8 import e4m3_bits
except ImportError:  # CPU-only installs: the unfused path serves
    triton = None


def rope_store_applies(qkv: torch.Tensor, head_dim: int) -> bool:
    """True when the fused kernel can run on this QKV projection output: Triton, CUDA, half precision,
    a contiguous (T, q + 2 kv) matrix, an even head_dim."""
    return (
        triton is not None
        and qkv.is_cuda
        and qkv.dim() == 2
        and qkv.dtype in (torch.bfloat16, torch.float16)
        and qkv.is_contiguous()
        and head_dim % 2 == 0
    )


if triton is not None:

    @triton.jit
    def _qk_norm_rope_store_kernel(
        qkv_ptr,
        q_norm_ptr,
        k_norm_ptr,
        cos_sin_ptr,
        positions_ptr,
        loc_ptr,
        q_out_ptr,
        k_cache_ptr,
        v_cache_ptr,
        scales_ptr,
        qkv_row_stride,
        cos_sin_row_stride,
        eps,
        H: tl.constexpr,
        KVH: tl.constexpr,
        D: tl.constexpr,
        BLOCK: tl.constexpr,
        HAS_NORM: tl.constexpr,
        FP8: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        if USE_PDL:  # see minisgl.kernels.pdl: everything read here may come from the kernel before
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        half: tl.constexpr = D // 2
        d = tl.arange(0, BLOCK)
        mask = d < half
        dtype = q_out_ptr.dtype.element_ty
        row = qkv_ptr + t * qkv_row_stride
        is_q = h < H
        head = tl.where(is_q, h, h - H)
        src = row + tl.where(is_q, h * D, H * D + head * D)
        x1 = tl.load(src + d, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + half + d, mask=mask, other=0.0).to(tl.float32)
        if HAS_NORM:
            rstd = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / D + eps)
            qw1 = tl.load(q_norm_ptr + d, mask=mask, other=0.0).to(tl.float32)
            qw2 = tl.load(q_norm_ptr + half + d, mask=mask, other=0.0).to(tl.float32)
            kw1 = tl.load(k_norm_ptr + d, mask=mask, other=0.0).to(tl.float32)
            kw2 = tl.load(k_norm_ptr + half + d, mask=mask, other=0.0).to(tl.float32)
            w1 = tl.where(is_q, qw1, kw1)
            w2 = tl.where(is_q, qw2, kw2)
            x1 = x1 * rstd * w1  # float32: the rotation below rounds once
            x2 = x2 * rstd * w2
        pos = tl.load(positions_ptr + t).to(tl.int64)
        cos = tl.load(cos_sin_ptr + pos * cos_sin_row_stride + d, mask=mask, other=0.0)
        sin = tl.load(cos_sin_ptr + pos * cos_sin_row_stride + half + d, mask=mask, other=0.0)
        o1 = (x1 * cos - x2 * sin).to(dtype)
        o2 = (x2 * cos + x1 * sin).to(dtype)
        if is_q:
            dst = q_out_ptr + (t * H + h) * D
            tl.store(dst + d, o1, mask=mask)
            tl.store(dst + half + d, o2, mask=mask)
        else:
            loc = tl.load(loc_ptr + t).to(tl.int64)
            slot = (loc * KVH + head) * D
            v_src = row + (H + KVH) * D + head * D
            v1 = tl.load(v_src + d, mask=mask, other=0.0)
            v2 = tl.load(v_src + half + d, mask=mask, other=0.0)
            # (new names in each branch: Triton refuses a variable whose type an `if` changes)
            if FP8:  # the caches are given as bytes: e4m3 of k / k_scale (k in dtype) and v / v_scale
                k_scale = tl.load(scales_ptr)
                v_scale = tl.load(scales_ptr + 1)
                tl.store(k_cache_ptr + slot + d, e4m3_bits(o1, k_scale), mask=mask)
                tl.store(k_cache_ptr + slot + half + d, e4m3_bits(o2, k_scale), mask=mask)
                tl.store(v_cache_ptr + slot + d, e4m3_bits(v1, v_scale), mask=mask)
                tl.store(v_cache_ptr + slot + half + d, e4m3_bits(v2, v_scale), mask=mask)
            else:
                tl.store(k_cache_ptr + slot + d, o1, mask=mask)
                tl.store(k_cache_ptr + slot + half + d, o2, mask=mask)
                tl.store(v_cache_ptr + slot + d, v1, mask=mask)
                tl.store(v_cache_ptr + slot + half + d, v2, mask=mask)


def qk_norm_rope_store(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    out_loc: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """The queries (T, num_heads, head_dim), normed and rotated; the keys (normed, rotated) and the values
    go to `k_cache[out_loc[t]]` and `v_cache[out_loc[t]]`. qkv: (T, (num_heads + 2 num_kv_heads) head_dim),
    contiguous, q, k then v heads; positions, out_loc: (T,) integers; cos_sin: (positions, head_dim)
    float32, cos then sin (`minisgl.layers.build_rope_cache`); q_norm, k_norm: (head_dim,) weights, both
    or neither; k_cache, v_cache: (slots, num_kv_heads, head_dim), contiguous, qkv's dtype or
    float8_e4m3fn, which stores `quantize_kv(k, kv_scales[0])` (k rounded to qkv's dtype first) and
    `quantize_kv(v, kv_scales[1])`; kv_scales: the layer's contiguous (2,) float32 scales, on qkv's device."""
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm: give both or neither")
    fp8, k_cache, v_cache = cache_views("qk_norm_rope_store", "kv_scales", k_cache, v_cache, kv_scales)
    tokens = qkv.shape[0]
    q = qkv.new_empty(tokens, num_heads, head_dim)
    if tokens == 0:
        return q
    has_norm = q_norm is not None
    _qk_norm_rope_store_kernel[(tokens, num_heads + num_kv_heads)](
        qkv,
        q_norm if has_norm else qkv,
        k_norm if has_norm else qkv,
        cos_sin,
        positions,
        out_loc,
        q,
        k_cache,
        v_cache,
        kv_scales if fp8 else qkv,  # not read
        qkv.stride(0),
        cos_sin.stride(0),
        eps,
        H=num_heads,
        KVH=num_kv_heads,
        D=head_dim,
        BLOCK=triton.next_power_of_2(head_dim // 2),
        HAS_NORM=has_norm,
        FP8=fp8,
        num_warps=1 if head_dim <= 128 else 2,
        **launch_options(pdl_enabled(qkv)),
    )
    return q
