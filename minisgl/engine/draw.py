"""The draw math of the sampler: integer token weights, the top-k / top-p / min-p filters, a counter-based
hash RNG, and `sample_rows`, the whole sampled path (the function `Sampler` compiles on CUDA).

A token is drawn by inverse transform over integer weights (fixed-point softmax numerators) with a uniform
that hashes (seed, position): integer sums do not depend on the order of the additions, so a request's
token depends only on its own logits, parameters, seed and position, in any batch and on any device.
Details: docs/gpu.md#the-sampler.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minisgl.compile import mark_unbacked
from minisgl.kernels.draw import WEIGHT_BITS

# top_k value stored for requests without a top-k limit (larger than any vocabulary)
TOP_K_ALL = 2**62

_MASK32 = 0xFFFFFFFF

# tokens per block of the two-level search and cumulative sums (no scan is longer than this)
SAMPLE_BLOCK = 1024


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(x * c) mod 2**32`` for int64 ``x`` in [0, 2**32) and a 32-bit constant ``c``.

    A constant of 2**31 or more is replaced by ``c - 2**32`` (the same residue mod 2**32), so the int64
    product stays inside (-2**63, 2**63): nothing overflows, and the mask takes the residue exactly.
    """
    return (x * (c if c < 2**31 else c - 2**32)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """The "lowbias32" integer finaliser (xorshift-multiply rounds, a bijection on 32-bit values).

    ``x`` is int64 with values in [0, 2**32); so is the result. Values stay non-negative, so the
    right shifts are logical shifts.
    """
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    x = x ^ (x >> 16)
    return x


def _absorb(h: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Chains a non-negative int64 ``value`` (both 32-bit halves) into the 32-bit hash state ``h``."""
    h = _mix32(h ^ (value & _MASK32))
    return _mix32(h ^ ((value >> 32) & _MASK32))


def uniform_from_hash(seeds: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """One uniform number in (0, 1) per row, float64, a pure function of (seed, offset).

    ``seeds`` and ``offsets`` are int64 (B,) tensors with non-negative values; the row's 32-bit state is
    the chained hash of both, mixed once more, and ``u = (k + 0.5) / 2**32`` (never 0 or 1).
    """
    h = torch.full_like(seeds, 0x9E3779B9)
    h = _mix32(_absorb(_absorb(h, seeds), offsets))
    return h.to(torch.float64).add_(0.5).mul_(1.0 / 2**32)


def token_weights(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """int64 (B, V): ``round(exp((logit - max) / T) * 2**WEIGHT_BITS)`` per row; ``T`` > 0 (B,) float32.

    The top token weighs ``2**WEIGHT_BITS``; -inf logits (suppressed tokens) weigh 0.
    """
    logits = logits.float()
    top = logits.amax(dim=-1, keepdim=True)
    weights = torch.exp((logits - top) / temperatures[:, None]) * float(2**WEIGHT_BITS)
    return torch.round(weights).to(torch.int64)


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """(B, V) -> (B, ceil(V / SAMPLE_BLOCK), SAMPLE_BLOCK), padded with zeros."""
    batch, width = x.shape
    if width % SAMPLE_BLOCK:
        x = F.pad(x, (0, SAMPLE_BLOCK - width % SAMPLE_BLOCK))
    return x.view(batch, -1, SAMPLE_BLOCK)


def blocked_cumsum(x: torch.Tensor) -> torch.Tensor:
    """The inclusive cumulative sum of int64 (B, V) along V, as cumulative sums inside blocks of
    ``SAMPLE_BLOCK`` plus the sums of the blocks before: integers, so equal to one long scan (which
    inductor cannot split on a 151,936-wide row)."""
    blocks = _blocks(x)
    inner = blocks.cumsum(dim=-1)
    before = inner[:, :, -1].cumsum(dim=-1) - inner[:, :, -1]
    return (inner + before[:, :, None]).flatten(1)[:, : x.shape[1]]


def draw(weights: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per row, the first token whose inclusive cumulative weight exceeds the target: int64 (B,).

    ``weights`` is int64 (B, V), non-negative; ``targets`` int64 (B,) in [0, row total). Two levels, so no
    scan covers the whole vocabulary: the cumulative sums of the block totals locate the block (the
    number of blocks whose cumulative total is <= target), one cumulative sum inside that block locates
    the token. Tokens of weight 0 are never drawn; a row that weighs 0 in all (NaN logits) still gets an
    id inside the vocabulary.
    """
    blocks = _blocks(weights)
    cdf = blocks.sum(dim=-1).cumsum(dim=-1)
    # clamped: a row of zero weights (NaN logits) must not index past the vocabulary
    block = (cdf <= targets[:, None]).sum(dim=-1, keepdim=True).clamp_(max=cdf.shape[1] - 1)
    local = blocks.gather(1, block[:, :, None].expand(-1, -1, SAMPLE_BLOCK)).squeeze(1)
    local_target = targets[:, None] - (cdf.gather(1, block) - local.sum(dim=-1, keepdim=True))
    token = (local.cumsum(dim=-1) <= local_target).sum(dim=-1, keepdim=True)
    return (block * SAMPLE_BLOCK + token).squeeze(1).clamp_(max=weights.shape[1] - 1)


def keep_mask(
    weights: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Boolean (B, V): the tokens that top-k, top-p and min-p all keep, judged on the unfiltered weights.

    Top-k keeps the k heaviest tokens; top-p keeps a token if the weight of the tokens sorted before it
    (descending, stable sort, so ties go to the lower token id) is below ``top_p`` times the total (so
    the heaviest token is always kept); min-p keeps tokens of weight >= ``min_p`` times the heaviest.
    """
    ordered, order = torch.sort(weights, dim=-1, descending=True, stable=True)
    rank = torch.arange(weights.shape[1], device=weights.device)[None, :]
    keep = rank < top_k[:, None]
    before = (blocked_cumsum(ordered) - ordered).double()
    total = ordered.sum(dim=-1, keepdim=True).double()
    # the heaviest token always stays, however small top_p is (1e-50 is 0 in float32)
    keep &= (before < top_p.double()[:, None] * total) | (top_p[:, None] >= 1.0) | (rank == 0)
    keep &= ordered.double() >= min_p.double()[:, None] * ordered[:, :1].double()
    return torch.zeros_like(keep).scatter_(1, order, keep)


def mark_batch_unbacked(logits: torch.Tensor, floats: torch.Tensor, ints: torch.Tensor) -> None:
    """Marks the batch dimension of `sample_rows`' arguments unbacked before a compiled call: dynamo
    then compiles one graph for every batch size, one row included (a dynamic but backed size would get
    a graph of its own at 1)."""
    for tensor, dim in ((logits, 0), (floats, 1), (ints, 1)):
        mark_unbacked(tensor, dim)


def sample_rows(
    logits: torch.Tensor, floats: torch.Tensor, ints: torch.Tensor, need_filter: bool
) -> torch.Tensor:
    """Next tokens, int32 (B,), of logits (B, V) for the arguments of `BatchSamplingArgs`: ``floats``
    (3, B) float32 = temperature, top_p, min_p; ``ints`` (3, B) int64 = top_k, seed, offset. Rows with
    temperature 0 take the argmax. The function `Sampler` compiles on CUDA."""
    temperatures, top_p, min_p = floats.unbind(0)
    top_k, seeds, offsets = ints.unbind(0)
    greedy = logits.argmax(dim=-1)
    is_greedy = temperatures == 0
    weights = token_weights(logits, torch.where(is_greedy, torch.ones_like(temperatures), temperatures))
    if need_filter:
        weights = weights * keep_mask(weights, top_k, top_p, min_p)
    total = weights.sum(dim=-1)
    # u <= 1 - 2**-33 and total >= 1, so the target stays below the total
    targets = (uniform_from_hash(seeds, offsets) * total.double()).floor().to(torch.int64)
    return torch.where(is_greedy, greedy, draw(weights, targets)).to(torch.int32)
