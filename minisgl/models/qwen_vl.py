"""Qwen2.5-VL and Qwen3-VL (dense text backbones): the Qwen2 / Qwen3 decoder of `LlamaForCausalLM` under
M-RoPE, and the vision encoder (`visual`) that turns images into the embeddings of their placeholder
tokens. docs/vision.md.

The text weights are named ``model.language_model.*`` (transformers 5) or ``model.*`` (older
checkpoints, and transformers 5's Qwen2.5-VL), the encoder's ``model.visual.*`` or ``visual.*``: the
names are read from the folder before loading (`prepare_checkpoint`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from minisgl.layers.rope import mrope_axes
from minisgl.models.config import ModelConfig
from minisgl.models.llama import LlamaForCausalLM
from minisgl.models.qwen2_5_vl_vision import Qwen2_5_VisionEncoder
from minisgl.models.qwen3_vl_vision import Qwen3VisionEncoder
from minisgl.models.vision import CHECKPOINT_PREFIXES
from minisgl.models.weights import Shard, checkpoint_files

ENCODERS = {"qwen2_5_vl": Qwen2_5_VisionEncoder, "qwen3_vl": Qwen3VisionEncoder}
TEXT_PREFIXES = ("model.language_model.", "model.")  # the first one the checkpoint has wins


class QwenVLForConditionalGeneration(LlamaForCausalLM):
    """Serves Qwen2_5_VLForConditionalGeneration and Qwen3VLForConditionalGeneration checkpoints."""

    def __init__(self, cfg: ModelConfig, max_seq_len: int) -> None:
        super().__init__(cfg, max_seq_len)
        self.visual = ENCODERS[cfg.family](cfg.vision)
        axes = mrope_axes(cfg.head_dim, cfg.mrope_section, cfg.mrope_interleaved)
        del self.mrope_axes  # LlamaForCausalLM's None: a buffer here (it follows the model's device)
        self.register_buffer("mrope_axes", axes.to(self.embed_tokens.device), persistent=False)
        self.text_prefix, self.visual_prefix = TEXT_PREFIXES[0], CHECKPOINT_PREFIXES[0]

    def prepare_checkpoint(self, model_path: str | Path) -> None:
        """Reads which prefixes the folder's tensor names use (see the module docstring)."""
        names: set[str] = set()
        for file in checkpoint_files(model_path):
            with safe_open(str(file), framework="pt", device="cpu") as f:
                names.update(f.keys())
        self.text_prefix = next(
            p for p in TEXT_PREFIXES if p == TEXT_PREFIXES[-1] or f"{p}embed_tokens.weight" in names
        )
        self.visual_prefix = next(
            (p for p in CHECKPOINT_PREFIXES if any(n.startswith(p) for n in names)), CHECKPOINT_PREFIXES[0]
        )

    def _rename(self, name: str) -> str:
        return self.text_prefix + name.removeprefix("model.") if name.startswith("model.") else name

    def checkpoint_map(self) -> dict[str, torch.Tensor | Shard]:
        out = {self._rename(name): dest for name, dest in super().checkpoint_map().items()}
        out.update({self.visual_prefix + name: p for name, p in self.visual.named_parameters()})
        return out

    def checkpoint_optional(self) -> frozenset[str]:
        return frozenset(map(self._rename, super().checkpoint_optional()))

    def checkpoint_ignored(self) -> frozenset[str]:
        return frozenset(map(self._rename, super().checkpoint_ignored()))

    def encode_images(
        self, pixel_values: torch.Tensor, grid_thw: torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The embeddings of the images' placeholder tokens, image after image, and the DeepStack
        features (Qwen3-VL; [] for Qwen2.5-VL), in the text model's dtype."""
        dtype = self.embed_tokens.dtype
        out = self.visual(pixel_values.to(dtype), grid_thw)
        embeds, deepstack = out if isinstance(out, tuple) else (out, [])
        return embeds.to(dtype), [d.to(dtype) for d in deepstack]
