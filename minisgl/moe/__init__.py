"""Mixture-of-experts backends: `torch` (everywhere, the reference; reads the routed experts on the host,
so no CUDA graphs) and `fused` (grouped GEMMs with no host sync, captured in CUDA graphs; on CUDA it
needs bfloat16 on sm90/sm100); `auto` picks `fused` where it has its fast kernel and `torch` elsewhere.
docs/tensor-parallel-and-moe.md.
"""

from __future__ import annotations

import logging

import torch

from minisgl.moe.base import BaseMoeBackend, MoeFunction
from minisgl.moe.fused_backend import FusedMoeBackend, fused_moe, fused_unsupported_reason, grouped_moe
from minisgl.moe.op import moe, moe_biased
from minisgl.moe.torch_backend import TorchMoeBackend, select_experts, torch_moe

logger = logging.getLogger(__name__)

__all__ = [
    "BaseMoeBackend",
    "FusedMoeBackend",
    "MoeFunction",
    "TorchMoeBackend",
    "create_moe_backend",
    "fused_moe",
    "grouped_moe",
    "moe",
    "moe_biased",
    "select_experts",
    "torch_moe",
]


def create_moe_backend(
    name: str, device: torch.device | str, dtype: torch.dtype | None = None
) -> BaseMoeBackend:
    """'torch', 'fused', or 'auto': 'fused' on CUDA (sm90/sm100, and bfloat16 when `dtype` is given),
    'torch' on CPU and elsewhere. 'fused' where it cannot run captured is a ValueError saying why."""
    device = torch.device(device)
    if name == "auto":
        reason = _why_not_fused(device, dtype) if device.type == "cuda" else "the reference on CPU"
        name = "fused" if reason is None else "torch"
        logger.info(
            "MoE backend 'auto' -> %s (device %s%s)", name, device, "" if reason is None else f"; {reason}"
        )
    if name == "torch":
        return TorchMoeBackend()
    if name == "fused":
        reason = _why_not_fused(device, dtype)
        if reason is not None:
            raise ValueError(f"moe_backend='fused' cannot run here ({reason}); use 'torch' (or 'auto')")
        return FusedMoeBackend()
    raise ValueError(f"moe_backend={name!r} is not valid: use one of auto, torch, fused")


def _why_not_fused(device: torch.device, dtype: torch.dtype | None) -> str | None:
    """Why the fused backend cannot run captured on `device` in `dtype` (None: it can)."""
    reason = fused_unsupported_reason(device)
    if reason is None and device.type == "cuda" and dtype is not None and dtype != torch.bfloat16:
        reason = f"it runs bfloat16 on CUDA, got dtype={dtype}"
    return reason
