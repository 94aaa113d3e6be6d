"""Chat messages with images (OpenAI content parts) to a prompt's token ids and its `ImageInputs`.

A message's content may be a string or a list of parts: ``{"type": "text", "text": ...}``,
``{"type": "image_url", "image_url": {"url": ...}}`` (or the URL as the value), and from Python
``{"type": "image", "image": <PIL image | path>}``. Images load through `load_image` (URLs, data URLs
and local files under the media settings' policy), the chat template renders each as the model's
vision placeholder (Qwen: ``<|vision_start|><|image_pad|><|vision_end|>``), and each image's
``<|image_pad|>`` is expanded to as many tokens as its merged patches, as transformers' processor does.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from minisgl.models.config import ModelConfig
from minisgl.multimodal.config import MediaConfig
from minisgl.multimodal.inputs import ImageInputs
from minisgl.templates import render_chat

IMAGE_PART_TYPES = ("image_url", "image")


class VisionPrompter:
    """Builds vision-language prompts for one model folder under the media settings."""

    def __init__(
        self, model_path: str | Path, model_config: ModelConfig, media: MediaConfig, trust_paths: bool = False
    ) -> None:
        """`trust_paths`: a string that is no URL names a local file the caller may read (`LLM`, in the
        process itself); otherwise it is checked against `allowed_local_media_path` (the server)."""
        self.model_path, self.model_config, self.media = model_path, model_config, media
        self.trust_paths = trust_paths
        self._processor = None  # the folder's ImageProcessorConfig, read at the first image

    def collect(self, messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[Any]]:
        """The messages as the chat template takes them (image parts as ``{"type": "image"}``, a list of
        text parts only joined into one string) and the image references, in order; ValueError for a
        malformed part, more images than `max_images_per_request`, or images for a text-only model."""
        out, refs = [], []
        for message in messages:
            content = message.get("content") if isinstance(message, Mapping) else None
            if not isinstance(content, list):
                out.append(message)
                continue
            parts = []
            for part in content:
                kind = part.get("type") if isinstance(part, Mapping) else None
                if kind == "text":
                    parts.append({"type": "text", "text": part.get("text", "")})
                elif kind in IMAGE_PART_TYPES:
                    refs.append(_image_ref(part, kind, self.trust_paths))
                    parts.append({"type": "image"})
                else:
                    raise ValueError(
                        f"a message content part must be of type 'text', 'image_url' or 'image', got {part!r}"
                    )
            if all(p["type"] == "text" for p in parts):
                out.append({**message, "content": "".join(p["text"] for p in parts)})
            else:
                out.append({**message, "content": parts})
        if refs:
            self.check_count(len(refs))
        return out, refs

    def check_count(self, count: int) -> None:
        """Raises a ValueError for `count` images to a text-only model, or more than the setting allows."""
        if not self.model_config.is_multimodal:
            raise ValueError(f"the request carries {count} image(s), but {self.model_config.why_no_images}")
        limit = self.media.max_images_per_request
        if count > limit:
            raise ValueError(
                f"the request carries {count} images, more than max_images_per_request={limit}: send "
                "fewer, or raise the setting"
            )

    def processor(self) -> Any:
        if self._processor is None:
            from minisgl.multimodal.qwen_vl import ImageProcessorConfig

            self._processor = ImageProcessorConfig.from_folder(
                self.model_path, self.media.image_min_pixels, self.media.image_max_pixels
            )
        return self._processor

    def prompt(
        self,
        tokenizer: Any,
        messages: list[dict[str, Any]],
        template_kwargs: Mapping[str, Any] | None,
        tools: list[dict[str, Any]] | None = None,
    ) -> tuple[list[int], ImageInputs | None]:
        """The prompt's token ids under the chat template (`tools`: as `render_chat` takes them), ready
        for the reply, and its images' inputs (None without images). Raises `MediaError` (a
        ValueError) for an image that does not load."""
        messages, refs = self.collect(messages)
        text = render_chat(tokenizer, messages, template_kwargs, tools)
        return self.text_prompt(tokenizer, text, refs)

    def text_prompt(self, tokenizer: Any, text: str, refs: list[Any]) -> tuple[list[int], ImageInputs | None]:
        """The ids of `text` (no special tokens added), whose image placeholders (one
        ``<|image_pad|>`` per image, as the chat template renders them) stand for the images `refs`, in
        order; their inputs (None without images). ValueError where the counts differ."""
        if not refs:
            return tokenizer(text, add_special_tokens=False)["input_ids"], None
        self.check_count(len(refs))
        from minisgl.multimodal.media import load_image
        from minisgl.multimodal.qwen_vl import preprocess_image

        policy = self.media.policy()
        processed = [preprocess_image(load_image(ref, policy), self.processor()) for ref in refs]
        cfg = self.model_config
        pad = tokenizer.convert_ids_to_tokens(cfg.image_token_id)
        pieces = text.split(pad)
        if len(pieces) != len(processed) + 1:
            raise ValueError(
                f"the prompt holds {len(pieces) - 1} image placeholders {pad!r} for {len(processed)} images: "
                "give one per image (the model folder's chat template emits one per image part)"
            )
        expanded = pieces[0] + "".join(
            pad * image.num_tokens + piece for image, piece in zip(processed, pieces[1:])
        )
        ids = tokenizer(expanded, add_special_tokens=False)["input_ids"]
        return ids, ImageInputs.build(ids, processed, cfg.image_token_id, cfg.vision.spatial_merge_size)


def _image_ref(part: Mapping[str, Any], kind: str, trust_paths: bool) -> Any:
    value = part.get(kind)
    if kind == "image_url" and isinstance(value, Mapping):
        value = value.get("url")
    if value is None:
        raise ValueError(f"the {kind} content part {dict(part)!r} names no image (its {kind!r} field)")
    if trust_paths and isinstance(value, str) and ":" not in value.split("/", 1)[0]:
        return Path(value)  # a plain path from the process itself (no scheme: not a URL)
    return value
