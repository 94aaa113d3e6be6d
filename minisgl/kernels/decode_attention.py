"""Decode attention for small batches in Triton: split-KV ("flash decoding") over the token-level page
table, then a merge of the splits by their log-sum-exp.

Under a CUDA graph FlashInfer's decode kernels take 10 to 13 us a layer at small batches whatever the
context; this kernel reads each request's page-table row and length on the device (no host plan) and
its split count depends only on the batch size, so a graph replays the same grid. It takes sliding
windows and FP8 KV pages (widened exactly, scales applied on the device). Design and measurements:
docs/gpu.md ("Small decode batches"), docs/quantization.md (FP8 KV).
"""

from __future__ import annotations

import math
import os

import torch

from minisgl.kernels.pdl import launch_options, pdl_enabled, sm_count

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the backends that call this need CUDA anyway
    triton = None

BLOCK_N = 64
# Triton's interpreter (CPU tests) computes `tl.dot` of bfloat16 operands wrongly: there the operands go
# to float32 first; compiled for a GPU they stay in their dtype (tensor cores)
_DOT_F32 = os.environ.get("TRITON_INTERPRET") == "1"


def num_splits(batch_size: int, num_kv_heads: int, num_sms: int) -> int:
    """Splits per (request, KV head): about two programs per SM, a power of two from 1 to 64."""
    want = max(1, (2 * num_sms) // max(1, batch_size * num_kv_heads))
    return min(64, 1 << (want.bit_length() - 1))


if triton is not None:

    @triton.jit
    def _span(n, SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr):
        """The first token a request of n tokens attends to, and the tokens of each split (a multiple
        of the block): shared by the split kernel and the merge, which reads only the splits that hold
        tokens."""
        if WINDOW > 0:
            first = tl.maximum(n - WINDOW, 0)
        else:
            first = 0
        return first, tl.cdiv(tl.cdiv(n - first, SPLITS), BLOCK_N) * BLOCK_N

    @triton.jit
    def _split_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        table_ptr,
        rows_ptr,
        lens_ptr,
        part_ptr,
        lse_ptr,
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
        NUM_HEADS: tl.constexpr,
        GROUP: tl.constexpr,
        BLOCK_G: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_N: tl.constexpr,
        SPLITS: tl.constexpr,
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
        s = tl.program_id(2)
        n = tl.load(lens_ptr + b)
        row = tl.load(rows_ptr + b).to(tl.int64)
        first, chunk = _span(n, SPLITS, BLOCK_N, WINDOW)
        start = first + s * chunk
        end = tl.minimum(start + chunk, n)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        heads = h * GROUP + g
        gmask = g < GROUP
        dmask = d < HEAD_DIM
        q = tl.load(
            q_ptr + b * stride_qt + heads[:, None] * stride_qh + d[None, :],
            mask=gmask[:, None] & dmask[None, :],
            other=0.0,
        )
        if FP8:  # e4m3 * k_scale: K's scale goes into the softmax scale, V's onto the output
            sm_scale = sm_scale * tl.load(scales_ptr)
            v_scale = tl.load(scales_ptr + 1)
        if DOT_F32:
            q = q.to(tl.float32)
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        denom = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for t0 in range(start, end, BLOCK_N):
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
            scores = tl.where(tmask[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, 1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(scores - m_new[:, None])
            denom = denom * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + offs, mask=kvmask, other=0.0)
            if FP8:
                v = v.to(q_ptr.dtype.element_ty)
            if DOT_F32:
                v = v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m = m_new
        safe = tl.where(denom > 0, denom, 1.0)
        out = acc / safe[:, None]
        if FP8:
            out = out * v_scale
        if SPLITS == 1:
            tl.store(
                out_ptr + b * stride_ot + heads[:, None] * stride_oh + d[None, :],
                out.to(out_ptr.dtype.element_ty),
                mask=gmask[:, None] & dmask[None, :],
            )
        else:
            part = (b * NUM_HEADS + heads) * SPLITS + s
            tl.store(part_ptr + part[:, None] * BLOCK_D + d[None, :], out, mask=gmask[:, None])
            lse = tl.where(denom > 0, m + tl.log(safe), float("-inf"))
            tl.store(lse_ptr + part, lse, mask=gmask)

    @triton.jit
    def _merge_kernel(
        part_ptr,
        lse_ptr,
        lens_ptr,
        out_ptr,
        stride_ot,
        stride_oh,
        NUM_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_N: tl.constexpr,
        SPLITS: tl.constexpr,
        WINDOW: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        if USE_PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        b = tl.program_id(0)
        hq = tl.program_id(1)
        s = tl.arange(0, SPLITS)
        d = tl.arange(0, BLOCK_D)
        base = (b * NUM_HEADS + hq) * SPLITS
        n = tl.load(lens_ptr + b)
        first, chunk = _span(n, SPLITS, BLOCK_N, WINDOW)
        live = s < tl.cdiv(n - first, chunk)  # only the splits that hold tokens are read
        lse = tl.load(lse_ptr + base + s, mask=live, other=float("-inf"))
        w = tl.exp(lse - tl.max(lse, 0))  # split 0 always holds tokens: the max is finite
        part = tl.load(part_ptr + (base + s)[:, None] * BLOCK_D + d[None, :], mask=live[:, None], other=0.0)
        out = tl.sum(w[:, None] * part, 0) / tl.sum(w, 0)
        tl.store(
            out_ptr + b * stride_ot + hq * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM
        )


def check_window(window: int | None, name: str = "window") -> int | None:
    """`window` as the attention kernels and backends take it: None (full causal attention) or an
    integer >= 1, the tokens each query attends to, its own included; ValueError naming `name` else."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"{name} must be None (full attention) or an integer >= 1, got {window!r}")
    return window


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    table: torch.Tensor,
    rows: torch.Tensor,
    lens: torch.Tensor,
    sm_scale: float | None = None,
    splits: int | None = None,
    block_n: int = BLOCK_N,
    pdl: bool | None = None,
    kv_scales: torch.Tensor | None = None,
    window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Attention of one query token per request over its first `lens[i]` tokens, or only the last
    `window` of them (a sliding window; None: none). q: (B, H, D); k, v: (locations, KVH, D), H a
    multiple of KVH, each head's D dense; table: (rows, positions) int32 KV locations (the page table);
    rows, lens: (B,) integers (each request's table row and token count, >= 1). Returns (B, H, D) in q's
    dtype. `splits` (a power of two) overrides `num_splits`; `pdl`: programmatic dependent launch (None:
    `pdl_enabled`). FP8 (float8_e4m3fn) k and v need `kv_scales`, the layer's contiguous (2,) float32 K
    and V scales on q's device, and attend e4m3 * scale."""
    bs, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if num_heads % num_kv_heads or q.stride(2) != 1 or k.stride(2) != 1 or k.stride() != v.stride():
        raise ValueError(
            f"decode_attention needs query heads a multiple of KV heads and dense head dims; got q "
            f"{tuple(q.shape)} (strides {q.stride()}), k {tuple(k.shape)} (strides {k.stride()}), "
            f"v strides {v.stride()}"
        )
    fp8 = k.dtype == torch.float8_e4m3fn
    if fp8 != (kv_scales is not None) or (fp8 and v.dtype != k.dtype):
        raise ValueError(
            "decode_attention: FP8 K and V need the layer's (2,) kv_scales and other caches take none; got "
            f"k {k.dtype}, v {v.dtype}, kv_scales={None if kv_scales is None else tuple(kv_scales.shape)}"
        )
    if fp8 and (kv_scales.dtype != torch.float32 or kv_scales.shape != (2,) or not kv_scales.is_contiguous()):
        raise ValueError(
            "decode_attention: kv_scales must be a contiguous (2,) float32 tensor, got "
            f"{tuple(kv_scales.shape)} {kv_scales.dtype} (strides {kv_scales.stride()})"
        )
    check_window(window)
    if splits is None:
        splits = num_splits(bs, num_kv_heads, sm_count(q.device))
    group = num_heads // num_kv_heads
    block_g = max(16, triton.next_power_of_2(group))
    block_d = triton.next_power_of_2(head_dim)
    out = torch.empty_like(q)
    if splits > 1:
        part = torch.empty(bs * num_heads * splits, block_d, dtype=torch.float32, device=q.device)
        lse = torch.empty(bs * num_heads * splits, dtype=torch.float32, device=q.device)
    else:
        part = lse = out  # not written
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
    options = launch_options(pdl_enabled(q) if pdl is None else pdl)
    _split_kernel[(bs, num_kv_heads, splits)](
        q, k, v, table, rows, lens, part, lse, out, kv_scales if fp8 else q, scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), table.stride(0), out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, GROUP=group, BLOCK_G=block_g, HEAD_DIM=head_dim,
        BLOCK_D=block_d, BLOCK_N=block_n, SPLITS=splits, DOT_F32=_DOT_F32,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", FP8=fp8, WINDOW=window or 0,
        SOFT_CAP=float(soft_cap or 0.0),
        **options,
    )  # fmt: skip
    if splits > 1:
        _merge_kernel[(bs, num_heads)](
            part, lse, lens, out, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=block_n, SPLITS=splits,
            WINDOW=window or 0, **options,
        )  # fmt: skip
    return out
