"""The LoRA kernels of a batch that mixes adapters: shrink (x A^T) and expand (+= y B^T) over blocks of
rows that share one adapter slot, Punica's SGMV (a prefill's requests) and BGMV (one row per request).

    y = lora_shrink(x, a, tiles, order, ranks, n_seg)
        x (T, K), a (slots, n_seg * R, K) -> y (T, n_seg * R) float32
    lora_add_kernels(x, out, a, b, tiles, order, sizes, ranks)
        the shrink, then the expand: out (T, N) += per segment i: y[:, iR:(i+1)R] @ b[slot, rows_i]^T
    torch.ops.minisgl.lora_add(...)
        the same, as an op for torch.compile

`b` is (slots, N, R) and `sizes` the rows of each output segment (N = sum). `order` (T,) int32 lists
the rows grouped by slot, and `tiles` (n, 3) int32 holds (first, end, slot) of each block of at most
`TILE_ROWS` entries of `order` of one slot (`minisgl.layers.lora.LoraBatch` builds both): a program
reads its rows through `order`, so the rows of one adapter share its weights wherever they sit in the
batch. Slot -1 pads, and its programs exit at once; rows of no adapter are in no tile, neither read nor
written. `ranks` (slots,) int32, where given, is each slot's adapter rank: the kernels read and multiply
only the first `ranks[slot]` of the R rows of each segment of A and columns of B (the rest is the
pool's zero padding), so an adapter of rank 16 in a pool of `max_lora_rank` 64 moves a quarter of the
bytes. The grid is tiles x column blocks (x parts of K for a shrink of few rows), a function of the
shapes only: nothing is read on the host, so CUDA graphs capture the kernels. Products accumulate in
float32; y stays in float32 and is rounded to the weights' dtype for the expand's product (as PEFT
rounds lora_A's output), the sum with `out` is rounded once.
"""

from __future__ import annotations

import os

import torch

from minisgl.kernels.pdl import launch_options, pdl_enabled

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: minisgl.layers.lora takes its torch path
    triton = None

# the most rows of a tile (one adapter's rows per program); the row dimension of the kernels' products
TILE_ROWS = 32
BLOCK_K = 64
BLOCK_N = 64  # the shrink's columns a program
EXPAND_BLOCK_N = 64  # the expand's
# the shrink splits its product along K (the parts summed atomically) until it has about this many
# programs: a decode batch has few tiles and n_seg * R columns, too few programs to stream the adapters'
# A from every multiprocessor (about 2 programs per multiprocessor of an H100 / H200)
SPLIT_K_PROGRAMS = 256
SPLIT_K_MAX = 16
# Triton's interpreter (CPU tests) computes `tl.dot` of bfloat16 operands wrongly: there they go to
# float32 first (as in minisgl.kernels.decode_attention)
_DOT_F32 = os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:

    @triton.jit
    def _tile_rows(tiles_ptr, order_ptr, BLOCK_M: tl.constexpr, USE_PDL: tl.constexpr):
        """(slot, rows, row mask) of this program's tile; slot -1: a padding tile, nothing to do. With
        PDL (minisgl.kernels.pdl) the next kernel may launch now, and every program, a padding one too,
        waits for the kernel before (so that the one after, waiting for this one, waits for both)."""
        if USE_PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        tile = tl.program_id(0)
        slot = tl.load(tiles_ptr + tile * 3 + 2)
        entries = tl.load(tiles_ptr + tile * 3) + tl.arange(0, BLOCK_M)
        mask = entries < tl.load(tiles_ptr + tile * 3 + 1)
        return slot, tl.load(order_ptr + entries, mask=mask, other=0), mask

    @triton.jit
    def _shrink_kernel(
        x_ptr,
        a_ptr,
        y_ptr,
        tiles_ptr,
        order_ptr,
        ranks_ptr,
        x_stride,
        a_slot_stride,
        K,
        N,
        R,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SPLITS: tl.constexpr,
        HAS_RANKS: tl.constexpr,
        DOT_F32: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        """y[rows, cols] = x[rows] @ a[slot, cols]^T for one tile's rows, a block of the n_seg * R
        columns (those within the slot's rank) and part program_id(2) of SPLITS of K (the parts added
        atomically into a zeroed y)."""
        slot, rows, row_mask = _tile_rows(tiles_ptr, order_ptr, BLOCK_M, USE_PDL)
        if slot >= 0:
            cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            col_mask = cols < N
            if HAS_RANKS:
                col_mask = col_mask & (cols % R < tl.load(ranks_ptr + slot))
            x_at = x_ptr + rows.to(tl.int64)[:, None] * x_stride
            a_at = a_ptr + slot.to(tl.int64) * a_slot_stride + cols.to(tl.int64)[None, :] * K
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            k_part = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLITS) * BLOCK_K
            k_start = tl.program_id(2) * k_part
            for k0 in range(k_start, tl.minimum(k_start + k_part, K), BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                k_mask = ks < K
                x = tl.load(x_at + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
                a = tl.load(a_at + ks[:, None], mask=k_mask[:, None] & col_mask[None, :], other=0.0)
                if DOT_F32:
                    x, a = x.to(tl.float32), a.to(tl.float32)
                acc = tl.dot(x, a, acc, input_precision=DOT_PRECISION)
            y_at = y_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :]
            if SPLITS == 1:
                tl.store(y_at, acc, mask=row_mask[:, None] & col_mask[None, :])
            else:
                tl.atomic_add(y_at, acc, mask=row_mask[:, None] & col_mask[None, :], sem="relaxed")

    @triton.jit
    def _expand_kernel(
        y_ptr,
        b_ptr,
        out_ptr,
        tiles_ptr,
        order_ptr,
        ranks_ptr,
        out_stride,
        b_slot_stride,
        N,
        R,
        SEG1,
        SEG2,
        N_SEG: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_R: tl.constexpr,
        HAS_RANKS: tl.constexpr,
        DOT_F32: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        """out[rows, cols] += sum over segments i of y[rows, iR:(i+1)R] @ b[slot, cols, :]^T (within the
        slot's rank), each column taking its own segment's (segment i: columns [SEG_i, SEG_i+1), SEG_0 =
        0, SEG_N_SEG = N)."""
        slot, rows, row_mask = _tile_rows(tiles_ptr, order_ptr, BLOCK_M, USE_PDL)
        if slot >= 0:
            col0 = tl.program_id(1) * BLOCK_N
            cols = col0 + tl.arange(0, BLOCK_N)
            col_mask = cols < N
            segment = (cols >= SEG1).to(tl.int32) + (cols >= SEG2).to(tl.int32)
            ranks = tl.arange(0, BLOCK_R)
            rank_mask = ranks < R
            if HAS_RANKS:
                rank_mask = rank_mask & (ranks < tl.load(ranks_ptr + slot))
            b_at = b_ptr + slot.to(tl.int64) * b_slot_stride + cols.to(tl.int64)[None, :] * R + ranks[:, None]
            y_at = y_ptr + rows.to(tl.int64)[:, None] * (N_SEG * R) + ranks[None, :]
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for i in tl.static_range(N_SEG):
                lo = 0 if i == 0 else (SEG1 if i == 1 else SEG2)
                hi = SEG1 if i == 0 else (SEG2 if i == 1 else N)
                if (col0 < hi) & (col0 + BLOCK_N > lo):  # this block holds columns of segment i
                    y = tl.load(y_at + i * R, mask=row_mask[:, None] & rank_mask[None, :], other=0.0)
                    b_mask = rank_mask[:, None] & (col_mask & (segment == i))[None, :]
                    b = tl.load(b_at, mask=b_mask, other=0.0)
                    y = y.to(b.dtype)
                    if DOT_F32:
                        y, b = y.to(tl.float32), b.to(tl.float32)
                    acc = tl.dot(y, b, acc, input_precision=DOT_PRECISION)
            out_at = out_ptr + rows.to(tl.int64)[:, None] * out_stride + cols[None, :]
            mask = row_mask[:, None] & col_mask[None, :]
            total = tl.load(out_at, mask=mask, other=0.0).to(tl.float32) + acc
            tl.store(out_at, total.to(out_ptr.dtype.element_ty), mask=mask)


def _precision(dtype: torch.dtype) -> str:
    """float32 products in full precision (TF32 would not match the float32 reference)."""
    return "ieee" if dtype == torch.float32 or _DOT_F32 else "tf32"


def shrink_splits(rows: int, n: int, k: int) -> int:
    """The parts the shrink cuts K into for `rows` rows (see SPLIT_K_PROGRAMS), counting the tiles of
    one adapter's rows, each part at least 4 blocks of K."""
    programs = triton.cdiv(rows, TILE_ROWS) * triton.cdiv(n, BLOCK_N)
    return max(1, min(SPLIT_K_MAX, SPLIT_K_PROGRAMS // max(programs, 1), k // (4 * BLOCK_K)))


def lora_shrink(
    x: torch.Tensor,
    a: torch.Tensor,
    tiles: torch.Tensor,
    order: torch.Tensor,
    ranks: torch.Tensor | None = None,
    n_seg: int = 1,
) -> torch.Tensor:
    """y (T, n_seg * R) float32 of the tiles' rows (other rows, and columns past a slot's rank, are left
    unwritten, or zero); see the module docstring."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    n, k = a.shape[1], a.shape[2]
    splits = shrink_splits(x.shape[0], n, k)
    y = (torch.zeros if splits > 1 else torch.empty)(x.shape[0], n, dtype=torch.float32, device=x.device)
    if x.shape[0] and tiles.shape[0]:
        grid = (tiles.shape[0], triton.cdiv(n, BLOCK_N), splits)
        _shrink_kernel[grid](
            x, a, y, tiles, order, tiles if ranks is None else ranks, x.stride(0), a.stride(0), k, n,
            n // n_seg, BLOCK_M=TILE_ROWS, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
            SPLITS=splits, HAS_RANKS=ranks is not None, DOT_F32=_DOT_F32, DOT_PRECISION=_precision(x.dtype),
            **launch_options(pdl_enabled(x)),
        )  # fmt: skip
    return y


def lora_add_kernels(
    x: torch.Tensor,
    out: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    tiles: torch.Tensor,
    order: torch.Tensor,
    sizes: list[int],
    ranks: torch.Tensor | None = None,
) -> None:
    """out += each tiled row's LoRA delta in place: `lora_shrink`, then the expand of y times the rows'
    slot's b (slots, N, R) into out (T, N), segment by segment, within each slot's rank."""
    assert out.stride(-1) == 1 and 1 <= len(sizes) <= 3 and sum(sizes) == out.shape[1] == b.shape[1]
    rank, n = b.shape[2], out.shape[1]
    y = lora_shrink(x, a, tiles, order, ranks, len(sizes))
    seg1, seg2 = ([sum(sizes[: i + 1]) for i in range(len(sizes) - 1)] + [n, n])[:2]
    if out.shape[0] and tiles.shape[0]:
        grid = (tiles.shape[0], triton.cdiv(n, EXPAND_BLOCK_N))
        _expand_kernel[grid](
            y, b, out, tiles, order, tiles if ranks is None else ranks, out.stride(0), b.stride(0), n,
            rank, seg1, seg2, N_SEG=len(sizes), BLOCK_M=TILE_ROWS,
            BLOCK_N=EXPAND_BLOCK_N, BLOCK_R=max(16, triton.next_power_of_2(rank)), HAS_RANKS=ranks is not None,
            DOT_F32=_DOT_F32, DOT_PRECISION=_precision(b.dtype), **launch_options(pdl_enabled(out)),
        )  # fmt: skip


# `lora_add_kernels` as an op torch.compile sees whole (its fake returns nothing); the function itself
# stays a plain function for eager calls
lora_add_op = torch.library.custom_op("minisgl::lora_add", lora_add_kernels, mutates_args=("out",))


@lora_add_op.register_fake
def _(x, out, a, b, tiles, order, sizes, ranks=None):
    return None
