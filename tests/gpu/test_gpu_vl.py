"""Qwen2.5-VL and Qwen3-VL on the GPU in bf16: tiny random models saved by transformers
(tests/vl_helpers.py) with the vision head dims of the real ones (80: Qwen2.5-VL's, 72: Qwen3-VL's,
neither a multiple of 64, so FlashInfer's ragged prefill runs padded to 128).

- the encoder (every attention method the machine has: batched SDPA, the old per-segment loop, torch's
  varlen attention, FlashInfer's ragged prefill) against transformers' visual module in float32, one
  to three images a batch; the methods against each other; the compiled block stack (inductor, one
  graph for every batch size) against eager;
- `LLM.chat` with images: the first token's top-20 log probabilities against transformers' float32
  logits, the greedy tokens transformers' argmax or a near tie (teacher-forced on minisgl's tokens),
  with CUDA graphs and without.

Skips without CUDA (the FlashInfer cases without flashinfer, the varlen ones without
torch.nn.attention.varlen):

    python -m pytest tests/gpu/test_gpu_vl.py -v -s
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from conftest import rel_err

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
transformers = pytest.importorskip("transformers")

BF16_TOL = 2e-2  # tests/gpu's bound on bf16 against float32 (relative, over the whole tensor)
METHOD_TOL = 1e-2  # bf16 against bf16: the methods differ in accumulation order only
NEAR_TIE = 0.1  # nats: a greedy token this close to transformers' best counts as agreeing
STEPS = 8
# the text model: head_dim 128 (= hidden / heads: transformers' Qwen2.5-VL text attention derives it)
TEXT = dict(
    hidden_size=256, intermediate_size=512, num_attention_heads=2, num_key_value_heads=1, head_dim=128
)
# head dims 80 and 72 (2 heads); 4 blocks, Qwen2.5-VL's block 2 over whole images, the others in windows
VISION = {
    "qwen2_5_vl": dict(depth=4, hidden_size=160, intermediate_size=192, num_heads=2, out_hidden_size=256),
    "qwen3_vl": dict(depth=4, hidden_size=144, intermediate_size=192, num_heads=2, out_hidden_size=256),
}
# (t, h, w) grids in patches: windows cut short at the edges; one image, two, three of unequal sizes
GRIDS = [[(1, 16, 24)], [(1, 10, 8), (1, 22, 14)], [(1, 2, 2), (1, 28, 20), (1, 8, 4)]]
METHODS = ["sdpa", "loop", "torch_varlen", "flashinfer"]


def _have(method: str) -> bool:
    """Whether this machine has `method` (CUDA assumed)."""
    if method == "flashinfer":
        return importlib.util.find_spec("flashinfer") is not None
    if method == "torch_varlen":
        return importlib.util.find_spec("torch.nn.attention.varlen") is not None
    return True


def make_gpu_vl(root: Path, family: str) -> Path:
    """`vl_helpers.make_tiny_vl`'s folder (tokenizer, template, preprocessor) with the vision shape of
    VISION and the text model rebuilt with TEXT's attention (head_dim 128, which FlashInfer's text
    kernels need; M-RoPE sections of Qwen2.5-VL-7B's [16, 24, 24])."""
    import vl_helpers

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(vl_helpers, "VISION", VISION[family])
        folder = vl_helpers.make_tiny_vl(root, family)
    config = transformers.AutoConfig.from_pretrained(folder)
    text = config.text_config
    for name, value in TEXT.items():
        setattr(text, name, value)
    rope = getattr(text, "rope_parameters", None) or text.rope_scaling
    rope["mrope_section"] = [16, 24, 24]
    model = transformers.AutoModelForImageTextToText.from_config(config)
    vl_helpers._randomize(model, seed=0)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", params=list(VISION))
def vl(request, tmp_path_factory) -> tuple[str, Path]:
    return request.param, make_gpu_vl(tmp_path_factory.mktemp(request.param), request.param)


def _encoder(family: str, folder: Path, method: str = "auto"):
    from minisgl.models.qwen_vl import ENCODERS
    from minisgl.models.vision import VisionConfig, load_visual_weights

    model = ENCODERS[family](VisionConfig.from_folder(folder))
    load_visual_weights(model, folder)
    model.configure(attention=method)
    return model.to("cuda", torch.bfloat16).eval()


def _reference(family: str, folder: Path):
    cls = (
        "Qwen2_5_VLForConditionalGeneration" if family == "qwen2_5_vl" else "Qwen3VLForConditionalGeneration"
    )
    model = getattr(transformers, cls).from_pretrained(
        folder, dtype=torch.float32, attn_implementation="sdpa"
    )
    return model.model.visual.to("cuda").eval()


def _inputs(grids, patch_dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    grid_thw = torch.tensor(grids, dtype=torch.int64)
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randn(int(grid_thw.prod(-1).sum()), patch_dim, generator=generator)
    return pixels.cuda(), grid_thw


def _run(model, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
    """The embeddings and the DeepStack features (Qwen3-VL), float32, as one list."""
    out = model(pixel_values.to(torch.bfloat16), grid_thw)
    embeds, deepstack = out if isinstance(out, tuple) else (out, [])
    return [t.float() for t in (embeds, *deepstack)]


@pytest.mark.parametrize("method", METHODS)
@torch.inference_mode()
def test_encoder_bf16_against_transformers(vl, method: str) -> None:
    family, folder = vl
    if not _have(method):
        pytest.skip(f"{method} is not installed")
    ours, reference = _encoder(family, folder, method), _reference(family, folder)
    for i, grids in enumerate(GRIDS):
        pixel_values, grid_thw = _inputs(grids, ours.cfg.patch_dim, seed=i)
        expected = reference(pixel_values, grid_thw=grid_thw.cuda())
        want = [expected.pooler_output, *(getattr(expected, "deepstack_features", None) or [])]
        got = _run(ours, pixel_values, grid_thw)
        assert len(got) == len(want)
        errors = [rel_err(g, w.float()) for g, w in zip(got, want)]
        print(f"{family} {method} {grids}: relative error {max(errors):.4f}")
        assert max(errors) < BF16_TOL, errors


@pytest.mark.parametrize("method", ["loop", "torch_varlen", "flashinfer"])
@torch.inference_mode()
def test_attention_methods_agree(vl, method: str) -> None:
    """Each one-launch method against the batched SDPA (the CPU's reference path), device grid_thw too."""
    family, folder = vl
    if not _have(method):
        pytest.skip(f"{method} is not installed")
    sdpa, other = _encoder(family, folder, "sdpa"), _encoder(family, folder, method)
    for i, grids in enumerate(GRIDS):
        pixel_values, grid_thw = _inputs(grids, sdpa.cfg.patch_dim, seed=10 + i)
        for a, b in zip(_run(sdpa, pixel_values, grid_thw), _run(other, pixel_values, grid_thw.cuda())):
            assert rel_err(b, a) < METHOD_TOL, (grids, rel_err(b, a))


@pytest.mark.parametrize("method", ["auto", "sdpa", "flashinfer"])
@torch.inference_mode()
def test_compiled_blocks_against_eager(vl, method: str) -> None:
    """The block stack compiled by inductor (the attention as the opaque op; 'auto': torch's varlen
    attention where torch has it) gives the eager outputs within bf16 rounding, with one graph for the
    three batch sizes."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend

    family, folder = vl
    if not _have(method):
        pytest.skip(f"{method} is not installed")
    torch._dynamo.reset()
    ours = _encoder(family, folder, method)
    batches = [_inputs(grids, ours.cfg.patch_dim, seed=20 + i) for i, grids in enumerate(GRIDS)]
    eager = [_run(ours, *batch) for batch in batches]
    counter = CompileCounterWithBackend("inductor")
    ours.configure(compile=True, backend=counter)
    compiled = [_run(ours, *batch) for batch in batches]
    assert counter.frame_count == 1
    for e, c in zip(eager, compiled):
        for a, b in zip(e, c):
            assert rel_err(b, a) < METHOD_TOL


def _messages():
    from vl_helpers import noise_image

    image = lambda w, h, seed: {"type": "image", "image": noise_image(w, h, seed)}  # noqa: E731
    return [
        {"role": "user", "content": [{"type": "text", "text": "Describe "}, image(100, 60, 1)]},
        {"role": "user", "content": [image(56, 56, 3), {"type": "text", "text": " and "}, image(90, 70, 4)]},
    ]


def _as_url(part: dict) -> dict:
    import base64
    import io

    if part["type"] != "image":
        return part
    buffer = io.BytesIO()
    part["image"].save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    return {"type": "image_url", "image_url": {"url": url}}


@torch.inference_mode()
def _teacher_forced(reference, message: dict, tokens: list[int]) -> torch.Tensor:
    """transformers' float32 log probabilities of the positions that predict `tokens` (each after the
    prompt and the tokens before it)."""
    inputs = reference.inputs([message])
    prompt = inputs["input_ids"].shape[1]
    extra = torch.tensor([tokens[:-1]], dtype=inputs["input_ids"].dtype)
    inputs["input_ids"] = torch.cat([inputs["input_ids"], extra], dim=1)
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    inputs["mm_token_type_ids"] = torch.cat(
        [inputs["mm_token_type_ids"], torch.zeros_like(extra, dtype=torch.int32)], 1
    )
    logits = reference.model(**inputs).logits[0, prompt - 1 :]
    return torch.log_softmax(logits.double(), dim=-1)


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_llm_first_token_and_greedy_against_transformers(vl, graphs: bool) -> None:
    from vl_helpers import Reference

    from minisgl.core import SamplingParams
    from minisgl.llm import LLM

    family, folder = vl
    reference = Reference(folder, family)
    settings = dict(device="cuda", dtype="bfloat16", max_images_per_request=3, memory_ratio=0.3)
    if not graphs:
        settings["cuda_graph_max_bs"] = 0
    params = SamplingParams(max_tokens=STEPS, ignore_eos=True, logprobs=20)
    with LLM(str(folder), **settings) as llm:
        outputs = [
            llm.chat([{**m, "content": list(map(_as_url, m["content"]))}], params) for m in _messages()
        ]
    for message, output in zip(_messages(), outputs):
        want = _teacher_forced(reference, message, output.token_ids)
        first = output.logprobs[0]
        ids = [token for token, _ in first.top]
        got = torch.tensor([value for _, value in first.top], dtype=torch.float64)
        err = rel_err(got, want[0, ids])
        gaps = [float(want[i].max() - want[i, token]) for i, token in enumerate(output.token_ids)]
        same = sum(gap == 0 for gap in gaps)
        print(f"{family} graphs={graphs}: first-token top-20 error {err:.4f}, {same}/{STEPS} argmax")
        assert err < BF16_TOL
        assert max(gaps) < NEAR_TIE, gaps
