"""Multi-LoRA serving: PEFT adapters read, checked and sharded for this rank (`load_adapter`), and the
device slots of the adapters being served (`LoraPool`). The op that applies them is
`minisgl.layers.lora.lora_add`; its kernels are `minisgl.kernels.lora`."""

from minisgl.lora.adapter import LoraAdapter, LoraError, load_adapter, lora_projections, supported_modules
from minisgl.lora.pool import LoraPool

__all__ = ["LoraAdapter", "LoraError", "LoraPool", "load_adapter", "lora_projections", "supported_modules"]
