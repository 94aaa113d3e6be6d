"""The attention backend interface."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from minisgl.core import Batch
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


@dataclass
class BaseAttnMetadata:
    """Per-batch attention plan. `last_indices` selects each request's last computed token (prefill);
    None means every row is already one per request (decode)."""

    last_indices: torch.Tensor | None


class BaseAttnBackend(ABC):
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

    @abstractmethod
    def attend(self, q: torch.Tensor, layer_id: int, batch: Batch) -> torch.Tensor:
        """Attention of q (T, H, D) over `layer_id`'s KV cache, where the batch's own K and V are already
        stored (by `forward`, or by the fused q/k-norm + RoPE + KV-store kernel); shaped like q."""
