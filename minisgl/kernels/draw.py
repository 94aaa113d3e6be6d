"""The sampler's draw without filters (temperature only, greedy rows mixed in) as three Triton kernels:
the same tokens as `minisgl.engine.draw.sample_rows` with ``need_filter=False``, in fewer passes.

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
and compiled runs of `sample_rows` itself. docs/gpu.md#the-sampler.
"""

from __future__ import annotations

import torch

from minisgl.kernels.decode_attention import triton

# fixed point of the token weights (`minisgl.engine.draw` and these kernels): the most likely token weighs
# 2**WEIGHT_BITS; a vocabulary of up to 2**21 tokens sums to less than 2**62
WEIGHT_BITS = 40
# tokens per program of the block passes
BLOCK = 2048
# False on CPU-only installs without Triton (the sampler then runs `sample_rows`)
AVAILABLE = triton is not None

if triton is not None:
    import triton.language as tl

    _WEIGHT_SCALE = tl.constexpr(float(2**WEIGHT_BITS))  # (a kernel reads only constexpr globals)

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
        tops = tl.load(max_ptr + b * NB + blocks, mask=blocks < NB, other=float("-inf"))
        top = tl.max(tops, axis=0)
        args = tl.load(arg_ptr + b * NB + blocks, mask=blocks < NB, other=0)
        greedy = tl.min(tl.where(tops == top, args, V), axis=0)
        sums = tl.load(sum_ptr + b * NB + blocks, mask=blocks < NB, other=0)
        cdf = tl.cumsum(sums, axis=0)
        total = tl.sum(sums, axis=0)
        # u = (hash(seed, offset) + 0.5) / 2**32, as `uniform_from_hash`; u < 1 and total >= 1 keep the
        # target below the total
        seed, offset = tl.load(ints_ptr + istride + b), tl.load(ints_ptr + 2 * istride + b)  # rows 1, 2
        h = _mix32(_absorb(_absorb(tl.full([], 0x9E3779B9, tl.uint32), seed), offset))
        u = (h.to(tl.float64) + 0.5) * (1.0 / 4294967296.0)
        target = tl.floor(u * total.to(tl.float64)).to(tl.int64)
        block = tl.minimum(tl.sum((cdf <= target).to(tl.int32), axis=0), NB - 1)
        before = tl.sum(tl.where(blocks == block, cdf - sums, 0), axis=0)
        cols = block * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(logits_ptr + b * stride + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        local = tl.cumsum(_weights(x, top, _temperature(floats_ptr, b)), axis=0)
        drawn = tl.minimum(block * BLOCK + tl.sum((local <= target - before).to(tl.int32), axis=0), V - 1)
        token = tl.where(tl.load(floats_ptr + b) == 0.0, tl.minimum(greedy, V - 1), drawn)
        tl.store(out_ptr + b, token.to(tl.int32))


def draw_unfiltered(logits: torch.Tensor, floats: torch.Tensor, ints: torch.Tensor) -> torch.Tensor:
    """Next tokens, int32 (B,), of ``logits`` (B, V) (rows contiguous) for the arguments of
    `BatchSamplingArgs` (``floats`` (3, B) float32, ``ints`` (3, B) int64), without the
    top-k / top-p / min-p filters: `sample_rows(logits, floats, ints, False)`'s tokens (see the module
    docstring). No host sync; capturable in a CUDA graph."""
    batch, vocab = logits.shape
    if logits.stride(1) != 1 or floats.stride(1) != 1 or ints.stride(1) != 1:
        raise ValueError(
            f"rows must be contiguous, got strides {logits.stride()}, {floats.stride()}, {ints.stride()}"
        )
    nb = triton.cdiv(vocab, BLOCK)
    nb_pow2 = max(triton.next_power_of_2(nb), 2)
    tops = torch.empty(batch, nb, dtype=torch.float32, device=logits.device)
    args = torch.empty(batch, nb, dtype=torch.int32, device=logits.device)
    sums = torch.empty(batch, nb, dtype=torch.int64, device=logits.device)
    out = torch.empty(batch, dtype=torch.int32, device=logits.device)
    if batch == 0:
        return out
    stride = logits.stride(0)
    _block_max_kernel[(batch, nb)](logits, stride, vocab, tops, args, nb, BLOCK=BLOCK)
    _block_weight_kernel[(batch, nb)](
        logits, stride, vocab, tops, floats, sums, nb, BLOCK=BLOCK, NB_POW2=nb_pow2
    )
    istride = ints.stride(0)
    _pick_kernel[(batch,)](
        logits, stride, vocab, tops, args, sums, floats, ints, istride, out, nb, BLOCK=BLOCK, NB_POW2=nb_pow2
    )  # fmt: skip
    return out
