"""Model configs, weight loading and the model families minisgl runs."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
from torch import nn

from minisgl.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from minisgl.models.default import DEFAULT_MODEL_ALIAS, default_model_path
from minisgl.models.llama import LlamaForCausalLM
from minisgl.models.qwen3_moe import Qwen3MoeForCausalLM
from minisgl.models.weights import init_dummy_weights, load_checkpoint

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_MODEL_ALIAS",
    "SUPPORTED_ARCHITECTURES",
    "ModelConfig",
    "build_model",
    "default_model_path",
]

MODEL_FAMILIES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
}


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_model(
    cfg: ModelConfig,
    model_path: str,
    max_seq_len: int,
    device: torch.device,
    dtype: torch.dtype,
    dummy: bool = False,
) -> nn.Module:
    """Allocates the model's parameters on `device` in `dtype`, then fills them from the checkpoint
    (or with dummy weights, without touching the disk)."""
    with torch.device(device), _default_dtype(dtype):
        model = MODEL_FAMILIES[cfg.family](cfg, max_seq_len)
    if dummy:
        init_dummy_weights(dict(model.named_parameters()))
    else:
        load_checkpoint(model.checkpoint_map(), model_path, ignored=model.checkpoint_ignored())
    return model.eval()
