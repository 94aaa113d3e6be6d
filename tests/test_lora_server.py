"""LoRA adapters over HTTP (docs/lora.md): `minisgl-run serve --lora-modules ... --allow-runtime-lora` on the
default model, float32 on the CPU, one device slot for the adapters. Every generated token equals
transformers + peft's (test_lora.py's reference) for the base and two adapters in one batch, through
completions, chat, streams, n > 1 and `/generate`; `/v1/models` lists the adapters under the base;
adapters load, serve, unload and load again at runtime, and every refusal has its status; the metrics
count requests by adapter and the trace names it; nothing is held at rest. Every request loop is
bounded in count and time; the servers bind to loopback and are stopped at the end."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import httpx2 as httpx
import openai
import pytest
import test_lora
import transformers
from test_lora import ADAPTERS, NEW_TOKENS, PROMPTS
from test_server import MODEL, Server

pytestmark = pytest.mark.slow

# test_lora.py's fixtures: the PEFT adapters and the transformers + peft reference
adapters, reference = test_lora.adapters, test_lora.reference


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("trace") / "requests.jsonl"


@pytest.fixture(scope="module")
def server(adapters, trace):
    modules = [arg for name, path in adapters.items() for arg in ("--lora-modules", f"{name}={path}")]
    srv = Server(
        *("--device", "cpu", "--dtype", "float32", "--max-running-req", "8", "--page-size", "4"),
        *(*modules, "--max-loras", "1", "--max-lora-rank", "8", "--allow-runtime-lora"),
        *("--request-trace", str(trace)),
    )
    try:
        yield srv
    finally:
        assert srv.stop() == 0, srv.output()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    return transformers.AutoTokenizer.from_pretrained(smollm2_path)


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text)["input_ids"]


def _post(server: Server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base + path, json=body, timeout=120)


def _at_rest(server: Server) -> None:
    """Nothing running or waiting, no KV page held by a request."""
    values = server.metrics()
    assert values["minisgl_requests_running"] == 0
    assert values["minisgl_kv_cache_usage_ratio"] == 0


def test_models_lists_the_adapters_under_the_base(client, server) -> None:
    cards = client.models.list().data
    assert [c.id for c in cards] == [MODEL, *ADAPTERS]
    assert getattr(cards[0], "parent", None) is None
    assert all(c.model_extra["parent"] == MODEL for c in cards[1:])
    card = httpx.get(server.base + "/v1/models/attn", timeout=10).json()
    assert (card["id"], card["parent"]) == ("attn", MODEL)
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt="Hi", max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and "attn, mlp" in e.value.body["message"]


def test_a_batch_of_base_and_adapters_matches_transformers_and_peft(server, tokenizer, reference) -> None:
    """Concurrent streamed and whole completions for the base and both adapters (more adapters than
    slots: they take turns), each token for token the reference's."""
    names = [MODEL, "attn", "mlp", "mlp", "attn", MODEL]
    prompts = [_ids(tokenizer, PROMPTS[i % len(PROMPTS)]) for i in range(len(names))]

    async def one(aclient: openai.AsyncOpenAI, model: str, prompt: list[int], stream: bool) -> list[int]:
        body = dict(model=model, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0)
        extra = {"ignore_eos": True, "return_token_ids": True}
        if not stream:
            answer = await aclient.completions.create(**body, extra_body=extra)
            assert answer.model == model
            return answer.choices[0].model_extra["token_ids"]
        ids = []
        async for chunk in await aclient.completions.create(**body, stream=True, extra_body=extra):
            assert chunk.model == model
            if chunk.choices:
                ids += chunk.choices[0].model_extra.get("token_ids") or []
        return ids

    async def main() -> list[list[int]]:
        async with openai.AsyncOpenAI(base_url=server.url, api_key="x", timeout=300, max_retries=0) as c:
            runs = [one(c, m, p, i % 2 == 1) for i, (m, p) in enumerate(zip(names, prompts))]
            return await asyncio.wait_for(asyncio.gather(*runs), 600)

    got = asyncio.run(main())
    want = [reference(p, None if m == MODEL else m) for m, p in zip(names, prompts)]
    assert got == want
    _at_rest(server)


def test_chat_n_and_generate_take_the_adapter(client, server, tokenizer, reference) -> None:
    messages = [{"role": "user", "content": "Hi!"}]
    prompt = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    want = reference(prompt, "mlp")
    answer = client.chat.completions.create(
        model="mlp",
        messages=messages,
        max_tokens=NEW_TOKENS,
        temperature=0,
        n=2,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert [c.model_extra["token_ids"] for c in answer.choices] == [want, want]
    ids = _ids(tokenizer, PROMPTS[2])
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True},
    }
    generated = _post(server, "/generate", {**body, "lora_name": "attn"}).json()
    assert generated["output_ids"] == reference(ids, "attn")
    assert _post(server, "/generate", body).json()["output_ids"] == reference(ids, None)
    missing = _post(server, "/generate", {**body, "lora_name": "nope"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    clash = _post(server, "/generate", {**body, "lora_name": "attn", "model": "mlp"})
    assert clash.status_code == 400 and "disagree" in clash.json()["error"]["message"]
    _at_rest(server)


def test_structured_output_runs_under_an_adapter(client, server) -> None:
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "required": ["n"],
        "additionalProperties": False,
    }
    answer = client.chat.completions.create(
        model="mlp",
        messages=[{"role": "user", "content": "Give a number as JSON."}],
        max_tokens=24,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
    )
    assert answer.model == "mlp" and answer.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(answer.choices[0].message.content)["n"], int)
    _at_rest(server)


def test_load_serve_unload_reload_at_runtime(client, server, adapters, tokenizer, reference) -> None:
    ids = _ids(tokenizer, PROMPTS[0])

    def generate(model: str) -> list[int]:
        answer = client.completions.create(
            model=model,
            prompt=ids,
            max_tokens=NEW_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        return answer.choices[0].model_extra["token_ids"]

    loaded = _post(server, "/v1/load_lora_adapter", {"lora_name": "again", "lora_path": adapters["attn"]})
    assert loaded.status_code == 200, loaded.text
    assert [c.id for c in client.models.list().data] == [MODEL, *ADAPTERS, "again"]
    assert generate("again") == reference(ids, "attn")
    assert _post(server, "/v1/unload_lora_adapter", {"lora_name": "again"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        generate("again")
    gone = _post(server, "/v1/unload_lora_adapter", {"lora_name": "again"})
    assert gone.status_code == 404 and "again" in gone.json()["error"]["message"]
    # the same name from another folder: its own tokens (no KV cached under the first load is reused)
    assert (
        _post(
            server, "/v1/load_lora_adapter", {"lora_name": "again", "lora_path": adapters["mlp"]}
        ).status_code
        == 200
    )
    assert generate("again") == reference(ids, "mlp")
    assert _post(server, "/v1/unload_lora_adapter", {"lora_name": "again"}).status_code == 200
    assert [c.id for c in client.models.list().data] == [MODEL, *ADAPTERS]
    _at_rest(server)


def _broken(adapters: dict[str, str], root: Path, name: str, **config) -> str:
    """A copy of the attn adapter with `config` written into its adapter_config.json."""
    folder = root / name
    shutil.copytree(adapters["attn"], folder)
    path = folder / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return str(folder)


def test_every_refusal_has_its_status_and_says_why(client, server, adapters, tmp_path) -> None:
    load, unload = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
    cases = [
        (load, {"lora_path": adapters["attn"]}, 400, "lora_name must be a non-empty string"),
        (load, {"lora_name": "x"}, 400, "lora_path must be a non-empty string"),
        (load, {"lora_name": "x", "lora_path": adapters["attn"], "extra": 1}, 400, "unknown field 'extra'"),
        (load, {"lora_name": "attn", "lora_path": adapters["mlp"]}, 400, "already loaded"),
        (load, {"lora_name": MODEL, "lora_path": adapters["mlp"]}, 400, "the base model's name"),
        (load, {"lora_name": "x", "lora_path": str(tmp_path)}, 400, "adapter_config.json"),
        (
            load,
            {"lora_name": "x", "lora_path": _broken(adapters, tmp_path, "r", r=64)},
            400,
            "max_lora_rank=8",
        ),
        (
            load,
            {"lora_name": "x", "lora_path": _broken(adapters, tmp_path, "dora", use_dora=True)},
            400,
            "DoRA",
        ),
        (
            load,
            {"lora_name": "x", "lora_path": _broken(adapters, tmp_path, "b", bias="lora_only")},
            400,
            "bias",
        ),
        (
            load,
            {"lora_name": "x", "lora_path": _broken(adapters, tmp_path, "m", modules_to_save=["lm_head"])},
            400,
            "modules_to_save",
        ),
        (
            load,
            {
                "lora_name": "x",
                "lora_path": _broken(adapters, tmp_path, "t", target_modules=["q_proj", "embed_tokens"]),
            },
            400,
            "embed_tokens",
        ),
        (
            load,
            {
                "lora_name": "x",
                "lora_path": _broken(adapters, tmp_path, "f", target_modules=["q_proj", "fc1"]),
            },
            400,
            "fc1",
        ),
        (unload, {"lora_name": "never"}, 404, "never"),
        (unload, {}, 400, "lora_name must be a non-empty string"),
    ]
    for path, body, status, message in cases:
        response = _post(server, path, body)
        assert response.status_code == status, (body, response.text)
        assert message in response.json()["error"]["message"], (body, response.text)
    assert [c.id for c in client.models.list().data] == [MODEL, *ADAPTERS]  # nothing changed
    assert client.completions.create(model="attn", prompt="Hi", max_tokens=2).choices[0].text is not None
    _at_rest(server)


def test_without_the_setting_runtime_loads_are_forbidden(smollm2_server, adapters) -> None:
    for path, body in (
        ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": adapters["attn"]}),
        ("/v1/unload_lora_adapter", {"lora_name": "x"}),
    ):
        response = _post(smollm2_server, path, body)
        assert response.status_code == 403 and "allow_runtime_lora" in response.json()["error"]["message"]
    assert [m["id"] for m in httpx.get(smollm2_server.url + "/models", timeout=10).json()["data"]] == [MODEL]


def test_metrics_count_requests_by_adapter_and_the_trace_names_it(client, server, trace) -> None:
    before = server.metrics()
    for model in ("attn", "attn", MODEL):
        client.completions.create(model=model, prompt="Hi", max_tokens=2)
    after = server.metrics()
    key = "minisgl_lora_requests_total,lora_name="
    assert after[key + "attn"] - before.get(key + "attn", 0) == 2
    assert after[key] - before.get(key, 0) == 1
    assert after["minisgl_lora_adapters_loaded"] == len(ADAPTERS)
    assert 1 <= after["minisgl_lora_adapters_resident"] <= 1  # max_loras=1
    # an unloaded adapter's series goes with it (the label values stay bounded)
    assert not any(k.startswith(key + "again") for k in after)
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    assert [r["lora"] for r in records[-3:]] == ["attn", "attn", None]
