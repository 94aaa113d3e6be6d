"""Image preprocessing of Qwen2.5-VL and Qwen3-VL: an image in, the vision encoder's pixel values out.

Both families read images the same way (transformers' Qwen2VLImageProcessor, its PIL backend), with
their own numbers from the folder's preprocessor_config.json (patch 14 and CLIP's mean and std for
Qwen2.5-VL; patch 16 and 0.5 for Qwen3-VL):

1. RGB, transparency composited onto white;
2. the smart resize: each side a multiple of patch_size * merge_size, the pixel count within
   [min_pixels, max_pixels], the aspect ratio kept as closely as possible (Pillow's bicubic filter);
3. cut into patches, (grid_h * grid_w, C, patch_size ** 2) 8-bit values, ordered so that each
   merge_size x merge_size block of patches is contiguous (the patch merger takes them in fours), with
   grid_thw = (1, grid_h, grid_w);
4. on the encoder's device (`minisgl.multimodal.inputs.pixel_rows`): rescale by 1/255, normalize by the
   mean and std, and the rows (grid_h * grid_w, C * temporal_patch_size * patch_size ** 2), the still
   image repeated over the temporal patch.

The prompt holds one placeholder token per merged patch: grid_h * grid_w // merge_size ** 2.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from minisgl.multimodal.inputs import PixelScale, ProcessedImage
from minisgl.multimodal.media import MediaError

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 200


@dataclass(frozen=True)
class ImageProcessorConfig:
    """A folder's preprocessor_config.json, as far as images go (defaults: transformers' Qwen2-VL ones)."""

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    rescale_factor: float = 1 / 255
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    resample: int = Image.Resampling.BICUBIC

    @property
    def factor(self) -> int:
        """What both sides of a resized image are multiples of."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_dict(
        cls, raw: dict[str, Any], min_pixels: int | None = None, max_pixels: int | None = None
    ) -> ImageProcessorConfig:
        """From preprocessor_config.json's keys; `min_pixels` / `max_pixels` (the settings
        image_min_pixels / image_max_pixels) override the folder's where given."""
        size = raw.get("size") or {}
        folder_min = raw.get("min_pixels", size.get("shortest_edge", cls.min_pixels))
        folder_max = raw.get("max_pixels", size.get("longest_edge", cls.max_pixels))
        known = {name: raw[name] for name in cls.__dataclass_fields__ if name in raw}
        for name in ("image_mean", "image_std"):
            if name in known:
                known[name] = tuple(known[name])
        config = cls(
            **{
                **known,
                "min_pixels": folder_min if min_pixels is None else min_pixels,
                "max_pixels": folder_max if max_pixels is None else max_pixels,
            }
        )
        if config.min_pixels > config.max_pixels:
            raise ValueError(
                f"image_min_pixels={config.min_pixels} is more than image_max_pixels={config.max_pixels} "
                "(from the settings or the folder's preprocessor_config.json); lower the one or raise the other"
            )
        return config

    @classmethod
    def from_folder(
        cls, folder: str | Path, min_pixels: int | None = None, max_pixels: int | None = None
    ) -> ImageProcessorConfig:
        """From `folder`/preprocessor_config.json (see `from_dict`)."""
        path = Path(folder) / "preprocessor_config.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"{str(path)!r} does not exist: a vision-language model folder holds its image processor's "
                "config (save it with the model's processor, e.g. AutoProcessor.save_pretrained)"
            )
        return cls.from_dict(json.loads(path.read_text(encoding="utf-8")), min_pixels, max_pixels)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) resized: multiples of `factor`, the area within [min_pixels, max_pixels] where the
    multiples allow, the aspect ratio kept; each side rounded to the nearest multiple, then scaled down
    (rounding down) or up (rounding up) as a whole when the area is out of bounds."""
    if max(height, width) > MAX_ASPECT_RATIO * min(height, width):
        raise MediaError(
            f"an image of {width}x{height} pixels: its aspect ratio is more than {MAX_ASPECT_RATIO} "
            "(crop or pad it)"
        )
    new_h, new_w = round(height / factor) * factor, round(width / factor) * factor
    if new_h * new_w > max_pixels:
        scale = math.sqrt(height * width / max_pixels)
        new_h = max(factor, math.floor(height / scale / factor) * factor)
        new_w = max(factor, math.floor(width / scale / factor) * factor)
    elif new_h * new_w < min_pixels:
        scale = math.sqrt(min_pixels / (height * width))
        new_h = math.ceil(height * scale / factor) * factor
        new_w = math.ceil(width * scale / factor) * factor
    return new_h, new_w


def to_rgb(image: Image.Image) -> Image.Image:
    """`image` in RGB, any transparency composited onto a white background."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        white = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, image.convert("RGBA")).convert("RGB")
    return image.convert("RGB")


def num_image_tokens(height: int, width: int, config: ImageProcessorConfig) -> int:
    """The placeholder tokens of an image of height x width pixels (its merged patches)."""
    if config.do_resize:
        height, width = smart_resize(height, width, config.factor, config.min_pixels, config.max_pixels)
    return (height // config.patch_size) * (width // config.patch_size) // config.merge_size**2


def preprocess_image(image: Image.Image, config: ImageProcessorConfig) -> ProcessedImage:
    """`image` resized, normalized and cut into patches (see the module docstring)."""
    image = to_rgb(image)
    if config.do_resize:
        height, width = smart_resize(
            image.height, image.width, config.factor, config.min_pixels, config.max_pixels
        )
        image = image.resize((width, height), resample=config.resample)
    pixels = torch.from_numpy(np.ascontiguousarray(np.asarray(image).transpose(2, 0, 1)))  # (C, H, W)
    patches, grid_h, grid_w = cut_patches(pixels, config)
    scale = PixelScale(
        config.rescale_factor if config.do_rescale else None,
        config.image_mean if config.do_normalize else None,
        config.image_std if config.do_normalize else None,
        config.temporal_patch_size,
    )
    return ProcessedImage(patches, scale, (1, grid_h, grid_w), grid_h * grid_w // config.merge_size**2)


def cut_patches(pixels: torch.Tensor, config: ImageProcessorConfig) -> tuple[torch.Tensor, int, int]:
    """(C, H, W) pixels -> (grid_h * grid_w, C, P * P) patches (one copy), each merge block's together."""
    channels, height, width = pixels.shape
    p, m = config.patch_size, config.merge_size
    if height % (p * m) or width % (p * m):
        raise ValueError(f"an image of {width}x{height} pixels does not split into {p * m}-pixel blocks")
    grid_h, grid_w = height // p, width // p
    blocks = pixels.reshape(channels, grid_h // m, m, p, grid_w // m, m, p)
    # (block row, block col, row in block, col in block, C, p, p)
    blocks = blocks.permute(1, 4, 2, 5, 0, 3, 6)
    return blocks.reshape(grid_h * grid_w, channels, p * p), grid_h, grid_w


def preprocess_images(
    images: list[Image.Image], config: ImageProcessorConfig
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Several images, as the encoder takes them: their rows concatenated, their (n, 3) grid_thw, and
    each one's number of placeholder tokens."""
    processed = [preprocess_image(image, config) for image in images]
    pixel_values = torch.cat([p.pixel_values for p in processed])
    grid_thw = torch.tensor([p.grid_thw for p in processed], dtype=torch.int64)
    return pixel_values, grid_thw, [p.num_tokens for p in processed]
