"""The structured-output token mask as the sampler applies it: one packed bit per vocabulary token.

The scheduler fills the mask on the host (`minisgl.scheduler.grammar`), one row per request of the batch:
bit ``t % 32`` of int32 word ``t // 32`` is set when token ``t`` may be drawn (xgrammar's bitmask
layout); a row of a request without a grammar has every bit set. The sampler applies it to the logits
first (`Sampler.sample`), so that logit_bias, the penalties, min_tokens and top-k / top-p / min-p all
see the masked distribution. Only batches with a constrained request carry one: the others pay nothing.
"""

from __future__ import annotations

import torch

BITS = 32  # tokens per int32 word of a mask row


def mask_words(vocab_size: int) -> int:
    """int32 words of one mask row for a vocabulary of `vocab_size` tokens."""
    return -(-vocab_size // BITS)


def unpack_mask(mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Boolean (B, vocab_size): the tokens each packed (B, words) int32 row allows."""
    shifts = torch.arange(BITS, dtype=torch.int32, device=mask.device)
    allowed = ((mask[:, :, None] >> shifts) & 1).bool()  # an arithmetic shift: & 1 keeps bit i alone
    return allowed.flatten(1)[:, :vocab_size]


def apply_token_mask(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``logits`` (B, V) with the tokens each row's packed mask (B, >= ceil(V / 32)) int32 does not
    allow set to -inf (a new tensor; nothing syncs with the host)."""
    allowed = unpack_mask(mask, logits.shape[1])
    return logits.masked_fill(~allowed, float("-inf"))
