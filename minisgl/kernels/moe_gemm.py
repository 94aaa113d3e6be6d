"""The mixture-of-experts MLP of many tokens (prefill, large decode batches) as two grouped GEMMs in Triton.

The (token, slot) pairs are sorted by expert and each expert's run padded to whole blocks of `BLOCK_M`
rows (`align_pairs`), so a block belongs to one expert; gate/up (SiLU-and-multiply in the epilogue),
then down scaled by the routing weight, then each token's top_k rows summed in float32 (packed experts:
each tile of words dequantized in registers, as `minisgl.kernels.packed_gemm.packed_mma` does). The grid has
the most blocks any routing can need (extra blocks return at once), so nothing is read on the host and
the kernels are captured in CUDA graphs. Configurations: `python -m perf.gpu.moe_tune --grouped`.
docs/tensor-parallel-and-moe.md.
"""

from __future__ import annotations

import torch

from minisgl.kernels.moe_gemv import MOE_GEMV_CONFIGS, Experts, lookup_config, packed_args

try:
    import triton
    import triton.language as tl

    from minisgl.kernels.packed_gemm import _mma_words, _tile
except ImportError:  # CPU-only installs: torch._grouped_mm serves every batch
    triton = None

# [block_m, block_n, block_k, warps, stages] of both kernels before tuning
DEFAULT_CONFIG = {"gate_up": [64, 64, 64, 4, 3], "down": [64, 64, 64, 4, 3]}
# packed experts: [block_n, block_k (words), warps, stages], block_m as tuned
PACKED_TILE = (64, 32, 4, 3)


def moe_gemm_config(num_experts: int, inter: int, hidden: int, tokens: int) -> dict[str, list[int]]:
    """The tuned launch configuration for this shape and token count (see `lookup_config`), or defaults."""
    return lookup_config(MOE_GEMV_CONFIGS.get("grouped", {}), num_experts, inter, hidden, tokens) or dict(
        DEFAULT_CONFIG
    )


def align_pairs(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, slot) pairs p = token * top_k + slot of `ids` (T, top_k), grouped by expert, each
    expert's run padded to a multiple of `block_m` with the value T * top_k (no pair). Returns (pairs
    (blocks * block_m,), the expert of each block (blocks,), `num_experts` for blocks past the last run).
    Every size is a function of the shapes only (no host sync)."""
    flat = ids.flatten()
    num_pairs = flat.numel()
    blocks = triton.cdiv(num_pairs, block_m) + min(num_experts, num_pairs)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    first = counts.cumsum(0) - counts  # each expert's first position in `order`
    experts = flat[order]
    rank = torch.arange(num_pairs, device=ids.device) - first[experts]
    pairs = torch.full((blocks * block_m,), num_pairs, dtype=torch.int32, device=ids.device)
    pairs[padded_end[experts] - padded[experts] + rank] = order.to(torch.int32)
    starts = torch.arange(blocks, device=ids.device) * block_m
    block_expert = torch.searchsorted(padded_end, starts, right=True).to(torch.int32)
    return pairs, block_expert


if triton is not None:

    @triton.jit
    def _grouped_kernel(
        a_ptr, w_ptr, s_ptr, z_ptr, weights_ptr, out_ptr, pairs_ptr, block_expert_ptr, E, P, a_stride,
        ROWS_PER_A: tl.constexpr, N: tl.constexpr, K: tl.constexpr, GATE_UP: tl.constexpr,
        BITS: tl.constexpr, GROUP: tl.constexpr, OUT_PACK: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """GATE_UP: the block's token rows (a = x, pair // ROWS_PER_A) times its expert's gate and up
        columns (w = w13, N = I, K = H), SiLU(gate) * up stored per pair. Else: its pairs' activations
        (a = act, ROWS_PER_A = 1) times the expert's down projection (w = w2, N = H, K = I), scaled by
        the routing weight, stored per pair. BITS 0: w in a's dtype. BITS 4 or 8: w packed (w the words,
        s and z the scales and zero points of groups of GROUP columns), BLOCK_K words a step, each tile
        dequantized in registers as `packed_mma` does (a given de-interleaved, the weight the MMA's long
        side). OUT_PACK > 1: the output stored de-interleaved for a packed down kernel (column c at
        (c % OUT_PACK) * N / OUT_PACK + c // OUT_PACK)."""
        block = tl.program_id(1)
        expert = tl.load(block_expert_ptr + block)
        if expert < E:  # blocks past the last expert's run have nothing to do
            pairs = tl.load(pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
            valid = pairs < P
            cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
            col_mask = cols < N
            rows_at = a_ptr + (pairs // ROWS_PER_A).to(tl.int64)[:, None] * a_stride
            w_rows = expert.to(tl.int64) * ((2 if GATE_UP else 1) * N) + cols.to(tl.int64)
            if BITS == 0:
                acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                w_at = w_ptr + w_rows[None, :] * K
                for k0 in range(0, K, BLOCK_K):
                    ks = k0 + tl.arange(0, BLOCK_K)
                    k_mask = ks < K
                    a = tl.load(rows_at + ks[None, :], mask=valid[:, None] & k_mask[None, :], other=0.0)
                    w_mask = k_mask[:, None] & col_mask[None, :]
                    acc = tl.dot(a, tl.load(w_at + ks[:, None], mask=w_mask, other=0.0), acc)
                    if GATE_UP:  # the up rows follow the gate rows
                        up = tl.load(w_at + N * K + ks[:, None], mask=w_mask, other=0.0)
                        acc_up = tl.dot(a, up, acc_up)
            else:
                PACK: tl.constexpr = 32 // BITS
                KW: tl.constexpr = K // PACK
                G: tl.constexpr = K // GROUP
                acc_t = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
                acc_up_t = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
                for w0 in range(0, KW, BLOCK_K):
                    words = w0 + tl.arange(0, BLOCK_K)
                    q, s, z = _tile(w_ptr, s_ptr, z_ptr, w_rows, col_mask, words, KW, G, PACK, GROUP // PACK)
                    acc_t = _mma_words(acc_t, q, s, z, rows_at, valid, words, KW, BITS)
                    if GATE_UP:
                        q, s, z = _tile(
                            w_ptr, s_ptr, z_ptr, w_rows + N, col_mask, words, KW, G, PACK, GROUP // PACK
                        )
                        acc_up_t = _mma_words(acc_up_t, q, s, z, rows_at, valid, words, KW, BITS)
                acc, acc_up = tl.trans(acc_t), tl.trans(acc_up_t)
            if GATE_UP:
                y = acc * tl.sigmoid(acc) * acc_up
            else:
                y = acc * tl.load(weights_ptr + pairs, mask=valid, other=0.0).to(tl.float32)[:, None]
            at = cols if OUT_PACK == 1 else cols % OUT_PACK * (N // OUT_PACK) + cols // OUT_PACK
            out_at = out_ptr + pairs.to(tl.int64)[:, None] * N + at[None, :]
            tl.store(out_at, y.to(out_ptr.dtype.element_ty), mask=valid[:, None] & col_mask[None, :])


def moe_gemm(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w13: Experts,
    w2: Experts,
    config: dict[str, list[int]] | None = None,
) -> torch.Tensor:
    """The MoE MLP of x (T, H) routed by (`weights`, `ids`) (T, top_k) (from `select_experts`), with
    w13 (E, 2I, H) and w2 (E, H, I) as in `BaseMoeBackend.forward`, plain or packed (`PackedWeights`).
    `config` overrides the tuned launch configuration (the tuning script sweeps it)."""
    tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter, top_k = two_inter // 2, ids.shape[1]
    if tokens == 0:
        return torch.empty_like(x)
    config = config or moe_gemm_config(num_experts, inter, hidden, tokens)
    num_pairs = tokens * top_k
    act = x.new_empty(num_pairs, inter)
    y = x.new_empty(num_pairs, hidden)
    weights = weights.contiguous()
    aligned = {}
    w2_bits = packed_args(w2)[3]
    down_pack = 32 // w2_bits if w2_bits else 1  # act stored as the packed down kernel reads it
    for part, a, w, out, rows_per_a, n_cols, k_cols in (
        ("gate_up", x, w13, act, top_k, inter, hidden),
        ("down", act, w2, y, 1, hidden, inter),
    ):
        m, n, k, warps, stages = config[part]
        words, scales, zeros, bits, group = packed_args(w)
        if bits:  # `packed_mma`'s tiles (64 rows of 32 words), a de-interleaved (act by the gate/up kernel)
            n, k, warps, stages = PACKED_TILE
            if part == "gate_up":
                a = a.view(a.shape[0], -1, 32 // bits).transpose(1, 2).contiguous()
        if m not in aligned:  # the two kernels may take blocks of different sizes
            aligned[m] = align_pairs(ids, num_experts, m)
        pairs, block_expert = aligned[m]
        _grouped_kernel[(triton.cdiv(n_cols, n), block_expert.numel())](
            a, words, scales, zeros, weights, out, pairs, block_expert, num_experts, num_pairs, a.stride(0),
            ROWS_PER_A=rows_per_a, N=n_cols, K=k_cols, GATE_UP=part == "gate_up", BITS=bits, GROUP=group,
            OUT_PACK=down_pack if part == "gate_up" else 1,
            BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, num_warps=warps, num_stages=stages,
        )  # fmt: skip
    # the sum over the top_k slots accumulates in float32 (for bf16 too) and rounds once
    return y.view(tokens, top_k, hidden).sum(dim=1)
