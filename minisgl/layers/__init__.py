"""Pure layer functions: explicit tensors in, tensors out, no hidden state."""

from minisgl.layers.attention import attention, rope_attention
from minisgl.layers.basic import (
    add_rms_norm,
    embed,
    linear,
    lm_head,
    norm_linear,
    norm_linear_keep,
    rms_norm,
    silu_mul_linear,
)
from minisgl.layers.fp8 import Fp8Linear
from minisgl.layers.rope import apply_rope, build_rope_cache, rope_cos_sin

__all__ = [
    "Fp8Linear",
    "add_rms_norm",
    "apply_rope",
    "attention",
    "build_rope_cache",
    "embed",
    "linear",
    "lm_head",
    "norm_linear",
    "norm_linear_keep",
    "rms_norm",
    "rope_attention",
    "rope_cos_sin",
    "silu_mul_linear",
]
