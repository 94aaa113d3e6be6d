"""SGLang's router (`sglang-router`, pinned in the test extra) in front of two `minisgl-run serve`
workers, as docs/scale-out.md starts them (here on free loopback ports, each serving a tiny model with
the default model's tokenizer under its name: conftest.py's `tiny_server_args`; the router is the subject,
not the model's tokens), the workers and the router sharing an API key. Through the router: the `openai` client gets the same greedy outputs as from a worker
directly, for text and chat; SGLang's `/generate` with `input_ids`; with the cache-aware policy,
requests sharing a long prefix go to one worker (its prefix-cache hits grow, the other's lookups do
not); `/flush_cache` needs the key and empties both; one worker stopped, traffic goes on to the other.
Every request loop is bounded in count and time; every process is stopped at the end."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator

import httpx2 as httpx
import openai
import pytest
from test_server import MODEL, PROMPTS, Process, Server, _alive, _free_port, _wait_for

pytestmark = pytest.mark.slow

KEY = "s3cret-router-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
START_TIMEOUT_S = 120


class Router(Process):
    """`python -m sglang_router.launch_router` in a subprocess on loopback (its metrics too), ready once
    it lists the workers' model (read from their /server_info)."""

    def __init__(self, workers: list[Server], *args: str) -> None:
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1"]
        command += ["--port", str(self.port), "--prometheus-host", "127.0.0.1"]
        command += ["--prometheus-port", str(_free_port()), "--worker-urls", *[w.base for w in workers]]
        command += ["--api-key", KEY, "--policy", "cache_aware", "--log-level", "warn"]
        # fail-over within a couple of seconds (docs/scale-out.md); a quick exit
        command += ["--health-check-interval-secs", "1", "--health-failure-threshold", "1"]
        command += ["--shutdown-grace-period-secs", "5", *args]
        super().__init__(command, f"sglang-router-{self.port}.log")
        self.wait_until(self._lists_the_model, START_TIMEOUT_S, f"the router listing {MODEL}")

    def _lists_the_model(self) -> bool:
        models = httpx.get(self.base + "/v1/models", headers=AUTH, timeout=2)
        return models.status_code == 200 and [m["id"] for m in models.json()["data"]] == [MODEL]

    def stop(self) -> int:
        children = self.children()
        code = super().stop()
        _wait_for(lambda: not any(_alive(pid) for pid in children), 30, "the router's processes to end")
        return code


@pytest.fixture(scope="module")
def workers(tiny_server_args: list[str]) -> Iterator[list[Server]]:
    started: list[Server] = []
    try:
        for _ in range(2):
            started.append(Server(*tiny_server_args, "--max-running-req", "8", env={"MINISGL_API_KEY": KEY}))
        yield started
    finally:
        for srv in started:
            srv.stop()


@pytest.fixture(scope="module")
def router(workers: list[Server]) -> Iterator[Router]:
    rt = Router(workers)
    try:
        yield rt
    finally:
        rt.stop()


def openai_client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key=KEY, timeout=120, max_retries=0)


def test_the_openai_client_through_the_router_gets_what_a_worker_gives(workers, router) -> None:
    direct, routed = openai_client(workers[0].base), openai_client(router.base)
    for prompt in PROMPTS:
        request = dict(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stop=["\n\n"])
        want = direct.completions.create(**request)
        got = routed.completions.create(**request)
        assert got.choices[0].text == want.choices[0].text and got.usage == want.usage
        chunks = list(routed.completions.create(**request, stream=True))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want.choices[0].text
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    want = direct.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    got = routed.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    assert got.choices[0].message.content == want.choices[0].message.content
    assert got.choices[0].finish_reason == want.choices[0].finish_reason
    stream = routed.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=20, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream) == want.choices[0].message.content
    # the router's own /v1/models names minisgl's model, from the workers' /server_info (keyed)
    assert [m.id for m in routed.models.list()] == [MODEL]
    assert httpx.get(workers[0].base + "/server_info", timeout=10).status_code == 401
    info = httpx.get(workers[0].base + "/server_info", headers=AUTH, timeout=10).json()
    assert info["served_model_name"] == MODEL and (info["tp_size"], info["dp_size"]) == (1, 1)
    [load] = httpx.get(workers[0].base + "/get_load", headers=AUTH, timeout=10).json()
    assert load == {"dp_rank": 0, "num_reqs": 0, "num_tokens": 0}  # nothing held between requests


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(smollm2_path)


def test_generate_with_input_ids_through_the_router(workers, router, tokenizer) -> None:
    body = {"sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}}
    prompt = tokenizer("The capital of France is")["input_ids"]
    want = httpx.post(
        workers[1].base + "/generate", json={**body, "input_ids": prompt}, headers=AUTH, timeout=120
    )
    got = httpx.post(router.base + "/generate", json={**body, "input_ids": prompt}, headers=AUTH, timeout=120)
    assert want.status_code == got.status_code == 200, got.text
    assert got.json()["output_ids"] == want.json()["output_ids"] and len(want.json()["output_ids"]) == 12
    assert got.json()["text"] == want.json()["text"]
    assert got.json()["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    # streamed: events carry the text and ids so far, the last one the finish reason
    events = []
    with httpx.stream(
        "POST",
        router.base + "/generate",
        json={**body, "input_ids": prompt, "stream": True},
        headers=AUTH,
        timeout=120,
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]" and len(events) > 2
    last = json.loads(events[-2])
    assert last["output_ids"] == want.json()["output_ids"] and last["text"] == want.json()["text"]
    assert [json.loads(e)["meta_info"]["finish_reason"] for e in events[:-2]] == [None] * (len(events) - 2)
    # no key, no answer: the router asks for it, and so does a worker
    assert (
        httpx.post(router.base + "/generate", json={**body, "input_ids": prompt}, timeout=30).status_code
        == 401
    )
    assert (
        httpx.post(workers[0].base + "/generate", json={**body, "input_ids": prompt}, timeout=30).status_code
        == 401
    )


def prefix_counters(worker: Server) -> tuple[float, float]:
    values = worker.metrics()
    return values["minisgl_prefix_cache_hit_tokens_total"], values["minisgl_prefix_cache_lookup_tokens_total"]


def test_the_cache_aware_router_keeps_a_shared_prefix_on_one_worker(workers, router, tokenizer) -> None:
    assert httpx.post(router.base + "/flush_cache", timeout=30).status_code == 401  # the router wants the key
    flushed = httpx.post(router.base + "/flush_cache", headers=AUTH, timeout=30)  # and passes it on
    assert flushed.status_code == 200, flushed.text
    assert [w.metrics()["minisgl_prefix_cache_pages"] for w in workers] == [0, 0]
    before = [prefix_counters(w) for w in workers]
    system = "You are the router test's assistant; you answer in one word, and only ever in English. " * 8
    prefix = len(tokenizer(system)["input_ids"])
    assert prefix >= 128
    client = openai_client(router.base)
    for question in ("Red?", "Blue?", "Green?", "Yellow?", "Purple?", "Orange?"):
        client.completions.create(model=MODEL, prompt=system + question, max_tokens=2, temperature=0)
    after = [prefix_counters(w) for w in workers]
    looked = [a[1] - b[1] for a, b in zip(after, before)]
    hits = [a[0] - b[0] for a, b in zip(after, before)]
    served = [i for i in range(2) if looked[i] > 0]
    assert len(served) == 1, (looked, hits)  # one worker saw every request
    other = 1 - served[0]
    assert hits[served[0]] >= 5 * prefix // 2 and hits[other] == 0  # the five later ones found the prefix


def test_one_worker_stopped_the_traffic_goes_on(workers, router) -> None:
    assert workers[1].stop() == 0
    client = openai_client(router.base)
    before = workers[0].metrics()["minisgl_generation_tokens_total"]
    deadline, ok = time.monotonic() + 60, 0
    for _ in range(200):  # the router notices within its health-check interval
        if time.monotonic() > deadline:
            break
        try:
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body={"ignore_eos": True})
            ok += 1
            break
        except openai.APIError:
            time.sleep(0.5)
    assert ok == 1, router.output()
    for prompt in PROMPTS:  # every one served, by the worker left
        got = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
        )
        assert got.usage.completion_tokens == 3
    assert workers[0].metrics()["minisgl_generation_tokens_total"] - before == 2 + 3 * len(PROMPTS)
