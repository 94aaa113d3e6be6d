"""The vision encoders of Qwen2.5-VL and Qwen3-VL (minisgl.models.qwen2_5_vl_vision, qwen3_vl_vision) against
transformers' visual modules: tiny random models saved by transformers, their visual.* weights loaded into
minisgl's encoder, the same pixel values and grids in, float32 outputs compared, one to three images a batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from minisgl.models.qwen2_5_vl_vision import Qwen2_5_VisionEncoder, window_order
from minisgl.models.qwen3_vl_vision import Qwen3VisionEncoder
from minisgl.models.vision import VisionConfig, load_visual_weights

transformers = pytest.importorskip("transformers")

TEXT = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, vocab_size=256, bos_token_id=0, eos_token_id=1, pad_token_id=1,
)  # fmt: skip
VISION = dict(depth=4, hidden_size=64, intermediate_size=96, num_heads=4, out_hidden_size=48)

# grids (t, h, w) in patches: windows cut short at the edges, learned positions resized up and down
GRIDS = [[(1, 4, 6)], [(1, 10, 8), (1, 6, 14)], [(1, 2, 2), (1, 12, 10), (1, 8, 4)]]


def _randomize(module: torch.nn.Module, seed: int) -> None:
    """Weights large enough that attention is far from uniform (a wrong mask or order shows)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            scale = 1.0 if param.dim() == 1 else param.shape[-1] ** -0.5 * 1.5
            param.copy_(torch.randn(param.shape, generator=generator) * scale)


def _save(model, folder: Path) -> Path:
    _randomize(model.model.visual, seed=0)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def qwen2_5_vl_folder(tmp_path_factory) -> Path:
    config = transformers.Qwen2_5_VLConfig(
        text_config=dict(TEXT, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
        vision_config=dict(VISION, patch_size=14, window_size=56, fullatt_block_indexes=[1, 3]),
    )
    model = transformers.Qwen2_5_VLForConditionalGeneration(config)
    return _save(model, tmp_path_factory.mktemp("qwen2_5_vl"))


@pytest.fixture(scope="module")
def qwen3_vl_folder(tmp_path_factory) -> Path:
    config = transformers.Qwen3VLConfig(
        text_config=dict(TEXT, rope_scaling={"rope_type": "default", "mrope_section": [2, 3, 3]}),
        vision_config=dict(
            VISION, patch_size=16, num_position_embeddings=36, deepstack_visual_indexes=[2, 0]
        ),
    )
    model = transformers.Qwen3VLForConditionalGeneration(config)
    return _save(model, tmp_path_factory.mktemp("qwen3_vl"))


def reference_visual(folder: Path, cls_name: str):
    model = getattr(transformers, cls_name).from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    )
    return model.model.visual.eval()


def inputs(grids: list[tuple[int, int, int]], patch_dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    grid_thw = torch.tensor(grids, dtype=torch.int64)
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(int(grid_thw.prod(-1).sum()), patch_dim, generator=generator), grid_thw


def encoder(cls, folder: Path):
    model = cls(VisionConfig.from_folder(folder))
    load_visual_weights(model, folder)
    return model.eval()


FAMILIES = {
    "qwen2_5_vl": (Qwen2_5_VisionEncoder, "Qwen2_5_VLForConditionalGeneration"),
    "qwen3_vl": (Qwen3VisionEncoder, "Qwen3VLForConditionalGeneration"),
}


def run(model, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(embeddings, DeepStack features) of either encoder (Qwen2.5-VL's has none)."""
    out = model(pixel_values, grid_thw)
    return out if isinstance(out, tuple) else (out, [])


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("grids", GRIDS, ids=len)
@torch.inference_mode()
def test_encoder_equals_transformers(family: str, grids, request) -> None:
    folder = request.getfixturevalue(f"{family}_folder")
    encoder_cls, reference_cls = FAMILIES[family]
    ours = encoder(encoder_cls, folder)
    pixel_values, grid_thw = inputs(grids, ours.cfg.patch_dim, seed=len(grids))
    expected = reference_visual(folder, reference_cls)(pixel_values, grid_thw=grid_thw)
    got, deepstack = run(ours, pixel_values, grid_thw)
    assert got.shape == (int(grid_thw.prod(-1).sum()) // 4, 48)
    torch.testing.assert_close(got, expected.pooler_output, rtol=1e-4, atol=1e-4)
    expected_deepstack = getattr(expected, "deepstack_features", None) or []
    assert len(deepstack) == len(expected_deepstack) == (2 if family == "qwen3_vl" else 0)
    for mine, theirs in zip(deepstack, expected_deepstack):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", list(FAMILIES))
@torch.inference_mode()
def test_images_of_a_batch_do_not_see_each_other(family: str, request) -> None:
    """Each image's embeddings in a batch equal those of the image alone (no attention across images)."""
    ours = encoder(FAMILIES[family][0], request.getfixturevalue(f"{family}_folder"))
    pixel_values, grid_thw = inputs(GRIDS[2], ours.cfg.patch_dim, seed=5)
    batched, _ = run(ours, pixel_values, grid_thw)
    start = merged = 0
    for grid in grid_thw:
        patches = int(grid.prod())
        alone, _ = run(ours, pixel_values[start : start + patches], grid[None])
        torch.testing.assert_close(batched[merged : merged + patches // 4], alone, rtol=1e-5, atol=1e-5)
        start, merged = start + patches, merged + patches // 4


def test_window_order_segments() -> None:
    """Windows of 2 merged tokens a side over a 3 x 5 grid of merged tokens: 2 x 3 windows, the last row and
    column cut short; each window's tokens contiguous, in the image's order inside it."""
    units, cu = window_order(torch.tensor([[1, 6, 10]]), merge_size=2, window=2)
    assert units.tolist() == [0, 1, 5, 6, 2, 3, 7, 8, 4, 9, 10, 11, 12, 13, 14]
    assert (torch.diff(cu) // 4).tolist() == [4, 4, 2, 2, 2, 1]


def test_load_refuses_a_folder_without_visual_weights(tmp_path: Path, qwen3_vl_folder: Path) -> None:
    from safetensors.torch import save_file

    save_file({"model.language_model.norm.weight": torch.ones(4)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="no visual"):
        load_visual_weights(Qwen3VisionEncoder(VisionConfig.from_folder(qwen3_vl_folder)), tmp_path)
