"""Prefill attention for CUDA graphs in Triton: causal attention of a prefill chunk over the token-level
page table, planned on the device (no FlashInfer plan), so a prefill can be captured and replayed.

Queries come in blocks of `ALIGN` tokens, each inside one request; `block_rows` gives each block's
page-table row, `lens` each query token's length (at least 1: padding attends to its row's first
token). A program per (block, KV head) reads each K/V tile once for the block and group. FP8 KV and
sliding windows as in decode attention. docs/gpu.md ("Prefill graphs").
"""

from __future__ import annotations

import math

import torch

from minisgl.kernels.decode_attention import _DOT_F32, check_window, triton
from minisgl.kernels.pdl import launch_options, pdl_enabled

if triton is not None:
    import triton.language as tl

ALIGN = 16  # query tokens per block: a request's tokens start a block
BLOCK_N = 64

if triton is not None:

    @triton.jit
    def _prefill_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        table_ptr,
        block_rows_ptr,
        lens_ptr,
        out_ptr,
        scales_ptr,
        sm_scale,
        stride_qt,
        stride_qh,
        stride_kvt,
        stride_kvh,
        stride_table,
        stride_ot,
        stride_oh,
        GROUP: tl.constexpr,
        GROUP_P: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        DOT_F32: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        FP8: tl.constexpr,
        WINDOW: tl.constexpr,
        SOFT_CAP: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        if USE_PDL:  # see minisgl.kernels.pdl: q and the KV cache come from the kernel before
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        b = tl.program_id(0)
        h = tl.program_id(1)
        row = tl.load(block_rows_ptr + b).to(tl.int64)
        r = tl.arange(0, BLOCK_M * GROUP_P)  # tile row r: token r // GROUP_P, head r % GROUP_P
        token = b * BLOCK_M + r // GROUP_P
        g = r % GROUP_P
        d = tl.arange(0, BLOCK_D)
        gmask = g < GROUP
        dmask = d < HEAD_DIM
        heads = h * GROUP + g
        qmask = gmask[:, None] & dmask[None, :]
        q = tl.load(
            q_ptr + token[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
            mask=qmask,
            other=0.0,
        )
        n = tl.load(lens_ptr + token)
        end = tl.max(n, 0)
        if WINDOW > 0:  # the first token any row of the block attends to
            first = tl.maximum(tl.min(n, 0) - WINDOW, 0)
        else:
            first = 0
        if FP8:
            sm_scale = sm_scale * tl.load(scales_ptr)
            v_scale = tl.load(scales_ptr + 1)
        if DOT_F32:
            q = q.to(tl.float32)
        m = tl.full([BLOCK_M * GROUP_P], float("-inf"), tl.float32)
        denom = tl.zeros([BLOCK_M * GROUP_P], tl.float32)
        acc = tl.zeros([BLOCK_M * GROUP_P, BLOCK_D], tl.float32)
        # without a window t = 0 is every row's: m is finite after the first block
        for t0 in range(first, end, BLOCK_N):
            t = t0 + tl.arange(0, BLOCK_N)
            tmask = t < end
            loc = tl.load(table_ptr + row * stride_table + t, mask=tmask, other=0).to(tl.int64)
            offs = loc[:, None] * stride_kvt + h * stride_kvh + d[None, :]
            kvmask = tmask[:, None] & dmask[None, :]
            k = tl.load(k_ptr + offs, mask=kvmask, other=0.0)
            if FP8:
                k = k.to(q_ptr.dtype.element_ty)
            if DOT_F32:
                k = k.to(tl.float32)
            scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * sm_scale
            if SOFT_CAP > 0:  # Gemma 2: cap * tanh(score / cap), tanh(x) = 2 sigmoid(2x) - 1
                scores = SOFT_CAP * (2.0 * tl.sigmoid(scores * (2.0 / SOFT_CAP)) - 1.0)
            visible = t[None, :] < n[:, None]
            if WINDOW > 0:
                visible = visible & (t[None, :] >= n[:, None] - WINDOW)
            scores = tl.where(visible, scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, 1))
            m_ref = m_new
            if WINDOW > 0:  # a row that has seen none of its tokens yet: exp(-inf - 0) = 0, never NaN
                m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - m_ref)
            p = tl.exp(scores - m_ref[:, None])
            denom = denom * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + offs, mask=kvmask, other=0.0)
            if FP8:
                v = v.to(q_ptr.dtype.element_ty)
            if DOT_F32:
                v = v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m = m_new
        out = acc / denom[:, None]
        if FP8:
            out = out * v_scale
        tl.store(
            out_ptr + token[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=qmask,
        )


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    table: torch.Tensor,
    block_rows: torch.Tensor,
    lens: torch.Tensor,
    sm_scale: float | None = None,
    pdl: bool | None = None,
    kv_scales: torch.Tensor | None = None,
    window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Attention of each query token over the first `lens[t]` tokens of its block's page-table row, or
    with `window` (a sliding window of that many tokens; None: none) over the last `window` of them.

    q: (T, H, D), T a multiple of `ALIGN`; k, v: (locations, KVH, D) (float8_e4m3fn with the layer's (2,)
    float32 `kv_scales`, as `decode_attention` takes them); table: the page table; block_rows: (T /
    ALIGN,) integers; lens: (T,) integers >= 1. Returns (T, H, D) in q's dtype."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if num_tokens % ALIGN or block_rows.shape[0] * ALIGN != num_tokens or lens.shape[0] != num_tokens:
        raise ValueError(
            f"prefill_attention takes tokens in blocks of {ALIGN}: got {num_tokens} tokens, "
            f"{block_rows.shape[0]} block rows and {lens.shape[0]} lengths"
        )
    if num_heads % num_kv_heads or q.stride(2) != 1 or k.stride(2) != 1 or k.stride() != v.stride():
        raise ValueError(
            f"prefill_attention needs query heads a multiple of KV heads and dense head dims; got q "
            f"{tuple(q.shape)} (strides {q.stride()}), k {tuple(k.shape)} (strides {k.stride()})"
        )
    fp8 = k.dtype == torch.float8_e4m3fn
    if fp8 != (kv_scales is not None):
        raise ValueError("prefill_attention: FP8 K and V need the layer's (2,) kv_scales, others none")
    check_window(window)
    group = num_heads // num_kv_heads
    group_p = triton.next_power_of_2(group)
    out = torch.empty_like(q)
    options = launch_options(pdl_enabled(q) if pdl is None else pdl)
    _prefill_kernel[(num_tokens // ALIGN, num_kv_heads)](
        q, k, v, table, block_rows, lens, out, kv_scales if fp8 else q,
        sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), table.stride(0), out.stride(0), out.stride(1),
        GROUP=group, GROUP_P=group_p, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_M=ALIGN, BLOCK_N=BLOCK_N, DOT_F32=_DOT_F32,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", FP8=fp8, WINDOW=window or 0,
        SOFT_CAP=float(soft_cap or 0.0),
        num_warps=8 if ALIGN * group_p >= 128 else 4, **options,
    )  # fmt: skip
    return out
