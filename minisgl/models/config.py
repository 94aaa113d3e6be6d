"""ModelConfig: the architecture facts minisgl needs, read from a model folder's config.json.

Every key read is checked for its JSON type (never coerced) and range, so a broken config.json fails
when it is read, with ``<path>: key=value must be ...``; the bounds: docs/failures.md. A
``quantization_config`` is read as FP8 (`Fp8Config`) or as integer weights of AWQ, GPTQ or
compressed-tensors (`minisgl.models.quant_config.PackedConfig`); any other is refused, naming it:
docs/quantization.md.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minisgl.layers.rope import RopeConfig
from minisgl.models.config_families import GEMMA3_TEXT_DEFAULTS, family_fields
from minisgl.models.config_keys import (
    MAX_POSITIONS,
    MAX_VOCAB,
    MAX_WIDTH,
    _is_int,
    _json_type,
    _Keys,
    _rope_config,
    _show,
)
from minisgl.models.quant_config import PACKED_METHODS, PackedConfig, parse_packed

# architecture name in config.json -> model family implemented in minisgl.models
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "GptOssForCausalLM": "gpt_oss",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
    "Qwen3VLForConditionalGeneration": "qwen3_vl",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",  # its text model only (config_families.IMAGES_NOTE)
    "Phi3ForCausalLM": "phi3",
    # the bare models (no LM head): checkpoints of embedding models such as Qwen3-Embedding
    "LlamaModel": "llama",
    "MistralModel": "mistral",
    "Qwen2Model": "qwen2",
    "Qwen3Model": "qwen3",
}
# vision-language families (docs/vision.md) -> the text family whose decoder layers they use
VL_TEXT_FAMILIES = {"qwen2_5_vl": "qwen2", "qwen3_vl": "qwen3"}

# the quantization methods minisgl implements: quantization_config.quant_method, the setting `quantization`
QUANT_METHODS = ("fp8",)
# the projections of each decoder layer that an FP8 model holds in FP8 (everything else stays in the
# model's dtype: embeddings, norms, the LM head, biases)
FP8_PROJECTIONS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
# the weight blocks of the setting `quantization: fp8` (Qwen's FP8 releases use the same)
FP8_DEFAULT_BLOCK = (128, 128)


@dataclass(frozen=True)
class Fp8Config:
    """FP8 projections (`FP8_PROJECTIONS`): e4m3 weights with one float32 scale per block of `block`
    (rows, columns) of each checkpoint weight, or one per weight where `block` is None (per-tensor
    scales); activations are quantized per token in groups on the fly (minisgl.kernels.fp8).
    `in_checkpoint`: the checkpoint holds the FP8 weights and their scales (`weight_scale_inv` per
    block, `weight_scale` per tensor); otherwise its weights are quantized at load (the setting
    `quantization: fp8`), or made so (dummy weights)."""

    block: tuple[int, int] | None = FP8_DEFAULT_BLOCK
    in_checkpoint: bool = False

    @property
    def scale_name(self) -> str:
        """The suffix of a weight's scale tensor in the checkpoint (after the module name)."""
        return "weight_scale_inv" if self.block is not None else "weight_scale"

    def describe(self) -> str:
        blocks = (
            "per-tensor scales" if self.block is None else f"{self.block[0]}x{self.block[1]} block scales"
        )
        return f"FP8 e4m3 weights with {blocks}, " + (
            "from the checkpoint" if self.in_checkpoint else "quantized at load"
        )


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    family: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    torch_dtype: str | None
    # mixture of experts (Qwen3-MoE); dense models have num_experts == 0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # FP8 projections (config.json's quantization_config, or the setting `quantization`), or integer
    # weights of a 4- or 8-bit checkpoint (`PackedConfig`); None: none
    quantization: Fp8Config | PackedConfig | None = None
    # sliding-window attention (Mistral's `sliding_window`): each token attends to the last W tokens, its
    # own included (keys at positions p - W < k <= p, transformers' mask); None: full causal attention.
    # Every layer has it, or those `layer_types` names sliding; the attention backends read it
    # (minisgl.attention)
    sliding_window: int | None = None
    # vision-language models (VL_TEXT_FAMILIES): the vision encoder's config (a
    # `minisgl.models.vision.VisionConfig`), the placeholder token of image embeddings, and M-RoPE's split
    # of the rotary frequencies over the (t, h, w) axes (`minisgl.layers.rope.mrope_axes`); None / ():
    # a text model
    vision: Any = None
    image_token_id: int | None = None
    mrope_section: tuple[int, ...] = ()
    mrope_interleaved: bool = False
    # per-layer attention (Gemma 2 / 3, gpt-oss): each layer's "sliding_attention" (within
    # `sliding_window`) or "full_attention"; (): all layers alike (`sliding_window` or none).
    # `local_rope`: the sliding layers' RoPE (Gemma 3; None: `rope`)
    layer_types: tuple[str, ...] = ()
    local_rope: RopeConfig | None = None
    # gpt-oss (minisgl.models.gpt_oss): learned attention sinks (a logit per head in the softmax's
    # denominator); the experts' clamped SwiGLU (None: plain SwiGLU) and biases; its experts stored as
    # MXFP4 in the checkpoint (dequantized at load, minisgl.models.mxfp4)
    attention_sinks: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    mxfp4_experts: bool = False
    # Gemma 2 / 3 and Phi-3 (minisgl.models.config_families): the MLP's activation ("silu"; "gelu_tanh":
    # GeGLU), RMSNorm weights stored as offsets from `norm_offset` (Gemma: 1 + weight), Gemma's four
    # norms a layer (`sandwich_norms`: after attention and after the MLP too), embeddings times
    # sqrt(hidden_size), the softmax scale (None: head_dim ** -0.5), tanh soft caps of the attention
    # scores and of the final logits (None: none)
    hidden_act: str = "silu"
    norm_offset: float = 0.0
    sandwich_norms: bool = False
    embed_scale: bool = False
    attn_scale: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    rotary_dim: int = 0  # the rotated columns of a head (Phi-3's partial_rotary_factor); 0: head_dim
    fused_checkpoint: bool = False  # Phi-3: qkv_proj and gate_up_proj are one tensor each in the checkpoint

    def layer_window(self, layer_id: int) -> int | None:
        """The sliding window of layer `layer_id` (None: full attention)."""
        if self.layer_types and self.layer_types[layer_id] != "sliding_attention":
            return None
        return self.sliding_window

    @property
    def is_multimodal(self) -> bool:
        """Takes images (a vision-language model)."""
        return self.vision is not None

    @property
    def why_no_images(self) -> str:
        """Why this model takes no images and what to do instead (for a request that carries some)."""
        if self.architecture == "Gemma3ForConditionalGeneration":
            return (
                f"minisgl serves only the text model of {self.architecture}; its vision tower (SigLIP) is not "
                "implemented yet: send text only, or serve a Qwen2.5-VL or Qwen3-VL model (docs/vision.md)"
            )
        return (
            f"{self.architecture} is a text-only model: send text only, or serve a vision-language model "
            "(docs/vision.md)"
        )

    @property
    def has_lm_head(self) -> bool:
        """False for a bare model's checkpoint (`Qwen3Model`, ...): it serves embeddings only."""
        return not self.architecture.endswith("Model")

    def with_quantization(self, method: str | None) -> ModelConfig:
        """This config under the setting `quantization`: 'fp8' quantizes a model whose checkpoint is not
        quantized at load, in 128x128 blocks (an FP8 checkpoint stays as it is); None changes nothing."""
        if method is None or self.quantization is not None:
            return self
        if method not in QUANT_METHODS:
            raise ValueError(f"quantization={method!r} is not valid: use one of {', '.join(QUANT_METHODS)}")
        if self.num_experts:
            raise ValueError(
                f"quantization={method!r} is not supported for {self.architecture} yet (its experts have "
                "no FP8 path); leave quantization unset"
            )
        return dataclasses.replace(self, quantization=Fp8Config())

    def is_sparse_layer(self, layer_id: int) -> bool:
        """True where the layer's MLP is a mixture of experts (transformers' Qwen3-MoE rule)."""
        return (
            layer_id not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer_id + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """The config of the parsed config.json `raw`; `source` (the file) begins every error message."""
        if not isinstance(raw, dict):
            raise ValueError(f"{source}: must hold a JSON object at its top level, got a {_json_type(raw)}")
        arch, family = _architecture(raw, source)
        top = raw
        if family in VL_TEXT_FAMILIES:  # the text model's keys are under text_config (transformers 5)
            raw = {**raw, **(raw.get("text_config") or {})}
        elif arch == "Gemma3ForConditionalGeneration":
            raw = {**GEMMA3_TEXT_DEFAULTS, **raw, **(raw.get("text_config") or {})}
        keys = _Keys(raw, source, f" for {arch}")
        _check_unsupported_features(keys, family)

        hidden_size = keys.integer("hidden_size", le=MAX_WIDTH)
        num_layers = keys.integer("num_hidden_layers")
        gpt_oss = {}
        if family == "gpt_oss":
            from minisgl.models.gpt_oss_config import gpt_oss_fields

            gpt_oss = gpt_oss_fields(keys, num_layers)
        quantization = None if gpt_oss else _quantization(keys, arch, family, num_layers)
        num_heads = keys.integer("num_attention_heads")
        num_kv_heads = keys.integer("num_key_value_heads", num_heads)
        if num_heads % num_kv_heads:
            raise ValueError(
                f"{source}: num_attention_heads={num_heads} must be a multiple of "
                f"num_key_value_heads={num_kv_heads}"
            )
        vocab_size = keys.integer("vocab_size", le=MAX_VOCAB)
        # transformers' Mistral has no attention biases, whatever attention_bias says
        attention_bias = keys.flag("attention_bias", family == "gpt_oss") and family != "mistral"
        text_family = VL_TEXT_FAMILIES.get(family, family)
        # transformers 5 writes `dtype`, older versions `torch_dtype`
        dtype, torch_dtype = keys.text("dtype", None), keys.text("torch_dtype", None)
        head_dim = _head_dim(keys, hidden_size, num_heads)
        fields: dict[str, Any] = dict(
            architecture=arch,
            family=family,
            hidden_size=hidden_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            intermediate_size=keys.integer("intermediate_size", le=MAX_WIDTH),
            vocab_size=vocab_size,
            rms_norm_eps=keys.number("rms_norm_eps", 1e-6),
            rope=_rope_config(keys),
            max_position_embeddings=keys.integer("max_position_embeddings", 4096, le=MAX_POSITIONS),
            # transformers' Llama, Qwen2 and Qwen3 configs default to untied embeddings
            tie_word_embeddings=bool(top.get("tie_word_embeddings", keys.flag("tie_word_embeddings"))),
            qkv_bias=True if text_family == "qwen2" else attention_bias,
            o_bias=False if text_family == "qwen2" else attention_bias,
            qk_norm=text_family in ("qwen3", "qwen3_moe"),
            eos_token_ids=keys.token_ids("eos_token_id", vocab_size),
            bos_token_id=keys.integer(
                "bos_token_id", None, ge=0, le=vocab_size - 1, why=f" (vocab_size={vocab_size})"
            ),
            torch_dtype=dtype or torch_dtype,
            quantization=quantization,
            sliding_window=_sliding_window(keys) if family == "mistral" else gpt_oss.pop("window", None),
            **(_moe(keys, num_layers) if family == "qwen3_moe" else {}),
            **gpt_oss,
            **(_vision(top, keys, family) if family in VL_TEXT_FAMILIES else {}),
        )
        if family in ("gemma2", "gemma3", "phi3"):
            fields.update(family_fields(keys, family, num_layers, head_dim))
        return cls(**fields)

    @classmethod
    def from_path(cls, model_path: str | Path) -> ModelConfig:
        path = Path(model_path) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in model folder {str(model_path)!r}")
        try:
            with open(path, encoding="utf-8") as f:
                raw = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: not a valid JSON file ({e})") from e
        return cls.from_dict(raw, source=str(path))


def _architecture(raw: dict[str, Any], source: str) -> tuple[str, str]:
    archs = raw.get("architectures") or []
    if not isinstance(archs, list):
        raise _Keys(raw, source).error("architectures", archs, "a list of architecture names")
    arch = next((a for a in archs if isinstance(a, str) and a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ValueError(
            f"{source}: unsupported architecture {archs or raw.get('model_type')!r}; minisgl supports "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch, SUPPORTED_ARCHITECTURES[arch]


def _check_unsupported_features(keys: _Keys, family: str) -> None:
    hidden_act, _ = keys.get("hidden_act", "silu")
    if hidden_act != "silu" and family not in ("gemma2", "gemma3"):  # Gemma's: config_families
        raise ValueError(
            f'{keys.source}: hidden_act={_show(hidden_act)} is not supported; minisgl supports "silu"'
        )
    if keys.flag("mlp_bias"):
        raise ValueError(f"{keys.source}: mlp_bias=true is not supported")
    if keys.flag("use_sliding_window"):
        raise ValueError(f"{keys.source}: use_sliding_window=true is not supported")


def _quantization(keys: _Keys, arch: str, family: str, num_layers: int) -> Fp8Config | PackedConfig | None:
    """The checkpoint's FP8 or integer format from `quantization_config`; every other is refused."""
    source = keys.source
    if keys.raw.get("compression_config") is not None:  # compressed-tensors' older key
        raise ValueError(
            f"{source}: compression_config (compressed-tensors quantization) is not supported; minisgl "
            'reads quantization_config (quant_method "fp8", "awq", "gptq" or "compressed-tensors")'
        )
    raw, given = keys.get("quantization_config", None)
    if not given:
        return None
    if not isinstance(raw, dict):
        raise keys.error("quantization_config", raw, "a JSON object or null")
    quant = _Keys(raw, source, names={k: f"quantization_config.{k}" for k in raw})
    method = raw.get("quant_method")
    supported = (
        'minisgl implements quant_method "fp8" (e4m3 weights with block or per-tensor scales) and "awq", '
        '"gptq", "compressed-tensors" (4- and 8-bit integer weights)'
    )
    if method is None:
        raise ValueError(f"{source}: quantization_config has no quant_method; {supported}")
    if method in PACKED_METHODS:
        return parse_packed(raw, source)
    if method not in QUANT_METHODS:
        raise ValueError(
            f"{source}: quantization_config.quant_method={_show(method)} is not supported; {supported}. "
            "Load the model's unquantized checkpoint instead (the setting quantization: fp8 quantizes it "
            "at load)"
        )
    if family == "qwen3_moe":
        raise ValueError(
            f'{source}: quantization_config.quant_method="fp8" is not supported for {arch} yet (its '
            "experts have no FP8 path); load the unquantized checkpoint"
        )
    fmt = quant.text("fmt", "e4m3")
    if fmt != "e4m3":
        raise quant.error("fmt", fmt, '"e4m3": minisgl reads float8_e4m3fn weights only')
    scheme = quant.text("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise quant.error("activation_scheme", scheme, '"dynamic" or "static"')
    block, given = quant.get("weight_block_size", None)
    if given and not (
        isinstance(block, list) and len(block) == 2 and all(_is_int(b) and 1 <= b <= MAX_WIDTH for b in block)
    ):
        raise quant.error(
            "weight_block_size", block, f"null or [rows, columns], integers in [1, {MAX_WIDTH}]"
        )
    projections = [f"model.layers.{i}.{name}" for i in range(num_layers) for name in FP8_PROJECTIONS]
    for key in ("modules_to_not_convert", "ignored_layers"):
        entries, listed = quant.get(key, [])
        if listed and not (isinstance(entries, list) and all(isinstance(e, str) for e in entries)):
            raise quant.error(key, entries, "a list of module names")
        # transformers skips a module whose name contains an entry
        hit = next((e for e in entries if any(e in name for name in projections)), None)
        if hit is not None:
            raise ValueError(
                f"{source}: quantization_config.{key} lists {hit!r}, which leaves some projections of the "
                "decoder layers unquantized; minisgl's FP8 models hold every projection in FP8"
            )
    return Fp8Config(block=tuple(block) if given else None, in_checkpoint=True)


def _head_dim(keys: _Keys, hidden_size: int, num_heads: int) -> int:
    """head_dim, or hidden_size / num_attention_heads where it is absent; even, for rotary embeddings."""
    head_dim = keys.integer("head_dim", None, le=MAX_WIDTH)
    if head_dim is None:
        if hidden_size % num_heads:
            raise ValueError(
                f"{keys.source}: hidden_size={hidden_size} must be a multiple of "
                f"num_attention_heads={num_heads} (or give head_dim)"
            )
        head_dim = hidden_size // num_heads
        if head_dim % 2:
            raise ValueError(
                f"{keys.source}: hidden_size={hidden_size} / num_attention_heads={num_heads} = head_dim "
                f"{head_dim} must be even for rotary embeddings"
            )
    elif head_dim % 2:
        raise keys.error("head_dim", head_dim, "even for rotary embeddings")
    return head_dim


# transformers' MistralConfig's window where config.json has no `sliding_window` key (null: none)
MISTRAL_DEFAULT_WINDOW = 4096


def _sliding_window(keys: _Keys) -> int | None:
    """Mistral's attention window: `sliding_window` tokens, null for full attention, 4096 where the key
    is absent (transformers' default). Only Mistral reads it: Qwen2 and Qwen3 configs carry one that
    their `use_sliding_window: false` turns off."""
    if "sliding_window" not in keys.raw:
        return MISTRAL_DEFAULT_WINDOW
    return keys.integer("sliding_window", None, le=MAX_POSITIONS)


def _vision(top: dict[str, Any], keys: _Keys, family: str) -> dict[str, Any]:
    """The vision-language fields of a Qwen2.5-VL / Qwen3-VL config (`top`: its whole config.json)."""
    from minisgl.models.vision import VisionConfig

    if not isinstance(top.get("vision_config"), dict):
        raise keys.error("vision_config", top.get("vision_config"), "an object (the vision encoder's config)")
    rope = {**keys.object("rope_scaling"), **keys.object("rope_parameters")}
    section = rope.get("mrope_section")
    if not (isinstance(section, list) and len(section) == 3 and all(_is_int(n) and n >= 0 for n in section)):
        raise keys.error("rope_parameters.mrope_section", section, "a list of 3 counts (t, h, w)")
    vocab_size = keys.integer("vocab_size", le=MAX_VOCAB)
    image_token_id = _Keys(top, keys.source).integer(
        "image_token_id", 151655, ge=0, le=vocab_size - 1, why=f" (vocab_size={vocab_size})"
    )
    return dict(
        vision=VisionConfig.from_dict(top["vision_config"]),
        image_token_id=image_token_id,
        mrope_section=tuple(section),
        mrope_interleaved=family == "qwen3_vl",  # transformers' Qwen3-VL always interleaves
    )


def _moe(keys: _Keys, num_layers: int) -> dict[str, Any]:
    """The mixture-of-experts fields of a Qwen3-MoE config."""
    # transformers 5 writes `num_local_experts`; the hub's config.json files say `num_experts`
    raw = keys.raw
    experts_key = (
        "num_local_experts"
        if raw.get("num_experts") is None and "num_local_experts" in raw
        else "num_experts"
    )
    num_experts = keys.integer(experts_key)
    layers, _ = keys.get("mlp_only_layers", [])
    if not (isinstance(layers, list) and all(_is_int(i) and 0 <= i < num_layers for i in layers)):
        raise keys.error(
            "mlp_only_layers",
            layers,
            f"a list of layer indices in [0, {num_layers - 1}] (num_hidden_layers={num_layers})",
        )
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=keys.integer(
            "num_experts_per_tok", le=num_experts, why=f" ({experts_key}={num_experts})"
        ),
        moe_intermediate_size=keys.integer("moe_intermediate_size", le=MAX_WIDTH),
        norm_topk_prob=keys.flag("norm_topk_prob"),  # transformers' default
        decoder_sparse_step=keys.integer("decoder_sparse_step", 1),
        mlp_only_layers=tuple(layers),
    )
