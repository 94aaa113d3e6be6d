"""The vision encoders of Qwen2.5-VL and Qwen3-VL (minisgl.models.qwen2_5_vl_vision, qwen3_vl_vision) against
transformers' visual modules: tiny random models saved by transformers, their visual.* weights loaded into
minisgl's encoder, the same pixel values and grids in, float32 outputs compared, one to three images a batch."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from minisgl.models import vision
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


# -- attention within segments, the compiled block stack ------------------------------------------------


def per_segment(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    """The reference: softmax(q k^T / sqrt(d)) v of each segment alone, written out."""
    out = torch.zeros_like(q)
    for start, stop in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (t[start:stop].transpose(0, 1).double() for t in (q, k, v))  # (heads, length, dim)
        weights = torch.softmax(qs @ ks.transpose(1, 2) / q.shape[-1] ** 0.5, dim=-1)
        out[start:stop] = (weights @ vs).transpose(0, 1).to(q.dtype)
    return out


SEGMENTS = {
    "one": [0, 37],
    "equal": [0, 16, 32, 48],
    "unequal": [0, 5, 61, 62, 90],
    "windows of two images": [0, 16, 32, 40, 56, 60, 124, 128],
}


@pytest.mark.parametrize("bounds", list(SEGMENTS.values()), ids=list(SEGMENTS))
@pytest.mark.parametrize("method", ["sdpa", "loop"])
def test_segment_attention_equals_per_segment_reference(bounds: list[int], method: str) -> None:
    """One batched SDPA call (segments padded to the longest, padded keys masked), and the old loop, give
    each segment's own attention (float32, tight); `varlen_attention` is the one-off form of 'sdpa'."""
    generator = torch.Generator().manual_seed(len(bounds))
    q, k, v = (torch.randn(bounds[-1], 3, 16, generator=generator) * 2 for _ in range(3))
    expected = per_segment(q, k, v, bounds)
    plan = vision.SegmentPlan(bounds, torch.device("cpu"), method)
    torch.testing.assert_close(plan.attend(q, k, v), expected, rtol=1e-5, atol=1e-5)
    one_off = vision.varlen_attention(q, k, v, torch.tensor(bounds, dtype=torch.int32))
    torch.testing.assert_close(one_off, expected, rtol=1e-5, atol=1e-5)


def test_attention_methods_resolve_by_device_and_dtype() -> None:
    cpu = torch.device("cpu")
    assert vision.resolve_attention_method("auto", cpu, torch.bfloat16) == "sdpa"
    assert vision.resolve_attention_method("loop", cpu, torch.float32) == "loop"
    for fused in ("torch_varlen", "flashinfer"):
        with pytest.raises(ValueError, match="needs CUDA"):
            vision.resolve_attention_method(fused, cpu, torch.bfloat16)
    with pytest.raises(ValueError, match="not one of"):
        vision.resolve_attention_method("flash", cpu, torch.float32)
    with pytest.raises(ValueError, match="not one of"):
        Qwen3VisionEncoder(VisionConfig(**VISION, num_position_embeddings=36)).configure(attention="flash")


@pytest.mark.parametrize("family", list(FAMILIES))
@torch.inference_mode()
def test_loop_attention_equals_batched(family: str, request) -> None:
    """The encoder with the old per-segment attention ('loop') gives what the batched one gives."""
    ours = encoder(FAMILIES[family][0], request.getfixturevalue(f"{family}_folder"))
    pixel_values, grid_thw = inputs(GRIDS[2], ours.cfg.patch_dim, seed=7)
    batched = run(ours, pixel_values, grid_thw)
    ours.configure(attention="loop")
    looped = run(ours, pixel_values, grid_thw)
    for a, b in zip([batched[0], *batched[1]], [looped[0], *looped[1]]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", list(FAMILIES))
@torch.inference_mode()
def test_compiled_blocks_equal_eager(family: str, request) -> None:
    """The block stack under torch.compile (fullgraph, dynamic shapes; aot_eager on the CPU, inductor's
    C++ build being slow here) gives the eager outputs, for batches of several sizes without a
    recompile per size: no host value is read inside it (a read would break the graph)."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    ours = encoder(FAMILIES[family][0], request.getfixturevalue(f"{family}_folder"))
    batches = [inputs(grids, ours.cfg.patch_dim, seed=10 + i) for i, grids in enumerate(GRIDS)]
    eager = [run(ours, *batch) for batch in batches]
    counter = CompileCounterWithBackend("aot_eager")
    ours.configure(compile=True, backend=counter)
    compiled = [run(ours, *batch) for batch in batches]
    assert counter.frame_count == 1  # one graph for all sizes
    for (e, e_deep), (c, c_deep) in zip(eager, compiled):
        torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-5)
        assert len(c_deep) == len(e_deep)
        for a, b in zip(c_deep, e_deep):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    ours.configure(compile=False)
    assert ours._compiled is None


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_engine_start_compiles_on_a_dummy_image_once_for_every_size(family: str, request) -> None:
    """`compile_vision` (the engine's start phase on CUDA, setting compile_vision) compiles the blocks
    on its dummy image, and the images of every other size after it run that graph, no recompile."""
    import types

    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend

    from minisgl.engine.start import compile_vision

    torch._dynamo.reset()
    ours = encoder(FAMILIES[family][0], request.getfixturevalue(f"{family}_folder"))
    batches = [inputs(grids, ours.cfg.patch_dim, seed=20 + i) for i, grids in enumerate(GRIDS)]
    with torch.inference_mode():
        eager = [run(ours, *batch)[0] for batch in batches]
    model = types.SimpleNamespace(visual=ours, encode_images=lambda pixels, grid: run(ours, pixels, grid))
    config = types.SimpleNamespace(torch_device=torch.device("cpu"), torch_dtype=torch.float32)
    counter = CompileCounterWithBackend("aot_eager")
    compile_vision(config, model, backend=counter)
    assert ours._compiled is not None and counter.frame_count == 1
    with torch.inference_mode():
        for batch, want in zip(batches, eager):
            torch.testing.assert_close(run(ours, *batch)[0], want, rtol=1e-5, atol=1e-5)
    assert counter.frame_count == 1


def test_perf_script_dry_run(capsys) -> None:
    """`python -m perf.gpu.vision --shape cpu`: a tiny encoder timed per attention method on the CPU, eager
    and compiled (aot_eager), and its GEMMs alone."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: perf.gpu.vision
    from perf.gpu import vision as script

    rows = script.main(["--shape", "cpu", "--image", "112x84"])
    assert [(row["attention"], row["compiled"]) for row in rows] == [
        ("sdpa", False), ("loop", False), ("sdpa", True), ("loop", True),
    ]  # fmt: skip
    assert all(row["ms"] > 0 for row in rows)
    assert "the GEMMs alone" in capsys.readouterr().out
