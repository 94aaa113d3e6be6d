"""`minisgl-run bench-serving`: an online benchmark client for an OpenAI-compatible server.

It sends a workload to `POST {base_url}/completions` with `stream: true` through the official `openai`
client and measures each request as it streams, the way SGLang's `bench_serving` and vLLM's serving
benchmark do (docs/bench-serving.md):

- TTFT: from sending the request to the first chunk that carries text or token ids.
- ITL (inter-token latency): the gap between a chunk and the previous one that carried tokens. A chunk
  with k tokens adds k values of gap / k (SGLang's per-token adjustment), so chunking never inflates ITL.
  The tokens of the first chunk add none. All requests' values are pooled before the statistics.
- TPOT (time per output token, excluding the first): (E2E - TTFT) / (output tokens - 1), one value per
  request with more than one output token.
- E2E latency: from sending the request to the end of its stream.
- Output tokens: `usage.completion_tokens` of the usage chunk when the server sends one, else counted
  (the `token_ids` of the chunks, else one per chunk with text).

The default workload is the offline benchmark's (`minisgl.bench.make_workload`): seeded random token-id
prompts, `ignore_eos`, `max_tokens` the drawn output length. Requests arrive as a Poisson process of
`request_rate` per second (exponential gaps from a seeded generator; `inf`: all at once), optionally
behind a semaphore of `max_concurrency`. The whole run is bounded by `timeout` seconds: requests still
running then are cancelled and reported as failed.

    from minisgl.server.bench_serving import bench_serving, format_report, workload
    report = bench_serving(workload(num_prompts=64), base_url="http://127.0.0.1:30000/v1", request_rate=8)
    print(format_report(report))
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

DEFAULT_BASE_URL = "http://127.0.0.1:30000/v1"
DEFAULT_TIMEOUT = 3600.0
# without --vocab-size, token ids stay below the offline workload's bound (minisgl.bench.TOKEN_ID_MAX)
# and are not wrapped: the same prompts as `minisgl-run bench` on any vocabulary larger than 10,000
UNWRAPPED_VOCAB = 10001
PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class RequestInput:
    """One request of the workload: a prompt of token ids and the tokens to generate."""

    prompt: list[int]
    max_tokens: int


@dataclass
class RequestResult:
    """What one request measured. Times in seconds; `start` is relative to the benchmark's start."""

    prompt_tokens: int
    max_tokens: int
    success: bool = False
    error: str | None = None
    start: float = 0.0
    ttft: float | None = None
    latency: float | None = None
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    chunks: int = 0

    @property
    def tpot(self) -> float | None:
        if not self.success or self.ttft is None or self.latency is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def workload(
    num_prompts: int | None = None,
    min_input: int | None = None,
    max_input: int | None = None,
    min_output: int | None = None,
    max_output: int | None = None,
    seed: int = 0,
    vocab_size: int | None = None,
) -> list[RequestInput]:
    """The offline benchmark's workload (`minisgl.bench.WorkloadShape`, `make_workload`): the same seed
    and shape draw the same prompts and output lengths. Unset fields take WorkloadShape's defaults."""
    from minisgl.bench import WorkloadShape, make_workload

    given = dict(
        num_seqs=num_prompts,
        min_input=min_input,
        max_input=max_input,
        min_output=min_output,
        max_output=max_output,
    )
    shape = WorkloadShape(**{k: v for k, v in given.items() if v is not None}, seed=seed)
    if shape.num_seqs < 1 or shape.min_input < 1 or shape.min_output < 1:
        raise ValueError("the number of prompts and the input and output lengths must be at least 1")
    if shape.min_input > shape.max_input or shape.min_output > shape.max_output:
        raise ValueError("the shortest input/output length must not exceed the longest")
    prompts, max_tokens = make_workload(shape, vocab_size or UNWRAPPED_VOCAB)
    return [RequestInput(p, n) for p, n in zip(prompts, max_tokens)]


def _chunk_token_ids(choice: Any) -> list[int] | None:
    """The `token_ids` extra field of a streamed choice (minisgl's `return_token_ids`), if any."""
    ids = getattr(choice, "token_ids", None)
    if ids is None:
        extra = getattr(choice, "model_extra", None) or {}
        ids = extra.get("token_ids")
    return list(ids) if isinstance(ids, list) else None


async def _one_request(
    client: Any,
    model: str,
    request: RequestInput,
    temperature: float,
    extra_body: dict[str, Any],
    t0: float,
) -> RequestResult:
    result = RequestResult(prompt_tokens=len(request.prompt), max_tokens=request.max_tokens)
    started = time.perf_counter()
    result.start = started - t0
    counted, usage_tokens = 0, None
    last = started
    try:
        stream = await client.completions.create(
            model=model,
            prompt=request.prompt,
            max_tokens=request.max_tokens,
            temperature=temperature,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra_body,
        )
        async for chunk in stream:
            now = time.perf_counter()
            usage = getattr(chunk, "usage", None)
            if usage is not None and usage.completion_tokens is not None:
                usage_tokens = usage.completion_tokens
            for choice in chunk.choices or []:
                ids = _chunk_token_ids(choice)
                text = getattr(choice, "text", None) or ""
                tokens = len(ids) if ids is not None else (1 if text else 0)
                if tokens == 0:
                    continue  # the final chunk (finish_reason only) or an empty one
                result.chunks += 1
                if result.ttft is None:
                    result.ttft = now - started
                else:
                    gap = (now - last) / tokens
                    result.itl.extend([gap] * tokens)
                last = now
                counted += tokens
        result.latency = time.perf_counter() - started
        result.output_tokens = usage_tokens if usage_tokens is not None else counted
        result.success = True
    except asyncio.CancelledError:
        result.error = "cancelled: the benchmark's --timeout ran out"
        result.output_tokens = counted
        raise
    except Exception as e:  # an HTTP error, an error event in the stream, a dropped connection...
        result.error = f"{type(e).__name__}: {e}"
        result.output_tokens = counted
    return result


async def _arrivals(n: int, request_rate: float, seed: int):
    """Yields 0..n-1 at Poisson arrival times: exponential gaps of mean 1/request_rate (none if inf)."""
    rng = random.Random(seed)
    for i in range(n):
        yield i
        if i + 1 < n and math.isfinite(request_rate):
            await asyncio.sleep(rng.expovariate(request_rate))


async def first_model(client: Any) -> str:
    """The id of the first model of `GET /v1/models`."""
    page = await client.models.list()
    models = list(page.data)
    if not models:
        raise RuntimeError("the server lists no model at GET /v1/models; give --model")
    return models[0].id


async def run_benchmark(
    requests: Sequence[RequestInput],
    *,
    base_url: str = DEFAULT_BASE_URL,
    model: str | None = None,
    api_key: str | None = None,
    temperature: float = 0.6,
    request_rate: float = math.inf,
    max_concurrency: int | None = None,
    seed: int = 0,
    timeout: float = DEFAULT_TIMEOUT,
    ignore_eos: bool = True,
    progress: bool = False,
) -> dict[str, Any]:
    """Sends `requests` and returns the report (`summarize`). Stops by itself after `timeout` seconds
    (the model lookup included): unfinished requests are cancelled and count as failed."""
    import openai

    if not requests:
        raise ValueError("the workload is empty")
    if not request_rate > 0:
        raise ValueError(f"request_rate must be > 0 (inf: all at once), got {request_rate}")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be at least 1, got {max_concurrency}")
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
    api_key = api_key or os.environ.get("MINISGL_API_KEY") or "EMPTY"
    deadline = time.perf_counter() + timeout
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=timeout)
    try:
        if model is None:
            model = await asyncio.wait_for(first_model(client), timeout)
        extra_body = {"ignore_eos": ignore_eos, "return_token_ids": True}
        semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        results: list[RequestResult | None] = [None] * len(requests)
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(requests), desc="requests", unit="req", file=sys.stderr)

        async def guarded(i: int) -> None:
            if semaphore is None:
                results[i] = await _one_request(client, model, requests[i], temperature, extra_body, t0)
            else:
                async with semaphore:
                    results[i] = await _one_request(client, model, requests[i], temperature, extra_body, t0)
            if bar is not None:
                bar.update(1)

        async def send_all(tasks: list[asyncio.Task]) -> None:
            async for i in _arrivals(len(requests), request_rate, seed):
                tasks.append(asyncio.create_task(guarded(i)))
            await asyncio.gather(*tasks)

        t0 = time.perf_counter()
        tasks: list[asyncio.Task] = []
        timed_out = False
        try:
            await asyncio.wait_for(send_all(tasks), max(0.0, deadline - time.perf_counter()))
        except asyncio.TimeoutError:
            timed_out = True
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        duration = time.perf_counter() - t0
        if bar is not None:
            bar.close()
    finally:
        await client.close()
    final = [
        r
        if r is not None
        else RequestResult(
            len(requests[i].prompt), requests[i].max_tokens, error="not finished: --timeout ran out"
        )
        for i, r in enumerate(results)
    ]
    settings = {
        "base_url": base_url,
        "model": model,
        "num_prompts": len(requests),
        "request_rate": request_rate if math.isfinite(request_rate) else "inf",
        "max_concurrency": max_concurrency,
        "temperature": temperature,
        "seed": seed,
        "timeout": timeout,
        "timed_out": timed_out,
    }
    return summarize(final, duration, settings)


def bench_serving(requests: Sequence[RequestInput], **kwargs: Any) -> dict[str, Any]:
    """`run_benchmark` in a fresh event loop."""
    return asyncio.run(run_benchmark(requests, **kwargs))


# ----------------------------------------------------------------------------------------------- report


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation (numpy's default)."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    pos = (len(ordered) - 1) * q / 100
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def _stats_ms(values: Sequence[float]) -> dict[str, float]:
    out = {"mean": 1000 * sum(values) / len(values) if values else 0.0}
    for q in PERCENTILES:
        out[f"p{q}"] = 1000 * percentile(values, q)
    return out


def summarize(results: Sequence[RequestResult], duration: float, settings: dict[str, Any]) -> dict[str, Any]:
    """The report: counts, throughputs and latency statistics (ms) over the successful requests."""
    ok = [r for r in results if r.success]
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    per_second = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    errors: dict[str, int] = {}
    for r in results:
        if not r.success:
            errors[r.error or "unknown"] = errors.get(r.error or "unknown", 0) + 1
    return {
        **settings,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "requested_output_tokens": sum(r.max_tokens for r in ok),
        "request_throughput": per_second(len(ok)),
        "input_throughput": per_second(input_tokens),
        "output_throughput": per_second(output_tokens),
        "total_throughput": per_second(input_tokens + output_tokens),
        # the mean number of requests in flight: the sum of latencies over the duration
        "concurrency": per_second(sum(r.latency or 0.0 for r in ok)),
        "ttft_ms": _stats_ms([r.ttft for r in ok if r.ttft is not None]),
        "itl_ms": _stats_ms([gap for r in ok for gap in r.itl]),
        "tpot_ms": _stats_ms([t for r in ok if (t := r.tpot) is not None]),
        "e2e_latency_ms": _stats_ms([r.latency for r in ok if r.latency is not None]),
        "errors": errors,
        "requests": [
            {**{k: v for k, v in asdict(r).items() if k != "itl"}, "tpot": r.tpot, "itl_count": len(r.itl)}
            for r in results
        ],
    }


def format_report(report: dict[str, Any]) -> str:
    """The report as text, in the shape of SGLang's and vLLM's serving benchmark results."""
    lines = [
        f"{' Serving Benchmark Result ':=^60}",
        f"{'Model:':<40}{report['model']}",
        f"{'Base URL:':<40}{report['base_url']}",
        f"{'Request rate (req/s):':<40}{report['request_rate']}",
        f"{'Max concurrency:':<40}{report['max_concurrency'] or 'unlimited'}",
        f"{'Successful requests:':<40}{report['completed']}",
        f"{'Failed requests:':<40}{report['failed']}",
        f"{'Benchmark duration (s):':<40}{report['duration_s']:.2f}",
        f"{'Total input tokens:':<40}{report['total_input_tokens']}",
        f"{'Total generated tokens:':<40}{report['total_output_tokens']}",
        f"{'Request throughput (req/s):':<40}{report['request_throughput']:.2f}",
        f"{'Input token throughput (tok/s):':<40}{report['input_throughput']:.2f}",
        f"{'Output token throughput (tok/s):':<40}{report['output_throughput']:.2f}",
        f"{'Total token throughput (tok/s):':<40}{report['total_throughput']:.2f}",
        f"{'Concurrency:':<40}{report['concurrency']:.2f}",
    ]
    for key, title in (
        ("e2e_latency_ms", "End-to-End Latency"),
        ("ttft_ms", "Time to First Token"),
        ("tpot_ms", "Time per Output Token (excl. 1st token)"),
        ("itl_ms", "Inter-Token Latency"),
    ):
        name = key.split("_ms")[0].upper().replace("_LATENCY", "")
        stats = report[key]
        lines.append(f"{' ' + title + ' ':-^60}")
        lines.append(f"{f'Mean {name} (ms):':<40}{stats['mean']:.2f}")
        for q in PERCENTILES:
            lines.append(f"{f'P{q} {name} (ms):':<40}{stats[f'p{q}']:.2f}")
    if report["errors"]:
        lines.append(f"{' Errors ':-^60}")
        for error, count in report["errors"].items():
            lines.append(f"{count:>5} x {error[:200]}")
    if report.get("timed_out"):
        lines.append(f"the run stopped at --timeout {report['timeout']} s")
    lines.append("=" * 60)
    return "\n".join(lines)


def dumps(report: dict[str, Any]) -> str:
    return json.dumps(report, indent=2)
