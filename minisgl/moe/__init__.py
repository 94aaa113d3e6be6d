"""Mixture-of-experts backends. `torch` runs everywhere and is the reference; `fused` will need CUDA."""

from __future__ import annotations

import logging

import torch

from minisgl.moe.base import BaseMoeBackend
from minisgl.moe.op import moe
from minisgl.moe.torch_backend import TorchMoeBackend, select_experts

logger = logging.getLogger(__name__)

__all__ = ["BaseMoeBackend", "TorchMoeBackend", "create_moe_backend", "moe", "select_experts"]


def create_moe_backend(name: str, device: torch.device) -> BaseMoeBackend:
    """'auto' picks the best backend built for `device` (for now always 'torch'); 'fused' is not built yet."""
    if name == "auto":
        logger.info("MoE backend 'auto' -> torch (device %s; the fused backend is not built yet)", device)
        name = "torch"
    if name == "torch":
        return TorchMoeBackend()
    if name == "fused":
        if torch.device(device).type != "cuda":
            raise ValueError("moe_backend='fused' needs a CUDA GPU; on CPU use 'torch' (or 'auto')")
        raise ValueError("moe_backend='fused' is not built in this version yet; use 'torch' (or 'auto')")
    raise ValueError(f"moe_backend={name!r} is not valid: use one of auto, torch, fused")
