"""Gemma3ForConditionalGeneration checkpoints (Gemma 3 4B-27B): their text model, Llama's layers with
Gemma's options (minisgl.models.llama). The vision tower (SigLIP) and its projector are not implemented:
their tensors are skipped at load and requests with images are refused (`ModelConfig.why_no_images`).

The text tensors are named `language_model.model.*` in the published checkpoints and
`model.language_model.*` in those transformers 5 saves; `prepare_checkpoint` reads which.
"""

from __future__ import annotations

from pathlib import Path

from safetensors import safe_open

from minisgl.models.llama import LlamaForCausalLM
from minisgl.models.weights import checkpoint_files

TEXT_PREFIXES = ("model.language_model.", "language_model.model.")


class Gemma3ForConditionalGeneration(LlamaForCausalLM):
    """The text model of a Gemma3ForConditionalGeneration checkpoint (tied embeddings, or its own
    `lm_head` where the checkpoint holds one)."""

    ignored: frozenset[str] = frozenset()

    def prepare_checkpoint(self, model_path: str | Path) -> None:
        """Picks the text model's prefix; every other tensor (vision tower, projector) is skipped."""
        names: set[str] = set()
        for file in checkpoint_files(model_path):
            with safe_open(str(file), framework="pt", device="cpu") as f:
                names.update(f.keys())
        self.prefix = next((p for p in TEXT_PREFIXES if f"{p}embed_tokens.weight" in names), TEXT_PREFIXES[0])
        wanted = set(self.checkpoint_map())
        self.ignored = frozenset(names - wanted)
        if self.lm_head is not None and "lm_head.weight" not in names:
            alias = "language_model.lm_head.weight"  # the published checkpoints' name
            if alias in names:
                self._lm_head_name = alias

    _lm_head_name = "lm_head.weight"

    def checkpoint_map(self):
        out = super().checkpoint_map()
        if self.lm_head is not None and self._lm_head_name != "lm_head.weight":
            out[self._lm_head_name] = out.pop("lm_head.weight")
        return out

    def checkpoint_ignored(self) -> frozenset[str]:
        return super().checkpoint_ignored() | self.ignored
