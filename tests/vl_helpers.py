"""Tiny random Qwen2.5-VL and Qwen3-VL folders for the vision-language tests (tests/test_vl_models.py),
built with transformers, with the default model's tokenizer extended by the Qwen vision tokens and a
ChatML chat template that renders image parts as Qwen's do; and transformers' own processor and
`generate` as the reference."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# ChatML, an image part rendered as Qwen2.5-VL's and Qwen3-VL's templates render it
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] in ('image', 'image_url') %}<|vision_start|><|image_pad|><|vision_end|>{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEXT = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=4096,
)  # fmt: skip
VISION = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64)
PIXELS = dict(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 40)  # at most 40 merged patches an image


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that every position, image row and layer changes the greedy tokens."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=generator) if "norm" in name
                            else 0.2 * torch.randn(param.shape, generator=generator))  # fmt: skip
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * param.shape[-1] ** -0.5 * 1.5)


def make_tiny_vl(tmp_path: Path, family: str, seed: int = 0) -> Path:
    """A tiny random `family` ('qwen2_5_vl' or 'qwen3_vl') folder as transformers saves it, with a
    tokenizer, a chat template and a preprocessor config."""
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from minisgl.models.default import default_model_path

    tokenizer = transformers.AutoTokenizer.from_pretrained(default_model_path())
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in VISION_TOKENS}
    special = dict(
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
    )  # fmt: skip
    text = dict(TEXT, vocab_size=len(tokenizer), bos_token_id=1, eos_token_id=2, pad_token_id=2)
    if family == "qwen2_5_vl":
        patch = 14
        config = transformers.Qwen2_5_VLConfig(
            text_config=dict(text, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
            vision_config=dict(VISION, patch_size=patch, window_size=56, fullatt_block_indexes=[2]),
            **special,
        )
        model = transformers.Qwen2_5_VLForConditionalGeneration(config)
    else:
        patch = 16
        config = transformers.Qwen3VLConfig(
            text_config=dict(text, rope_scaling={"rope_type": "default", "mrope_section": [2, 3, 3]}),
            vision_config=dict(
                VISION, patch_size=patch, num_position_embeddings=64, deepstack_visual_indexes=[0, 1]
            ),
            **special,
        )
        model = transformers.Qwen3VLForConditionalGeneration(config)
    _randomize(model, seed)
    folder = tmp_path / f"tiny-{family}"
    model.save_pretrained(folder)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    scale = (patch / 14) ** 2
    Qwen2VLImageProcessorPil(
        patch_size=patch,
        min_pixels=int(PIXELS["min_pixels"] * scale),
        max_pixels=int(PIXELS["max_pixels"] * scale),
    ).save_pretrained(folder)
    return folder


def noise_image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


class Reference:
    """transformers' model, tokenizer and image processor of a folder: greedy tokens of a conversation.
    The prompt is made as transformers' Qwen VL processors make it (their class needs a video processor,
    which needs torchvision): the image processor's pixel values and grids, each ``<|image_pad|>``
    repeated grid_t * grid_h * grid_w / merge_size**2 times, and mm_token_type_ids marking them."""

    def __init__(self, folder: Path, family: str) -> None:
        import transformers

        cls = "Qwen2_5_VL" if family == "qwen2_5_vl" else "Qwen3VL"
        self.model = (
            getattr(transformers, f"{cls}ForConditionalGeneration")
            .from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
            .eval()
        )
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
        self.image_processor = transformers.AutoImageProcessor.from_pretrained(folder, backend="pil")

    def inputs(self, messages: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        images = [p["image"] for m in messages if isinstance(m["content"], list) for p in m["content"]
                  if p["type"] == "image"]  # fmt: skip
        extra: dict[str, torch.Tensor] = {}
        if images:
            extra = dict(self.image_processor(images=images, return_tensors="pt"))
            merge = self.image_processor.merge_size**2
            pieces = text.split("<|image_pad|>")
            assert len(pieces) == len(images) + 1
            counts = (extra["image_grid_thw"].prod(-1) // merge).tolist()
            text = pieces[0] + "".join("<|image_pad|>" * n + piece for n, piece in zip(counts, pieces[1:]))
        ids = self.tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        image_id = self.model.config.image_token_id
        return dict(extra, input_ids=ids, attention_mask=torch.ones_like(ids),
                    mm_token_type_ids=(ids == image_id).to(torch.int32))  # fmt: skip

    def generate(self, messages: list[dict[str, Any]], max_tokens: int) -> list[int]:
        inputs = self.inputs(messages)
        with torch.no_grad():
            out = self.model.generate(
                **inputs, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False
            )
        return out[0, inputs["input_ids"].shape[1] :].tolist()
