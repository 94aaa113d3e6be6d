"""The sampler's draw as Triton kernels: without filters (temperature only, greedy rows mixed in) in three,
the same tokens as `minisgl.engine.draw.sample_rows` with ``need_filter=False``, in fewer passes; with
top-k / top-p / min-p (`draw_filtered`) by a threshold search instead of a sort (below).

`sample_rows` compiled with a dynamic batch dimension reduces each 151,936-wide row in one program, so
a small batch leaves most of the GPU idle for several passes over its logits. Here every pass splits
the row into blocks of `BLOCK` tokens, one program each:

1. `_block_max_kernel`, (B, NB) programs: each block's max logit and the first token reaching it.
2. `_block_weight_kernel`, (B, NB): the row's max from step 1, each token's integer weight
   ``round(exp((logit - max) / T) * 2**WEIGHT_BITS)`` (`token_weights`), the block's total.
3. `_pick_kernel`, (B,): the cumulative block totals, the target ``floor(u * total)`` from the
   (seed, offset) hash (`uniform_from_hash`), the block it falls in, that block's weights again and the
   first token whose cumulative weight exceeds it (`draw`); greedy rows (T 0) take the argmax.

Integer weights make the token independent of the block size and of the order of the sums, so the only
difference from `sample_rows` is the float ``exp`` (each implementation's roundings), as between eager
and compiled runs of `sample_rows` itself.

The filters (`keep_mask`) keep a prefix of the row's tokens sorted by weight, heaviest first, ties by
token id: its end is the first token that top-k, top-p or min-p drops. Judged at the first token of a
weight ``v`` (the tokens heavier than ``v`` before it: their count ``C(v)`` and weight ``S(v)``), the
condition ``C(v) < top_k and (S(v) < top_p * total or C(v) == 0 or top_p >= 1) and v >= min_p * max``
holds for heavy weights and fails from some weight down, so `draw_filtered` searches the integers for
the smallest ``u`` where it holds, without sorting: each pass evaluates it at `PIVOTS` thresholds
spread over the interval left (one kernel counts and sums the weights above each threshold per block,
the tokens above the interval once and the others only while one is above the threshold, a second one
per row adds the blocks and narrows the interval), and `SEARCH_PASSES` passes take the
2**WEIGHT_BITS + 1 weights down to one. The lightest kept weight ``v*`` is then the smallest weight
>= ``u``; of the tokens that weigh exactly ``v*``, the first ``n`` by id are kept, ``n`` the count the
condition allows for the next ranks (found per row by bisection). The draw then runs over the kept
weights as above. The same tokens as `sample_rows` with ``need_filter=True``. docs/gpu.md#the-sampler.
"""

from __future__ import annotations

import torch

from minisgl.kernels.decode_attention import triton

# fixed point of the token weights (`minisgl.engine.draw` and these kernels): the most likely token weighs
# 2**WEIGHT_BITS; a vocabulary of up to 2**21 tokens sums to less than 2**62
WEIGHT_BITS = 40
# tokens per program of the block passes
BLOCK = 2048
# thresholds a search pass of `draw_filtered` evaluates, and the passes: (PIVOTS + 1) ** SEARCH_PASSES
# must reach 2**WEIGHT_BITS + 1 (the weights 0 to 2**WEIGHT_BITS)
PIVOTS = 63
SEARCH_PASSES = 7
# False on CPU-only installs without Triton (the sampler then runs `sample_rows`)
AVAILABLE = triton is not None

if triton is not None:
    import triton.language as tl

    _WEIGHT_SCALE = tl.constexpr(float(2**WEIGHT_BITS))  # (a kernel reads only constexpr globals)
    _TOP_WEIGHT = tl.constexpr(2**WEIGHT_BITS)  # the heaviest token's weight

    @triton.jit
    def _weights(x, top, temperature):
        """int64 weights of float32 logits ``x`` (-inf where absent) under the row max and T."""
        w = tl.exp((x - top) / temperature) * _WEIGHT_SCALE
        # round half to even (torch.round) by adding and taking away 2**23: below it the sum's float32
        # rounding is the integer one; from it on every float32 is an integer already
        w = tl.where(w < 8388608.0, (w + 8388608.0) - 8388608.0, w)
        return tl.where(w == w, w, 0.0).to(tl.int64)  # NaN logits weigh 0

    @triton.jit
    def _block_max_kernel(logits_ptr, stride, V, max_ptr, arg_ptr, NB, BLOCK: tl.constexpr):
        b, nb = tl.program_id(0).to(tl.int64), tl.program_id(1)
        cols = nb * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(logits_ptr + b * stride + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        top = tl.max(x, axis=0)
        tl.store(max_ptr + b * NB + nb, top)
        tl.store(arg_ptr + b * NB + nb, tl.min(tl.where(x == top, cols, V), axis=0))

    @triton.jit
    def _row_max(max_ptr, b, NB, NB_POW2: tl.constexpr):
        tops = tl.load(
            max_ptr + b * NB + tl.arange(0, NB_POW2), mask=tl.arange(0, NB_POW2) < NB, other=float("-inf")
        )
        return tl.max(tops, axis=0)

    @triton.jit
    def _temperature(floats_ptr, b):
        t = tl.load(floats_ptr + b)  # row 0 of (3, B): temperature; greedy rows weigh under T 1
        return tl.where(t == 0.0, 1.0, t)

    @triton.jit
    def _block_weight_kernel(
        logits_ptr, stride, V, max_ptr, floats_ptr, sum_ptr, NB, BLOCK: tl.constexpr, NB_POW2: tl.constexpr
    ):
        b, nb = tl.program_id(0).to(tl.int64), tl.program_id(1)
        top = _row_max(max_ptr, b, NB, NB_POW2)
        cols = nb * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(logits_ptr + b * stride + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        tl.store(sum_ptr + b * NB + nb, tl.sum(_weights(x, top, _temperature(floats_ptr, b)), axis=0))

    @triton.jit
    def _mix32(x):
        x = x ^ (x >> 16)
        x = x * 0x7FEB352D
        x = x ^ (x >> 15)
        x = x * 0x846CA68B
        return x ^ (x >> 16)

    @triton.jit
    def _absorb(h, value):
        h = _mix32(h ^ (value & 0xFFFFFFFF).to(tl.uint32))
        return _mix32(h ^ ((value >> 32) & 0xFFFFFFFF).to(tl.uint32))

    @triton.jit
    def _pick_kernel(
        logits_ptr, stride, V, max_ptr, arg_ptr, sum_ptr, floats_ptr, ints_ptr, istride, out_ptr, NB,
        BLOCK: tl.constexpr, NB_POW2: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0).to(tl.int64)
        blocks = tl.arange(0, NB_POW2)
        sums = tl.load(sum_ptr + b * NB + blocks, mask=blocks < NB, other=0)
        cdf = tl.cumsum(sums, axis=0)
        # u < 1 and total >= 1 keep the target below the total
        target = tl.floor(_uniform(ints_ptr, istride, b) * tl.sum(sums, axis=0).to(tl.float64)).to(tl.int64)
        block = tl.minimum(tl.sum((cdf <= target).to(tl.int32), axis=0), NB - 1)
        before = tl.sum(tl.where(blocks == block, cdf - sums, 0), axis=0)
        cols = block * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(logits_ptr + b * stride + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        local = tl.cumsum(_weights(x, _row_max(max_ptr, b, NB, NB_POW2), _temperature(floats_ptr, b)), axis=0)
        drawn = tl.minimum(block * BLOCK + tl.sum((local <= target - before).to(tl.int32), axis=0), V - 1)
        greedy = _greedy(max_ptr, arg_ptr, b, NB, V, NB_POW2)
        tl.store(out_ptr + b, tl.where(tl.load(floats_ptr + b) == 0.0, greedy, drawn).to(tl.int32))

    @triton.jit
    def _uniform(ints_ptr, istride, b):
        """u = (hash(seed, offset) + 0.5) / 2**32, as `uniform_from_hash` (rows 1 and 2 of the ints)."""
        seed, offset = tl.load(ints_ptr + istride + b), tl.load(ints_ptr + 2 * istride + b)
        h = _mix32(_absorb(_absorb(tl.full([], 0x9E3779B9, tl.uint32), seed), offset))
        return (h.to(tl.float64) + 0.5) * (1.0 / 4294967296.0)

    @triton.jit
    def _greedy(max_ptr, arg_ptr, b, NB, V, NB_POW2: tl.constexpr):
        """The row's first argmax from its blocks' maxima and argmaxima."""
        blocks = tl.arange(0, NB_POW2)
        tops = tl.load(max_ptr + b * NB + blocks, mask=blocks < NB, other=float("-inf"))
        args = tl.load(arg_ptr + b * NB + blocks, mask=blocks < NB, other=0)
        return tl.minimum(tl.min(tl.where(tops == tl.max(tops, axis=0), args, V), axis=0), V - 1)

    @triton.jit
    def _pivots(lo, hi, PIVOTS: tl.constexpr, PIVOTS_POW2: tl.constexpr):
        """PIVOTS thresholds spread over (lo, hi], increasing (the padding repeats lo)."""
        js = tl.arange(0, PIVOTS_POW2)
        return tl.where(js < PIVOTS, lo + ((hi - lo) * (js + 1)) // (PIVOTS + 1), lo)

    @triton.jit
    def _bounds(bounds_ptr, b, FIRST: tl.constexpr):
        """The interval (lo, hi] left to search: every weight at first (-1 keeps nothing: min-p's
        threshold is >= 0)."""
        if FIRST:
            return tl.full([], -1, tl.int64), tl.full([], _TOP_WEIGHT, tl.int64)
        return tl.load(bounds_ptr + 2 * b), tl.load(bounds_ptr + 2 * b + 1)

    @triton.jit
    def _search_block_kernel(
        logits_ptr, stride, V, max_ptr, floats_ptr, bounds_ptr, cnt_ptr, sum_ptr, NB, FIRST: tl.constexpr,
        BLOCK: tl.constexpr, NB_POW2: tl.constexpr, PIVOTS: tl.constexpr, PIVOTS_POW2: tl.constexpr,
    ):  # fmt: skip
        """Per block and threshold q of this pass: the count and weight of the block's tokens above q."""
        b, nb = tl.program_id(0).to(tl.int64), tl.program_id(1)
        lo, hi = _bounds(bounds_ptr, b, FIRST)
        if hi - lo > 1:  # (else the row's search is over)
            cols = nb * BLOCK + tl.arange(0, BLOCK)
            x = tl.load(logits_ptr + b * stride + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            w = _weights(x, _row_max(max_ptr, b, NB, NB_POW2), _temperature(floats_ptr, b))
            w = tl.where(cols < V, w, -1)
            # the tokens above hi are above every threshold: counted once; the loop sees the rest
            top = w > hi
            inner = tl.where(top, -1, w)
            heaviest = tl.max(inner, axis=0)
            js = tl.arange(0, PIVOTS_POW2)
            count = tl.full([PIVOTS_POW2], tl.sum(top.to(tl.int32), axis=0), tl.int32)
            weight = tl.full([PIVOTS_POW2], tl.sum(tl.where(top, w, 0), axis=0), tl.int64)
            # thresholds from the least up, while some token of the interval is above (few are, past
            # the first passes)
            j = 0
            q = lo + (hi - lo) // (PIVOTS + 1)
            while (j < PIVOTS) & (q < heaviest):
                above = inner > q
                count += tl.where(js == j, tl.sum(above.to(tl.int32), axis=0), 0)
                weight += tl.where(js == j, tl.sum(tl.where(above, inner, 0), axis=0), 0)
                j += 1
                q = lo + ((hi - lo) * (j + 1)) // (PIVOTS + 1)
            at = (b * NB + nb) * PIVOTS_POW2 + tl.arange(0, PIVOTS_POW2)
            tl.store(cnt_ptr + at, count)
            tl.store(sum_ptr + at, weight)

    @triton.jit
    def _keeps(count, weight, q, top_k, limit, min_weight):
        """Whether a token of weight q with `count` heavier tokens of total `weight` before it is kept."""
        by_p = (weight.to(tl.float64) < limit) | (count == 0)
        return (count < top_k) & by_p & (q.to(tl.float64) >= min_weight)

    @triton.jit
    def _filters(floats_ptr, ints_ptr, wsum_ptr, b, NB, fstride, NB_POW2: tl.constexpr):
        """The row's top_k, top-p's limit (top_p times its total weight; infinite for top_p >= 1) and
        min-p's least weight, in float64 as `keep_mask` computes them (the heaviest token weighs
        2**WEIGHT_BITS)."""
        blocks = tl.arange(0, NB_POW2)
        total = tl.sum(tl.load(wsum_ptr + b * NB + blocks, mask=blocks < NB, other=0), axis=0)
        top_p = tl.load(floats_ptr + fstride + b)
        limit = tl.where(top_p >= 1.0, float("inf"), top_p.to(tl.float64) * total.to(tl.float64))
        min_weight = tl.load(floats_ptr + 2 * fstride + b).to(tl.float64) * _WEIGHT_SCALE
        return tl.load(ints_ptr + b), limit, min_weight

    @triton.jit
    def _search_row_kernel(
        floats_ptr, fstride, ints_ptr, wsum_ptr, bounds_ptr, cnt_ptr, sum_ptr, NB, FIRST: tl.constexpr,
        NB_POW2: tl.constexpr, PIVOTS: tl.constexpr, PIVOTS_POW2: tl.constexpr,
    ):  # fmt: skip
        """Per row: the blocks' counts and weights added at each threshold, the interval narrowed to the
        last threshold that keeps nothing and the first that keeps a token."""
        b = tl.program_id(0).to(tl.int64)
        lo, hi = _bounds(bounds_ptr, b, FIRST)
        if hi - lo > 1:
            q = _pivots(lo, hi, PIVOTS, PIVOTS_POW2)
            at = (b * NB + tl.arange(0, NB_POW2))[:, None] * PIVOTS_POW2 + tl.arange(0, PIVOTS_POW2)[None, :]
            live = (tl.arange(0, NB_POW2) < NB)[:, None]
            count = tl.sum(tl.load(cnt_ptr + at, mask=live, other=0).to(tl.int64), axis=0)
            weight = tl.sum(tl.load(sum_ptr + at, mask=live, other=0), axis=0)
            top_k, limit, min_weight = _filters(floats_ptr, ints_ptr, wsum_ptr, b, NB, fstride, NB_POW2)
            # (the padding past PIVOTS is no threshold: its q is lo, with nothing counted above it)
            keeps = _keeps(count, weight, q, top_k, limit, min_weight) & (tl.arange(0, PIVOTS_POW2) < PIVOTS)
            new_hi = tl.min(tl.where(keeps, q, hi), axis=0)
            new_lo = tl.max(tl.where(keeps | (q >= new_hi), lo, q), axis=0)
            tl.store(bounds_ptr + 2 * b, new_lo)
            tl.store(bounds_ptr + 2 * b + 1, new_hi)

    @triton.jit
    def _least_kept_kernel(
        logits_ptr, stride, V, max_ptr, floats_ptr, bounds_ptr, least_ptr, NB, BLOCK: tl.constexpr,
        NB_POW2: tl.constexpr,
    ):  # fmt: skip
        """Per block: its least weight at or above the threshold found (the kept weights' least
        candidate; 2**62 where none)."""
        b, nb = tl.program_id(0).to(tl.int64), tl.program_id(1)
        u = tl.load(bounds_ptr + 2 * b + 1)
        cols = nb * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(logits_ptr + b * stride + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        w = _weights(x, _row_max(max_ptr, b, NB, NB_POW2), _temperature(floats_ptr, b))
        tl.store(least_ptr + b * NB + nb, tl.min(tl.where((w >= u) & (cols < V), w, 2**62), axis=0))

    @triton.jit
    def _tie_block_kernel(
        logits_ptr, stride, V, max_ptr, floats_ptr, least_ptr, gt_sum_ptr, gt_cnt_ptr, tie_ptr, NB,
        BLOCK: tl.constexpr, NB_POW2: tl.constexpr,
    ):  # fmt: skip
        """Per block, against the least kept weight v: the weight and count of its tokens above v, and
        how many weigh exactly v."""
        b, nb = tl.program_id(0).to(tl.int64), tl.program_id(1)
        blocks = tl.arange(0, NB_POW2)
        v = tl.min(tl.load(least_ptr + b * NB + blocks, mask=blocks < NB, other=2**62), axis=0)
        cols = nb * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(logits_ptr + b * stride + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        w = _weights(x, _row_max(max_ptr, b, NB, NB_POW2), _temperature(floats_ptr, b))
        w = tl.where(cols < V, w, 0)
        tl.store(gt_sum_ptr + b * NB + nb, tl.sum(tl.where(w > v, w, 0), axis=0))
        tl.store(gt_cnt_ptr + b * NB + nb, tl.sum((w > v).to(tl.int32), axis=0))
        tl.store(tie_ptr + b * NB + nb, tl.sum(((w == v) & (cols < V)).to(tl.int32), axis=0))

    @triton.jit
    def _filtered_pick_kernel(
        logits_ptr, stride, V, max_ptr, arg_ptr, wsum_ptr, least_ptr, gt_sum_ptr, gt_cnt_ptr, tie_ptr,
        floats_ptr, fstride, ints_ptr, istride, out_ptr, NB, BLOCK: tl.constexpr, NB_POW2: tl.constexpr,
    ):  # fmt: skip
        """Per row: how many of the tokens of the least kept weight v are kept (the first by id), the
        target in the kept weights' total, its block and its token."""
        b = tl.program_id(0).to(tl.int64)
        blocks = tl.arange(0, NB_POW2)
        live = blocks < NB
        v = tl.min(tl.load(least_ptr + b * NB + blocks, mask=live, other=2**62), axis=0)
        gt_sums = tl.load(gt_sum_ptr + b * NB + blocks, mask=live, other=0)
        ties = tl.load(tie_ptr + b * NB + blocks, mask=live, other=0).to(tl.int64)
        count = tl.sum(tl.load(gt_cnt_ptr + b * NB + blocks, mask=live, other=0).to(tl.int64), axis=0)
        weight = tl.sum(gt_sums, axis=0)
        top_k, limit, min_weight = _filters(floats_ptr, ints_ptr, wsum_ptr, b, NB, fstride, NB_POW2)
        # the most ties n kept: the n-th (0-based n - 1) still passes; the first always does
        lo, hi = tl.full([], 1, tl.int64), tl.sum(ties, axis=0)
        for _ in range(21):  # (2**21 > any vocabulary's ties)
            mid = (lo + hi + 1) // 2
            ok = _keeps(count + mid - 1, weight + (mid - 1) * v, v, top_k, limit, min_weight)
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid - 1)
        kept_ties = tl.where(v > 0, lo, 0)  # (weightless ties change no sum)
        ties_before = tl.cumsum(ties, axis=0) - ties
        sums = gt_sums + tl.minimum(tl.maximum(kept_ties - ties_before, 0), ties) * v
        cdf = tl.cumsum(sums, axis=0)
        target = tl.floor(_uniform(ints_ptr, istride, b) * tl.sum(sums, axis=0).to(tl.float64)).to(tl.int64)
        block = tl.minimum(tl.sum((cdf <= target).to(tl.int32), axis=0), NB - 1)
        before = tl.sum(tl.where(blocks == block, cdf - sums, 0), axis=0)
        ties_left = kept_ties - tl.sum(tl.where(blocks == block, ties_before, 0), axis=0)
        cols = block * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(logits_ptr + b * stride + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        w = _weights(x, _row_max(max_ptr, b, NB, NB_POW2), _temperature(floats_ptr, b))
        tie = (w == v) & (cols < V)
        kept = (w > v) | (tie & (tl.cumsum(tie.to(tl.int32), axis=0) <= ties_left))
        local = tl.cumsum(tl.where(kept, w, 0), axis=0)
        drawn = tl.minimum(block * BLOCK + tl.sum((local <= target - before).to(tl.int32), axis=0), V - 1)
        greedy = _greedy(max_ptr, arg_ptr, b, NB, V, NB_POW2)
        tl.store(out_ptr + b, tl.where(tl.load(floats_ptr + b) == 0.0, greedy, drawn).to(tl.int32))


def _weigh_blocks(
    logits: torch.Tensor, floats: torch.Tensor, ints: torch.Tensor
) -> tuple[torch.Tensor, tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor] | None]:
    """Both draws' start: the arguments checked, the tokens' buffer, and (kernels 1 and 2) the block
    count, its power of two and the blocks' maxima, argmaxima and weight totals; None for an empty
    batch."""
    if logits.stride(1) != 1 or floats.stride(1) != 1 or ints.stride(1) != 1:
        raise ValueError(
            f"rows must be contiguous, got strides {logits.stride()}, {floats.stride()}, {ints.stride()}"
        )
    batch, vocab = logits.shape
    out = torch.empty(batch, dtype=torch.int32, device=logits.device)
    if batch == 0:
        return out, None
    nb = triton.cdiv(vocab, BLOCK)
    nb_pow2 = max(triton.next_power_of_2(nb), 2)
    tops = torch.empty(batch, nb, dtype=torch.float32, device=logits.device)
    args = torch.empty(batch, nb, dtype=torch.int32, device=logits.device)
    sums = torch.empty(batch, nb, dtype=torch.int64, device=logits.device)
    stride = logits.stride(0)
    _block_max_kernel[(batch, nb)](logits, stride, vocab, tops, args, nb, BLOCK=BLOCK)
    _block_weight_kernel[(batch, nb)](
        logits, stride, vocab, tops, floats, sums, nb, BLOCK=BLOCK, NB_POW2=nb_pow2
    )
    return out, (nb, nb_pow2, tops, args, sums)


def draw_unfiltered(logits: torch.Tensor, floats: torch.Tensor, ints: torch.Tensor) -> torch.Tensor:
    """Next tokens, int32 (B,), of ``logits`` (B, V) (rows contiguous) for the arguments of
    `BatchSamplingArgs` (``floats`` (3, B) float32, ``ints`` (3, B) int64), without the
    top-k / top-p / min-p filters: `sample_rows(logits, floats, ints, False)`'s tokens (see the module
    docstring). No host sync; capturable in a CUDA graph."""
    out, blocks = _weigh_blocks(logits, floats, ints)
    if blocks is None:
        return out
    nb, nb_pow2, tops, args, sums = blocks
    (batch, vocab), stride, istride = logits.shape, logits.stride(0), ints.stride(0)
    _pick_kernel[(batch,)](
        logits, stride, vocab, tops, args, sums, floats, ints, istride, out, nb, BLOCK=BLOCK, NB_POW2=nb_pow2
    )  # fmt: skip
    return out


def draw_filtered(logits: torch.Tensor, floats: torch.Tensor, ints: torch.Tensor) -> torch.Tensor:
    """`draw_unfiltered` with the top-k / top-p / min-p filters of each row's arguments:
    `sample_rows(logits, floats, ints, True)`'s tokens, by the threshold search of the module docstring
    (`SEARCH_PASSES` passes of two kernels, then four). No host sync; capturable in a CUDA graph."""
    out, blocks = _weigh_blocks(logits, floats, ints)
    if blocks is None:
        return out
    nb, nb_pow2, tops, args, sums = blocks
    batch, vocab = logits.shape
    pivots_pow2 = triton.next_power_of_2(PIVOTS + 1)
    device, stride, fstride, istride = logits.device, logits.stride(0), floats.stride(0), ints.stride(0)
    bounds = torch.empty(batch, 2, dtype=torch.int64, device=device)
    counts = torch.empty(batch, nb, pivots_pow2, dtype=torch.int32, device=device)
    weights = torch.empty(batch, nb, pivots_pow2, dtype=torch.int64, device=device)
    least, gt_sums = torch.empty_like(sums), torch.empty_like(sums)
    gt_counts, ties = torch.empty_like(args), torch.empty_like(args)
    search = dict(NB_POW2=nb_pow2, PIVOTS=PIVOTS, PIVOTS_POW2=pivots_pow2)
    for i in range(SEARCH_PASSES):
        _search_block_kernel[(batch, nb)](
            logits, stride, vocab, tops, floats, bounds, counts, weights, nb, FIRST=i == 0, BLOCK=BLOCK,
            **search,
        )  # fmt: skip
        _search_row_kernel[(batch,)](
            floats, fstride, ints, sums, bounds, counts, weights, nb, FIRST=i == 0, **search
        )
    _least_kept_kernel[(batch, nb)](
        logits, stride, vocab, tops, floats, bounds, least, nb, BLOCK=BLOCK, NB_POW2=nb_pow2
    )
    _tie_block_kernel[(batch, nb)](
        logits, stride, vocab, tops, floats, least, gt_sums, gt_counts, ties, nb, BLOCK=BLOCK, NB_POW2=nb_pow2
    )
    _filtered_pick_kernel[(batch,)](
        logits, stride, vocab, tops, args, sums, least, gt_sums, gt_counts, ties, floats, fstride, ints,
        istride, out, nb, BLOCK=BLOCK, NB_POW2=nb_pow2,
    )  # fmt: skip
    return out
