"""Attention backends. `torch` runs everywhere and is the reference; FlashInfer backends need CUDA."""

from __future__ import annotations

import logging

import torch

from minisgl.attention.base import BaseAttnBackend, BaseAttnMetadata, parse_attention_backend
from minisgl.attention.torch_backend import TorchAttnBackend
from minisgl.kvcache import MHAKVCachePool

logger = logging.getLogger(__name__)

__all__ = ["BaseAttnBackend", "BaseAttnMetadata", "TorchAttnBackend", "create_attention_backend"]

AVAILABLE_BACKENDS = ("torch",)


def create_attention_backend(
    name: str, kv_cache: MHAKVCachePool, page_table: torch.Tensor, device: torch.device
) -> BaseAttnBackend:
    """Builds the backend that `name` asks for ('auto', a name, or a 'prefill,decode' pair)."""
    prefill, decode = parse_attention_backend(name)
    if prefill == "auto":
        prefill = decode = "torch"
        logger.info("attention backend 'auto' -> torch (device %s)", device)
    for choice in (prefill, decode):
        if choice not in AVAILABLE_BACKENDS:
            raise ValueError(
                f"attention_backend={name!r}: backend {choice!r} is not available in this build; "
                f"available: {', '.join(AVAILABLE_BACKENDS)}"
            )
    return TorchAttnBackend(kv_cache, page_table, device)
