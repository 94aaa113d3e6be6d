"""The attention backend interface."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from minisgl.core import Batch
from minisgl.kernels.decode_attention import check_window
from minisgl.kvcache import MHAKVCachePool

ATTENTION_BACKENDS = ("torch", "fi", "fa", "trtllm")


def parse_attention_backend(value: str) -> tuple[str, str]:
    """'auto', a backend name, or a 'prefill,decode' pair -> (prefill, decode); 'auto' stays 'auto'."""
    parts = [p.strip() for p in value.split(",")]
    if value == "auto":
        return ("auto", "auto")
    if len(parts) not in (1, 2) or any(p not in ATTENTION_BACKENDS for p in parts):
        raise ValueError(
            f"attention_backend={value!r} is not valid: use 'auto', one of {', '.join(ATTENTION_BACKENDS)}, "
            "or a 'prefill,decode' pair such as 'fa,fi'"
        )
    return (parts[0], parts[-1])


def check_kv_dtype(name: str, prefill: str, decode: str, kv_dtype: torch.dtype | None) -> None:
    """Refuses a backend pair that cannot read a float8_e4m3fn KV cache: FlashInfer's FA3 kernels (`fa`)
    take FP8 KV only with an FP8 query, and minisgl's queries are in the model's dtype."""
    if kv_dtype != torch.float8_e4m3fn or "fa" not in (prefill, decode):
        return
    raise ValueError(
        f"attention_backend={name!r} cannot read the FP8 KV cache (kv_cache_dtype 'fp8_e4m3'): FlashInfer's "
        "FA3 kernels ('fa') take FP8 KV only with FP8 queries. Use attention_backend 'auto' or 'fi' (FA2 "
        "prefill, FlashInfer or Triton decode), or 'torch', or kv_cache_dtype 'auto'"
    )


@dataclass
class BaseAttnMetadata:
    """Per-batch attention plan. `last_indices` selects each request's last computed token (prefill);
    None means every row is already one per request (decode)."""

    last_indices: torch.Tensor | None


@dataclass(frozen=True)
class AttnOptions:
    """What a model's attention asks beyond causal softmax(q k^T / sqrt(head_dim)) v: `window_layers`,
    the layers under the sliding window (None: all of them, where there is one; Gemma's alternate);
    `sm_scale`, the softmax scale (None: head_dim ** -0.5; Gemma's query_pre_attn_scalar ** -0.5);
    `soft_cap`, scores capped to soft_cap * tanh(score / soft_cap) (None: none; Gemma 2's 50); `sinks`,
    the model has attention sinks, a learned logit per query head in the softmax's denominator
    (gpt-oss; the model passes them to `forward_sinks`; the `torch` backend only, without a soft cap)."""

    window_layers: tuple[bool, ...] | None = None
    sm_scale: float | None = None
    soft_cap: float | None = None
    sinks: bool = False

    def __post_init__(self) -> None:
        if self.sinks and self.soft_cap is not None:
            raise ValueError(
                f"attention sinks with a soft cap (soft_cap={self.soft_cap!r}) are not supported: no "
                "model has both"
            )


class BaseAttnBackend(ABC):
    """A backend attends with the model's sliding window, `sliding_window` (given at creation, the same
    for every batch; every layer's or those of `options.window_layers`): the query at position p sees
    the keys at p - W < k <= p; None: every earlier key. Pages behind the window stay allocated (and
    cached): only the attention skips them. `options`: the model's scale, soft cap and sinks (`AttnOptions`)."""

    sliding_window: int | None = None
    options: AttnOptions = AttnOptions()

    def _set_sliding_window(self, window: int | None, options: AttnOptions | None = None) -> None:
        self.sliding_window = check_window(window, "sliding_window")
        self.options = options or AttnOptions()
        cap = self.options.soft_cap
        if cap is not None and not cap > 0:
            raise ValueError(f"soft_cap must be None (no cap) or a number > 0, got {cap!r}")

    def window(self, layer_id: int) -> int | None:
        """The sliding window of layer `layer_id` (None: full attention)."""
        layers = self.options.window_layers
        return self.sliding_window if layers is None or layers[layer_id] else None

    @abstractmethod
    def prepare_metadata(self, batch: Batch, graph_bs: int = 0) -> None:
        """Builds `batch.attn_metadata` from the requests and the page table, without a host sync.
        `graph_bs` > 0: plan the decode batch padded to that captured CUDA-graph batch size."""

    kv_cache: MHAKVCachePool

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: Batch
    ) -> torch.Tensor:
        """Stores k, v at `batch.out_loc` for `layer_id`, then returns attention output shaped like q."""
        self.kv_cache.store_kv(k, v, batch.out_loc, layer_id)
        return self.attend(q, layer_id, batch)

    def forward_sinks(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sinks: torch.Tensor,
        layer_id: int,
        batch: Batch,
    ) -> torch.Tensor:
        """`forward` with attention sinks: `sinks` (H,) float32, a logit per query head added to the
        softmax's denominator only."""
        self.kv_cache.store_kv(k, v, batch.out_loc, layer_id)
        return self.attend_sinks(q, sinks, layer_id, batch)

    def attend_sinks(self, q: torch.Tensor, sinks: torch.Tensor, layer_id: int, batch: Batch) -> torch.Tensor:
        raise ValueError(
            f"the attention backend {type(self).__name__} has no attention sinks (gpt-oss): use "
            "attention_backend 'torch'"
        )

    @abstractmethod
    def attend(self, q: torch.Tensor, layer_id: int, batch: Batch) -> torch.Tensor:
        """Attention of q (T, H, D) over `layer_id`'s KV cache, where the batch's own K and V are already
        stored (by `forward`, or by the fused q/k-norm + RoPE + KV-store kernel); shaped like q."""
