"""Token sampling: greedy, temperature, top-k / top-p / min-p, with counter-based (seedable) randomness.

A sampled token is drawn by inverse transform: with ``u`` uniform in (0, 1), the token is the first one
(in vocabulary order) at which the cumulative sum of the filtered probabilities exceeds ``u`` times their
total: an exact draw from the filtered, renormalised softmax. ``u`` does not come from torch's global RNG:
it is a hash of ``(seed, offset)``, so a row's draw depends only on its own logits, parameters, seed and
offset, never on the other rows of the batch. One hash per row keeps sampling cheap on large vocabularies;
the hash needs only host values, so it runs on the host while the arguments are prepared (some fifty tiny
integer ops that would otherwise each be a kernel launch per step) and ``u`` travels with them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minisgl.core import Batch, Req

# top_k value stored for requests without a top-k limit (larger than any vocabulary)
TOP_K_ALL = 2**62

_MASK32 = 0xFFFFFFFF

# tokens per block of the two-level inverse-transform search (see inverse_transform)
SAMPLE_BLOCK = 1024
# False: one float64 cumsum over the whole vocabulary instead (ablation)
TWO_LEVEL = True

# seeds for requests without one, when from_reqs is given no generator
_default_rng = random.Random()


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


def inverse_transform(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row, the first token whose cumulative probability exceeds ``u * total``: int64 (B,).

    ``probs`` is (B, V), non-negative with a positive total per row; ``uniforms`` is float64 (B,) in
    (0, 1). The search runs in two levels so that no scan covers the whole vocabulary (with one float64
    cumsum over Qwen3's 151,936 tokens, sampling added about 1.5 ms to a decode step at batch 256 on the
    H200, and torch.compile could not take that scan): the
    float64 sums of blocks of ``SAMPLE_BLOCK`` tokens locate the block, one cumulative sum inside that
    block locates the token. Every partial sum is accumulated in float64. A width that is not a
    multiple of ``SAMPLE_BLOCK`` is padded with zeros (a copy: `Sampler` builds its probabilities
    padded already).
    """
    batch, width = probs.shape
    if width % SAMPLE_BLOCK:
        probs = F.pad(probs, (0, SAMPLE_BLOCK - width % SAMPLE_BLOCK))
    sums = probs.view(batch, -1, SAMPLE_BLOCK).sum(-1, dtype=torch.float64)
    # cdf[:, j]: the mass of the blocks before block j (cdf[:, 0] = 0, cdf[:, -1] = the total)
    cdf = F.pad(sums, (1, 0)).cumsum_(dim=-1)
    target = (uniforms * cdf[:, -1])[:, None]
    # block (B, 1): cdf[block] <= target < cdf[block + 1]
    block = torch.searchsorted(cdf, target, right=True).sub_(1)
    target = target - cdf.gather(1, block)
    cols = block * SAMPLE_BLOCK + torch.arange(SAMPLE_BLOCK, device=probs.device)
    local_cdf = probs.gather(1, cols).double().cumsum_(dim=-1)
    # the block sum and the in-block cumsum may round apart: keep the target below the block's last
    # cumulative value, so the search lands on a token of the block (one of non-zero probability)
    target = torch.minimum(target, torch.nextafter(local_cdf[:, -1:], torch.zeros_like(target)))
    return cols.gather(1, torch.searchsorted(local_cdf, target, right=True)).squeeze(1)


@dataclass
class BatchSamplingArgs:
    """Per-request sampling parameters of one batch, as tensors on the device.

    The tensors are (B,): ``temperatures`` float32 (0 = greedy), ``top_k`` int64 (``TOP_K_ALL`` when
    unlimited), ``top_p`` float32, ``min_p`` float32 and ``uniforms`` float64, the row's ``u`` (on the
    device); ``seeds`` int64 (a fresh random seed for requests without one) and ``offsets`` int64 (the
    position of the token being sampled, ``req.device_len``) stay on the host: ``u`` is
    ``uniform_from_hash(seeds, offsets)``. They are None when every request is greedy. ``all_greedy`` and ``need_filter`` (some sampled request
    uses top-k, top-p or min-p) are host booleans, so ``Sampler.sample`` can pick its path without a
    device sync.
    """

    all_greedy: bool
    need_filter: bool
    temperatures: torch.Tensor | None = None
    top_k: torch.Tensor | None = None
    top_p: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    seeds: torch.Tensor | None = None
    offsets: torch.Tensor | None = None
    uniforms: torch.Tensor | None = None
    # (B, K) int64 token ids that must not be drawn (e.g. EOS before min_tokens), padded with vocab_size
    suppress: torch.Tensor | None = None

    @classmethod
    def from_reqs(
        cls, reqs: list[Req], device: torch.device, rng: random.Random | None = None
    ) -> BatchSamplingArgs:
        """Builds the arguments on the host and copies them to ``device`` without blocking.

        Requests without a seed draw a new 63-bit seed from ``rng`` (default: a module-level
        ``random.Random``) on every call, so their tokens vary between steps and runs.
        """
        params = [req.sampling_params for req in reqs]
        if all(p.is_greedy for p in params):
            return cls(all_greedy=True, need_filter=False)
        rng = rng if rng is not None else _default_rng
        need_filter = any(not p.is_greedy and (p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0) for p in params)
        pin = device.type == "cuda"
        floats = torch.tensor(
            [
                [p.temperature for p in params],
                [p.top_p for p in params],
                [p.min_p for p in params],
            ],
            dtype=torch.float32,
            pin_memory=pin,
        )
        top_k = torch.tensor(
            [p.top_k if p.top_k > 0 else TOP_K_ALL for p in params], dtype=torch.int64, pin_memory=pin
        )
        seeds = torch.tensor([p.seed if p.seed is not None else rng.getrandbits(63) for p in params])
        offsets = torch.tensor([req.device_len for req in reqs], dtype=torch.int64)
        uniforms = uniform_from_hash(seeds, offsets)  # on the host: integer math, exact anywhere
        if pin:
            uniforms = uniforms.pin_memory()
        floats = floats.to(device, non_blocking=True)
        return cls(
            all_greedy=False,
            need_filter=need_filter,
            temperatures=floats[0],
            top_p=floats[1],
            min_p=floats[2],
            top_k=top_k.to(device, non_blocking=True),
            seeds=seeds,
            offsets=offsets,
            uniforms=uniforms.to(device, non_blocking=True),
        )


class Sampler:
    """Turns the last-position logits of a batch into next tokens (see the module docstring)."""

    def __init__(self, device: torch.device, vocab_size: int) -> None:
        self.device = device
        self.vocab_size = vocab_size
        self._rng = random.Random()

    def prepare(self, batch: Batch) -> BatchSamplingArgs:
        """The sampling arguments of ``batch``; call it before the forward so the copy overlaps."""
        return BatchSamplingArgs.from_reqs(batch.reqs, self.device, self._rng)

    def sample(self, logits: torch.Tensor, args: BatchSamplingArgs) -> torch.Tensor:
        """Next token ids, int32 of shape (B,), on the device of ``logits``.

        ``logits`` is (B, V) with V >= ``vocab_size``; columns past ``vocab_size`` (padding) are
        ignored. Rows with temperature 0 take the argmax of the logits. The other rows draw from
        ``softmax(logits / T)`` restricted to the tokens that every active filter keeps, each filter
        judged on that unfiltered softmax: top-k keeps the k most likely tokens; top-p keeps a token
        if the probability of the tokens sorted before it (descending, stable sort, so ties go to
        the lower token id) sums to less than ``top_p`` (so the most likely token is always kept);
        min-p keeps tokens with ``p >= min_p * max(p)``. Nothing here syncs with the host.
        """
        if logits.dim() != 2 or logits.shape[1] < self.vocab_size:
            raise ValueError(
                f"logits must be (batch, >= vocab_size={self.vocab_size}), got shape {tuple(logits.shape)}"
            )
        logits = logits[:, : self.vocab_size]
        if args.suppress is not None:  # an extra column takes the padding entries
            logits = torch.cat([logits, logits.new_zeros(logits.shape[0], 1)], dim=1)
            logits = logits.scatter_(1, args.suppress, float("-inf"))[:, : self.vocab_size]
        greedy_tokens = logits.argmax(dim=-1)
        if args.all_greedy:
            return greedy_tokens.to(torch.int32)
        assert args.temperatures is not None and args.uniforms is not None
        is_greedy = args.temperatures == 0
        temps = torch.where(is_greedy, torch.ones_like(args.temperatures), args.temperatures)
        if TWO_LEVEL:  # softmax into a buffer padded to whole blocks: -inf logits, zero probabilities
            vocab, width = self.vocab_size, -(-self.vocab_size // SAMPLE_BLOCK) * SAMPLE_BLOCK
            scaled = logits.new_empty((logits.shape[0], width), dtype=torch.float32)
            scaled[:, vocab:].fill_(float("-inf"))
            torch.div(logits, temps[:, None], out=scaled[:, :vocab])
            probs = torch.softmax(scaled, dim=-1)
            if args.need_filter:
                probs[:, :vocab] *= self._keep_mask(probs[:, :vocab], args)
            sampled = inverse_transform(probs, args.uniforms)
        else:
            probs = torch.softmax(logits.float() / temps[:, None], dim=-1)
            if args.need_filter:
                probs = probs * self._keep_mask(probs, args)
            cdf = probs.double().cumsum(dim=-1)
            target = (args.uniforms * cdf[:, -1])[:, None]
            sampled = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=self.vocab_size - 1)
        return torch.where(is_greedy, greedy_tokens, sampled).to(torch.int32)

    @staticmethod
    def _keep_mask(probs: torch.Tensor, args: BatchSamplingArgs) -> torch.Tensor:
        """Boolean (B, V): the tokens that top-k, top-p and min-p all keep."""
        assert args.top_k is not None and args.top_p is not None and args.min_p is not None
        probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        rank = torch.arange(probs.shape[1], device=probs.device)[None, :]
        keep = rank < args.top_k[:, None]
        # probability mass strictly before each token; float64 so long tails add up accurately
        mass_before = probs.double().cumsum(dim=-1) - probs.double()
        keep &= (mass_before < args.top_p[:, None]) | (args.top_p[:, None] >= 1.0)
        keep &= probs >= args.min_p[:, None] * probs[:, :1]
        return torch.zeros_like(keep).scatter_(1, order, keep)
