"""`minisgl-run serve` as a user runs it: a real server in a subprocess on a free loopback port, driven by
the official `openai` client (sync and async) and by raw HTTP. Every request loop is bounded in count
and time; every server is stopped at the end."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx2 as httpx  # the HTTP client the openai package is built on
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_metrics import prometheus  # noqa: F401  (the fixture: a real Prometheus server on loopback)

from minisgl.core import SamplingParams

pytestmark = pytest.mark.slow

START_TIMEOUT_S = 180
MODEL = "smollm2-135m-instruct"  # the embedded model's folder name: the default served name
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Process:
    """A command in a subprocess, its output in a log file; `stop` sends SIGTERM (SIGKILL after 60 s)."""

    def __init__(self, command: list[str], log_name: str, env=None, preexec_fn=None) -> None:
        self.log = open(Path(os.environ.get("TMPDIR", "/tmp")) / log_name, "w+")
        self.proc = subprocess.Popen(
            command, stdout=self.log, stderr=subprocess.STDOUT, env=env, preexec_fn=preexec_fn
        )

    def wait_until(self, ready, timeout: float, what: str) -> None:
        """Polls `ready()` (a transport error counts as not yet) for `timeout` s; stops the process and
        fails if it never holds or the process exits first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"the process exited early:\n{self.output()}"
            try:
                if ready():
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        output = self.output()  # before `stop` closes the log
        self.stop()
        raise AssertionError(f"{what} did not happen in {timeout} s:\n{output}")

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-5000:]

    def children(self) -> list[int]:
        return _descendants(self.proc.pid)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()
        return self.proc.returncode


class Server(Process):
    """`python -m minisgl.cli serve` in a subprocess; `url` is its /v1 base."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, preexec_fn=None) -> None:
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.url = self.base + "/v1"
        super().__init__(
            [sys.executable, "-m", "minisgl.cli", "serve", "--port", str(self.port), *args],
            f"minisgl-serve-{self.port}.log",
            env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **(env or {})},
            preexec_fn=preexec_fn,
        )
        healthy = lambda: httpx.get(self.base + "/health", timeout=2).status_code == 200  # noqa: E731
        self.wait_until(healthy, START_TIMEOUT_S, "the server becoming healthy")

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.base + "/metrics", timeout=10).text
        values = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                key = sample.name + "".join(
                    f",{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name"
                )
                values[key] = sample.value
        return values


def _descendants(pid: int) -> list[int]:
    """Every live process below `pid` (from /proc)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if fields[0] != "Z":
                parents[int(entry.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, parent in parents.items() if parent == p]
        found += kids
        frontier += kids
    return found


def _wait_for(condition, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def _wait_until_idle(server: Server, what: str) -> None:
    """Until no request runs and no page is in use (30 s at most)."""
    _wait_for(
        lambda: (
            server.metrics()["minisgl_kv_cache_usage_ratio"] == 0
            and server.metrics()["minisgl_requests_running"] == 0
        ),
        30,
        what,
    )


@pytest.fixture(scope="module")
def server(smollm2_server: Server) -> Server:
    """The session's server of the default model (conftest.py; 16 requests at a time, bodies up to
    64 KiB): the tests below measure what they change (metric deltas), not absolute counts."""
    return smollm2_server


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key="unused", timeout=60, max_retries=0)


@pytest.fixture(scope="module")
def reference(smollm2_path):
    """`LLM.generate` on the same model: what the server must answer, token for token."""
    from minisgl.llm import LLM

    llm = LLM(max_running_req=16)
    try:
        yield llm
    finally:
        llm.shutdown()


def test_health_and_models(server: Server, client: openai.OpenAI) -> None:
    health = httpx.get(server.base + "/health").json()
    assert health["status"] == "ok" and [r["state"] for r in health["replicas"]] == ["serving"]
    assert [m.id for m in client.models.list()] == [MODEL]


def test_greedy_completions_over_http_equal_llm_generate(client: openai.OpenAI, reference) -> None:
    want = reference.generate(PROMPTS, SamplingParams(max_tokens=24, stop=["\n\n"]))
    for prompt, expected in zip(PROMPTS, want):
        request = dict(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=["\n\n"])
        got = client.completions.create(**request)
        assert got.choices[0].text == expected.text
        assert got.choices[0].finish_reason == expected.finish_reason
        assert got.usage.prompt_tokens == len(expected.prompt_token_ids)
        # streamed: the deltas add up to the same text, the last chunk carries the finish reason
        chunks = list(
            client.completions.create(**request, stream=True, stream_options={"include_usage": True})
        )
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected.finish_reason
        assert chunks[-1].usage.completion_tokens == got.usage.completion_tokens


def test_chat_streamed_and_not_equal_llm_chat(client: openai.OpenAI, reference) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    want = reference.chat(messages, SamplingParams(max_tokens=20))
    got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    assert got.choices[0].message.content == want.text
    assert got.choices[0].message.role == "assistant"
    assert got.usage.completion_tokens == len(want.token_ids)
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=20, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream) == want.text


def test_token_id_prompts_n_choices_and_seeds(client: openai.OpenAI, reference) -> None:
    ids = reference.tokenizer("Hello, my name is")["input_ids"]
    got = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=8, temperature=0.8, seed=7, n=3, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in got.choices] == [0, 1, 2]
    token_ids = [c.model_extra["token_ids"] for c in got.choices]  # token-id prompts get token ids
    assert all(len(t) == 8 for t in token_ids) and got.usage.completion_tokens == 24
    want = [
        reference.generate([ids], SamplingParams(max_tokens=8, temperature=0.8, seed=7 + i, ignore_eos=True))[
            0
        ]
        for i in range(3)
    ]
    assert token_ids == [w.token_ids for w in want]  # choice i samples with seed + i


def test_32_concurrent_streams_each_get_exactly_their_tokens(server: Server, reference) -> None:
    before = server.metrics()
    lengths = [4 + i % 13 for i in range(32)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(32)]
    want = reference.generate(prompts, [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths])

    async def one(aclient: openai.AsyncOpenAI, prompt: str, n: int) -> tuple[str, int]:
        stream = await aclient.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=n,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
        return text, usage

    async def main() -> list[tuple[str, int]]:
        async with openai.AsyncOpenAI(base_url=server.url, api_key="x", timeout=120, max_retries=0) as c:
            return await asyncio.wait_for(
                asyncio.gather(*(one(c, p, n) for p, n in zip(prompts, lengths))), 300
            )

    results = asyncio.run(main())
    assert [usage for _, usage in results] == lengths
    assert [text for text, _ in results] == [w.text for w in want]
    after = server.metrics()
    served = after["minisgl_generation_tokens_total"] - before.get("minisgl_generation_tokens_total", 0)
    assert served == sum(lengths)  # the scheduler's counter, scraped through the front end


def test_a_client_that_disconnects_mid_stream_frees_its_pages(server: Server) -> None:
    body = {
        "model": MODEL,
        "prompt": "Tell me a long story.",
        "max_tokens": 2000,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", server.url + "/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            received = [line for _, line in zip(range(6), lines) if line.startswith("data:")]
            assert received
            _wait_for(lambda: server.metrics()["minisgl_kv_cache_usage_ratio"] > 0, 10, "pages in use")
        # closing the response closes the connection: the request is aborted
    _wait_until_idle(server, "the aborted request's pages to be freed")
    assert server.metrics().get("minisgl_requests_finished_total,reason=abort", 0) >= 1


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (
            "/completions",
            {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 6000, "ignore_eos": True},
        ),
        (
            "/generate",
            {
                "text": "Tell me a long story.",
                "sampling_params": {"max_new_tokens": 6000, "ignore_eos": True},
            },
        ),
    ],
    ids=["completions", "generate"],
)
def test_a_client_that_gives_up_on_a_whole_answer_aborts_it(server: Server, path: str, body: dict) -> None:
    """A non-streamed request whose client stops waiting (its read timeout closes the connection) is
    aborted: it leaves the running set and its pages are freed, long before its 6,000 tokens (at least a
    minute of decoding here), and it counts as finished with reason abort."""
    aborts = server.metrics().get("minisgl_requests_finished_total,reason=abort", 0)
    url = server.url + path if path == "/completions" else server.base + path
    with httpx.Client(timeout=httpx.Timeout(60, read=3)) as http:
        with pytest.raises(httpx.ReadTimeout):
            http.post(url, json=body)
    _wait_until_idle(server, "the abandoned request's pages to be freed")
    assert server.metrics().get("minisgl_requests_finished_total,reason=abort", 0) == aborts + 1


def test_prefix_cache_over_http_and_flush_cache(server: Server, client: openai.OpenAI) -> None:
    """A repeated prompt finds its prefix in the server's radix cache (same greedy text); POST
    /flush_cache empties the cache, and the next request computes its whole prompt again."""
    prompt = "You are a careful assistant who answers in one short sentence. " * 6 + "What is a cache?"

    def run() -> tuple[str, float, float]:
        before = server.metrics()
        text = (
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0).choices[0].text
        )
        after = server.metrics()
        hits = (
            after["minisgl_prefix_cache_hit_tokens_total"] - before["minisgl_prefix_cache_hit_tokens_total"]
        )
        looked = (
            after["minisgl_prefix_cache_lookup_tokens_total"]
            - before["minisgl_prefix_cache_lookup_tokens_total"]
        )
        return text, hits, looked

    first, _, looked = run()
    second, hits, _ = run()
    assert second == first and looked > 64 and hits >= looked - 16  # all but the last partial page
    assert server.metrics()["minisgl_prefix_cache_pages"] > 0  # held by the tree alone, at rest
    flushed = httpx.post(server.base + "/flush_cache", timeout=30)
    assert flushed.status_code == 200 and flushed.json()["freed_pages"] > 0
    assert server.metrics()["minisgl_prefix_cache_pages"] == 0
    third, hits, _ = run()
    assert third == first and hits == 0


@pytest.mark.parametrize(
    "body,status,code_or_param",
    [
        (b"{not json", 400, None),
        ({"model": MODEL, "prompt": "hi", "max_tokens": "8"}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "hi", "temperature": "hot"}, 400, "temperature"),
        ({"model": "gpt-4", "prompt": "hi"}, 404, "model_not_found"),
        ({"model": MODEL, "prompt": "hi " * 9000}, 400, "context_length_exceeded"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": 10**6}, 400, "context_length_exceeded"),
        ({"model": MODEL, "prompt": "hi", "best_of": 2}, 400, "unsupported_parameter"),
        ({"model": MODEL, "prompt": [1, 2, 10**9]}, 400, "prompt"),
        ({"model": MODEL, "prompt": "x" * 70000}, 413, None),
    ],
)
def test_bad_requests_get_their_status_and_the_server_goes_on(server: Server, body, status, code_or_param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(
        server.url + "/completions", content=content, headers={"content-type": "application/json"}, timeout=30
    )
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"]
    if code_or_param is not None:
        assert code_or_param in (error["code"], error["param"])
    ok = httpx.post(
        server.url + "/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=30
    )
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


LONG_TOKENS = 120  # each of the two requests in flight at the graceful shutdown


def test_api_key_full_queue_and_graceful_shutdown() -> None:
    """A second server, with an API key, two request slots and no waiting room."""
    srv = Server(
        "--max-running-req",
        "2",
        "--max-waiting-requests",
        "0",
        "--shutdown-grace-s",
        "600",
        env={"MINISGL_API_KEY": "s3cret"},
    )
    try:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        assert httpx.post(srv.url + "/completions", json=body).status_code == 401
        wrong = httpx.post(srv.url + "/completions", json=body, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(srv.base + "/health").status_code == 200  # open without the key
        assert httpx.get(srv.base + "/metrics").status_code == 200
        assert httpx.post(srv.base + "/flush_cache").status_code == 401
        assert (
            httpx.post(srv.base + "/flush_cache", headers={"Authorization": "Bearer s3cret"}).status_code
            == 200
        )
        keyed = openai.OpenAI(base_url=srv.url, api_key="s3cret", timeout=600, max_retries=0)
        assert keyed.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens == 2

        # two long requests fill the slots; a third is refused with 503 and Retry-After. Long: 120
        # decode steps, 6 s at least on 2 cores, where the checks until SIGTERM take well under one
        results: list = []

        def long_request() -> None:
            r = keyed.completions.create(
                model=MODEL, prompt="Count:", max_tokens=LONG_TOKENS, extra_body={"ignore_eos": True}
            )
            results.append(r.usage.completion_tokens)

        threads = [threading.Thread(target=long_request) for _ in range(2)]
        for t in threads:
            t.start()
        _wait_for(lambda: srv.metrics()["minisgl_requests_running"] == 2, 30, "two running requests")
        full = httpx.post(srv.url + "/completions", json=body, headers={"Authorization": "Bearer s3cret"})
        assert full.status_code == 503 and full.headers["retry-after"] == "1"
        # SIGTERM with both in flight: new requests get 503, the running ones finish, exit 0
        srv.proc.send_signal(signal.SIGTERM)
        _wait_for(lambda: httpx.get(srv.base + "/health").status_code == 503, 10, "draining")
        late = httpx.post(srv.url + "/completions", json=body, headers={"Authorization": "Bearer s3cret"})
        assert late.status_code == 503
        children = srv.children()
        assert children  # the scheduler process
        for t in threads:
            t.join(600)
        assert results == [LONG_TOKENS] * 2
        assert srv.proc.wait(60) == 0
        _wait_for(lambda: not any(Path(f"/proc/{pid}").exists() for pid in children), 30, "children gone")
    finally:
        srv.stop()


def test_a_killed_front_end_leaves_no_scheduler_process(tiny_server_args: list[str]) -> None:
    # with two tokenizer processes besides the scheduler process; a tiny model served as the default one
    # (conftest.py): only the processes matter
    srv = Server(*tiny_server_args, "--max-running-req", "4", "--tokenizer-workers", "2")
    try:
        children = srv.children()
        assert len(children) >= 3
        srv.proc.kill()
        srv.proc.wait(10)
        _wait_for(
            lambda: not any(Path(f"/proc/{pid}").exists() and _alive(pid) for pid in children),
            30,
            "the scheduler and tokenizer processes to end",
        )
    finally:
        srv.stop()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_config_never_prints_the_api_key() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "minisgl.cli", "config"],
        capture_output=True,
        text=True,
        env={**os.environ, "MINISGL_API_KEY": "s3cret-value"},
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "s3cret-value" not in out.stdout + out.stderr
    assert "api_key: <set>" in out.stdout


def test_readme_serving_examples_run(server: Server, capsys) -> None:
    """The README's curl command and openai example, pointed at this server's port."""
    import re
    import shlex
    import shutil

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    [curl] = [line.strip() for line in readme.splitlines() if line.strip().startswith("curl ")]
    args = shlex.split(curl.replace("127.0.0.1:30000", f"127.0.0.1:{server.port}"))
    body = json.loads(args[args.index("-d") + 1])
    expected = httpx.post(server.url + "/completions", json=body, timeout=60).json()
    assert expected["choices"][0]["text"].strip().startswith("Paris")
    if shutil.which("curl"):  # the command itself, as a user pastes it
        out = subprocess.run(args, capture_output=True, text=True, timeout=60, check=True).stdout
        assert json.loads(out)["choices"][0]["text"] == expected["choices"][0]["text"]
    [block] = [b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "from openai import" in b]
    exec(compile(block.replace("127.0.0.1:30000", f"127.0.0.1:{server.port}"), "README.md", "exec"), {})
    assert "Paris" in capsys.readouterr().out


def test_an_engine_that_cannot_start_ends_the_server_with_its_reason() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "minisgl.cli", "serve", "--port", str(_free_port()), "--tp", "2"],
        capture_output=True,
        text=True,
        timeout=START_TIMEOUT_S,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
    )
    assert out.returncode == 1
    assert "num_attention_heads=9 is not divisible by the tensor-parallel size 2" in out.stderr


def test_a_model_folder_without_tokenizer_is_served_with_token_ids(tiny_model) -> None:
    """The dummy-weight presets' case: token-id prompts, token ids in the answers, text refused."""

    from minisgl.llm import LLM

    folder = tiny_model("llama")
    prompt = [5, 17, 42, 99, 3]
    llm = LLM(str(folder), device="cpu", dtype="float32")
    try:
        want = llm.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))[0].token_ids
    finally:
        llm.shutdown()
    srv = Server("--model", str(folder), "--device", "cpu", "--dtype", "float32")
    try:
        client = openai.OpenAI(base_url=srv.url, api_key="x", timeout=120, max_retries=0)
        [name] = [m.id for m in client.models.list()]
        assert name == folder.name
        request = dict(
            model=name, prompt=prompt, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
        )
        got = client.completions.create(**request)
        assert got.choices[0].model_extra["token_ids"] == want and got.choices[0].text == ""
        chunks = list(client.completions.create(**request, stream=True))
        assert sum((c.choices[0].model_extra.get("token_ids", []) for c in chunks if c.choices), []) == want
        with pytest.raises(openai.BadRequestError, match="no tokenizer"):
            client.completions.create(model=name, prompt="text", max_tokens=2)
        with pytest.raises(openai.BadRequestError, match="chat template"):
            client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}])
    finally:
        assert srv.stop() == 0


@pytest.fixture
def metrics_port(server: Server) -> int:
    """The port test_metrics' `prometheus` fixture scrapes: the server's own (its /metrics)."""
    return server.port


def test_prometheus_scrapes_the_servers_metrics(
    server: Server,
    client: openai.OpenAI,
    prometheus,  # noqa: F811  (the fixture imported above)
) -> None:
    """The real Prometheus server scraping `minisgl-run serve`'s /metrics: the scheduler's token counter
    grows by exactly the tokens the server answered with."""
    query = 'minisgl_generation_tokens_total{job="minisgl"}'
    start = server.metrics().get("minisgl_generation_tokens_total", 0)
    _wait_for(lambda: (prometheus.value(query) or 0) == start, 30, "Prometheus's first scrape")
    served = sum(
        client.completions.create(
            model=MODEL, prompt=p, max_tokens=5 + i, temperature=0, extra_body={"ignore_eos": True}
        ).usage.completion_tokens
        for i, p in enumerate(PROMPTS)
    )
    assert served == sum(5 + i for i in range(len(PROMPTS)))
    _wait_for(lambda: prometheus.value(query) == start + served, 30, "Prometheus to see the tokens")
