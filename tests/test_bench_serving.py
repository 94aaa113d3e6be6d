"""`minisgl-run bench-serving` against a stub OpenAI-compatible server (FastAPI on uvicorn in a thread).

The stub streams deterministic `text_completion` chunks (minisgl.server.protocol's shapes): one token
per chunk, or two per chunk with `tokens_per_chunk=2`, each chunk after a short delay, with
`token_ids` and a final usage chunk. It counts the streams in flight and can fail chosen requests with
an HTTP 500 before the stream or with an error event inside it. Every run is bounded: few requests,
short delays, and the benchmark's own --timeout.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from click.testing import CliRunner
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from minisgl.bench.client import _Measured
from minisgl.bench.offline import WorkloadShape, make_workload
from minisgl.bench.processes import split_concurrency
from minisgl.bench.serving import (
    RequestInput,
    RequestResult,
    arrival_offsets,
    bench_serving,
    client_prompt_tokens,
    default_client_processes,
    format_report,
    percentile,
    summarize,
    with_texts,
    workload,
)
from minisgl.cli import main
from minisgl.server import protocol, responses
from minisgl.server.errors import APIError, error_body

MODEL = "stub-model"
TOKEN_DELAY = 0.002  # seconds per token
ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Stub:
    """What the stub server does and what it saw."""

    tokens_per_chunk: int = 1
    fail_http: set[int] = field(default_factory=set)  # first prompt token ids answered with a 500
    fail_stream: set[int] = field(default_factory=set)  # ... with an error event after one chunk
    with_usage: bool = True
    hang: bool = False  # never finish a stream (the benchmark's timeout must end it)
    mini_sglang: bool = False  # chat as Mini-SGLang streams it: no usage, no token ids, always streamed
    in_flight: int = 0
    max_in_flight: int = 0
    requests: int = 0
    tokens_sent: int = 0
    arrivals: list[float] = field(default_factory=list)
    bodies: list[dict[str, Any]] = field(default_factory=list)


def usage_prompt_tokens(prompt: Any) -> int:
    """The stub's prompt tokens: a token-id prompt's length; a text's words plus 1000 (not what a
    client-side tokenizer counts, so a test sees which count the report used)."""
    return len(prompt) if isinstance(prompt, list) else 1000 + len(prompt.split())


def _app(stub: Stub) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> Any:
        return responses.model_list(MODEL)

    async def generate(request: Request, chat: bool) -> Any:
        body = await request.json()
        stub.requests += 1
        stub.arrivals.append(time.perf_counter())
        stub.bodies.append(body)
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        n, choices = body["max_tokens"], body.get("n", 1)
        first = prompt[0] if isinstance(prompt, list) else None
        if first in stub.fail_http:
            error = APIError("stub failure", status=500, type="server_error")
            return JSONResponse(error_body(error), status_code=500)
        kind = "chat" if chat else "completion"
        if not body.get("stream") and not stub.mini_sglang:
            ids = [j % 97 for j in range(n)]
            stub.tokens_sent += n * choices
            text = {"message": {"role": "assistant", "content": " x" * n}} if chat else {"text": " x" * n}
            p_tokens = usage_prompt_tokens(prompt)
            usage = {"prompt_tokens": p_tokens, "completion_tokens": n * choices}
            listed = [
                {"index": i, **text, "finish_reason": "length", "token_ids": ids} for i in range(choices)
            ]
            obj = "chat.completion" if chat else "text_completion"
            return JSONResponse(
                {"id": "cmpl-1", "object": obj, "model": MODEL, "choices": listed, "usage": usage}
            )

        def chunk(i: int, ids: list[int] | None, finish: str | None = None, role: bool = False) -> str:
            if stub.mini_sglang:  # its shape: default json separators, role in the first delta
                delta = {"role": "assistant"} if role else {}
                if ids:
                    delta["content"] = " x" * len(ids)
                obj = {"id": "cmpl-1", "object": "text_completion.chunk"}
                obj["choices"] = [{"delta": delta, "index": i, "finish_reason": finish}]
                return f"data: {json.dumps(obj)}\n\n"
            if chat:
                text = " x" * len(ids) if ids else None
                obj = responses.chat_chunk(
                    "cmpl-1", MODEL, i, content=text, finish_reason=finish, token_ids=ids
                )
            else:
                obj = responses.completion_chunk("cmpl-1", MODEL, i, "", finish_reason=finish, token_ids=ids)
            return responses.sse(obj)

        async def events() -> Iterator[str]:
            stub.in_flight += 1
            stub.max_in_flight = max(stub.max_in_flight, stub.in_flight)
            try:
                sent = 0
                if chat and not stub.mini_sglang:
                    for i in range(choices):
                        yield responses.sse(
                            responses.chat_chunk("cmpl-1", MODEL, i, role="assistant", content="")
                        )
                while sent < n or stub.hang:
                    k = min(stub.tokens_per_chunk, n - sent) if not stub.hang else 1
                    await asyncio.sleep(TOKEN_DELAY * k)
                    ids = [(sent + j) % 97 for j in range(k)]
                    for i in range(choices):
                        yield chunk(i, ids, role=stub.mini_sglang and sent == 0)
                    sent += k
                    stub.tokens_sent += k * choices
                    if first in stub.fail_stream:
                        error = APIError("stub broke", status=500, type="server_error")
                        yield responses.sse(error_body(error))
                        yield responses.SSE_DONE
                        return
                for i in range(choices):
                    yield chunk(i, None, finish="length")
                usage = stub.with_usage and not stub.mini_sglang
                if usage and (body.get("stream_options") or {}).get("include_usage"):
                    p_tokens = usage_prompt_tokens(prompt)
                    yield responses.sse(
                        responses.usage_chunk(kind, "cmpl-1", MODEL, p_tokens, sent * choices)
                    )
                yield responses.SSE_DONE
            finally:
                stub.in_flight -= 1

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await generate(request, chat=True)

    return app


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def stub_server() -> Iterator[tuple[Stub, str]]:
    stub = Stub()
    port = _free_port()
    config = uvicorn.Config(_app(stub), host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "the stub server did not start"
        time.sleep(0.02)
    try:
        yield stub, f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def _requests(n: int, out: int = 5) -> list[RequestInput]:
    """n requests whose first prompt token is their index (the stub's failure switch)."""
    return [RequestInput([i, 7, 8], out + i % 3) for i in range(n)]


# -- the workload --------------------------------------------------------------------------------


def test_workload_is_the_offline_benchmarks() -> None:
    shape = WorkloadShape(num_seqs=8, min_input=4, max_input=12, min_output=2, max_output=9, seed=3)
    prompts, max_tokens = make_workload(shape, 10001)
    requests = workload(8, 4, 12, 2, 9, seed=3)
    assert [r.prompt for r in requests] == prompts
    assert [r.max_tokens for r in requests] == max_tokens
    assert all(0 <= t < 320 for r in workload(4, 4, 12, 2, 9, vocab_size=320) for t in r.prompt)
    assert len(workload()) == WorkloadShape().num_seqs  # the default shape: the offline benchmark's
    with pytest.raises(ValueError):
        workload(4, min_input=9, max_input=3)


def test_percentile_and_summary() -> None:
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([5], 99) == 5
    assert percentile([], 50) == 0.0
    ok = RequestResult(3, 4, success=True, ttft=0.1, latency=0.4, itl=[0.1, 0.1, 0.1], output_tokens=4)
    bad = RequestResult(3, 4, error="boom")
    report = summarize(
        [ok, bad], 2.0, {"model": "m", "base_url": "u", "request_rate": 1, "max_concurrency": None}
    )
    assert report["completed"] == 1 and report["failed"] == 1 and report["errors"] == {"boom": 1}
    assert report["output_throughput"] == 2.0 and report["request_throughput"] == 0.5
    assert math.isclose(report["tpot_ms"]["mean"], 100.0)
    assert math.isclose(report["itl_ms"]["p99"], 100.0)
    assert "Successful requests:" in format_report(report)


# -- against the stub server ---------------------------------------------------------------------


@pytest.mark.parametrize("tokens_per_chunk", [1, 2])
def test_all_requests_complete(stub_server, tokens_per_chunk: int) -> None:
    stub, url = stub_server
    stub.tokens_per_chunk = tokens_per_chunk
    requests = _requests(12)
    report = bench_serving(requests, base_url=url, timeout=60)
    assert report["model"] == MODEL  # from GET /v1/models
    assert report["completed"] == 12 and report["failed"] == 0
    assert report["total_output_tokens"] == stub.tokens_sent == sum(r.max_tokens for r in requests)
    assert report["total_input_tokens"] == sum(len(r.prompt) for r in requests)
    for r in report["requests"]:
        assert r["success"] and 0 < r["ttft"] < r["latency"]
        # one value per token after the first chunk, whatever the chunking
        assert r["itl_count"] == r["output_tokens"] - min(tokens_per_chunk, r["output_tokens"])
    assert 0 < report["ttft_ms"]["p50"] <= report["e2e_latency_ms"]["p50"]
    assert report["itl_ms"]["mean"] > 0 and report["tpot_ms"]["mean"] > 0
    # what the client asked for: token ids, ignore_eos, usage, the drawn max_tokens
    body = stub.bodies[0]
    assert body["ignore_eos"] is True and body["return_token_ids"] is True
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert sorted(b["max_tokens"] for b in stub.bodies) == sorted(r.max_tokens for r in requests)


def test_tokens_counted_without_usage(stub_server) -> None:
    stub, url = stub_server
    stub.with_usage = False
    report = bench_serving(_requests(4), base_url=url, model=MODEL, timeout=60)
    assert report["completed"] == 4
    assert report["total_output_tokens"] == stub.tokens_sent


def test_request_rate_paces_arrivals(stub_server) -> None:
    stub, url = stub_server
    n, rate = 8, 20.0
    report = bench_serving(
        _requests(n, out=1), base_url=url, model=MODEL, request_rate=rate, seed=1, timeout=60
    )
    assert report["completed"] == n
    # the 7 gaps are exponential draws of mean 1/rate from random.Random(1): the run lasts at least
    # their sum (computed the same way), far above what sending all at once takes
    import random

    rng = random.Random(1)
    gaps = sum(rng.expovariate(rate) for _ in range(n - 1))
    assert report["duration_s"] >= gaps * 0.9
    assert stub.arrivals[-1] - stub.arrivals[0] >= gaps * 0.5
    starts = sorted(r["start"] for r in report["requests"])
    assert starts[-1] - starts[0] >= gaps * 0.9


def test_max_concurrency_is_respected(stub_server) -> None:
    stub, url = stub_server
    report = bench_serving(_requests(10, out=6), base_url=url, model=MODEL, max_concurrency=3, timeout=60)
    assert report["completed"] == 10
    assert 1 <= stub.max_in_flight <= 3
    unlimited = bench_serving(_requests(10, out=6), base_url=url, model=MODEL, timeout=60)
    assert unlimited["completed"] == 10


def test_server_errors_are_failures(stub_server) -> None:
    stub, url = stub_server
    stub.fail_http = {1, 4}
    stub.fail_stream = {2}
    requests = _requests(6)
    report = bench_serving(requests, base_url=url, model=MODEL, timeout=60)
    assert report["completed"] == 3 and report["failed"] == 3
    failed = [i for i, r in enumerate(report["requests"]) if not r["success"]]
    assert failed == [1, 2, 4]
    assert all(report["requests"][i]["error"] for i in failed)
    assert sum(report["errors"].values()) == 3
    expected = sum(r.max_tokens for i, r in enumerate(requests) if i not in failed)
    assert report["total_output_tokens"] == expected


def test_timeout_stops_the_run(stub_server) -> None:
    stub, url = stub_server
    stub.hang = True
    started = time.perf_counter()
    report = bench_serving(_requests(3), base_url=url, model=MODEL, timeout=1.0)
    assert time.perf_counter() - started < 10
    assert report["timed_out"] and report["completed"] == 0 and report["failed"] == 3


# -- through the command line --------------------------------------------------------------------


def test_cli_json(stub_server) -> None:
    stub, url = stub_server
    args = ["bench-serving", "--base-url", url, "--num-prompts", "6", "--min-input", "3", "--max-input", "9"]
    args += ["--min-output", "2", "--max-output", "6", "--max-concurrency", "2", "--timeout", "60", "--json"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    expected = workload(6, 3, 9, 2, 6, seed=0)
    assert report["completed"] == 6 and report["failed"] == 0 and report["model"] == MODEL
    assert report["total_output_tokens"] == sum(r.max_tokens for r in expected) == stub.tokens_sent
    assert report["total_input_tokens"] == sum(len(r.prompt) for r in expected)
    assert sorted(b["prompt"] for b in stub.bodies) == sorted(r.prompt for r in expected)
    assert stub.max_in_flight <= 2
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_latency_ms"):
        assert set(report[key]) == {"mean", "p50", "p90", "p99"}


def test_cli_text_report(stub_server) -> None:
    _, url = stub_server
    args = ["bench-serving", "--base-url", url, "--num-prompts", "3", "--max-input", "8", "--min-input", "2"]
    result = CliRunner().invoke(main, [*args, "--min-output", "2", "--max-output", "3", "--timeout", "60"])
    assert result.exit_code == 0, result.output
    assert "Successful requests:" in result.stdout and "Mean TTFT (ms):" in result.stdout


def test_cli_unreachable_server() -> None:
    url = f"http://127.0.0.1:{_free_port()}/v1"
    result = CliRunner().invoke(
        main, ["bench-serving", "--base-url", url, "--num-prompts", "1", "--timeout", "20"]
    )
    assert result.exit_code == 1
    assert "cannot benchmark" in result.stderr and "Traceback" not in result.output


# -- the stream reader on its own: framing, SSE parsing, the per-token ITL split ----------------------


class _Transport:
    def close(self) -> None:
        pass

    def abort(self) -> None:
        pass


def _event(ids: list[int] | None = None, text: str = "", index: int = 0) -> bytes:
    choice: dict[str, Any] = {"index": index, "text": text, "finish_reason": None}
    if ids is not None:
        choice["token_ids"] = ids
    return b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n"


def _measured(result: RequestResult, started: float = 10.0) -> _Measured:
    exchange = _Measured(b"", result, started)
    exchange.transport = _Transport()  # type: ignore[assignment]
    return exchange


def test_sse_times_split_and_counts() -> None:
    async def run() -> RequestResult:
        result = RequestResult(3, 5)
        m = _measured(result)
        m.status, m.headers = 200, {"content-type": "text/event-stream; charset=utf-8"}
        m.head_received()
        m.body_received(b": a comment\n\n" + _event([1]), 10.5)  # TTFT 0.5 s
        three = _event([2, 3, 4])
        m.body_received(three[:17], 10.8)  # an event split across reads counts when it is complete
        m.body_received(three[17:], 11.1)  # 3 tokens 0.6 s after the last: 3 gaps of 0.2 s
        m.body_received(_event(text="x").replace(b"\n", b"\r\n"), 11.2)  # text, no ids: 1 token; CRLF
        m.body_received(_event(None, "") + _event([], ""), 11.25)  # no tokens: no chunk, no gap
        tail = b'data: {"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":5}}\n\ndata: [DONE]\n\n'
        m.body_received(tail, 11.3)
        assert m.finished and m.done.done()
        return result

    r = asyncio.run(run())
    assert r.success and r.error is None
    assert r.ttft == pytest.approx(0.5) and r.latency == pytest.approx(1.3)
    assert r.itl == pytest.approx([0.2, 0.2, 0.2, 0.1])
    assert r.chunks == 3 and r.output_tokens == 5 and r.output_tokens_source == "usage"
    assert r.prompt_tokens == 9 and r.prompt_tokens_source == "usage"
    assert r.tpot == pytest.approx(0.8 / 4)


def test_sse_choices_are_timed_apart() -> None:
    async def run() -> RequestResult:
        result = RequestResult(3, 2, n=2)
        m = _measured(result, started=0.0)
        m.status, m.headers = 200, {"content-type": "text/event-stream"}
        m.head_received()
        m.body_received(_event([1], index=0) + _event([1], index=1), 1.0)
        m.body_received(_event([2], index=1), 1.5)
        m.body_received(_event([2], index=0), 2.0)
        m.body_ended(2.5)  # no [DONE], no usage: the end of the body ends the stream
        return result

    r = asyncio.run(run())
    assert r.success and r.ttft == 1.0 and r.latency == 2.5
    assert sorted(r.itl) == [0.5, 1.0]  # each choice's gap from its own previous chunk
    assert r.output_tokens == 4 and r.output_tokens_source == "token_ids"
    assert r.prompt_tokens == 3 and r.prompt_tokens_source == "client"
    assert r.tpot == pytest.approx((2.5 - 1.0) / (2 - 1))  # per choice: 4 tokens over 2 choices


def _feed(raw: bytes, piece: int) -> RequestResult:
    async def run() -> RequestResult:
        result = RequestResult(3, 4)
        m = _measured(result, started=time.perf_counter())
        for i in range(0, len(raw), piece):
            m.data_received(raw[i : i + piece])
        if not m.finished:
            m.connection_lost(None)
        return result

    return asyncio.run(run())


@pytest.mark.parametrize("piece", [1, 7, 10_000])
def test_http_framing(piece: int) -> None:
    events = _event([1]) + _event([2, 3]) + _event([4]) + b"data: [DONE]\n\n"
    frames = b"".join(
        b"%x\r\n%b\r\n" % (len(events[i : i + 23]), events[i : i + 23]) for i in range(0, len(events), 23)
    )
    head = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
    chunked = _feed(head + b"Transfer-Encoding: chunked\r\n\r\n" + frames + b"0\r\n\r\n", piece)
    assert chunked.success and chunked.output_tokens == 4 and chunked.chunks == 3
    sized = _feed(head + b"Content-Length: %d\r\n\r\n" % len(events) + events, piece)
    assert sized.success and sized.output_tokens == 4
    closed = _feed(
        head + b"\r\n" + events.replace(b"data: [DONE]\n\n", b""), piece
    )  # ends with the connection
    assert closed.success and closed.output_tokens == 4
    error = json.dumps({"error": {"message": "boom", "type": "server_error"}}).encode()
    failed = _feed(
        b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: %d\r\n\r\n" % len(error) + error, piece
    )
    assert not failed.success and failed.error == "HTTP 500: boom"
    cut = _feed(head + b"Transfer-Encoding: chunked\r\n\r\n" + frames[:60], piece)
    assert not cut.success and "closed the connection" in (cut.error or "")
    in_stream = _feed(head + b"\r\n" + _event([1]) + b'data: {"error": {"message": "oops"}}\n\n', piece)
    assert not in_stream.success and "oops" in (in_stream.error or "") and in_stream.output_tokens == 1


def test_schedule_and_split() -> None:
    import random

    rng = random.Random(4)
    gaps = [rng.expovariate(2.0) for _ in range(3)]
    assert arrival_offsets(4, 2.0, 4) == pytest.approx([0, gaps[0], gaps[0] + gaps[1], sum(gaps)])
    assert arrival_offsets(3, math.inf, 4) == [0.0, 0.0, 0.0]
    assert split_concurrency(10, 4) == [3, 3, 2, 2] and split_concurrency(None, 2) == [None, None]
    assert 1 <= default_client_processes() <= 8


# -- the fast stub (perf/stub_server.py) in subprocesses --------------------------------------------


@pytest.fixture(scope="module")
def fast_stub() -> Iterator[Callable[..., str]]:
    """`python -m perf.stub_server` subprocesses on free ports (each stops by itself within 120 s)."""
    procs: dict[tuple, tuple[subprocess.Popen, str]] = {}

    def start(tokens_per_chunk: int = 1, processes: int = 1, framing: str = "chunked") -> str:
        key = (tokens_per_chunk, processes, framing)
        if key not in procs:
            args = [sys.executable, "-m", "perf.stub_server", "--port", "0", "--max-seconds", "120"]
            args += ["--tokens-per-chunk", str(tokens_per_chunk), "--processes", str(processes)]
            proc = subprocess.Popen(
                [*args, "--framing", framing], cwd=ROOT, stdout=subprocess.PIPE, text=True
            )
            line: list[str] = []
            reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
            reader.start()
            reader.join(60)
            assert line and "listening on" in line[0], "the stub server did not start"
            procs[key] = (proc, line[0].split("listening on ", 1)[1].split()[0])
        return procs[key][1]

    try:
        yield start
    finally:
        for proc, _ in procs.values():
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


@pytest.mark.parametrize(("tokens_per_chunk", "framing"), [(1, "chunked"), (3, "chunked"), (3, "close")])
def test_fast_stub_counts_exactly(fast_stub, tokens_per_chunk: int, framing: str) -> None:
    url = fast_stub(tokens_per_chunk, framing=framing)
    requests = _requests(16, out=10)
    report = bench_serving(requests, base_url=url, max_concurrency=8, client_processes=1, timeout=60)
    assert report["model"] == "stub-model" and report["client_processes"] == 1
    assert report["completed"] == 16 and report["failed"] == 0
    assert report["total_output_tokens"] == sum(r.max_tokens for r in requests)
    assert report["total_input_tokens"] == sum(len(r.prompt) for r in requests)  # usage: the ids' count
    assert report["prompt_tokens_source"] == "usage" and report["output_tokens_source"] == "usage"
    for r, asked in zip(report["requests"], requests):
        assert r["success"] and r["output_tokens"] == asked.max_tokens and 0 < r["ttft"] <= r["latency"]
        assert r["itl_count"] == r["output_tokens"] - tokens_per_chunk
        assert r["chunks"] == math.ceil(asked.max_tokens / tokens_per_chunk)
    assert report["ttft_ms"]["p50"] > 0 and report["e2e_latency_ms"]["p50"] > 0


def test_fast_stub_client_processes(fast_stub) -> None:
    url = fast_stub(2, processes=2)
    requests = _requests(20, out=30)
    offsets = arrival_offsets(20, 100.0, 2)
    report = bench_serving(
        requests, base_url=url, request_rate=100.0, seed=2, client_processes=2, max_concurrency=6, timeout=60
    )
    assert report["client_processes"] == 2 and report["completed"] == 20
    assert report["total_output_tokens"] == sum(r.max_tokens for r in requests)
    # in workload order, each sent no earlier than its place in the one shared schedule (within 5 ms: each
    # process reads the shared start on its own clock; 1 ms flaked by 0.1 ms on a loaded 2-core machine)
    assert [r["max_tokens"] for r in report["requests"]] == [r.max_tokens for r in requests]
    for r, offset in zip(report["requests"], offsets):
        assert r["start"] >= offset - 5e-3
    assert report["duration_s"] >= offsets[-1]
    assert "Client processes:" in format_report(report)


def test_client_processes_split_the_concurrency(stub_server) -> None:
    stub, url = stub_server
    report = bench_serving(
        _requests(12, out=6), base_url=url, model=MODEL, max_concurrency=3, client_processes=2, timeout=60
    )
    assert report["completed"] == 12 and report["client_processes"] == 2
    assert 1 <= stub.max_in_flight <= 3
    # never more processes than requests in flight
    one = bench_serving(_requests(2), base_url=url, model=MODEL, max_concurrency=1, client_processes=4)
    assert one["client_processes"] == 1 and one["completed"] == 2


def test_timeout_stops_client_processes(stub_server) -> None:
    stub, url = stub_server
    stub.hang = True
    started = time.perf_counter()
    # the timeout counts from before the processes start (spawned: ~1 s to import on a loaded 2-core
    # machine, 3 s was too close): processes that start after it fail as "did not start", not "timeout"
    report = bench_serving(_requests(3), base_url=url, model=MODEL, timeout=10.0, client_processes=2)
    assert time.perf_counter() - started < 60  # ended by the timeout: a hung stream never ends by itself
    assert report["timed_out"] and report["completed"] == 0 and report["failed"] == 3
    assert all("timeout" in r["error"] for r in report["requests"])


def test_stub_stops_by_itself() -> None:
    args = [sys.executable, "-m", "perf.stub_server", "--port", "0", "--max-seconds", "1", "--processes", "2"]
    out = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "listening on" in out.stdout


def test_measure_client_from_a_script() -> None:
    args = [sys.executable, "-m", "perf.stub_server", "--measure-client", "8", "--output-len", "16"]
    args += ["--tokens-per-chunk", "3", "--max-concurrency", "4", "--max-seconds", "60", "--json"]
    out = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["completed"] == 8 and report["total_output_tokens"] == 8 * 16
    assert report["tokens_per_chunk"] == 3 and report["output_throughput"] > 0


# -- chat, text prompts, non-streamed, n > 1 -----------------------------------------------------------


@pytest.fixture(scope="module")
def texts(smollm2_path) -> list[RequestInput]:
    """A small workload decoded once with SmolLM2's tokenizer."""
    return with_texts(workload(4, 8, 16, 3, 5, seed=1), smollm2_path)


def test_with_texts(texts) -> None:
    plain = workload(4, 8, 16, 3, 5, seed=1)
    assert [r.prompt for r in texts] == [r.prompt for r in plain]
    assert all(r.text and r.text_tokens and r.chat_tokens > r.text_tokens for r in texts)  # the template adds
    assert client_prompt_tokens(texts[0], "chat", "text") == texts[0].chat_tokens
    assert client_prompt_tokens(texts[0], "completions", "text") == texts[0].text_tokens
    assert client_prompt_tokens(texts[0], "completions", "ids") == len(texts[0].prompt)


def test_chat_endpoint(stub_server, texts) -> None:
    stub, url = stub_server
    stub.tokens_per_chunk = 2
    report = bench_serving(texts, base_url=url, endpoint="chat", timeout=60)
    assert report["endpoint"] == "chat" and report["completed"] == 4
    assert report["total_output_tokens"] == sum(r.max_tokens for r in texts) == stub.tokens_sent
    # the server's usage.prompt_tokens, not the client's count
    assert report["total_input_tokens"] == sum(1000 + len(r.text.split()) for r in texts)
    assert report["prompt_tokens_source"] == "usage"
    for r in report["requests"]:
        assert r["itl_count"] == r["output_tokens"] - min(2, r["output_tokens"])
    by_text = {b["messages"][0]["content"]: b for b in stub.bodies}
    assert set(by_text) == {r.text for r in texts}
    body = stub.bodies[0]
    assert body["messages"] == [{"role": "user", "content": body["messages"][0]["content"]}]
    assert set(body) == {
        "model",
        "messages",
        "max_tokens",
        "temperature",
        "stream",
        "stream_options",
        "ignore_eos",
        "return_token_ids",
    }
    # minisgl's server accepts the body as it is (it refuses unknown fields)
    protocol.parse_chat_request(body, MODEL)


def test_chat_against_a_server_without_usage(stub_server, texts) -> None:
    """Mini-SGLang's chat stream: no usage, no token ids; a role chunk; one chunk per token."""
    stub, url = stub_server
    stub.mini_sglang = True
    report = bench_serving(texts, base_url=url, model=MODEL, endpoint="chat", timeout=60)
    assert report["completed"] == 4
    assert report["total_input_tokens"] == sum(r.chat_tokens for r in texts)
    assert report["prompt_tokens_source"] == "client" and report["output_tokens_source"] == "chunks"
    assert report["total_output_tokens"] == sum(r.max_tokens for r in texts)
    assert "Input tokens counted from:" in format_report(report)
    # asked not to stream, Mini-SGLang streams anyway: read as a stream
    report = bench_serving(texts, base_url=url, model=MODEL, endpoint="chat", stream=False, timeout=60)
    assert report["completed"] == 4 and report["total_output_tokens"] == sum(r.max_tokens for r in texts)


def test_text_prompts(stub_server, texts) -> None:
    stub, url = stub_server
    report = bench_serving(texts, base_url=url, model=MODEL, prompt_format="text", timeout=60)
    assert report["prompt_format"] == "text" and report["completed"] == 4
    assert sorted(b["prompt"] for b in stub.bodies) == sorted(r.text for r in texts)
    assert report["total_input_tokens"] == sum(1000 + len(r.text.split()) for r in texts)
    protocol.parse_completion_request(stub.bodies[0], MODEL)
    with pytest.raises(ValueError, match="tokenizer"):
        bench_serving(_requests(2), base_url=url, model=MODEL, prompt_format="text", timeout=60)


def test_not_streamed(stub_server) -> None:
    stub, url = stub_server
    requests = _requests(5)
    report = bench_serving(requests, base_url=url, model=MODEL, stream=False, timeout=60)
    assert report["completed"] == 5 and report["stream"] is False
    assert report["total_output_tokens"] == sum(r.max_tokens for r in requests)
    for r in report["requests"]:
        assert r["ttft"] == r["latency"] and r["itl_count"] == 0
    body = stub.bodies[0]
    assert body["stream"] is False and "stream_options" not in body
    protocol.parse_completion_request(body, MODEL)


def test_n_choices(stub_server) -> None:
    stub, url = stub_server
    stub.tokens_per_chunk = 2
    requests = _requests(4, out=6)
    report = bench_serving(requests, base_url=url, model=MODEL, n=3, timeout=60)
    assert report["completed"] == 4 and report["n"] == 3
    assert report["total_output_tokens"] == 3 * sum(r.max_tokens for r in requests) == stub.tokens_sent
    for r in report["requests"]:
        assert r["itl_count"] == r["output_tokens"] - 3 * 2  # the first chunk of each choice adds none
        assert r["tpot"] > 0
    assert all(b["n"] == 3 for b in stub.bodies)
    streamed = bench_serving(requests, base_url=url, model=MODEL, n=2, stream=False, timeout=60)
    assert streamed["total_output_tokens"] == 2 * sum(r.max_tokens for r in requests)


def test_cli_chat_options(stub_server, smollm2_path) -> None:
    stub, url = stub_server
    args = ["bench-serving", "--base-url", url, "--num-prompts", "3", "--min-input", "4", "--max-input", "8"]
    args += ["--min-output", "2", "--max-output", "4", "--timeout", "60", "--json", "--client-processes", "1"]
    result = CliRunner().invoke(
        main, [*args, "--endpoint", "chat", "--tokenizer", str(smollm2_path), "--n", "2"]
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["endpoint"] == "chat" and report["n"] == 2 and report["completed"] == 3
    assert report["total_output_tokens"] == 2 * sum(r.max_tokens for r in workload(3, 4, 8, 2, 4))
    assert all("messages" in b for b in stub.bodies)
    result = CliRunner().invoke(main, [*args, "--no-stream", "--no-return-token-ids"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["stream"] is False and report["completed"] == 3
    assert "return_token_ids" not in stub.bodies[-1]
    result = CliRunner().invoke(main, [*args, "--endpoint", "chat"])
    assert result.exit_code == 2 and "--tokenizer" in result.output


# -- the command's end: after its report, and on SIGTERM / SIGINT ---------------------------------------

# a hung exit (the bug this guards against) lasted minutes; a loaded 2-core host needs seconds
EXIT_BOUND_S = 60


def _cli_process(url: str, prompts: int, processes: int, timeout: int) -> subprocess.Popen:
    """`python -m minisgl.cli bench-serving --json` (`workload(prompts, 3, 9, 2, 6)`) in a session of its
    own (its process group: what is left of it after it exits is found there)."""
    cmd = [sys.executable, "-m", "minisgl.cli", "bench-serving", "--base-url", url, "--json"]
    cmd += ["--num-prompts", str(prompts), "--min-input", "3", "--max-input", "9", "--min-output", "2"]
    cmd += ["--max-output", "6", "--client-processes", str(processes), "--timeout", str(timeout)]
    return subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def _ended(proc: subprocess.Popen) -> tuple[str, str]:
    """The output once the process and everything holding its pipes are gone (bounded); no process of
    its group may outlive it."""
    try:
        out, err = proc.communicate(timeout=EXIT_BOUND_S)
    finally:
        survivors = subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True, text=True).stdout
        if proc.poll() is None or survivors:
            os.killpg(proc.pid, signal.SIGKILL)
    assert not survivors, f"processes left behind: {survivors.split()}"
    return out, err


def test_cli_with_client_processes_exits_after_its_report(stub_server) -> None:
    stub, url = stub_server
    proc = _cli_process(url, prompts=12, processes=4, timeout=120)
    out, err = _ended(proc)
    assert proc.returncode == 0, err
    report = json.loads(out)
    assert report["client_processes"] == 4 and report["completed"] == 12 and report["failed"] == 0
    assert report["interrupted"] is None and not report["timed_out"]
    assert report["total_output_tokens"] == stub.tokens_sent


@pytest.mark.parametrize(
    ("sig", "group", "processes"),
    [(signal.SIGTERM, False, 4), (signal.SIGINT, True, 4), (signal.SIGINT, False, 1)],
    ids=["sigterm-4-processes", "ctrl-c-to-the-group-4-processes", "sigint-1-process"],
)
def test_a_signal_mid_run_ends_it_with_a_partial_report(stub_server, sig, group, processes) -> None:
    stub, url = stub_server
    stub.hang = True  # streams that never end: only the signal stops the run
    n = 8
    drawn = workload(n, 3, 9, 2, 6, seed=0)
    stub.fail_http = {drawn[0].prompt[0], drawn[1].prompt[0]}  # two requests fail at once, in two processes
    failing = sum(r.prompt[0] in stub.fail_http for r in drawn)
    proc = _cli_process(url, prompts=n, processes=processes, timeout=300)
    deadline = time.monotonic() + EXIT_BOUND_S
    while stub.requests < n:  # every request sent: the run is under way
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    time.sleep(0.3)
    (os.killpg if group else os.kill)(proc.pid, sig)
    out, err = _ended(proc)
    assert proc.returncode == 128 + sig, err
    report = json.loads(out)
    assert report["interrupted"] == sig.name and not report["timed_out"]
    assert report["client_processes"] == processes and report["completed"] == 0 and report["failed"] == n
    errors = report["errors"]
    assert errors.pop(f"cancelled: {sig.name} stopped the run") == n - failing
    assert sum(errors.values()) == failing and all("500" in e for e in errors)
