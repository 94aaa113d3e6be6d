"""A one-row linear layer (y = x W^T + b for a single row x) as a Triton kernel.

Decoding one request multiplies one row by every weight matrix of the model. cuBLAS's kernels for that
shape read small matrices well below HBM bandwidth (see docs/performance.md, `python -m perf.gpu.gemv`);
this kernel gives each program `BLOCK_N` whole output rows (all of K, read in one unrolled sweep so
every load is in flight at once) and reduces in float32. `linear` in `minisgl.layers.basic` calls it for
a single row on CUDA in half precision when Triton is present, unless the engine turned it off
(`use_gemv_kernel` setting, or `batch_invariant`); everything else goes to `F.linear`.

Under torch.compile the kernel is the opaque custom op `minisgl::gemv`, so the decode graph traces and
captures it like any other kernel.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: F.linear serves every shape
    triton = None

# the widest row (K) the kernel takes; its sweep is unrolled, so this bounds the code size
MAX_K = 16384


def _block_n(n: int) -> int:
    """Output rows per program: two on wide matrices, one on narrow ones (one program per row keeps
    every SM busy on narrow matrices). Chosen by `python -m perf.gpu.gemv --sweep`; see
    docs/performance.md."""
    return 2 if n >= 4096 else 1


def gemv_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when `linear(x, weight)` should run on the kernel: one row, CUDA, bf16/fp16, contiguous."""
    return (
        triton is not None
        and x.is_cuda
        and x.dim() == 2
        and x.shape[0] == 1
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and weight.dim() == 2
        and weight.shape[1] == x.shape[1]
        and weight.shape[1] <= MAX_K
        and weight.is_contiguous()
    )


if triton is not None:

    @triton.jit
    def _gemv_kernel(
        x_ptr,
        w_ptr,
        b_ptr,
        y_ptr,
        N,
        K: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask = rows < N
        row_start = rows.to(tl.int64) * K
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in tl.static_range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            col_mask = cols < K
            x = tl.load(x_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
            w = tl.load(
                w_ptr + row_start[:, None] + cols[None, :],
                mask=row_mask[:, None] & col_mask[None, :],
                other=0.0,
            )
            acc += w.to(tl.float32) * x[None, :]
        y = tl.sum(acc, axis=1)
        if HAS_BIAS:
            y += tl.load(b_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_mask)


def gemv_launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    block_n: int,
    block_k: int,
    num_warps: int,
) -> None:
    """Launches the kernel with an explicit configuration (the benchmark sweeps these)."""
    n, k = weight.shape
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x,
        weight,
        bias if bias is not None else weight,
        out,
        n,
        K=k,
        HAS_BIAS=bias is not None,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=num_warps,
    )


@torch.library.custom_op("minisgl::gemv", mutates_args=())
def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (1, K) @ weight (N, K)^T (+ bias (N,)) -> (1, N), on the Triton kernel."""
    n, k = weight.shape
    out = x.new_empty(1, n)
    block_n = _block_n(n)
    gemv_launch(x.contiguous(), weight, bias, out, block_n, min(1024, triton.next_power_of_2(k)), 4)
    return out


@gemv.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return x.new_empty(1, weight.shape[0])
