"""minisgl.multimodal.qwen_vl against transformers' Qwen2-VL image processor (what Qwen2.5-VL and Qwen3-VL
folders name): the same pixel values and grid sizes for several sizes, aspect ratios, modes and pixel bounds."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from minisgl.multimodal.media import MediaError
from minisgl.multimodal.qwen_vl import (
    ImageProcessorConfig,
    num_image_tokens,
    preprocess_image,
    preprocess_images,
    smart_resize,
)

transformers = pytest.importorskip("transformers")

# the families' preprocessor configs, as their hub folders give them (the pixel bounds kept small here)
FAMILIES = {
    "qwen2_5_vl": {"patch_size": 14, "min_pixels": 3136, "max_pixels": 200_000},
    "qwen3_vl": {
        "patch_size": 16,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "size": {"shortest_edge": 65536, "longest_edge": 300_000},
    },
}


def reference_processor(family: str, folder: Path, **overrides):
    """transformers' processor for `family`, saved to `folder` and loaded back the way a model's is."""
    kwargs = dict(FAMILIES[family])
    processor = transformers.AutoImageProcessor.from_pretrained(_save(family, folder, kwargs), **overrides)
    return processor


def _save(family: str, folder: Path, kwargs: dict) -> Path:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    folder.mkdir(parents=True, exist_ok=True)
    Qwen2VLImageProcessorPil(**kwargs).save_pretrained(folder)
    return folder


def noise_image(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    data = rng.integers(0, 256, size=(height, width, channels), dtype=np.uint8)
    return Image.fromarray(data[..., 0] if channels == 1 else data, mode)


SIZES = [(100, 60), (37, 450), (640, 480), (20, 20), (1000, 90), (333, 777)]


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize(("width", "height"), SIZES)
def test_pixel_values_and_grid_equal_transformers(
    family: str, width: int, height: int, tmp_path: Path
) -> None:
    reference = reference_processor(family, tmp_path)
    config = ImageProcessorConfig.from_folder(tmp_path)
    image = noise_image(width, height, seed=width * height)
    expected = reference(images=[image], return_tensors="pt")
    got = preprocess_image(image, config)
    assert got.grid_thw == tuple(expected["image_grid_thw"][0].tolist())
    assert got.patches.dtype == torch.uint8 and got.pixel_values.dtype == torch.float32
    torch.testing.assert_close(got.pixel_values, expected["pixel_values"], rtol=1e-6, atol=1e-6)
    assert got.num_tokens == expected["image_grid_thw"][0].prod().item() // reference.merge_size**2
    assert num_image_tokens(height, width, config) == got.num_tokens


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize(("min_pixels", "max_pixels"), [(None, 100_000), (150_000, None), (70_000, 120_000)])
def test_pixel_bound_overrides_equal_transformers(
    family: str, min_pixels: int | None, max_pixels: int | None, tmp_path: Path
) -> None:
    overrides = {k: v for k, v in {"min_pixels": min_pixels, "max_pixels": max_pixels}.items() if v}
    reference = reference_processor(family, tmp_path, **overrides)
    config = ImageProcessorConfig.from_folder(tmp_path, min_pixels=min_pixels, max_pixels=max_pixels)
    images = [noise_image(500, 300, seed=1), noise_image(90, 70, seed=2), noise_image(64, 900, seed=3)]
    expected = reference(images=images, return_tensors="pt")
    pixel_values, grid_thw, tokens = preprocess_images(images, config)
    assert torch.equal(grid_thw, expected["image_grid_thw"])
    torch.testing.assert_close(pixel_values, expected["pixel_values"], rtol=1e-6, atol=1e-6)
    assert tokens == (expected["image_grid_thw"].prod(-1) // reference.merge_size**2).tolist()
    area = (grid_thw[:, 1] * grid_thw[:, 2] * config.patch_size**2).tolist()
    if max_pixels:
        assert max(area) <= max_pixels
    if min_pixels:
        assert min(area) >= min_pixels


@pytest.mark.parametrize("mode", ["RGBA", "L"])
def test_other_modes_equal_transformers(mode: str, tmp_path: Path) -> None:
    reference = reference_processor("qwen2_5_vl", tmp_path)
    image = noise_image(120, 90, mode=mode, seed=7)
    expected = reference(images=[image], return_tensors="pt")
    got = preprocess_image(image, ImageProcessorConfig.from_folder(tmp_path))
    torch.testing.assert_close(got.pixel_values, expected["pixel_values"], rtol=1e-6, atol=1e-6)


def test_smart_resize_bounds() -> None:
    for height, width in [(1, 150), (7, 7), (4000, 3000), (28, 28), (999, 1001)]:
        h, w = smart_resize(height, width, 28, 3136, 500_000)
        assert h % 28 == 0 and w % 28 == 0 and 3136 <= h * w <= 500_000
    with pytest.raises(MediaError, match="aspect ratio"):
        smart_resize(10, 2001, 28, 3136, 500_000)


def test_config_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="preprocessor_config.json"):
        ImageProcessorConfig.from_folder(tmp_path)
    with pytest.raises(ValueError, match="image_min_pixels=9000 is more than image_max_pixels=4000"):
        ImageProcessorConfig.from_dict({}, min_pixels=9000, max_pixels=4000)
