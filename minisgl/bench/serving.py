"""`minisgl-run bench-serving`: an online benchmark client for an OpenAI-compatible server.

It sends a workload (by default the offline benchmark's, `minisgl.bench.offline.make_workload`) to
`POST {base_url}/completions` (or `/chat/completions`) as a Poisson process of `request_rate` per
second, optionally behind `max_concurrency`, and measures each request as it streams: TTFT, ITL, TPOT,
E2E latency and token counts, the way SGLang's `bench_serving` and vLLM's serving benchmark do. The
client is built not to be the bottleneck: each request on its own connection read by an asyncio
protocol (`minisgl.bench.client`), uvloop when importable, the requests spread over several client
processes. The whole run is bounded by `timeout`. The metrics, options and report: docs/bench-serving.md.

    from minisgl.bench.serving import bench_serving, format_report, workload
    report = bench_serving(workload(num_prompts=64), base_url="http://127.0.0.1:30000/v1", request_rate=8)
    print(format_report(report))
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from minisgl.bench.client import (
    CANCELLED,
    RequestResult,
    Server,
    get_json,
    loop_name,
    run_loop,
)
from minisgl.bench.processes import Item, run_processes, run_share

__all__ = [
    "RequestInput",
    "RequestResult",
    "bench_serving",
    "default_client_processes",
    "format_report",
    "load_tokenizer",
    "percentile",
    "run_benchmark",
    "summarize",
    "with_texts",
    "workload",
]

DEFAULT_BASE_URL = "http://127.0.0.1:30000/v1"
DEFAULT_TIMEOUT = 3600.0
# without --vocab-size, token ids stay below the offline workload's bound
# (minisgl.bench.workloads.TOKEN_ID_MAX) and are not wrapped: the same prompts as `minisgl-run bench` on any vocabulary larger than 10,000
UNWRAPPED_VOCAB = 10001
PERCENTILES = (50, 90, 99)
ENDPOINTS = ("completions", "chat")
PROMPT_FORMATS = ("ids", "text")


@dataclass(frozen=True)
class RequestInput:
    """One request of the workload: a prompt of token ids and the tokens to generate. `with_texts`
    adds the prompt decoded to text (`text`), the client's token count of that text (`text_tokens`)
    and of the chat conversation holding it (`chat_tokens`: the chat template applied)."""

    prompt: list[int]
    max_tokens: int
    text: str | None = None
    text_tokens: int | None = None
    chat_tokens: int | None = None


def workload(
    num_prompts: int | None = None,
    min_input: int | None = None,
    max_input: int | None = None,
    min_output: int | None = None,
    max_output: int | None = None,
    seed: int = 0,
    vocab_size: int | None = None,
) -> list[RequestInput]:
    """The offline benchmark's workload (`minisgl.bench.offline.WorkloadShape`, `make_workload`): the
    same seed and shape draw the same prompts and output lengths. Unset fields take WorkloadShape's
    defaults."""
    from minisgl.bench.offline import WorkloadShape, make_workload

    names = ("num_seqs", "min_input", "max_input", "min_output", "max_output")
    given = zip(names, (num_prompts, min_input, max_input, min_output, max_output))
    shape = WorkloadShape(**{k: v for k, v in given if v is not None}, seed=seed)
    if shape.num_seqs < 1 or shape.min_input < 1 or shape.min_output < 1:
        raise ValueError("the number of prompts and the input and output lengths must be at least 1")
    if shape.min_input > shape.max_input or shape.min_output > shape.max_output:
        raise ValueError("the shortest input/output length must not exceed the longest")
    prompts, max_tokens = make_workload(shape, vocab_size or UNWRAPPED_VOCAB)
    return [RequestInput(p, n) for p, n in zip(prompts, max_tokens)]


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
    """transformers' AutoTokenizer from a local folder (or a name the hub cache holds)."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(path))


def with_texts(requests: Sequence[RequestInput], tokenizer: Any) -> list[RequestInput]:
    """The requests with their prompts decoded to text once (special tokens skipped, so that no prompt
    holds control tokens), for the chat endpoint and text prompts: the same texts then go to every
    server. Also the client's token counts of each text alone and inside a one-message chat (the
    tokenizer's chat template, when it has one), used when a server sends no usage. `tokenizer`: a
    loaded tokenizer or a path for `load_tokenizer`."""
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = load_tokenizer(tokenizer)
    texts = tokenizer.batch_decode([list(r.prompt) for r in requests], skip_special_tokens=True)
    out = []
    for r, text in zip(requests, texts):
        text_tokens = len(tokenizer(text)["input_ids"])
        chat_tokens = text_tokens
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
            )
            if hasattr(ids, "keys"):  # a BatchEncoding (transformers 5)
                ids = ids["input_ids"]
            chat_tokens = len(ids)
        out.append(replace(r, text=text, text_tokens=text_tokens, chat_tokens=chat_tokens))
    return out


def default_client_processes() -> int:
    """A quarter of the CPUs this process may run on, 1 to 8: 1 on 2 to 7 cores, 4 on 16, 8 from 32
    (the rest of the host for the server being measured)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(8, cpus // 4))


def arrival_offsets(n: int, request_rate: float, seed: int) -> list[float]:
    """The send times of n requests in seconds after the start: a Poisson process, exponential gaps of
    mean 1/request_rate drawn from `random.Random(seed)` in order (all 0 when the rate is inf)."""
    if not math.isfinite(request_rate):
        return [0.0] * n
    rng = random.Random(seed)
    offsets, t = [], 0.0
    for i in range(n):
        offsets.append(t)
        if i + 1 < n:
            t += rng.expovariate(request_rate)
    return offsets


def request_body(
    request: RequestInput,
    *,
    model: str,
    endpoint: str = "completions",
    prompt_format: str = "ids",
    temperature: float = 0.6,
    ignore_eos: bool = True,
    stream: bool = True,
    n: int = 1,
    return_token_ids: bool = True,
) -> dict[str, Any]:
    """The JSON body of one request. Only fields that both minisgl's server (which refuses unknown
    fields) and Mini-SGLang's (which ignores them) accept: `n` only when above 1, `stream_options` only
    when streamed (minisgl refuses it otherwise)."""
    body: dict[str, Any] = {"model": model}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": request.text}]
    else:
        body["prompt"] = request.text if prompt_format == "text" else list(request.prompt)
    body.update(max_tokens=request.max_tokens, temperature=temperature, stream=stream)
    if stream:
        body["stream_options"] = {"include_usage": True}
    if n != 1:
        body["n"] = n
    body["ignore_eos"] = ignore_eos
    if return_token_ids:
        body["return_token_ids"] = True
    return body


def client_prompt_tokens(request: RequestInput, endpoint: str, prompt_format: str) -> int:
    """The client's count of a request's prompt tokens (when the server sends no usage)."""
    if endpoint == "chat" and request.chat_tokens is not None:
        return request.chat_tokens
    if (endpoint == "chat" or prompt_format == "text") and request.text_tokens is not None:
        return request.text_tokens
    return len(request.prompt)


@contextlib.contextmanager
def _stopped_by_signals(stop: asyncio.Event, stopped_by: list[str]) -> Iterator[None]:
    """While inside: SIGINT and SIGTERM set `stop` (the run ends early with a partial report) and their
    name goes into `stopped_by`; a second one ends the process as its default would. Outside the main
    thread (no signal handlers there) nothing is installed."""
    loop = asyncio.get_running_loop()

    def handle(sig: signal.Signals) -> None:
        if stop.is_set():
            signal.signal(sig, signal.SIG_DFL)
            os.kill(os.getpid(), sig)
        stopped_by.append(sig.name)
        stop.set()

    installed = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, handle, sig)
        except (RuntimeError, ValueError, NotImplementedError):
            continue
        installed.append(sig)
    try:
        yield
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)


async def first_model(server: Server) -> str:
    """The id of the first model of `GET /v1/models`."""
    page = await get_json(server, "/models")
    models = page.get("data") if isinstance(page, dict) else None
    if not models:
        raise RuntimeError("the server lists no model at GET /v1/models; give --model")
    return models[0]["id"]


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
    endpoint: str = "completions",
    prompt_format: str = "ids",
    tokenizer: Any = None,
    stream: bool = True,
    n: int = 1,
    return_token_ids: bool = True,
    client_processes: int | None = None,
    use_uvloop: bool = True,
    extra_body: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Sends `requests` and returns the report (`summarize`). Stops by itself after `timeout` seconds
    (the model lookup and the start of client processes included): unfinished requests are cancelled
    and count as failed.

    `endpoint`: "completions" (`POST {base_url}/completions`) or "chat" (`/chat/completions`, one user
    message per prompt). `prompt_format` (completions): "ids" sends the token ids, "text" the decoded
    text. Chat and text prompts need the texts: requests from `with_texts`, or a `tokenizer` (a path
    or a loaded tokenizer) to decode them here. `stream=False` sends non-streamed requests (TTFT = E2E).
    `n`: choices per request. `return_token_ids`: ask minisgl's server for the `token_ids` of each chunk.
    `client_processes`: spread the requests over that many spawned processes (None:
    `default_client_processes()`; 1: this process). `extra_body`: fields added to every request's body
    (e.g. ``{"logprobs": 5}`` or penalties), over the ones made here."""
    if not requests:
        raise ValueError("the workload is empty")
    if not request_rate > 0:
        raise ValueError(f"request_rate must be > 0 (inf: all at once), got {request_rate}")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be at least 1, got {max_concurrency}")
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
    if endpoint not in ENDPOINTS:
        raise ValueError(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}")
    if prompt_format not in PROMPT_FORMATS:
        raise ValueError(f"prompt_format must be one of {', '.join(PROMPT_FORMATS)}, got {prompt_format!r}")
    if endpoint == "chat" and prompt_format == "ids":
        prompt_format = "text"  # chat messages are text
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    if client_processes is not None and client_processes < 1:
        raise ValueError(f"client_processes must be at least 1, got {client_processes}")
    if prompt_format == "text" and any(r.text is None for r in requests):
        if tokenizer is None:
            raise ValueError(f"the {endpoint} endpoint with text prompts needs a tokenizer (--tokenizer)")
        requests = with_texts(requests, tokenizer)
    api_key = api_key or os.environ.get("MINISGL_API_KEY") or "EMPTY"
    deadline = time.perf_counter() + timeout
    server = Server.parse(base_url, api_key)
    if model is None:
        try:
            model = await asyncio.wait_for(first_model(server), timeout)
        except asyncio.TimeoutError:
            raise RuntimeError(f"GET /v1/models did not answer within the --timeout of {timeout} s") from None
    path = "/chat/completions" if endpoint == "chat" else "/completions"
    offsets = arrival_offsets(len(requests), request_rate, seed)
    items: list[Item] = []
    shape = dict(endpoint=endpoint, prompt_format=prompt_format, stream=stream, n=n)
    sampling = dict(temperature=temperature, ignore_eos=ignore_eos, return_token_ids=return_token_ids)
    for i, r in enumerate(requests):
        body = request_body(r, model=model, **shape, **sampling) | (extra_body or {})
        data = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
        items.append(
            (
                i,
                server.request("POST", path, data),
                client_prompt_tokens(r, endpoint, prompt_format),
                r.max_tokens,
                n,
                offsets[i],
            )
        )
    processes = client_processes or default_client_processes()
    processes = max(1, min(processes, len(requests), max_concurrency or len(requests)))
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(requests), desc="requests", unit="req", file=sys.stderr)
    problems: list[str] = []
    stop, stopped_by = asyncio.Event(), []
    with _stopped_by_signals(stop, stopped_by):
        try:
            if processes == 1:
                t0 = time.perf_counter()
                update = (lambda: bar.update(1)) if bar is not None else None
                results, cut, end = await run_share(
                    server, items, t0, deadline, max_concurrency, update, stop
                )
            else:
                results, cut, t0, end, problems = await run_processes(
                    server, items, processes, max_concurrency, deadline, use_uvloop, bar, stop
                )
        finally:
            if bar is not None:
                bar.close()
    duration = max(0.0, end - t0)
    interrupted = stopped_by[0] if stopped_by else None
    unfinished = (
        f"not sent: {interrupted} stopped the run" if interrupted else "not finished: --timeout ran out"
    )
    missing = "; ".join(problems) if problems else unfinished
    final = [
        results.get(i) or RequestResult(item[2], item[3], n=n, error=missing) for i, item in enumerate(items)
    ]
    timed_out = cut and interrupted is None
    for result in final:
        if result.error == CANCELLED:
            if interrupted:
                result.error = f"cancelled: {interrupted} stopped the run"
            else:
                timed_out = True
    settings = {
        "base_url": base_url,
        "model": model,
        "endpoint": endpoint,
        "prompt_format": prompt_format,
        "stream": stream,
        "n": n,
        "num_prompts": len(requests),
        "request_rate": request_rate if math.isfinite(request_rate) else "inf",
        "max_concurrency": max_concurrency,
        "temperature": temperature,
        "seed": seed,
        "timeout": timeout,
        "timed_out": timed_out,
        "interrupted": interrupted,
        "client_processes": processes,
        "event_loop": loop_name(use_uvloop) if processes > 1 else _current_loop_name(),
    }
    return summarize(final, duration, settings)


def _current_loop_name() -> str:
    loop = asyncio.get_running_loop()
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"


def bench_serving(requests: Sequence[RequestInput], **kwargs: Any) -> dict[str, Any]:
    """`run_benchmark` in a fresh event loop (uvloop's when importable, unless `use_uvloop=False`)."""
    return run_loop(run_benchmark(requests, **kwargs), kwargs.get("use_uvloop", True))


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


_RESULT_FIELDS = [f.name for f in fields(RequestResult) if f.name != "itl"]  # a request in the report


def _source(sources: Any) -> str:
    """Where the successful requests' token counts came from: the one source, "mixed", or "none"."""
    found = set(sources)
    return found.pop() if len(found) == 1 else ("mixed" if found else "none")


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
        "prompt_tokens_source": _source(r.prompt_tokens_source for r in ok),
        "output_tokens_source": _source(r.output_tokens_source for r in ok),
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
            {**{k: getattr(r, k) for k in _RESULT_FIELDS}, "tpot": r.tpot, "itl_count": len(r.itl)}
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
    if "endpoint" in report:
        mode = "streamed" if report.get("stream", True) else "not streamed"
        endpoint = f"{report['endpoint']} ({mode}, prompts as {report.get('prompt_format', 'ids')}"
        lines.append(f"{'Endpoint:':<40}{endpoint}, n={report.get('n', 1)})")
    if "client_processes" in report:
        loop = report.get("event_loop", "asyncio")
        lines.append(f"{'Client processes:':<40}{report['client_processes']} ({loop})")
    for key, title in (("prompt_tokens_source", "Input"), ("output_tokens_source", "Output")):
        if key in report:
            source = {"usage": "server usage", "client": "client tokenizer/ids"}.get(report[key], report[key])
            lines.append(f"{f'{title} tokens counted from:':<40}{source}")
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
    if report.get("interrupted"):
        lines.append(f"{report['interrupted']} stopped the run: a partial report")
    lines.append("=" * 60)
    return "\n".join(lines)


def dumps(report: dict[str, Any]) -> str:
    return json.dumps(report, indent=2)
