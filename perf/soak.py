"""A soak of `minisgl-run serve`: a seeded, bounded mix of requests for N minutes while the server's
processes and gauges are sampled, then checks that nothing leaked or failed.

    python -m perf.soak --minutes 20                      # starts its own server (default model, CPU)
    python -m perf.soak --minutes 5 --url http://127.0.0.1:30000 --log server.log

The mix is `MIX` (a row per kind of request: a feature adds its row); requests go through
`minisgl.bench.client`'s raw HTTP/1.1 protocol. The exit code is 1 when a check fails, 2 when the soak
could not run; the JSON report goes to `--report`. The mix, the samples and the checks:
docs/testing.md#soak.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import os
import random
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from minisgl.bench.client import RequestResult, Server, _JSONResponse, _Measured, run_loop
from minisgl.bench.serving import first_model, percentile
from perf.common import OFFLINE_ENV, free_port, stop_process

MAX_IN_FLIGHT = 16
RSS_GROWTH = 0.05  # the RSS check's bound: +5% over the baseline
BASELINE_S = 120.0  # the RSS baseline: 2 minutes into the load ...
BASELINE_SHARE = 0.2  # ... or this share of a shorter run
REQUEST_TIMEOUT_S = 120.0
REST_TIMEOUT_S = 60.0  # how long the gauges and descriptors may take to come back after the load
START_TIMEOUT_S = 300.0
KEEP_FAILURES = 30  # unexpected outcomes kept in the report
GAUGES = {
    "kv_usage": "minisgl_kv_cache_usage_ratio",
    "prefix_pages": "minisgl_prefix_cache_pages",
    "running": "minisgl_requests_running",
    "waiting": "minisgl_requests_waiting",
}
TRACEBACK = "Traceback (most recent call last)"


# -- the mix


@dataclass(frozen=True)
class Context:
    """What the request builders need to know of the run."""

    model: str
    max_tokens: int  # the largest max_tokens of a served request
    max_request_bytes: int  # the server's body limit: the oversized row sends more


@dataclass
class Call:
    """One request of a row: its route under /v1, its body, and what the client does."""

    path: str
    body: dict[str, Any] | bytes
    drop_after: int | None = None  # events read before the client closes the connection
    abort_after: float | None = None  # seconds before the client closes the connection, answered or not
    unsent: int = 0  # bytes of the request left unsent (with abort_after: a body that never arrives)

    @property
    def fields(self) -> dict[str, Any]:
        return self.body if isinstance(self.body, dict) else {}


@dataclass
class Outcome:
    """What came back of one request."""

    status: int | None = None  # None: no response head
    objects: list[dict[str, Any]] = field(default_factory=list)  # the JSON body, or the stream's events
    error: dict[str, Any] | None = None  # OpenAI's error object of an error status or an error event
    client_error: str | None = None  # the connection or the response broke (bench_client's message)
    dropped: bool = False  # the client went away, as its row asked
    timed_out: bool = False
    latency: float = 0.0
    ttft: float | None = None

    @property
    def label(self) -> str:
        """The status, or what happened instead."""
        if self.timed_out:
            return "timeout"
        if self.dropped:
            return "client went away"
        if self.status is None:
            return "no response"
        if self.status == 200 and self.error is not None:
            return "200 + error event"
        return str(self.status)

    @property
    def error_kind(self) -> str | None:
        if self.error is not None:
            return str(self.error.get("code") or self.error.get("type") or "error")
        if self.client_error is not None:
            return self.client_error.split(":", 1)[0]
        return None

    @property
    def server_error(self) -> bool:
        """A 5xx, or a server error event inside a 200 stream."""
        if self.status is not None and self.status >= 500:
            return True
        return self.error is not None and self.error.get("type") == "server_error"


@dataclass(frozen=True)
class Row:
    """A kind of request: `build(rng, context)` makes one, `expect(call, outcome)` says what is wrong with
    its outcome (None: as expected). `valid`: the server must serve it (a 5xx is a failure)."""

    name: str
    weight: float
    build: Callable[[random.Random, Context], Call]
    expect: Callable[[Call, Outcome], str | None]
    valid: bool = True


@dataclass
class Choice:
    """One choice of a response, put together from its body or its chunks."""

    text: str = ""
    finish_reason: str | None = None
    logprob_tokens: int = 0
    top_sizes: list[int] = field(default_factory=list)  # alternatives given per token


def collect(objects: list[dict[str, Any]]) -> tuple[dict[int, Choice], dict[str, Any] | None]:
    """The choices (by index) and the usage of a completion or chat response, whole or streamed."""
    choices: dict[int, Choice] = {}
    usage = None
    for obj in objects:
        usage = obj.get("usage") or usage
        for raw in obj.get("choices") or ():
            choice = choices.setdefault(raw.get("index", 0), Choice())
            text = raw.get("text")
            if text is None:
                text = (raw.get("message") or raw.get("delta") or {}).get("content")
            choice.text += text or ""
            choice.finish_reason = raw.get("finish_reason") or choice.finish_reason
            logprobs = raw.get("logprobs") or {}
            if "content" in logprobs:  # chat: one entry per token
                entries = logprobs["content"] or []
                choice.logprob_tokens += len(entries)
                choice.top_sizes += [len(e.get("top_logprobs") or []) for e in entries]
            elif logprobs:  # completions: parallel lists
                choice.logprob_tokens += len(logprobs.get("tokens") or [])
                choice.top_sizes += [len(top or {}) for top in logprobs.get("top_logprobs") or []]
    return choices, usage


def served(call: Call, out: Outcome, extra: Callable[..., str | None] | None = None) -> str | None:
    """A 200 with every choice finished ("stop" or "length"), usage within max_tokens, then `extra`."""
    if out.timed_out:
        return "timeout"
    if out.status != 200 or out.error is not None or out.client_error is not None:
        return f"{out.label}: {out.error_kind}"
    choices, usage = collect(out.objects)
    n = call.fields.get("n") or 1
    if sorted(choices) != list(range(n)):
        return f"choices {sorted(choices)} for n={n}"
    reasons = {c.finish_reason for c in choices.values()}
    if not reasons <= {"stop", "length"}:
        return f"finish reasons {sorted(map(str, reasons))}"
    if usage is None:
        return "no usage"
    limit = call.fields.get("max_tokens") or call.fields.get("max_completion_tokens")
    if not 0 <= usage.get("completion_tokens", -1) <= n * limit:
        return f"usage {usage} for n={n} x max_tokens={limit}"
    return None if extra is None else extra(call, choices, usage)


def _no_stop_string(call: Call, choices: dict[int, Choice], usage: dict[str, Any]) -> str | None:
    stops = call.fields["stop"]
    found = [s for c in choices.values() for s in stops if s in c.text]
    return f"stop strings {found} in the text" if found else None


def _logprobs(call: Call, choices: dict[int, Choice], usage: dict[str, Any]) -> str | None:
    choice, fields, tokens = choices[0], call.fields, usage["completion_tokens"]
    # one entry per token of the text: a final EOS (finish "stop") has none (docs/server.md)
    if choice.logprob_tokens not in (tokens, tokens - (choice.finish_reason == "stop")):
        return f"log probabilities of {choice.logprob_tokens} tokens for {tokens} ({choice.finish_reason})"
    if "top_logprobs" in fields:  # chat: k alternatives each
        k, low = fields["top_logprobs"], fields["top_logprobs"]
    else:  # completions: the k most likely, and the sampled token when it is not among them
        k, low = fields["logprobs"], max(fields["logprobs"], 1)
    wrong = [size for size in choice.top_sizes if not low <= size <= max(k, low) + (k > 0)]
    return f"alternatives per token {wrong} for k={k}" if wrong else None


ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no", "maybe"]}, "sure": {"type": "boolean"}},
    "required": ["answer", "sure"],
    "additionalProperties": False,
}


def _answer_json(call: Call, choices: dict[int, Choice], usage: dict[str, Any]) -> str | None:
    """The schema's object, whole: it is at most a dozen tokens, well within max_tokens."""
    choice = choices[0]
    try:
        value = json.loads(choice.text)
    except ValueError:
        return f"not JSON ({choice.finish_reason}): {choice.text[:100]!r}"
    ok = (
        isinstance(value, dict)
        and set(value) == {"answer", "sure"}
        and value["answer"] in ("yes", "no", "maybe")
        and isinstance(value["sure"], bool)
    )
    return None if ok else f"not the schema's object: {choice.text[:100]!r}"


def _object_json(call: Call, choices: dict[int, Choice], usage: dict[str, Any]) -> str | None:
    """A JSON object when the grammar ended it (a "length" finish leaves a prefix of one)."""
    choice = choices[0]
    if choice.finish_reason != "stop":
        return None if choice.text.lstrip().startswith("{") or not choice.text else "no object begun"
    try:
        value = json.loads(choice.text)
    except ValueError:
        return f"not JSON: {choice.text[:100]!r}"
    return None if isinstance(value, dict) else f"not an object: {choice.text[:100]!r}"


def went_away(call: Call, out: Outcome) -> str | None:
    """The client closed the connection as asked, or the response ended first and is a served one."""
    return None if out.dropped else served(call, out)


def body_never_sent(call: Call, out: Outcome) -> str | None:
    """The client went away with its body half sent: no answer, or a 4xx."""
    if out.dropped or (out.status is not None and 400 <= out.status < 500):
        return None
    return f"{out.label}: {out.error_kind}"


def refused(status: int, code: str | None, call: Call, out: Outcome) -> str | None:
    """`status` with OpenAI's error body; its code or param `code` when given."""
    if out.status != status:
        return f"{out.label} (expected {status}): {out.error_kind}"
    if out.error is None or not out.error.get("message"):
        return "no error message"
    if code is not None and code not in (out.error.get("code"), out.error.get("param")):
        return f"error {out.error_kind} (expected {code})"
    return None


TOPICS = ["the sea", "a small robot", "prime numbers", "bread", "a rainy city", "chess", "volcanoes", "owls"]
SYSTEM = "You are a concise assistant. Answer in one or two short sentences."
STOPS = [" the", ".", "\n", ",", " a", "!"]


def _prompt(rng: random.Random) -> str:
    return f"Write a few words about {rng.choice(TOPICS)} (note {rng.randrange(10_000)}):"


def _sampling(rng: random.Random, ctx: Context, **fields: Any) -> dict[str, Any]:
    return {
        "model": ctx.model,
        "max_tokens": rng.randint(max(1, ctx.max_tokens // 2), ctx.max_tokens),
        "temperature": rng.choice([0.0, 0.7, 1.0]),
        "seed": rng.randrange(1 << 30),
        **fields,
    }


def completion(rng: random.Random, ctx: Context, stream: bool | None = None, **fields: Any) -> Call:
    """A completion (streamed or not: `stream`, else a coin) with `fields` over the usual ones."""
    body = _sampling(rng, ctx, prompt=_prompt(rng), **fields)
    return Call("/completions", _stream(rng, body, stream))


def chat(rng: random.Random, ctx: Context, stream: bool | None = None, **fields: Any) -> Call:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": _prompt(rng)}]
    body = _sampling(rng, ctx, messages=messages, **fields)
    return Call("/chat/completions", _stream(rng, body, stream))


def _stream(rng: random.Random, body: dict[str, Any], stream: bool | None) -> dict[str, Any]:
    if stream is None:
        stream = rng.random() < 0.5
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return body


def _either(rng: random.Random, ctx: Context, **fields: Any) -> Call:
    return (completion if rng.random() < 0.5 else chat)(rng, ctx, **fields)


def _n_choices(rng: random.Random, ctx: Context) -> Call:
    return _either(rng, ctx, n=rng.randint(2, 3))


def _stop_strings(rng: random.Random, ctx: Context) -> Call:
    return completion(rng, ctx, stop=rng.sample(STOPS, rng.randint(1, 3)))


def _completion_logprobs(rng: random.Random, ctx: Context) -> Call:
    return completion(rng, ctx, logprobs=rng.randint(0, 3))


def _chat_logprobs(rng: random.Random, ctx: Context) -> Call:
    return chat(rng, ctx, logprobs=True, top_logprobs=rng.randint(0, 3))


def _penalties(rng: random.Random, ctx: Context) -> Call:
    penalties = {
        "presence_penalty": round(rng.uniform(-1.0, 2.0), 2),
        "frequency_penalty": round(rng.uniform(-1.0, 2.0), 2),
        "repetition_penalty": round(rng.uniform(0.8, 1.6), 2),
    }
    chosen = rng.sample(sorted(penalties), rng.randint(1, 3))
    return _either(rng, ctx, **{name: penalties[name] for name in chosen})


def _json_schema(rng: random.Random, ctx: Context) -> Call:
    schema = {"name": "answer", "schema": ANSWER_SCHEMA}
    call = chat(rng, ctx, response_format={"type": "json_schema", "json_schema": schema})
    call.fields["max_tokens"] = max(ctx.max_tokens, 32)  # the object needs a dozen tokens
    return call


def _json_object(rng: random.Random, ctx: Context) -> Call:
    return _either(rng, ctx, response_format={"type": "json_object"})


def _disconnect(rng: random.Random, ctx: Context) -> Call:
    """A long stream the client leaves after 1 to 3 events."""
    call = _either(rng, ctx, stream=True, ignore_eos=True)
    call.fields["max_tokens"] = 4 * ctx.max_tokens
    call.drop_after = rng.randint(1, 3)
    return call


def _abort(rng: random.Random, ctx: Context) -> Call:
    """A long non-streamed request the client leaves after 0.05 to 1.5 s (queued, running or done)."""
    call = _either(rng, ctx, stream=False, ignore_eos=True)
    call.fields["max_tokens"] = 4 * ctx.max_tokens
    call.abort_after = rng.uniform(0.05, 1.5)
    return call


def _half_body(rng: random.Random, ctx: Context) -> Call:
    """A request whose body stops short; the client leaves after 0.3 s."""
    call = completion(rng, ctx, stream=False)
    size = len(json.dumps(call.body))
    call.unsent, call.abort_after = rng.randint(1, size - 1), 0.3
    return call


MALFORMED = [
    b"{not json",
    b'{"model": "m", "prompt": "cut',
    b"[1, 2]",
    b"",
    b"\xff\xfe{}",
    b"null",
    b'"text"',
]


def _malformed(rng: random.Random, ctx: Context) -> Call:
    return Call(rng.choice(["/completions", "/chat/completions"]), rng.choice(MALFORMED))


INVALID_FIELDS = [
    {"max_tokens": "8"},
    {"temperature": "hot"},
    {"n": 0},
    {"top_p": 2.0},
    {"stop": 5},
    {"logprobs": 99},
    {"presence_penalty": 3.0},
    {"response_format": {"type": "json_schema"}},
    {"best_of": 2},
    {"no_such_field": 1},
]


def _invalid_field(rng: random.Random, ctx: Context) -> Call:
    call = completion(rng, ctx, stream=False)
    call.fields.update(rng.choice(INVALID_FIELDS))
    return call


def _unknown_model(rng: random.Random, ctx: Context) -> Call:
    call = _either(rng, ctx)
    call.fields["model"] = f"no-such-model-{rng.randrange(100)}"
    return call


def _context_overflow(rng: random.Random, ctx: Context) -> Call:
    call = _either(rng, ctx)
    call.fields["max_tokens"] = 10**6
    return call


def _oversized(rng: random.Random, ctx: Context) -> Call:
    """A body one byte to 1 KiB over the server's limit."""
    call = completion(rng, ctx, stream=False)
    call.fields["prompt"] = ""
    room = ctx.max_request_bytes - len(json.dumps(call.body))
    call.fields["prompt"] = "x" * (room + rng.randint(1, 1024))
    return call


MIX: list[Row] = [
    Row("completion", 10, functools.partial(completion, stream=False), served),
    Row("completion_stream", 10, functools.partial(completion, stream=True), served),
    Row("chat", 10, functools.partial(chat, stream=False), served),
    Row("chat_stream", 10, functools.partial(chat, stream=True), served),
    Row("n_choices", 5, _n_choices, served),
    Row("stop_strings", 5, _stop_strings, functools.partial(served, extra=_no_stop_string)),
    Row("logprobs_completion", 4, _completion_logprobs, functools.partial(served, extra=_logprobs)),
    Row("logprobs_chat", 4, _chat_logprobs, functools.partial(served, extra=_logprobs)),
    Row("penalties", 5, _penalties, served),
    Row("json_schema", 4, _json_schema, functools.partial(served, extra=_answer_json)),
    Row("json_object", 3, _json_object, functools.partial(served, extra=_object_json)),
    Row("disconnect_mid_stream", 5, _disconnect, went_away),
    Row("abort", 4, _abort, went_away),
    Row("abort_mid_body", 2, _half_body, body_never_sent, valid=False),
    Row("malformed_json", 3, _malformed, functools.partial(refused, 400, None), valid=False),
    Row("invalid_field", 3, _invalid_field, functools.partial(refused, 400, None), valid=False),
    Row("unknown_model", 2, _unknown_model, functools.partial(refused, 404, "model_not_found"), valid=False),
    Row(
        "context_overflow",
        2,
        _context_overflow,
        functools.partial(refused, 400, "context_length_exceeded"),
        valid=False,
    ),
    Row("oversized_body", 2, _oversized, functools.partial(refused, 413, None), valid=False),
]


# -- the client (minisgl.bench.client's protocol)


class _Exchange(_Measured):
    """bench_client's measured exchange, keeping what the soak checks: the JSON objects (the body or the
    events), an error event's data, and closing the connection after `drop_after` events."""

    def __init__(self, request: bytes, started: float, drop_after: int | None) -> None:
        super().__init__(request, RequestResult(prompt_tokens=0, max_tokens=0), started)
        self.drop_after = drop_after
        self.objects: list[dict[str, Any]] = []
        self.error_data: bytes | None = None
        self.events = 0
        self.dropped = False

    def _object(self, data: bytes, what: str, error_prefix: str) -> dict[str, Any] | None:
        obj = super()._object(data, what, error_prefix)
        if obj is None:
            self.error_data = bytes(data)
        else:
            self.objects.append(obj)
        return obj

    def _on_event(self, data: bytes, now: float) -> None:
        super()._on_event(data, now)
        self.events += 1
        if self.drop_after is not None and self.events >= self.drop_after and not self.finished:
            self.leave()

    def leave(self, asked: bool = True) -> None:
        """The client goes away (`asked`: as its row asked): the connection is dropped."""
        self.dropped = asked
        if self.transport is not None:
            self.transport.abort()
        self.close()


def _error_object(data: bytes) -> dict[str, Any]:
    """OpenAI's `error` object in `data`, or a stand-in holding the text."""
    try:
        obj = json.loads(data)
    except ValueError:
        obj = None
    if isinstance(obj, dict) and isinstance(obj.get("error"), dict):
        return obj["error"]
    return {"message": data[:300].decode("utf-8", "replace"), "type": None, "code": "not_openai_error"}


async def send(api: Server, call: Call, timeout: float = REQUEST_TIMEOUT_S) -> Outcome:
    """Sends `call` on a connection of its own and reads what comes back (at most `timeout` s)."""
    body = call.body if isinstance(call.body, bytes) else json.dumps(call.body).encode()
    request = api.request("POST", call.path, body)
    request = request[: len(request) - call.unsent]
    started = time.perf_counter()
    exchange = _Exchange(request, started, call.drop_after)
    out = Outcome()
    try:
        await api.connect(exchange)
        done, _ = await asyncio.wait({exchange.done}, timeout=call.abort_after or timeout)
        if not done:
            out.timed_out = call.abort_after is None
            exchange.leave(asked=not out.timed_out)
    except OSError as e:
        out.client_error = f"{type(e).__name__}: {e}"
    finally:
        if not exchange.finished:  # cancelled, or the connection failed
            exchange.leave(asked=False)
    out.latency = time.perf_counter() - started
    out.status, out.objects, out.ttft = exchange.status, exchange.objects, exchange.result.ttft
    out.dropped = exchange.dropped
    if out.status is not None and not 200 <= out.status < 300:
        out.error = _error_object(bytes(exchange.body))
    elif exchange.error_data is not None:
        out.error = _error_object(exchange.error_data)
    elif exchange.result.error is not None and not exchange.dropped and out.client_error is None:
        out.client_error = exchange.result.error
    return out


async def fetch(server: Server, method: str, path: str, timeout: float = 30.0) -> tuple[int, bytes]:
    """The status and body of `method path` (no body sent); RuntimeError when the exchange breaks."""
    exchange = _JSONResponse(server.request(method, path))
    transport = await server.connect(exchange)
    try:
        await asyncio.wait_for(asyncio.shield(exchange.done), timeout)
    finally:
        transport.close()
    if exchange.error is not None:
        raise RuntimeError(f"{method} {path}: {exchange.error}")
    return exchange.status or 0, bytes(exchange.body)


async def read_metrics(root: Server) -> dict[str, Any]:
    """The gauges of `GAUGES` (None when the server has not set one yet; summed over replicas) and the
    finished requests by reason."""
    status, body = await fetch(root, "GET", "/metrics")
    if status != 200:
        raise RuntimeError(f"GET /metrics: HTTP {status}")
    sums: dict[str, float] = {}
    finished: Counter[str] = Counter()
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
            if sample.name == "minisgl_requests_finished_total":
                finished[sample.labels.get("reason", "?")] += int(sample.value)
    values: dict[str, Any] = {key: sums.get(name) for key, name in GAUGES.items()}
    values["finished"] = dict(finished)
    return values


# -- the server's processes (/proc)


def process_tree(pid: int) -> list[int]:
    """`pid` and every live process below it."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    tree, todo = [], [pid]
    while todo and len(tree) < 10_000:
        current = todo.pop()
        tree.append(current)
        todo += children.get(current, [])
    return sorted(tree)


def process_figures(pid: int, command: bool = False) -> dict[str, Any] | None:
    """RSS (KiB) and open descriptors of `pid` (and its command line); None when it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            figures = {"rss_kib": next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))}
        figures["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
        if command:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                figures["command"] = f.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()[:160]
    except (OSError, StopIteration):
        return None
    return figures


def snapshot(pid: int, command: bool = False) -> dict[str, dict[str, Any]]:
    """`process_figures` of the server's processes, by pid (as text: JSON's keys)."""
    figures = {str(p): process_figures(p, command) for p in process_tree(pid)}
    return {p: f for p, f in figures.items() if f is not None}


def listening_pid(port: int) -> int | None:
    """The process that listens on TCP `port` (from /proc/net/tcp*); the topmost when several do."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(f"socket:[{cols[9]}]")
    holders = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if any(os.readlink(fd.path) in inodes for fd in os.scandir(f"/proc/{entry.name}/fd")):
                holders.append(int(entry.name))
        except OSError:
            continue
    tops = [p for p in holders if not any(p != q and p in process_tree(q) for q in holders)]
    return min(tops) if tops else None


# -- the run


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    stats = {f"p{q}": round(percentile(values, q), 4) for q in (50, 90, 99)}
    return stats | {"max": round(max(values), 4)}


@dataclass
class Tally:
    """What the requests gave: per row, status and error kind; per minute of the load, the latencies."""

    minutes: int
    rows: dict[str, dict[str, Any]] = field(default_factory=dict)
    statuses: Counter[str] = field(default_factory=Counter)
    error_kinds: Counter[str] = field(default_factory=Counter)
    failures: list[dict[str, Any]] = field(default_factory=list)
    unexpected: int = 0
    valid_5xx: int = 0
    per_minute: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        for row in MIX:
            self.rows[row.name] = {
                "weight": row.weight,
                "valid": row.valid,
                "sent": 0,
                "unexpected": 0,
                "statuses": Counter(),
                "error_kinds": Counter(),
            }
        self.per_minute = [
            {"requests": 0, "served": 0, "unexpected": 0, "latency": [], "ttft": []}
            for _ in range(self.minutes)
        ]

    def add(self, row: Row, call: Call, out: Outcome, minute: int | None) -> None:
        problem = row.expect(call, out)
        stats = self.rows[row.name]
        stats["sent"] += 1
        stats["statuses"][out.label] += 1
        self.statuses[out.label] += 1
        if out.error_kind is not None:
            stats["error_kinds"][out.error_kind] += 1
            self.error_kinds[out.error_kind] += 1
        if row.valid and out.server_error:
            self.valid_5xx += 1
        if problem is not None:
            stats["unexpected"] += 1
            self.unexpected += 1
            if len(self.failures) < KEEP_FAILURES:
                message = (out.error or {}).get("message") or out.client_error
                self.failures.append(
                    {"row": row.name, "problem": problem, "message": message, "body": _shown(call.body)}
                )
                print(f"soak: unexpected: {row.name}: {problem} ({message})", flush=True)
        if minute is None:
            return
        bucket = self.per_minute[min(minute, self.minutes - 1)]
        bucket["requests"] += 1
        bucket["unexpected"] += problem is not None
        if row.valid and problem is None and out.status == 200 and not out.dropped:
            bucket["served"] += 1
            bucket["latency"].append(out.latency)
            if out.ttft is not None:
                bucket["ttft"].append(out.ttft)

    def minute_summary(self, m: int) -> dict[str, Any]:
        bucket = self.per_minute[m]
        return {
            "minute": m + 1,
            "requests": bucket["requests"],
            "served": bucket["served"],
            "unexpected": bucket["unexpected"],
            "latency_s": _stats(bucket["latency"]),
            "ttft_s": _stats(bucket["ttft"]),
        }


def _shown(body: dict[str, Any] | bytes) -> str:
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else json.dumps(body)
    return text if len(text) <= 300 else f"{text[:300]}... ({len(text)} characters)"


def _print_minute(summary: dict[str, Any]) -> None:
    lat, ttft = summary["latency_s"], summary["ttft_s"]
    timing = (
        f"latency p50 {lat['p50']:.2f} s, p90 {lat['p90']:.2f} s, p99 {lat['p99']:.2f} s, max {lat['max']:.2f} s"
        if lat
        else "no request served"
    )
    if ttft:
        timing += f"; TTFT p50 {ttft['p50']:.2f} s, p99 {ttft['p99']:.2f} s"
    print(
        f"soak: minute {summary['minute']}: {summary['requests']} requests, {summary['served']} served, "
        f"{summary['unexpected']} unexpected; {timing}",
        flush=True,
    )


@dataclass
class Soak:
    """One soak against a running server: `api` (its /v1), `root`, the front end's `pid`."""

    api: Server
    root: Server
    pid: int
    seconds: float
    seed: int = 0
    concurrency: int = MAX_IN_FLIGHT
    max_tokens: int = 16
    max_request_bytes: int = 8 << 20
    sample_every: float = 10.0
    samples: list[dict[str, Any]] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    printed: int = 0  # minutes printed

    async def sample(self, t: float) -> dict[str, Any]:
        entry = {"t": round(t, 2), "in_flight": self.in_flight, "processes": snapshot(self.pid)}
        try:
            entry |= await read_metrics(self.root)
        except (OSError, RuntimeError, asyncio.TimeoutError) as e:
            entry["metrics_error"] = str(e)
        self.samples.append(entry)
        return entry

    async def one(self, row: Row, call: Call, tally: Tally, t0: float | None) -> None:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            out = await send(self.api, call)
        finally:
            self.in_flight -= 1
        minute = None if t0 is None else int((time.monotonic() - t0) // 60)
        tally.add(row, call, out, minute)

    async def load(self, ctx: Context, tally: Tally, t0: float) -> set[asyncio.Task[None]]:
        """Weighted draws of the mix until the time is up, at most `concurrency` in flight; returns the
        requests still in flight."""
        draw = random.Random(self.seed)
        slots = asyncio.Semaphore(self.concurrency)
        tasks: set[asyncio.Task[None]] = set()
        end = t0 + self.seconds

        async def run(row: Row, call: Call) -> None:
            try:
                await self.one(row, call, tally, t0)
            finally:
                slots.release()

        for i in range(int(self.seconds * 200) + 1):  # bounded: far more than can finish in time
            await slots.acquire()
            if time.monotonic() >= end:
                slots.release()
                break
            row = draw.choices(MIX, weights=[r.weight for r in MIX])[0]
            call = row.build(random.Random(f"{self.seed}:{i}"), ctx)
            task = asyncio.create_task(run(row, call))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        return tasks

    async def sampler(self, tally: Tally, t0: float, stop: asyncio.Event) -> None:
        """A sample every `sample_every` s until `stop`; each minute's latencies once it is over."""
        for _ in range(int(self.seconds / self.sample_every) + 2):
            elapsed = time.monotonic() - t0
            await self.sample(elapsed)
            self.print_minutes(tally, int(elapsed // 60))
            try:
                await asyncio.wait_for(stop.wait(), self.sample_every)
                return
            except asyncio.TimeoutError:
                pass

    def print_minutes(self, tally: Tally, until: int) -> None:
        for m in range(self.printed, min(until, tally.minutes)):
            _print_minute(tally.minute_summary(m))
            self.printed = m + 1

    async def rest(self, start: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """After the load: waits (bounded) for nothing to run, flushes the prefix cache, reads the gauges,
        and waits for the descriptors to come back to `start`."""
        metrics: dict[str, Any] = {}
        deadline = time.monotonic() + REST_TIMEOUT_S
        while time.monotonic() < deadline:
            metrics = await read_metrics(self.root)
            if metrics["running"] == 0 and metrics["waiting"] == 0 and metrics["kv_usage"] == 0:
                break
            await asyncio.sleep(0.5)
        status, body = await fetch(self.root, "POST", "/flush_cache")
        freed = json.loads(body).get("freed_pages") if status == 200 else None
        after = await read_metrics(self.root)
        figures = snapshot(self.pid)
        while time.monotonic() < deadline and any(
            pid in figures and figures[pid]["fds"] > start[pid]["fds"] for pid in start
        ):
            await asyncio.sleep(0.5)
            figures = snapshot(self.pid)
        return {
            "before_flush": metrics,
            "flush_status": status,
            "freed_pages": freed,
            "after_flush": after,
            "processes": figures,
        }

    async def run(self) -> dict[str, Any]:
        model = await first_model(self.api)
        ctx = Context(model, self.max_tokens, self.max_request_bytes)
        tally = Tally(max(1, math.ceil(self.seconds / 60)))
        print(
            f"soak: {model}, {self.seconds / 60:g} min, seed {self.seed}, first pass through the mix",
            flush=True,
        )
        for row in MIX:  # every row once, in order: all of them run, caches warm
            await self.one(row, row.build(random.Random(f"{self.seed}:first:{row.name}"), ctx), tally, None)
        await asyncio.sleep(1.0)  # the first pass's connections closed
        start = snapshot(self.pid, command=True)
        print(
            f"soak: load: at most {self.concurrency} in flight; processes {sorted(map(int, start))}",
            flush=True,
        )
        t0 = time.monotonic()
        stop = asyncio.Event()
        sampler = asyncio.create_task(self.sampler(tally, t0, stop))
        pending = await self.load(ctx, tally, t0)
        stop.set()
        await sampler
        last = await self.sample(time.monotonic() - t0)  # the end of the load
        if pending:  # each bounded by its own timeout
            await asyncio.wait(pending, timeout=REQUEST_TIMEOUT_S + 30)
        self.print_minutes(tally, tally.minutes)  # the last minute holds the requests that ended after it
        at_rest = await self.rest(start)
        return self.report(tally, start, last, at_rest)

    def report(
        self, tally: Tally, start: dict[str, Any], last: dict[str, Any], at_rest: dict[str, Any]
    ) -> dict[str, Any]:
        baseline_t = min(BASELINE_S, BASELINE_SHARE * self.seconds)
        baseline = next((s for s in self.samples if s["t"] >= baseline_t), last)
        processes = {}
        for pid, first in start.items():
            base = baseline["processes"].get(pid)
            end = last["processes"].get(pid)
            rest = at_rest["processes"].get(pid)
            processes[pid] = {
                "command": first["command"],
                "rss_kib": {
                    "start": first["rss_kib"],
                    "baseline": base and base["rss_kib"],
                    "end": end and end["rss_kib"],
                    "max": max(
                        (s["processes"][pid]["rss_kib"] for s in self.samples if pid in s["processes"]),
                        default=None,
                    ),
                },
                "fds": {"start": first["fds"], "rest": rest and rest["fds"]},
            }
        rss_over = {
            pid: p["rss_kib"]
            for pid, p in processes.items()
            if not (p["rss_kib"]["baseline"] and p["rss_kib"]["end"])
            or p["rss_kib"]["end"] > (1 + RSS_GROWTH) * p["rss_kib"]["baseline"]
        }
        fds_over = {
            pid: p["fds"]
            for pid, p in processes.items()
            if p["fds"]["rest"] is None or p["fds"]["rest"] > p["fds"]["start"]
        }
        changed = sorted(set(start) ^ set(at_rest["processes"]), key=int)
        after = at_rest["after_flush"]
        gauges = {key: after.get(key) for key in GAUGES}
        checks = {
            "no_5xx_for_valid": _check(tally.valid_5xx == 0, f"{tally.valid_5xx} valid requests got a 5xx"),
            "as_expected": _check(
                tally.unexpected == 0, f"{tally.unexpected} requests did not get what their row expects"
            ),
            "rss": _check(
                not rss_over,
                f"baseline at {baseline['t']:.0f} s into the load; over +{RSS_GROWTH:.0%}: {rss_over or 'none'}",
            ),
            "descriptors": _check(
                not fds_over, f"more open descriptors at rest than at the start: {fds_over or 'none'}"
            ),
            "processes": _check(not changed, f"processes that came or went: {changed or 'none'}"),
            "kv_at_rest": _check(
                at_rest["flush_status"] == 200 and all(v == 0 for v in gauges.values()),
                f"after POST /flush_cache ({at_rest['flush_status']}, {at_rest['freed_pages']} pages freed): {gauges}",
            ),
        }
        minutes = [tally.minute_summary(m) for m in range(tally.minutes)]
        for stats in tally.rows.values():
            stats["statuses"], stats["error_kinds"] = dict(stats["statuses"]), dict(stats["error_kinds"])
        return {
            "settings": {
                "url": self.api.base_url,
                "pid": self.pid,
                "seconds": self.seconds,
                "seed": self.seed,
                "concurrency": self.concurrency,
                "max_tokens": self.max_tokens,
                "max_request_bytes": self.max_request_bytes,
                "sample_every_s": self.sample_every,
                "rss_baseline_s": baseline_t,
            },
            "requests": sum(stats["sent"] for stats in tally.rows.values()),
            "max_in_flight": self.max_in_flight,
            "rows": tally.rows,
            "statuses": dict(tally.statuses),
            "error_kinds": dict(tally.error_kinds),
            "minutes": minutes,
            "processes": processes,
            "rest": at_rest,
            "failures": tally.failures,
            "samples": self.samples,
            "checks": checks,
        }


def _check(ok: bool | None, detail: str) -> dict[str, Any]:
    return {"ok": ok, "detail": detail}


def scan_log(path: Path | None) -> dict[str, Any]:
    """The log check: no traceback in `path` (skipped, ok None, without a log)."""
    if path is None:
        return _check(None, "skipped: no server log (give --log)")
    text = path.read_text(errors="replace")
    count = text.count(TRACEBACK)
    first = text[text.find(TRACEBACK) :][:3000] if count else None
    return _check(count == 0, f"{count} tracebacks in {path}" + (f"; the first:\n{first}" if first else ""))


# -- its own server


async def wait_healthy(root: Server, proc: subprocess.Popen | None, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it served")
        try:
            if (await fetch(root, "GET", "/health", timeout=5))[0] == 200:
                return
        except (OSError, RuntimeError, asyncio.TimeoutError):
            pass
        await asyncio.sleep(0.5)
    raise RuntimeError(f"the server was not healthy after {timeout:.0f} s")


def start_server(port: int, max_request_bytes: int, extra: list[str], log: Path) -> subprocess.Popen:
    """`minisgl-run serve` on 127.0.0.1:`port` (the default model), its output into `log`."""
    command = [sys.executable, "-m", "minisgl.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--max-request-bytes", str(max_request_bytes), *extra]
    env = {**os.environ, **OFFLINE_ENV}
    with open(log, "wb") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m perf.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=20.0, help="length of the load (default 20)")
    p.add_argument("--url", help="a running server (http://127.0.0.1:PORT); unset: start one")
    p.add_argument("--pid", type=int, help="with --url: its front end's pid (default: the port's listener)")
    p.add_argument("--log", type=Path, help="the server's log to scan (its own server: where it goes)")
    p.add_argument("--report", type=Path, default=Path("soak-report.json"), help="the JSON report")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--concurrency", type=int, default=MAX_IN_FLIGHT, help="requests in flight, 1 to 16")
    p.add_argument("--max-tokens", type=int, default=16, help="largest max_tokens of a served request")
    p.add_argument(
        "--max-request-bytes",
        type=int,
        help="the server's body limit (the oversized row sends more); default: 65536 passed to its own "
        "server, the server's default (8 MiB) with --url",
    )
    p.add_argument(
        "--sample-every", type=float, help="seconds between samples (default: minutes x 0.5 s, 1 to 10)"
    )
    p.add_argument("--api-key", default="EMPTY")
    p.add_argument("--serve-arg", action="append", default=[], help="an argument for its own server (repeat)")
    args = p.parse_args(argv)
    if not 1 <= args.concurrency <= MAX_IN_FLIGHT:
        p.error(f"--concurrency must be 1 to {MAX_IN_FLIGHT}")
    if args.minutes <= 0 or args.max_tokens < 1:
        p.error("--minutes must be positive and --max-tokens at least 1")
    if args.sample_every is None:
        args.sample_every = min(10.0, max(1.0, args.minutes * 0.5))
    if args.max_request_bytes is None:
        args.max_request_bytes = (8 << 20) if args.url else 65536
    return args


async def _soak(args: argparse.Namespace, base: str, proc: subprocess.Popen | None) -> dict[str, Any]:
    root = Server.parse(base, args.api_key)
    await wait_healthy(root, proc, START_TIMEOUT_S if proc is not None else 10)
    pid = proc.pid if proc is not None else args.pid or listening_pid(root.port)
    if pid is None:
        raise RuntimeError(f"no process listens on port {root.port} here: give --pid")
    soak = Soak(
        Server.parse(base + "/v1", args.api_key),
        root,
        pid,
        args.minutes * 60,
        seed=args.seed,
        concurrency=args.concurrency,
        max_tokens=args.max_tokens,
        max_request_bytes=args.max_request_bytes,
        sample_every=args.sample_every,
    )
    return await soak.run()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    proc = None
    if args.url:
        base, log = args.url.rstrip("/").removesuffix("/v1"), args.log
    else:
        port = free_port()
        base, log = f"http://127.0.0.1:{port}", args.log or args.report.with_suffix(".server.log")
        print(f"soak: starting minisgl-run serve on {base} (log: {log})", flush=True)
        proc = start_server(port, args.max_request_bytes, args.serve_arg, log)
    try:
        report = run_loop(_soak(args, base, proc))
    except (OSError, RuntimeError, asyncio.TimeoutError) as e:
        print(f"soak: could not run: {e}", file=sys.stderr)
        return 2
    finally:
        code = None if proc is None else stop_process(proc, group=False, grace=90)
    if code is not None:
        report["checks"]["server_exit"] = _check(code == 0, f"its server exited with {code} on SIGTERM")
    report["checks"]["log"] = scan_log(log)
    report["ok"] = all(c["ok"] is not False for c in report["checks"].values())
    args.report.write_text(json.dumps(report, indent=1, default=dict))
    print(
        f"soak: {report['requests']} requests, statuses {report['statuses']}, at most {report['max_in_flight']} in flight"
    )
    for name, c in report["checks"].items():
        state = "skipped" if c["ok"] is None else "ok" if c["ok"] else "FAILED"
        print(f"soak: check {name}: {state}: {c['detail']}")
    print(f"soak: report in {args.report}; {'all checks pass' if report['ok'] else 'a check FAILED'}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
