"""Model configs, weight loading and the model families minisgl runs."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
from torch import nn

from minisgl.models.config import SUPPORTED_ARCHITECTURES, Fp8Config, ModelConfig
from minisgl.models.default import DEFAULT_MODEL_ALIAS, default_model_path
from minisgl.models.fp8 import init_dummy_fp8
from minisgl.models.gemma3 import Gemma3ForConditionalGeneration
from minisgl.models.gpt_oss import GptOssForCausalLM
from minisgl.models.llama import LlamaForCausalLM
from minisgl.models.packed import experts_packed, init_dummy_packed, keep_packed
from minisgl.models.quant_config import PackedConfig
from minisgl.models.qwen3_moe import Qwen3MoeForCausalLM
from minisgl.models.qwen_vl import QwenVLForConditionalGeneration
from minisgl.models.weights import init_dummy_weights, load_checkpoint

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_MODEL_ALIAS",
    "SUPPORTED_ARCHITECTURES",
    "Fp8Config",
    "ModelConfig",
    "build_model",
    "default_model_path",
]

MODEL_FAMILIES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,  # Llama's layers; its sliding window is the attention backends' (config)
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    "gpt_oss": GptOssForCausalLM,  # sinks, per-layer windows, biased experts: minisgl.models.gpt_oss
    "qwen2_5_vl": QwenVLForConditionalGeneration,  # vision-language: docs/vision.md
    "qwen3_vl": QwenVLForConditionalGeneration,
    # Llama's layers with the families' options (minisgl.models.config_families)
    "gemma2": LlamaForCausalLM,
    "gemma3": LlamaForCausalLM,
    "phi3": LlamaForCausalLM,
}
# architectures whose model class is not their family's
MODEL_ARCHITECTURES: dict[str, type[nn.Module]] = {
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,  # the text model: models/gemma3.py
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
    (or with dummy weights, without touching the disk). With `cfg.quantization` the projections are FP8
    (see minisgl.models.fp8): read from an FP8 checkpoint, quantized at load, or random."""
    with torch.device(device), _default_dtype(dtype):
        model = MODEL_ARCHITECTURES.get(cfg.architecture, MODEL_FAMILIES[cfg.family])(cfg, max_seq_len)
    if isinstance(cfg.quantization, PackedConfig):
        where = "packed" if keep_packed(device) else f"dequantized at load to {dtype} (the reference path)"
        logger.info("%s: projections %s", cfg.quantization.describe(), where)
        if cfg.num_experts and not experts_packed(cfg.quantization, device):
            logger.info("the MoE experts' packed weights are dequantized at load to %s", dtype)
    elif cfg.quantization is not None:
        logger.info("%s", cfg.quantization.describe())
        if device.type == "cuda" and dtype not in (torch.bfloat16, torch.float16):
            logger.warning(
                "FP8 linear layers in %s run minisgl's float32 emulation on CUDA (the FP8 kernels take "
                "bf16 and float16 activations, docs/quantization.md): correct, but slow",
                dtype,
            )
    if dummy:
        fp8 = init_dummy_fp8(model) | init_dummy_packed(model)
        init_dummy_weights({name: p for name, p in model.named_parameters() if name not in fp8})
    else:
        if hasattr(model, "prepare_checkpoint"):  # vision-language models: tensor names vary by version
            model.prepare_checkpoint(model_path)
        load_checkpoint(
            model.checkpoint_map(),
            model_path,
            ignored=model.checkpoint_ignored(),
            optional=model.checkpoint_optional(),
        )
        if hasattr(model, "after_load"):  # Gemma: its norms' 1 + weight
            model.after_load()
    return model.eval()
