"""Qwen2.5-VL and Qwen3-VL end to end on the CPU (float32): tiny random models saved by transformers
(tests/vl_helpers.py), `LLM.chat` with images token-exact against transformers' `generate`, chunked
prefill cutting through images, batched with text-only requests, streamed = whole, the prefix cache keyed
by image content, and bad inputs refused with the engine still clean."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import pytest
from conftest import llm_clean
from vl_helpers import Reference, make_tiny_vl, noise_image

from minisgl.core import SamplingParams
from minisgl.llm import LLM
from minisgl.multimodal.inputs import ImagePrompt
from minisgl.multimodal.media import MediaError

pytest.importorskip("transformers")

STEPS = 8
GREEDY = SamplingParams(max_tokens=STEPS, ignore_eos=True)
GREEDY30 = SamplingParams(max_tokens=30, ignore_eos=True)


def user(*parts) -> dict:
    return {
        "role": "user",
        "content": [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts],
    }


def image(width: int, height: int, seed: int) -> dict:
    return {"type": "image", "image": noise_image(width, height, seed)}


def data_url(part: dict) -> dict:
    """The same image as an image_url part with a PNG data URL."""
    buffer = io.BytesIO()
    part["image"].save(buffer, format="PNG")
    return {
        "type": "image_url",
        "image_url": {"url": "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()},
    }


def as_urls(messages: list[dict]) -> list[dict]:
    """`messages` with every image part as a data URL (what minisgl is sent; the reference takes PIL)."""
    return [
        {**m, "content": [data_url(p) if p["type"] == "image" else p for p in m["content"]]}
        if isinstance(m["content"], list)
        else m
        for m in messages
    ]


CONVERSATIONS = {
    "wide image": [user("Describe ", image(100, 60, 1), " briefly.")],
    "tall image first": [user(image(40, 120, 2), "What is this?")],
    "three images between text": [
        user(
            "First ",
            image(56, 56, 3),
            " then ",
            image(90, 70, 4),
            " and last ",
            image(30, 100, 5),
            " compare.",
        )
    ],
    "image in an earlier turn": [
        user("Look at ", image(80, 80, 6)),
        {"role": "assistant", "content": "A square of noise."},
        user("And the colors?"),
    ],
}


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def vl(request, tmp_path_factory):
    folder = make_tiny_vl(tmp_path_factory.mktemp(request.param), request.param)
    reference = Reference(folder, request.param)
    # small pages and prefill chunks: chunks end inside images, the prefix cache matches inside them
    with LLM(
        str(folder), device="cpu", dtype="float32", cpu_kv_budget_gib=0.05, page_size=4,
        max_prefill_tokens=24, max_images_per_request=3,
    ) as llm:  # fmt: skip
        yield llm, reference


def test_greedy_equals_transformers_batched_with_text(vl) -> None:
    llm, reference = vl
    prompts = [llm.chat_inputs(as_urls(messages)) for messages in CONVERSATIONS.values()]
    text_only = [{"role": "user", "content": "A question in plain text."}]
    prompts.append(llm.chat_inputs(text_only))
    outputs = llm.generate(prompts, GREEDY)
    for (name, messages), output in zip(CONVERSATIONS.items(), outputs):
        assert output.token_ids == reference.generate(messages, STEPS), name
    assert outputs[-1].token_ids == reference.generate(text_only, STEPS)
    llm_clean(llm)


def test_chat_and_stream_equal_whole(vl) -> None:
    llm, reference = vl
    messages = CONVERSATIONS["three images between text"]
    whole = llm.chat(as_urls(messages), GREEDY)
    assert whole.token_ids == reference.generate(messages, STEPS)
    assert "".join(llm.stream(llm.chat_inputs(as_urls(messages)), GREEDY)) == whole.text
    llm_clean(llm)


def test_image_from_a_path(vl, tmp_path: Path) -> None:
    llm, reference = vl
    messages = CONVERSATIONS["wide image"]
    path = tmp_path / "wide.png"
    messages[0]["content"][1]["image"].save(path)
    by_path = [user("Describe ", {"type": "image_url", "image_url": {"url": str(path)}}, " briefly.")]
    assert llm.chat(by_path, GREEDY).token_ids == reference.generate(messages, STEPS)


def test_prefix_cache_keys_images_by_content(vl) -> None:
    llm, reference = vl
    llm.flush_cache()
    same = [user("Tell me about ", image(64, 64, 7), " now.")]
    other = [user("Tell me about ", image(64, 64, 8), " now.")]  # same size: same tokens but the image
    positions = llm.chat_inputs(as_urls(same)).images.token_positions
    first_image_token, last_image_token = positions[0], positions[-1]

    def cached_tokens(messages) -> int:
        before = llm.scheduler.prefix_cached_tokens
        assert llm.chat(as_urls(messages), GREEDY).token_ids == reference.generate(messages, STEPS)
        return llm.scheduler.prefix_cached_tokens - before

    assert cached_tokens(same) == 0
    assert cached_tokens(same) > last_image_token  # the same image after the same text: a hit past it
    assert cached_tokens(other) <= first_image_token  # another image: nothing of it, nor after it
    llm_clean(llm)


def test_bad_inputs_leave_the_engine_clean(vl) -> None:
    llm, reference = vl
    broken = {
        "type": "image_url",
        "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"not a png").decode()},
    }
    with pytest.raises(MediaError, match="image"):
        llm.chat([user("What is ", broken)], GREEDY)
    with pytest.raises(ValueError, match="max_images_per_request=3"):
        llm.chat([user(*(image(30, 30, seed) for seed in range(4)))], GREEDY)
    prompt = llm.chat_inputs(as_urls(CONVERSATIONS["wide image"]))
    text_tokens = len(prompt.token_ids) - len(prompt.images.token_positions)
    with pytest.raises(ValueError, match="max_seq_len"):  # the image tokens count against the context
        llm.generate([prompt], SamplingParams(max_tokens=llm.engine.max_seq_len - text_tokens))
    with pytest.raises(ValueError, match="names no image"):
        llm.chat([user("x", {"type": "image_url", "image_url": {}})], GREEDY)
    wide = llm.chat_inputs(as_urls(CONVERSATIONS["wide image"]))
    with pytest.raises(ValueError, match="placeholder tokens .* but no image"):
        llm.generate([wide.token_ids], GREEDY)
    other = llm.chat_inputs(as_urls(CONVERSATIONS["tall image first"])).token_ids
    with pytest.raises(ValueError, match="prepared for a prompt"):
        llm.generate([ImagePrompt(other, wide.images)], GREEDY)
    llm_clean(llm)
    messages = CONVERSATIONS["wide image"]
    assert llm.chat(as_urls(messages), GREEDY).token_ids == reference.generate(messages, STEPS)
    llm_clean(llm)


def test_images_to_a_text_only_model(tiny_model) -> None:
    folder = tiny_model("qwen2", tokenizer=True)
    with LLM(str(folder), device="cpu", dtype="float32", cpu_kv_budget_gib=0.02) as llm:
        with pytest.raises(ValueError, match="text-only model"):
            llm.chat([user("What is ", image(40, 40, 0))], GREEDY)
        assert len(llm.chat([user("Hello", " there")], GREEDY).token_ids) == STEPS  # text parts still work
        llm_clean(llm)


def test_cli_generate_with_images(vl, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    import minisgl.llm
    from minisgl.cli import main

    llm, _ = vl
    monkeypatch.setattr(llm, "shutdown", lambda: None)  # the module's LLM outlives the command
    monkeypatch.setattr(minisgl.llm, "LLM", lambda *args, **kwargs: llm)
    wide, tall = image(100, 60, 1), image(40, 120, 2)
    paths = [tmp_path / "wide.png", tmp_path / "tall.png"]
    for part, path in zip((wide, tall), paths):
        part["image"].save(path)
    args = ["generate", "Compare them.", "--chat", "--max-tokens", str(STEPS), "--ignore-eos", "-q"]
    result = CliRunner().invoke(main, [*args, "--image", str(paths[0]), "--image", str(paths[1])])
    assert result.exit_code == 0, result.output
    expected = llm.chat([user(wide, tall, "Compare them.")], GREEDY).text
    assert result.output == expected + "\n"
    result = CliRunner().invoke(main, ["generate", "Compare them.", "--image", str(paths[0])])
    assert result.exit_code != 0 and "--image needs --chat" in result.output
    llm_clean(llm)


def test_pixel_bounds_settings(vl) -> None:
    """image_min_pixels / image_max_pixels override the folder's bounds: the grid (and the placeholder
    count) equal transformers' image processor under the same bounds."""
    import transformers

    from minisgl.multimodal.chat import VisionPrompter
    from minisgl.multimodal.config import MediaConfig

    llm, reference = vl
    folder = llm.engine.config.model_path
    factor = reference.image_processor.patch_size * reference.image_processor.merge_size
    bounds = dict(min_pixels=factor**2 * 2, max_pixels=factor**2 * 6)
    media = MediaConfig(image_min_pixels=bounds["min_pixels"], image_max_pixels=bounds["max_pixels"])
    prompter = VisionPrompter(folder, llm.engine.config.model_config, media)
    picture = image(200, 90, 9)
    ids, images = prompter.prompt(llm.tokenizer, [user("Size? ", picture)], None)
    processor = transformers.AutoImageProcessor.from_pretrained(folder, backend="pil", **bounds)
    expected = processor(images=[picture["image"]], return_tensors="pt")
    assert images.grid_thw.tolist() == expected["image_grid_thw"].tolist()
    assert (
        images.grid_thw.prod() < reference.image_processor(images=[picture["image"]])["image_grid_thw"].prod()
    )
    assert ids.count(llm.engine.config.model_config.image_token_id) == images.grid_thw.prod() // 4


def test_speculative_ngram_with_images(vl) -> None:
    """n-gram speculative decoding: verify steps of image requests at index + mrope_delta (the KV slots
    stay the sequence indices: such a step is never moved on the device), the tokens unchanged."""
    llm, reference = vl
    if llm.engine.config.model_config.family != "qwen3_vl":
        pytest.skip("the tiny Qwen2.5-VL's greedy tokens repeat no n-gram: nothing would be drafted")
    folder = llm.engine.config.model_path
    with LLM(
        folder, device="cpu", dtype="float32", cpu_kv_budget_gib=0.05, page_size=4, speculative_method="ngram"
    ) as spec:
        for name, messages in CONVERSATIONS.items():
            got = spec.chat(as_urls(messages), SamplingParams(max_tokens=24, ignore_eos=True)).token_ids
            assert got == reference.generate(messages, 24), name
        assert spec.scheduler.spec.accepted > 0  # drafts were verified and taken
        llm_clean(spec)


def test_preempted_image_requests_recompute_their_images(vl) -> None:
    """A pool too small for every request: a preempted image request is recomputed from its prompt (its
    images encoded again at its new first chunk, its M-RoPE positions kept), tokens unchanged."""
    llm, reference = vl
    folder = llm.engine.config.model_path
    with LLM(
        folder, device="cpu", dtype="float32", page_size=4, num_page_override=45, max_prefill_tokens=24
    ) as small:
        outputs = small.generate([small.chat_inputs(as_urls(m)) for m in CONVERSATIONS.values()], GREEDY30)
        assert small.scheduler.preemptions > 0
        for (name, messages), output in zip(CONVERSATIONS.items(), outputs):
            assert output.token_ids == reference.generate(messages, 30), name
        llm_clean(small)


def test_image_metrics(vl) -> None:
    from minisgl import metrics

    llm, _ = vl

    def sample(name: str) -> float:
        return metrics.REGISTRY.get_sample_value(name, {"model_name": llm.model_name}) or 0.0

    before = [sample(n) for n in ("minisgl_images_total", "minisgl_image_tokens_total")]
    encodes = sample("minisgl_vision_encoder_seconds_count")
    prompt = llm.chat_inputs(as_urls(CONVERSATIONS["three images between text"]))
    llm.generate([prompt], GREEDY)
    after = [sample(n) for n in ("minisgl_images_total", "minisgl_image_tokens_total")]
    assert [a - b for a, b in zip(after, before)] == [3, len(prompt.images.token_positions)]
    assert sample("minisgl_vision_encoder_seconds_count") == encodes + 1


def test_the_images_of_a_prefill_batch_are_encoded_in_one_call(vl) -> None:
    from minisgl import metrics

    shared, reference = vl
    with LLM(
        shared.engine.config.model_path, device="cpu", dtype="float32", page_size=4, max_prefill_tokens=4096
    ) as llm:

        def encodes() -> float:
            labels = {"model_name": llm.model_name}
            return metrics.REGISTRY.get_sample_value("minisgl_vision_encoder_seconds_count", labels) or 0.0

        before = encodes()
        prompts = [llm.chat_inputs(as_urls(messages)) for messages in CONVERSATIONS.values()]
        outputs = llm.generate(prompts, GREEDY)
        assert encodes() == before + 1  # the four requests' six images: one encoder call
        for (name, messages), output in zip(CONVERSATIONS.items(), outputs):
            assert output.token_ids == reference.generate(messages, STEPS), name
        llm_clean(llm)


@pytest.mark.parametrize("rescale_factor", [1 / 255, 0.0037])
def test_preprocessing_equals_transformers_on_both_rescale_paths(rescale_factor: float) -> None:
    """A 1/255-like factor takes one float32 division, another the float64 product: both give
    transformers' pixel values (its PIL processor)."""
    import torch
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from minisgl.multimodal.qwen_vl import ImageProcessorConfig, preprocess_image

    kwargs = {"rescale_factor": rescale_factor, "min_pixels": 3136, "max_pixels": 400_000}
    reference = Qwen2VLImageProcessorPil(**kwargs)
    picture = noise_image(641, 359, 5)
    expected = reference(images=[picture], return_tensors="pt")
    got = preprocess_image(picture, ImageProcessorConfig.from_dict(kwargs))
    assert got.grid_thw == tuple(expected["image_grid_thw"][0].tolist())
    torch.testing.assert_close(got.pixel_values, expected["pixel_values"], rtol=1e-6, atol=1e-6)
