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
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields, replace
from multiprocessing.connection import Connection, Pipe
from typing import Any

from minisgl.bench.client import (
    CANCELLED,
    RequestResult,
    Server,
    get_json,
    loop_name,
    measure,
    run_loop,
)

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
START_MARGIN = 0.05  # seconds between the start signal and the common start time of client processes
REPORT_GRACE = 10.0  # seconds client processes get after the deadline to send their results
STOP_GRACE = 1.0  # seconds client processes get to send what they have once SIGINT or SIGTERM stopped the run


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


# one request as a client process gets it: (index, HTTP request bytes, client prompt tokens, max_tokens,
# n, send offset in seconds after the common start)
_Item = tuple[int, bytes, int, int, int, float]


async def _run_share(
    server: Server,
    items: Sequence[_Item],
    t0: float,
    deadline: float,
    max_concurrency: int | None,
    progress: Callable[[], None] | None = None,
    stop: asyncio.Event | None = None,
) -> tuple[dict[int, RequestResult], bool, float]:
    """Sends `items` at t0 + their offsets (perf_counter times, shared by all processes of the host),
    at most `max_concurrency` in flight; cancels what still runs at `deadline` or once `stop` is set.
    Returns (the results by index, whether it was cut short, the perf_counter time it ended)."""
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    results: dict[int, RequestResult] = {}

    async def one(item: _Item) -> None:
        index, request, prompt_tokens, max_tokens, n, _ = item
        result = RequestResult(prompt_tokens=prompt_tokens, max_tokens=max_tokens, n=n)
        if semaphore is None:
            results[index] = result
            await measure(server, request, result, t0)
        else:
            async with semaphore:
                results[index] = result
                await measure(server, request, result, t0)
        if progress is not None:
            progress()

    tasks: list[asyncio.Task] = []

    async def send_all() -> None:
        for item in items:
            delay = t0 + item[5] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(item)))
        await asyncio.gather(*tasks)

    sending = asyncio.ensure_future(send_all())
    waiters: set[asyncio.Future] = {sending}
    if stop is not None:
        waiters.add(asyncio.ensure_future(stop.wait()))
    await asyncio.wait(
        waiters, timeout=max(0.0, deadline - time.perf_counter()), return_when="FIRST_COMPLETED"
    )
    cut = not sending.done()
    for waiter in waiters:
        waiter.cancel()
    if cut:
        for task in tasks:
            task.cancel()
    await asyncio.gather(*waiters, *tasks, return_exceptions=True)
    return results, cut, time.perf_counter()


async def _child_share(
    conn: Connection, server: Server, items: list[_Item], t0: float, deadline: float, limit: int | None
) -> tuple[dict[int, RequestResult], bool, float]:
    """A client process's share: `_run_share`, a progress message per finished request, stopped by a
    ("stop",) from the parent or by the parent's end (EOF on `conn`)."""
    stop = asyncio.Event()

    def readable() -> None:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            message = ("stop",)
        if message[0] == "stop":
            asyncio.get_running_loop().remove_reader(conn.fileno())
            stop.set()

    asyncio.get_running_loop().add_reader(conn.fileno(), readable)
    return await _run_share(server, items, t0, deadline, limit, lambda: conn.send(("progress",)), stop)


def _client_process(fd: int) -> None:
    """A client process (`python -m minisgl.bench.serving FD`, started by `_run_processes`; it imports
    no more than this module): reads its share from the connection on `fd`, says it is ready, waits for
    ("start", t0, deadline), sends its share and returns the results through the connection. Ctrl-C
    reaches the whole process group: the parent decides, so SIGINT is ignored here."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Connection(fd)
    try:
        server, items, limit, use_uvloop = conn.recv()
        conn.send(("ready",))
        message = conn.recv()
        if message[0] != "start":
            return
        _, t0, deadline = message
        results, cut, end = run_loop(_child_share(conn, server, items, t0, deadline, limit), use_uvloop)
        conn.send(("done", sorted(results.items()), cut, end))
    except (EOFError, BrokenPipeError, ConnectionResetError):  # the parent is gone
        pass
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc(limit=5)))
        except OSError:
            pass


def split_concurrency(max_concurrency: int | None, processes: int) -> list[int | None]:
    """`max_concurrency` over `processes` client processes: the first ones get one more when it does
    not divide (10 over 4: 3, 3, 2, 2); None (unlimited) for each when None."""
    if max_concurrency is None:
        return [None] * processes
    base, extra = divmod(max_concurrency, processes)
    return [base + (1 if p < extra else 0) for p in range(processes)]


class _Client:
    """One client process and the parent's end of its connection."""

    def __init__(self, index: int, share: list[_Item], setup: tuple) -> None:
        self.index = index
        self.conn, child = Pipe()
        cmd = [sys.executable, "-m", "minisgl.bench.serving", str(child.fileno())]
        # its own output stays off the parent's (a pipe the caller reads to its end), stderr kept for
        # a failure's message; the share goes after the start so that a large one cannot block it
        self.proc = subprocess.Popen(
            cmd,
            pass_fds=(child.fileno(),),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        child.close()
        self.share = (setup[0], share, *setup[1:])

    def failure(self) -> str:
        """Why the process ended without its results: its exit code and the end of its stderr."""
        code = self.proc.poll()
        tail = self.proc.stderr.read().decode(errors="replace").strip()[-800:] if code is not None else ""
        return f"client process {self.index} exited with code {code}" + (f": {tail}" if tail else "")

    def end(self, grace: float) -> None:
        """Waits up to `grace` seconds for the process to exit, then kills it; closes the pipes."""
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stderr.close()
        self.conn.close()


async def _run_processes(
    server: Server,
    items: list[_Item],
    processes: int,
    max_concurrency: int | None,
    deadline: float,
    use_uvloop: bool,
    bar: Any,
    stop: asyncio.Event,
) -> tuple[dict[int, RequestResult], bool, float, float, list[str]]:
    """The items over `processes` client processes (`python -m minisgl.bench.serving`, not
    multiprocessing: a spawned child would import the caller's main module, the engine with it, and
    leave a resource tracker holding the caller's output), request i to process i % processes. Once
    `stop` is set, each is told to stop and gets STOP_GRACE seconds to send what it has. Returns
    (results by index, cut short, t0, end, errors of processes that failed)."""
    limits = split_concurrency(max_concurrency, processes)
    clients: list[_Client] = []
    results: dict[int, RequestResult] = {}
    problems: list[str] = []
    cut = False
    t0 = end = time.perf_counter()
    try:
        for p in range(processes):
            clients.append(_Client(p, items[p::processes], (server, limits[p], use_uvloop)))
        for client in clients:
            client.conn.send(client.share)
        # every process ready (imported, listening) before the common start time
        waiting = set(clients)
        while waiting:
            for client in list(waiting):
                if client.conn.poll():
                    message = client.conn.recv()
                    if message[0] != "ready":
                        raise RuntimeError(f"client process {client.index} failed to start: {message[-1]}")
                    waiting.discard(client)
                elif client.proc.poll() is not None:
                    raise RuntimeError(client.failure() + " at start")
            if waiting and (time.perf_counter() > deadline or stop.is_set()):
                return results, True, t0, time.perf_counter(), ["the client processes did not start"]
            if waiting:
                await asyncio.sleep(0.01)
        t0 = time.perf_counter() + START_MARGIN
        for client in clients:
            client.conn.send(("start", t0, deadline))
        pending = set(clients)
        ends = []
        give_up = deadline + REPORT_GRACE
        while pending:
            if stop.is_set() and give_up > time.perf_counter() + STOP_GRACE:
                for client in pending:
                    client.conn.send(("stop",))
                give_up = time.perf_counter() + STOP_GRACE
            for client in list(pending):
                while client in pending and client.conn.poll():
                    try:
                        message = client.conn.recv()
                    except EOFError:
                        message = ("error", client.failure())
                    if message[0] == "progress":
                        if bar is not None:
                            bar.update(1)
                        continue
                    pending.discard(client)
                    if message[0] == "done":
                        results.update(message[1])
                        cut |= message[2]
                        ends.append(message[3])
                    else:
                        problems.append(f"client process {client.index} failed: {message[-1].strip()}")
                if client in pending and client.proc.poll() is not None:
                    pending.discard(client)
                    problems.append(client.failure())
            if pending and time.perf_counter() > give_up:
                cut = True
                problems.extend(f"client process {c.index} did not report in time" for c in pending)
                break
            if pending:
                await asyncio.sleep(0.01)
        end = max(ends) if ends else time.perf_counter()
    finally:
        for client in clients:
            try:
                client.conn.send(("stop",))  # to a process still waiting for its share or its start
            except OSError:
                pass
        for client in clients:
            client.end(grace=1.0)
    return results, cut, t0, end, problems


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
    items: list[_Item] = []
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
                results, cut, end = await _run_share(
                    server, items, t0, deadline, max_concurrency, update, stop
                )
            else:
                results, cut, t0, end, problems = await _run_processes(
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


if __name__ == "__main__":  # a client process of `_run_processes`
    _client_process(int(sys.argv[1]))
