"""Images over HTTP: `minisgl-run serve` of a tiny Qwen3-VL (tests/vl_helpers.py), chat requests with
`image_url` content parts (data URLs) sent with the `openai` package, every token equal to transformers'
`generate`; each bad input a 400 naming the problem, the server serving on after it."""

from __future__ import annotations

import json

import httpx2 as httpx  # the HTTP client the openai package is built on
import pytest
from test_server import Server
from test_vl_models import CONVERSATIONS, as_urls, user
from vl_helpers import Reference, make_tiny_vl

openai = pytest.importorskip("openai")

STEPS = 6
FAMILY = "qwen3_vl"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = make_tiny_vl(tmp_path_factory.mktemp("served-vl"), FAMILY)
    trace = tmp_path_factory.mktemp("trace") / "trace.jsonl"
    srv = Server(
        "--model", str(folder), "--device", "cpu", "--dtype", "float32", "--max-images-per-request", "3",
        "--max-prefill-tokens", "24", "--page-size", "4", "--request-trace", str(trace),
    )  # fmt: skip
    srv.trace = trace
    try:
        yield srv, Reference(folder, FAMILY)
    finally:
        assert srv.stop() == 0, srv.output()


def _chat(client, messages: list[dict]):
    return client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=messages,
        max_tokens=STEPS,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )


def test_image_url_parts_equal_transformers(served) -> None:
    srv, reference = served
    client = openai.OpenAI(base_url=srv.url, api_key="none")
    for name, messages in CONVERSATIONS.items():
        got = _chat(client, as_urls(messages)).choices[0].model_extra["token_ids"]
        assert got == reference.generate(messages, STEPS), name
    # the request trace counts the images and their tokens (the trace is written as the response ends)
    srv.wait_until(lambda: len(srv.trace.read_text().splitlines()) >= len(CONVERSATIONS), 10, "the trace")
    records = [json.loads(line) for line in srv.trace.read_text().splitlines()]
    images = reference.inputs(CONVERSATIONS["three images between text"])
    tokens = int((images["input_ids"] == reference.model.config.image_token_id).sum())
    assert (records[2]["images"], records[2]["image_tokens"]) == (3, tokens)


def test_bad_images_are_400(served) -> None:
    srv, reference = served
    client = openai.OpenAI(base_url=srv.url, api_key="none", max_retries=0)
    bad = {
        "undecodable": ([user("x", {"type": "image_url", "image_url": {"url": "data:image/png;base64,aGk="}})], "image"),
        "too many": (as_urls([user(*CONVERSATIONS["wide image"][0]["content"][1:2] * 4)]), "max_images_per_request=3"),
        "a local file": ([user("x", {"type": "image_url", "image_url": {"url": "/etc/hostname"}})], "allowed_local_media_path"),
        "a loopback URL": ([user("x", {"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/a.png"}})], "loopback|private"),
        "a bad part": ([user("x", {"type": "image_url", "image_url": {"url": 5}})], "image parts"),
    }  # fmt: skip
    for messages, says in bad.values():
        with pytest.raises(openai.BadRequestError, match=says):
            _chat(client, messages)
    messages = CONVERSATIONS["wide image"]  # still serving
    assert _chat(client, as_urls(messages)).choices[0].model_extra["token_ids"] == reference.generate(
        messages, STEPS
    )


def test_generate_image_data(served) -> None:
    """SGLang's /generate: the text holds one <|image_pad|> per image_data entry (base64 or data URL)."""
    srv, reference = served
    messages = CONVERSATIONS["three images between text"]
    text = reference.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    urls = [p["image_url"]["url"] for p in as_urls(messages)[0]["content"] if p["type"] == "image_url"]
    image_data = [urls[0].split(",", 1)[1], *urls[1:]]  # raw base64 and data URLs
    body = {
        "text": text,
        "image_data": image_data,
        "sampling_params": {"max_new_tokens": STEPS, "ignore_eos": True, "temperature": 0},
    }
    got = httpx.post(srv.base + "/generate", json=body, timeout=60)
    assert got.status_code == 200, got.text
    assert got.json()["output_ids"] == reference.generate(messages, STEPS)
    for wrong, says in [
        ({"image_data": image_data[:2]}, "3 image placeholders"),
        ({"image_data": 5}, "image_data"),
    ]:
        got = httpx.post(srv.base + "/generate", json={**body, **wrong}, timeout=60)
        assert got.status_code == 400 and says in got.text, got.text


def test_images_to_a_text_only_server_are_400(tiny_model) -> None:
    folder = tiny_model("qwen2", tokenizer=True)
    srv = Server("--model", str(folder), "--device", "cpu", "--dtype", "float32")
    try:
        client = openai.OpenAI(base_url=srv.url, api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="text-only model"):
            _chat(client, as_urls(CONVERSATIONS["wide image"]))
        assert len(_chat(client, [user("Hello")]).choices[0].model_extra["token_ids"]) == STEPS
    finally:
        assert srv.stop() == 0, srv.output()
