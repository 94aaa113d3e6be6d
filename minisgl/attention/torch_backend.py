"""Paged attention in plain PyTorch: runs on CPU and GPU, and is the reference for every other backend.

Each request's keys and values are gathered page by page from the paged pool, through its page-table
row, into a padded (batch, pages * page_size) layout; queries are padded to (batch, max_extend_len); one masked
scaled-dot-product attention call serves prefill of mixed lengths, extension of a cached prefix
(chunked prefill) and decode alike. The mask is causal and, with the model's sliding window W, also
hides the keys W or more positions behind each query (transformers' sliding-window mask), on every
layer or on the windowed ones (`AttnOptions.window_layers`: Gemma, gpt-oss). With a soft cap (Gemma 2)
the scores are computed, capped and softmaxed explicitly (scaled-dot-product attention takes no cap);
attention sinks (gpt-oss) join the softmax as one more key (`_with_sinks`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.nn.functional as F

from minisgl.attention.base import AttnOptions, BaseAttnBackend, BaseAttnMetadata
from minisgl.core import Batch
from minisgl.kvcache import MHAKVCachePool

Metadata = TypeVar("Metadata", bound=BaseAttnMetadata)


def planned(batch: Batch, kind: type[Metadata]) -> Metadata:
    """The batch's attention plan, which must be the backend's own `kind`."""
    meta = batch.attn_metadata
    assert isinstance(meta, kind), "prepare_metadata must run before attention"
    return meta


@dataclass
class TorchAttnMetadata(BaseAttnMetadata):
    page_index: torch.Tensor  # (B, max_pages) pages holding each request's tokens, in order, int64
    mask: torch.Tensor  # (B, 1, max_q, max_pages * page_size) True where a query may attend
    q_index: torch.Tensor | None  # (T,) row of each token in the padded (B * max_q) layout; None: no padding
    max_q: int
    group_mask: torch.Tensor | None = None  # `mask` repeated for the query heads sharing a KV head
    # the full layers' masks where only some layers have the window (`AttnOptions.window_layers`: Gemma,
    # gpt-oss); None: every layer's is `mask`
    full_mask: torch.Tensor | None = None
    full_group_mask: torch.Tensor | None = None


class TorchAttnBackend(BaseAttnBackend):
    def __init__(
        self,
        kv_cache: MHAKVCachePool,
        page_table: torch.Tensor,
        device: torch.device,
        sliding_window: int | None = None,
        options: AttnOptions | None = None,
    ) -> None:
        self.kv_cache, self.page_table, self.device = kv_cache, page_table, device
        self._set_sliding_window(sliding_window, options)

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":
            return host.pin_memory().to(self.device, non_blocking=True)
        return host

    def prepare_metadata(self, batch: Batch, graph_bs: int = 0) -> None:
        extend = [req.extend_len for req in batch.reqs]
        cached = torch.tensor([req.cached_len for req in batch.reqs], dtype=torch.int64)
        max_q, max_kv = max(extend), max(req.device_len for req in batch.reqs)
        num_reqs, num_tokens = len(extend), sum(extend)
        extend_t = torch.tensor(extend, dtype=torch.int64)

        last_indices = q_index = None
        if batch.is_prefill or max_q > 1:
            last_indices = self._to_device(extend_t.cumsum(0) - 1)
        if any(e != max_q for e in extend):
            starts = extend_t.cumsum(0) - extend_t
            row_base = torch.arange(num_reqs, dtype=torch.int64) * max_q - starts
            q_index = self._to_device(torch.arange(num_tokens) + row_base.repeat_interleave(extend_t))

        page_size = self.kv_cache.page_size
        max_kv = -(-max_kv // page_size) * page_size
        table_idx = self._to_device(torch.tensor([req.table_idx for req in batch.reqs], dtype=torch.int64))
        page_index = self.page_table[table_idx, :max_kv:page_size].long() // page_size
        q_start = self._to_device(cached)
        if batch.shift is not None:  # a pending verify batch: its requests start earlier
            q_start = q_start + batch.shift[0]
        q_pos = q_start[:, None] + torch.arange(max_q, device=self.device)
        kv_pos = torch.arange(max_kv, device=self.device)
        mask = full = kv_pos <= q_pos[:, :, None]
        if self.sliding_window is not None:
            mask = mask & (kv_pos > q_pos[:, :, None] - self.sliding_window)
        # some layers full, the others windowed: both masks, each layer picks (`attend_sinks`)
        per_layer = self.sliding_window is not None and self.options.window_layers is not None
        batch.attn_metadata = TorchAttnMetadata(
            last_indices=last_indices,
            page_index=page_index,
            mask=mask.unsqueeze(1),
            q_index=q_index,
            max_q=max_q,
            full_mask=full.unsqueeze(1) if per_layer else None,
        )

    def attend(self, q: torch.Tensor, layer_id: int, batch: Batch) -> torch.Tensor:
        return self.attend_sinks(q, None, layer_id, batch)

    def attend_sinks(
        self, q: torch.Tensor, sinks: torch.Tensor | None, layer_id: int, batch: Batch
    ) -> torch.Tensor:
        """`attend`, with `sinks` (H,) (or None) a logit per head in the softmax's denominator."""
        meta = planned(batch, TorchAttnMetadata)
        num_tokens, num_heads, head_dim = q.shape
        num_reqs, max_q = meta.page_index.shape[0], meta.max_q
        num_kv_heads = self.kv_cache.num_kv_heads
        group = num_heads // num_kv_heads
        if meta.q_index is None:
            q_pad = q.reshape(num_reqs, max_q, num_heads, head_dim)
        else:
            q_pad = q.new_zeros(num_reqs * max_q, num_heads, head_dim).index_copy_(0, meta.q_index, q)
            q_pad = q_pad.view(num_reqs, max_q, num_heads, head_dim)
        # the query heads sharing a KV head become extra query rows of it: (B, KVH, group * max_q, D)
        q_pad = q_pad.reshape(num_reqs, max_q, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
        q_pad = q_pad.reshape(num_reqs, num_kv_heads, group * max_q, head_dim)
        if meta.group_mask is None:  # once per batch, shared by the layers
            meta.group_mask = meta.mask.repeat(1, 1, group, 1)
            if meta.full_mask is not None:
                meta.full_group_mask = meta.full_mask.repeat(1, 1, group, 1)
        full = meta.full_group_mask is not None and self.window(layer_id) is None
        mask = meta.full_group_mask if full else meta.group_mask
        kv_shape = (num_reqs, -1, num_kv_heads, head_dim)  # (B, max_pages * page_size, KVH, D)
        keys, values = self.kv_cache.gather(layer_id, meta.page_index.view(-1), q.dtype)  # FP8: dequantized
        keys, values = keys.view(kv_shape), values.view(kv_shape)
        keys, values = keys.transpose(1, 2), values.transpose(1, 2)
        scale, cap = self.options.sm_scale, self.options.soft_cap
        if cap is not None:  # AttnOptions refuses sinks with a cap
            out = _capped_attention(q_pad, keys, values, mask, scale or head_dim**-0.5, cap)
        else:
            if sinks is not None:
                keys, values, mask = _with_sinks(keys, values, mask, sinks, max_q)
            out = F.scaled_dot_product_attention(q_pad, keys, values, attn_mask=mask, scale=scale)
        # (B, KVH, group * max_q, D)
        out = out.reshape(num_reqs, num_kv_heads, group, max_q, head_dim).permute(0, 3, 1, 2, 4)
        out = out.reshape(num_reqs * max_q, num_heads, head_dim)
        return out if meta.q_index is None else out.index_select(0, meta.q_index)


def _with_sinks(
    keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor, max_q: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys, values and a float mask with one more key per KV head whose logit is each query head's
    sink: a zero key (its score 0) under a bias of the sink, with a zero value (it only joins the
    softmax's denominator). keys, values (B, KVH, L, D); mask (B, 1, group * max_q, L) boolean."""
    num_reqs, num_kv_heads, _, head_dim = keys.shape
    zeros = keys.new_zeros(num_reqs, num_kv_heads, 1, head_dim)
    keys, values = torch.cat([keys, zeros], dim=2), torch.cat([values, zeros], dim=2)
    bias = torch.zeros(mask.shape, dtype=keys.dtype, device=keys.device).masked_fill_(~mask, float("-inf"))
    # query row g * max_q + i of KV head h is query head h * group + g
    sink = sinks.to(keys.dtype).view(num_kv_heads, -1).repeat_interleave(max_q, dim=1)
    sink = sink.view(1, num_kv_heads, -1, 1).expand(num_reqs, -1, -1, -1)
    return keys, values, torch.cat([bias.expand(-1, num_kv_heads, -1, -1), sink], dim=-1)


def _capped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, cap: float
) -> torch.Tensor:
    """Attention with soft-capped scores (in float32): softmax(cap * tanh(q k^T * scale / cap)) v."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = torch.tanh(scores / cap) * cap
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.matmul(probs.to(v.dtype), v)
