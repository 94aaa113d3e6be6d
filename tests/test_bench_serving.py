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
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import uvicorn
from click.testing import CliRunner
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from minisgl.bench import WorkloadShape, make_workload
from minisgl.cli import main
from minisgl.server import protocol
from minisgl.server.bench_serving import (
    RequestInput,
    RequestResult,
    bench_serving,
    format_report,
    percentile,
    summarize,
    workload,
)

MODEL = "stub-model"
TOKEN_DELAY = 0.002  # seconds per token


@dataclass
class Stub:
    """What the stub server does and what it saw."""

    tokens_per_chunk: int = 1
    fail_http: set[int] = field(default_factory=set)  # first prompt token ids answered with a 500
    fail_stream: set[int] = field(default_factory=set)  # ... with an error event after one chunk
    with_usage: bool = True
    hang: bool = False  # never finish a stream (the benchmark's timeout must end it)
    in_flight: int = 0
    max_in_flight: int = 0
    requests: int = 0
    tokens_sent: int = 0
    arrivals: list[float] = field(default_factory=list)
    bodies: list[dict[str, Any]] = field(default_factory=list)


def _app(stub: Stub) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> Any:
        return protocol.model_list(MODEL)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await request.json()
        stub.requests += 1
        stub.arrivals.append(time.perf_counter())
        stub.bodies.append(body)
        prompt, n = body["prompt"], body["max_tokens"]
        if prompt[0] in stub.fail_http:
            error = protocol.APIError("stub failure", status=500, type="server_error")
            return JSONResponse(protocol.error_body(error), status_code=500)

        async def events() -> Iterator[str]:
            stub.in_flight += 1
            stub.max_in_flight = max(stub.max_in_flight, stub.in_flight)
            try:
                sent = 0
                while sent < n or stub.hang:
                    k = min(stub.tokens_per_chunk, n - sent) if not stub.hang else 1
                    await asyncio.sleep(TOKEN_DELAY * k)
                    ids = [(sent + j) % 97 for j in range(k)]
                    yield protocol.sse(protocol.completion_chunk("cmpl-1", MODEL, 0, "", token_ids=ids))
                    sent += k
                    stub.tokens_sent += k
                    if prompt[0] in stub.fail_stream:
                        error = protocol.APIError("stub broke", status=500, type="server_error")
                        yield protocol.sse(protocol.error_body(error))
                        yield protocol.SSE_DONE
                        return
                yield protocol.sse(protocol.completion_chunk("cmpl-1", MODEL, 0, "", finish_reason="length"))
                if stub.with_usage and (body.get("stream_options") or {}).get("include_usage"):
                    yield protocol.sse(protocol.usage_chunk("completion", "cmpl-1", MODEL, len(prompt), sent))
                yield protocol.SSE_DONE
            finally:
                stub.in_flight -= 1

        return StreamingResponse(events(), media_type="text/event-stream")

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
