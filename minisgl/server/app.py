"""The HTTP front end of `minisgl-run serve`: FastAPI on uvicorn, in its own process.

It parses and checks requests (`minisgl.server.protocol`), tokenizes prompts (one worker thread),
sends token ids to the scheduler process (`minisgl.server.worker`) over ZeroMQ, and turns the token ids
that come back into text (an incremental detokenizer per choice) and OpenAI responses or server-sent
events. Stop strings are found here, where the text is made: the choice ends at once and an abort goes
back to the scheduler, which frees the request's pages at its next step. A client that disconnects from
a stream aborts its request the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import itertools
import json
import logging
import multiprocessing as mp
import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import uvicorn
import zmq
import zmq.asyncio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from minisgl.core import SamplingParams, TokenLogprobs
from minisgl.metrics import HotHistogram
from minisgl.scheduler.detokenizer import IncrementalDetokenizer
from minisgl.scheduler.grammar import Grammars
from minisgl.scheduler.stops import StopScanner, stop_strings
from minisgl.server import native, protocol
from minisgl.server.connections import (
    connection_cap,
    log_limited,
    loop_exception_handler,
    protocol_class,
)
from minisgl.server.logprobs import TokenTexts, chat_logprobs, completion_logprobs
from minisgl.server.protocol import APIError
from minisgl.server.replicas import Replicas, become_subreaper, kill_process_group, replica_settings
from minisgl.server.tokenize import PromptTooLong, TemplateFailed, TokenizerPool, default_workers
from minisgl.server.worker import (
    encode_params,
    frame_ids,
    ids_frame,
    read_logprobs,
    scheduler_main,
    set_parent_death_signal,
    unpack,
)
from minisgl.templates import THINK_OPEN, ReasoningSplitter, split_reasoning

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
STOP_JOIN_S = 30.0  # how long the front end waits for the scheduler process to end at shutdown
METRICS_TIMEOUT_S = 10.0
# minisgl_token_delivery_seconds: fine below a millisecond, where a step-to-socket delay should be
DELIVERY_BUCKETS = (
    1e-4,
    2e-4,
    3e-4,
    5e-4,
    7.5e-4,
    1e-3,
    2e-3,
    5e-3,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
)


def _scheduler_entry(devices: str | None, *args: Any) -> None:
    set_parent_death_signal()
    # the leader of a process group of its own: it, the ranks it spawns and their workers are killed
    # together when it dies (`kill_process_group`)
    os.setpgid(0, 0)
    # a terminal's Ctrl-C reaches the whole process group: the front end drains, then stops this one
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if devices is not None:  # a data-parallel replica's GPUs (before anything here touches CUDA)
        os.environ["CUDA_VISIBLE_DEVICES"] = devices
    scheduler_main(*args)


# ---------------------------------------------------------------------------------------------- choices


@dataclass(eq=False)
class Choice:
    """One choice of one request as the front end makes it: token ids from the scheduler in, text out."""

    rid: int  # the scheduler process's name for it (the front end counts them)
    index: int
    params: SamplingParams  # the request's, with its stop strings
    detokenizer: IncrementalDetokenizer | None
    job: Job | None = None  # the request it belongs to (woken when this choice has news)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    emitted: int = 0
    emitted_ids: int = 0
    finish_reason: str | None = None
    error: str | None = None
    reported: bool = False  # its final chunk was handed out (streaming)
    times: list[float | None] | None = None  # the scheduler's [arrived, admitted, first token, finished]
    stops: StopScanner | None = None  # the search for the stop strings (made with the first check)
    # with log probabilities asked: one per token of token_ids; the prompt's (None first) with echo
    logprobs: TokenLogprobs | None = None
    prompt_logprobs: TokenLogprobs | None = None
    prompt_ids: list[int] | None = None  # with prompt_logprobs
    emitted_logprobs: int = 0  # entries of `logprobs` already handed out (streaming)
    text_offset: int = 0  # characters of the text handed out with their logprobs (streamed completions)
    hidden_last: bool = False  # its last token (EOS or a stop token) is not part of the text
    cost: int = 0  # tokens it adds to its scheduler's load while the front end holds it (prompt + max)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def feed(self, ids: list[int], finished: bool, reason: str | None, error: str | None) -> bool:
        """Takes one step's tokens; returns True if a stop string ended the choice here (the scheduler,
        which does not know the stop strings, must then be told to abort the request)."""
        params = self.params
        for k, token in enumerate(ids):
            last = finished and k == len(ids) - 1
            self.token_ids.append(token)
            if last and reason == "stop":  # EOS or a stop token: kept in token_ids, out of the text
                self.hidden_last = True
                break
            if self.detokenizer is not None:
                self.detokenizer.add(token)
                self.text = self.detokenizer.text
                if params.stop and len(self.token_ids) > params.min_tokens:
                    if self.stops is None:
                        self.stops = stop_strings(params.stop).scanner()
                    cut = self.stops.search(self.text, self.emitted)
                    if cut is not None:
                        self.text = self.text[:cut]
                        self.finish_reason = "stop"
                        return not finished
        if finished:
            if self.detokenizer is not None:
                self.detokenizer.flush()
                self.text = self.detokenizer.text
            self.finish_reason, self.error = reason or "error", error
        return False

    def end(self, reason: str, error: str | None = None) -> None:
        """Finishes the choice here (the front end aborted it, or the scheduler failed)."""
        if not self.finished:
            self.finish_reason, self.error = reason, error

    def take(self) -> tuple[str, list[int]]:
        """The text and token ids not handed out yet (while running, minus what may start a stop string)."""
        upto = len(self.text)
        if not self.finished and self.params.stop:
            upto = max(self.emitted, upto - stop_strings(self.params.stop).max_len + 1)
        delta = self.text[self.emitted : upto]
        self.emitted = upto
        new_ids = self.token_ids[self.emitted_ids :]
        self.emitted_ids = len(self.token_ids)
        return delta, new_ids

    def text_logprobs(self) -> int:
        """How many entries of `logprobs` are of the tokens of its text (not a final EOS or stop token)."""
        assert self.logprobs is not None
        return len(self.logprobs) - self.hidden_last if self.finished else len(self.logprobs)

    def take_logprobs(self) -> tuple[int, int]:
        """The entries [start, end) of `text_logprobs` not handed out yet."""
        start = self.emitted_logprobs
        self.emitted_logprobs = max(start, self.text_logprobs())
        return start, self.emitted_logprobs


class Job:
    """One HTTP request in the front end: its choices, the event that wakes its response when any of
    them has news (set at most once per scheduler step, whatever the number of choices), and the times
    of its stages (`time.perf_counter()`, the clock the scheduler process stamps with too; written to
    the request trace, `trace_record`)."""

    def __init__(self, received: float) -> None:
        self.choices: list[Choice] = []
        self.wake = asyncio.Event()
        self.received = received
        self.tokenized = self.sent = 0.0
        self.first_received = self.last_received = 0.0  # tokens from the scheduler, first and last time
        self.first_written = self.done = 0.0  # the first token's bytes to the socket; the response's end
        # the latest step with news for it: its tokens on the host, its message sent, read here
        self.step_time = self.step_sent = self.step_read = 0.0
        self.chunks = 0  # writes of tokens to the socket
        self.delay_max = 0.0  # the largest delay from step_time to a write
        # the delays summed, split: in the scheduler, the hop (a Unix socket), here (they add up to it)
        self.parts_sum = [0.0, 0.0, 0.0]

    def news(self, step_time: float, sent: float, now: float) -> None:
        """A scheduler step (its tokens on the host at `step_time`, its message sent at `sent`)
        reached it at `now`."""
        if not self.first_received:
            self.first_received = now
        self.last_received = self.step_read = now
        self.step_time, self.step_sent = step_time, sent
        self.wake.set()

    def written(self, now: float) -> float:
        """Tokens were handed to the socket at `now`: returns the delay since their step ended."""
        if not self.first_written:
            self.first_written = now
        delay = now - self.step_time
        self.chunks += 1
        self.delay_max = max(self.delay_max, delay)
        parts = self.parts_sum
        parts[0] += self.step_sent - self.step_time
        parts[1] += self.step_read - self.step_sent
        parts[2] += now - self.step_read
        return delay


# stamps of a trace record, in order; their consecutive differences are its stages
TRACE_STAGES = (
    ("received", "parse_tokenize"),  # body read and parsed, prompt tokenized, limits checked
    ("tokenized", "to_scheduler"),  # sent over ZeroMQ and taken in by the scheduler process
    ("arrived", "queue"),  # waiting for admission (a slot and KV pages)
    ("admitted", "prefill"),  # prompt computed up to the first token (on the host)
    ("first_token", "decode"),  # the other tokens, to the last one on the host
    ("finished", "to_client"),  # the last tokens back to the front end, out to the socket
)


def trace_record(job: Job, request_id: str, prompt_tokens: int, clock_offset: float) -> dict[str, Any]:
    """The request trace's line for a finished `job`: its stamps in Unix seconds (perf_counter +
    `clock_offset`), its stages in seconds (consecutive, so they add up to `e2e_s`), the delay from
    the end of a step to its tokens on the socket (mean and largest over the writes), and counts.
    Stamps the request never reached (a request refused or aborted early) are null, as are the stages
    around them."""
    sched = [c.times for c in job.choices if c.times is not None]

    def over(i: int, pick: Any) -> float | None:
        values = [t[i] for t in sched if t[i] is not None]
        return pick(values) if values else None

    stamps: dict[str, float | None] = {
        "received": job.received,
        "tokenized": job.tokenized or None,
        "sent": job.sent or None,
        "arrived": over(0, min),
        "admitted": over(1, min),
        "first_token": over(2, min),
        "first_received": job.first_received or None,
        "first_written": job.first_written or None,
        "finished": over(3, max),
        "last_received": job.last_received or None,
        "done": job.done,
    }
    order = [name for name, _ in TRACE_STAGES] + ["done"]
    stages = {
        stage: None if stamps[a] is None or stamps[b] is None else stamps[b] - stamps[a]
        for (a, stage), b in zip(TRACE_STAGES, order[1:])
    }
    return {
        "id": request_id,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": sum(len(c.token_ids) for c in job.choices),
        "n": len(job.choices),
        "finish_reasons": [c.finish_reason for c in job.choices],
        "e2e_s": job.done - job.received,
        "stages_s": stages,
        "delivery": {
            "writes": job.chunks,
            "mean_s": sum(job.parts_sum) / job.chunks if job.chunks else None,
            "max_s": job.delay_max if job.chunks else None,
            # the mean split: the scheduler's processing of the step, the hop (a Unix socket), this process
            "split_mean_s": [part / job.chunks for part in job.parts_sum] if job.chunks else None,
        },
        "stamps": {k: None if v is None else v + clock_offset for k, v in stamps.items()},
    }


# ------------------------------------------------------------------------------------ scheduler client


class SchedulerClient:
    """The front end's side of the scheduler process: starts it, sends requests and aborts, and routes
    each step's tokens to the choices waiting for them. `devices`: the process's CUDA_VISIBLE_DEVICES
    (a data-parallel replica's GPUs; None: this process's)."""

    load_tokens = 0  # the `cost` of the choices the front end holds here: what routing compares

    def __init__(
        self,
        settings: dict[str, Any],
        config: str | None,
        devices: str | None = None,
        name: str = "minisgl-scheduler",
    ) -> None:
        self.settings, self.config = settings, config
        self.info: dict[str, Any] | None = None
        self.failed: str | None = None
        self.on_failure: Any = None  # called once when the scheduler process fails or dies
        self.ready = asyncio.Event()
        self.choices: dict[int, Choice] = {}  # by rid, until finished
        self.rids = itertools.count()
        self._answers: dict[int, asyncio.Future] = {}  # `_ask` questions waiting for the scheduler
        self._metrics: asyncio.Future | None = None  # the metrics question in flight
        self._ids = itertools.count()
        self._dir = tempfile.mkdtemp(prefix="minisgl-serve-")  # private (0700): the sockets live here
        self._ctx = zmq.asyncio.Context()
        self._out = self._ctx.socket(zmq.PUSH)
        inbox, outbox = f"ipc://{self._dir}/requests", f"{self._dir}/tokens"
        self._out.bind(inbox)
        # the scheduler's messages: a Unix stream socket read by a protocol of this event loop
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(outbox)
        listener.listen(1)
        self._inbox: _Inbox | None = None
        self.proc = mp.get_context("spawn").Process(
            target=_scheduler_entry,
            args=(devices, dict(settings), config, inbox, outbox, os.getpid()),
            name=name,
        )
        self.proc.start()
        loop = asyncio.get_running_loop()
        self._tasks = [
            asyncio.create_task(loop.create_unix_server(lambda: _Inbox(self), sock=listener)),
            asyncio.create_task(self._watch()),
        ]

    # -- to the scheduler

    def add(self, choice: Choice, prompt: bytes) -> None:
        """Queues `choice` (of `choice.job`, which is woken with its progress) in the scheduler;
        `prompt`: the prompt's ids as a frame (`ids_frame`)."""
        self.choices[choice.rid] = choice
        params = replace(choice.params, stop=())  # stop strings are found here
        self._send({"op": "add", "rid": choice.rid, "params": encode_params(params)}, prompt)

    def abort(self, rid: int) -> None:
        if self.choices.pop(rid, None) is not None:
            self._send({"op": "abort", "rid": rid})

    def submit(self, choices: list[Choice], prompt: bytes, prompt_len: int) -> None:
        """Queues the choices of one request (`add`); each costs its prompt and its max_tokens."""
        for choice in choices:
            choice.cost = prompt_len + choice.params.max_tokens
            self.load_tokens += choice.cost
            self.add(choice, prompt)

    def release(self, choice: Choice, abort: bool) -> None:
        """The front end is done with `choice` (its response ended): `abort` it in the scheduler if it
        was still running there, and take its cost off the load."""
        if abort:
            self.abort(choice.rid)
        else:
            self.choices.pop(choice.rid, None)
        self.load_tokens -= choice.cost
        choice.cost = 0

    def loads(self) -> list[dict[str, Any]]:
        """`GET /get_load`'s entries (SGLang's shape): requests held and their cost in tokens."""
        return [{"dp_rank": 0, "num_reqs": len(self.choices), "num_tokens": self.load_tokens}]

    def status(self) -> dict[str, Any]:
        """What `/health` adds to its body (a data-parallel front end lists its replicas)."""
        return {}

    async def metrics(self) -> str:
        """The scheduler process's Prometheus series, as text (scrapes at the same time share one
        question to the scheduler)."""
        if self._metrics is None or self._metrics.done():
            self._metrics = asyncio.ensure_future(self._ask("metrics"))
        return (await asyncio.shield(self._metrics))["text"]

    async def flush_cache(self) -> int:
        """Empties the scheduler's prefix cache; the KV pages freed."""
        return (await self._ask("flush"))["pages"]

    async def _ask(self, op: str) -> dict[str, Any]:
        """Sends a question to the scheduler process and waits for its answer (same op and id)."""
        key = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._answers[key] = future
        self._send({"op": op, "id": key})
        try:
            return await asyncio.wait_for(future, METRICS_TIMEOUT_S)
        finally:
            self._answers.pop(key, None)

    def _send(self, header: dict[str, Any], *frames: bytes) -> None:
        if self.failed is None:
            self._out.send_multipart([json.dumps(header).encode(), *frames])

    # -- from the scheduler

    def handle(self, frames: list[bytes]) -> None:
        """One message of the scheduler process (`minisgl.server.worker`'s list)."""
        header = json.loads(frames[0])
        op = header["op"]
        if op == "step":
            self._step(header, frame_ids(frames[1]), frame_ids(frames[2]), frames[3:])
        elif op == "rejected":
            choice = self.choices.pop(header["rid"], None)
            if choice is not None:
                choice.end("rejected", header["error"])
                choice.job.wake.set()
        elif op in ("metrics", "flush"):  # answers to `_ask`
            future = self._answers.get(header["id"])
            if future is not None and not future.done():
                future.set_result(header)
        elif op == "ready":
            self.info = header
            self.ready.set()
        elif op == "failed":
            self._fail(header["error"])

    def _step(
        self, header: dict[str, Any], served: list[int], tokens: list[int], scored: Sequence[bytes] = ()
    ) -> None:
        """One scheduler step: each served choice takes its tokens (detokenized, stop strings checked)
        and their log probabilities (`scored`: the message's `LogprobFrames`, if any), and its request
        is woken."""
        now, step_time, sent = time.perf_counter(), header["t"], header["s"]
        counts = header["n"]
        starts = None if counts is None else [0, *itertools.accumulate(counts)]
        done = {row: rest for row, *rest in header["done"]}
        choices = self.choices

        def row_tokens(row: int) -> list[int]:
            return tokens[row : row + 1] if starts is None else tokens[starts[row] : starts[row + 1]]

        for row, new_tokens, values, top_ids, top_values in read_logprobs(scored) if scored else ():
            choice = choices.get(served[row])
            if choice is None:
                continue
            if new_tokens and choice.logprobs is not None:
                choice.logprobs.extend(row_tokens(row), values, top_ids, top_values)
            elif not new_tokens and choice.prompt_logprobs is not None and choice.prompt_ids is not None:
                have = len(choice.prompt_logprobs)
                ids = choice.prompt_ids[have : have + len(values)]
                choice.prompt_logprobs.extend(ids, values, top_ids, top_values)
        for row, rid in enumerate(served):
            ids = row_tokens(row)
            choice = choices.get(rid)
            if choice is None:
                continue
            finished = row in done
            if finished:
                reason, error, choice.times = done[row]
                stopped = choice.feed(ids, True, reason, error)
            else:
                stopped = choice.feed(ids, False, None, None)
            if stopped:
                self.abort(rid)  # a stop string: the scheduler frees its pages
            elif finished:
                choices.pop(rid, None)
            choice.job.news(step_time, sent, now)

    async def _watch(self) -> None:
        while self.failed is None:
            await asyncio.sleep(0.5)
            if not self.proc.is_alive():
                self._fail(f"the scheduler process exited (exit code {self.proc.exitcode})")

    def _fail(self, error: str) -> None:
        if self.failed is not None:
            return
        self.failed = error
        logger.error("the engine is gone: %s", error)
        for choice in self.choices.values():
            choice.end("engine_died", error)
            choice.job.wake.set()
        self.choices.clear()
        if self.on_failure is not None:
            self.on_failure()

    def abort_all(self) -> None:
        """Ends every unfinished choice with finish reason "abort" (shutdown) and aborts it."""
        for rid, choice in list(self.choices.items()):
            self.abort(rid)
            choice.end("abort")
            choice.job.wake.set()

    async def close(self) -> None:
        """Stops the scheduler process (which stops the ranks it spawned) and waits for it."""
        for task in self._tasks:
            task.cancel()
        if self._inbox is not None:
            self._inbox.closing = True
        with contextlib.suppress(zmq.ZMQError, asyncio.TimeoutError):  # no peer: the process is gone
            await asyncio.wait_for(self._out.send_multipart([json.dumps({"op": "stop"}).encode()]), 1.0)
        await asyncio.to_thread(self.proc.join, STOP_JOIN_S)
        if self.proc.is_alive():
            self.proc.kill()
            await asyncio.to_thread(self.proc.join, 5)
        # what it started and left behind (ranks blocked in a collective, compile workers)
        await asyncio.to_thread(kill_process_group, self.proc.pid)
        self._out.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)


class _Inbox(asyncio.Protocol):
    """The scheduler process's connection: splits the stream into messages (`worker.pack`) and hands
    each to the client as its bytes arrive, in this event loop's callback (no task to wake)."""

    def __init__(self, client: SchedulerClient) -> None:
        self.client, self.buffer, self.closing = client, bytearray(), False

    def connection_made(self, transport: Any) -> None:
        if self.client._inbox is not None:  # one scheduler, one connection
            transport.close()
            return
        self.client._inbox = self

    def data_received(self, data: bytes) -> None:
        buffer = self.buffer
        buffer += data
        while len(buffer) >= 4:
            end = 4 + int.from_bytes(buffer[:4], "little")
            if len(buffer) < end:
                return
            message = bytes(buffer[4:end])
            del buffer[:end]
            try:
                self.client.handle(unpack(message))
            except Exception as e:  # a bug here: fail loudly rather than lose tokens silently
                logger.exception("the front end could not handle a message of the scheduler")
                self.client._fail(f"the front end failed on a message of the scheduler: {e!r}")

    def connection_lost(self, exc: Exception | None) -> None:
        if self.client._inbox is self and not self.closing:
            self.client._fail("the scheduler process closed its connection")


# ----------------------------------------------------------------------------------------------- the app


class ServerState:
    """What the endpoints share: the scheduler client, the tokenizers, the limits."""

    def __init__(self, settings: Any, explicit: dict[str, Any], config: str | None) -> None:
        self.server = settings.to_server_config()
        self.explicit, self.config = explicit, config
        self.tp_size, self.dp_size = settings.tp_size, settings.dp_size
        self.replicas = replica_settings(settings, explicit)  # per replica: settings, GPUs
        self.client: SchedulerClient | Replicas | None = None
        self.served_model = self.server.served_model_name
        self.limits = protocol.Limits(self.server.max_stop_strings, self.server.max_stop_string_length)
        self.encoder: Any = None  # the model's tokenizer, for its chat template (None: the model has none)
        self.tokenizers: TokenizerPool | None = None  # where prompts are tokenized
        self.decoder: Any = None  # tokenizer used on the event loop (detokenizing)
        self.grammars: Grammars | None = None  # structured output's grammars, checked before queueing
        self.tp_size = settings.tp_size
        self._token_texts: TokenTexts | None = None
        self.outstanding = 0  # choices admitted by the front end and not finished
        self.body_bytes = 0  # bytes of request bodies being read now
        self.draining = False
        self.limit = 0
        self.on_failure: Any = None
        # the front end's own series, served after the scheduler's at /metrics
        self.registry = CollectorRegistry()
        self.delivery: HotHistogram | None = None  # made once the model's name is known
        self.clock_offset = time.time() - time.perf_counter()  # perf_counter -> Unix time (traces)
        self.trace: Any = None  # the request trace's file (request_trace)
        if self.server.request_trace:
            self.trace = open(self.server.request_trace, "a", buffering=1, encoding="utf-8")  # noqa: SIM115

    async def start(self) -> None:
        server = self.server
        if self.dp_size == 1 and not server.engine_restart:  # its death ends the server
            self.client = self.client_class(self.explicit, self.config)
        else:
            limits = {
                "crash_limit": server.engine_restart_limit,
                "crash_window_s": server.engine_restart_window_s,
            }
            restart = server.engine_restart
            self.client = Replicas(self.replicas, self.config, self.client_class, restart=restart, **limits)
        self.client.on_failure = self.on_failure
        asyncio.create_task(self._when_ready())

    async def _when_ready(self) -> None:
        client = self.client
        await client.ready.wait()
        info = client.info
        if self.served_model is None:
            self.served_model = info["model_name"]
        path = info["model_path"]
        if any((Path(path) / name).is_file() for name in TOKENIZER_FILES):
            import transformers

            load = transformers.AutoTokenizer.from_pretrained
            self.encoder, self.decoder = await asyncio.to_thread(lambda: (load(path), load(path)))
            workers = self.server.tokenizer_workers or default_workers()
            self.tokenizers = TokenizerPool(path, workers)
            await self.tokenizers.warm(info["max_context"])
        self.limit = info["max_running_req"] + self.server.max_waiting_requests
        # structured output's check before a request is sent on (compiles lazily: nothing until used)
        self.grammars = Grammars(
            self.encoder, info["vocab_size"], info["eos_token_ids"], tensor_parallel=self.tp_size > 1
        )
        self.limits = replace(self.limits, max_context=info["max_context"])
        self.delivery = HotHistogram(
            "minisgl_token_delivery_seconds",
            "From the end of the step that made a streamed request's tokens (on the host, in the scheduler "
            "process) to their bytes handed to the request's socket; one observation per write.",
            DELIVERY_BUCKETS,
            {"model_name": info["model_name"]},
        )
        self.registry.register(self.delivery)
        self.ready = True
        logger.info("serving %s at http://%s:%d/v1", self.served_model, self.server.host, self.server.port)

    ready = False
    client_class = SchedulerClient  # what `start` makes (perf/cpu/test_front_end.py puts a fake here)

    @property
    def token_texts(self) -> TokenTexts:
        """Each token's text and bytes (log probabilities), made at the first use."""
        if self._token_texts is None:
            self._token_texts = TokenTexts(self.decoder)
        return self._token_texts

    def write_trace(self, job: Job, request_id: str, prompt_tokens: int) -> None:
        if self.trace is not None:
            record = trace_record(job, request_id, prompt_tokens, self.clock_offset)
            self.trace.write(json.dumps(record, separators=(",", ":")) + "\n")


def _json_response(body: dict[str, Any]) -> Response:
    """A JSON response whose body may hold `protocol.RawJSON` values (log probabilities)."""
    return Response(protocol.to_json(body), media_type="application/json")


def _error(e: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(protocol.error_body(e), status_code=e.status, headers=headers)


LARGE_BODY_BYTES = 256 << 10  # bodies parsed and checked off the event loop past this size
BODY_BUDGET = 32  # request bodies read at the same time hold at most this many times max_request_bytes


def _parse_body(parse: Any, raw: bytes, served_model: str, limits: protocol.Limits) -> Any:
    """The checked request of the body `raw` (`parse`: protocol.parse_chat_request or _completion_)."""
    return parse(protocol.load_json(raw), served_model, limits)


async def _read_body(state: ServerState, request: Request) -> bytes:
    """The request's body: 413 past `max_request_bytes`, 503 when the bodies being read at the same
    time would hold more than BODY_BUDGET times that (memory stays bounded whatever the clients)."""
    limit = state.server.max_request_bytes
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise APIError(f"the request body has {length} bytes, more than the limit of {limit}", status=413)
    parts, size = [], 0
    try:
        async for part in request.stream():
            parts.append(part)
            size += len(part)
            state.body_bytes += len(part)
            if size > limit:
                raise APIError(f"the request body is larger than the limit of {limit} bytes", status=413)
            if state.body_bytes > BODY_BUDGET * limit:
                raise APIError(
                    "the server is reading too many large request bodies at once; retry later",
                    status=503,
                    type="server_error",
                    code="server_overloaded",
                )
        return b"".join(parts)
    finally:
        state.body_bytes -= size


def create_app(state: ServerState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        asyncio.get_running_loop().set_exception_handler(loop_exception_handler)
        await state.start()
        try:
            yield
        finally:
            if state.client is not None:
                await state.client.close()
            if state.tokenizers is not None:
                state.tokenizers.shutdown()
            if state.trace is not None:
                state.trace.close()

    app = FastAPI(title="minisgl", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    app.add_middleware(_Guard, server=state.server)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        where = f"{request.method} {protocol.short(request.url.path, 100)}"
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        if exc.status_code == 404:
            message = f"Invalid URL ({where}): no such route (the API's routes: docs/server.md)"
        elif exc.status_code == 405:
            message = f"Invalid method ({where}): allowed: {(exc.headers or {}).get('Allow', '?')}"
        else:
            message = str(exc.detail)
        return _error(APIError(message, status=exc.status_code, code=code), exc.headers)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:  # a bug: logged by uvicorn
        error = APIError(f"internal server error ({type(exc).__name__})", status=500, type="server_error")
        return _error(error)

    @app.get("/health")
    async def health() -> Response:
        unavailable = _unavailable(state)
        replicas = {} if state.client is None else state.client.status()  # --dp: the replicas' states
        if unavailable is None:
            return JSONResponse({"status": "ok", **replicas})
        failed = state.client is not None and state.client.failed is not None
        restarting = failed and getattr(state.client, "restarting", False)
        status = (
            "restarting"
            if restarting
            else "failed"
            if failed
            else "starting"
            if not state.ready
            else "shutting down"
        )
        body = {**replicas, "status": status, **protocol.error_body(unavailable)}
        return JSONResponse(body, status_code=503)

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        # with restarts, the front end's series and the restart counts while no engine serves
        if not state.ready or (
            state.client.failed is not None and not getattr(state.client, "restarting", False)
        ):
            return _error(_unavailable(state))
        text = await state.client.metrics() + generate_latest(state.registry).decode()
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/flush_cache")
    async def flush_cache() -> Response:
        if not state.ready or state.client.failed is not None:
            return _error(_unavailable(state))
        pages = await state.client.flush_cache()
        return JSONResponse({"freed_pages": pages})

    @app.get("/v1/models")
    async def models() -> Response:
        unavailable = _unavailable(state)
        if unavailable is not None:
            return _error(unavailable)
        return JSONResponse(protocol.model_list(state.served_model))

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> Response:
        unavailable = _unavailable(state)
        if unavailable is not None:
            return _error(unavailable)
        try:
            protocol.check_model(model, state.served_model)
        except APIError as e:
            return _error(e)
        return JSONResponse(protocol.model_card(state.served_model))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _generate(state, request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _generate(state, request, "chat")

    # SGLang's native API and what its router asks workers for (minisgl/server/native.py)
    @app.post("/generate")
    async def generate(request: Request) -> Response:
        return await _native_generate(state, request)

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> Response:
        return _answer(
            state,
            lambda info: native.server_info(
                info["model_path"],
                state.served_model,
                state.tp_size,
                state.dp_size,
                info["max_running_req"],
                info["max_context"],
            ),
        )

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> Response:
        return _answer(state, lambda info: native.model_info(info["model_path"], state.encoder is not None))

    @app.get("/get_load")
    async def get_load() -> Response:
        return _answer(state, lambda info: state.client.loads())

    return app


LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
# with an API key, these need it too (besides /v1/*): all but /health and /metrics
KEYED_PATHS = frozenset(
    {
        "/flush_cache",
        "/generate",
        "/server_info",
        "/get_server_info",
        "/model_info",
        "/get_model_info",
        "/get_load",
    }
)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _host_name(value: bytes) -> str:
    """The name in a Host header: "127.0.0.1:8000" -> "127.0.0.1", "[::1]:8000" -> "::1"."""
    host = value.decode("latin-1").strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class _Guard:
    """What every request passes before the app (a plain ASGI middleware: responses, streams included,
    pass through untouched). In order:

    - `Host` among the allowed names (`allowed_hosts`; bound to loopback, by default the loopback
      names: a DNS-rebinding page on another name gets 403);
    - no `Origin` but the allowed ones (`cors_allow_origins`; none by default): a page of another site
      gets 403, and an allowed one gets CORS headers and its preflight answered;
    - with an API key, `Authorization: Bearer KEY` on /v1/* and KEYED_PATHS (scheme in any case; 401);
    - a POST body declared `Content-Type: application/json` (415), which a browser cannot send to
      another site without a preflight."""

    def __init__(self, app: Any, server: Any) -> None:
        self.app = app
        self.key = None if server.api_key is None else server.api_key.encode()
        hosts = server.allowed_hosts
        if hosts is None and _is_loopback(server.host):
            hosts = (*LOOPBACK_HOSTS, server.host)
        self.hosts = None if hosts is None or "*" in hosts else frozenset(h.lower() for h in hosts)
        self.origins = frozenset(server.cors_allow_origins or ())

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        first: dict[bytes, bytes] = {}  # each header's first value
        for name, value in scope["headers"]:
            first.setdefault(name, value)
        host, origin, auth = first.get(b"host"), first.get(b"origin"), first.get(b"authorization")
        ctype, length, chunked = (
            first.get(b"content-type"),
            first.get(b"content-length"),
            first.get(b"transfer-encoding"),
        )
        error = None
        if self.hosts is not None and host is not None and _host_name(host) not in self.hosts:
            shown = protocol.short(host.decode("latin-1"))
            error = (
                403,
                "host_not_allowed",
                f"this server does not answer to the Host {shown}; see --allowed-hosts",
            )
        elif origin is not None and origin.decode("latin-1") not in self.origins:
            shown = protocol.short(origin.decode("latin-1"))
            error = (
                403,
                "origin_not_allowed",
                f"requests from the web origin {shown} are not allowed; see --cors-allow-origins",
            )
        elif origin is not None and scope["method"] == "OPTIONS":  # a CORS preflight of an allowed origin
            headers = _cors_headers(origin.decode("latin-1"), True)
            return await Response(status_code=204, headers=headers)(scope, receive, send)
        elif self.key is not None and (scope["path"].startswith("/v1/") or scope["path"] in KEYED_PATHS):
            scheme, _, given = (auth or b"").strip().partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(given.strip(), self.key):
                error = (
                    401,
                    "invalid_api_key",
                    "a valid API key is required: send the header Authorization: Bearer KEY",
                )
        if (
            error is None
            and scope["method"] == "POST"
            and (chunked or (length or b"0").strip() not in (b"0", b""))
        ):
            if (ctype or b"").split(b";", 1)[0].strip().lower() != b"application/json":
                shown = "none" if ctype is None else protocol.short(ctype.decode("latin-1"))
                message = f"the request body must be JSON with the header Content-Type: application/json (got {shown})"
                error = (415, "unsupported_media_type", message)
        if error is not None:
            status, code, message = error
            return await _error(APIError(message, status=status, code=code))(scope, receive, send)
        if origin is not None:
            send = _with_cors(send, origin.decode("latin-1"))
        await self.app(scope, receive, send)


def _cors_headers(origin: str, preflight: bool) -> dict[str, str]:
    headers = {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}
    if preflight:
        headers |= {
            "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
            "Access-Control-Allow-Headers": "Authorization, Content-Type",
            "Access-Control-Max-Age": "600",
        }
    return headers


def _with_cors(send: Any, origin: str) -> Any:
    extra = [(k.lower().encode(), v.encode()) for k, v in _cors_headers(origin, False).items()]

    async def send_with_cors(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), *extra]}
        await send(message)

    return send_with_cors


def _answer(state: ServerState, make: Any) -> Response:
    """`make(the scheduler's facts)` as JSON once the server serves; else the 503 that says why."""
    unavailable = _unavailable(state)
    return _error(unavailable) if unavailable is not None else JSONResponse(make(state.client.info))


def _unavailable(state: ServerState) -> APIError | None:
    client = state.client
    if client is not None and client.failed is not None:
        return protocol.engine_unavailable(client.failed, getattr(client, "restarting", False))
    if not state.ready:
        return APIError(
            "the server is starting; retry when GET /health answers 200", status=503, type="server_error"
        )
    if state.draining:
        return APIError("the server is shutting down", status=503, type="server_error")
    return None


async def _prepare(
    state: ServerState, request: Request, parse: Any, tokenize: Any, plan: Any
) -> tuple[Any, list[int], list[SamplingParams]] | Response:
    """What every generation route checks before anything runs: the server available, the body read and
    parsed (`parse(body, served_model, limits)`), the prompt's ids (`await tokenize(req)`), one
    SamplingParams per choice (`plan(req, prompt_len, max_context)`) and room for them. Returns the
    request, the prompt's ids and the params, or the error response."""
    try:
        unavailable = _unavailable(state)
        if unavailable is not None:
            raise unavailable
        raw = await _read_body(state, request)
        args = (parse, raw, state.served_model, state.limits)
        if len(raw) <= LARGE_BODY_BYTES:
            req = _parse_body(*args)
        else:  # on a thread: the event loop goes on (but for json.loads itself, one C call)
            req = await asyncio.to_thread(_parse_body, *args)
        del raw, args
        prompt_ids = await tokenize(req)
        params = plan(req, len(prompt_ids), state.client.info["max_context"])
        if params[0].grammar is not None:  # compiled here first (off the event loop): a 400, never a stream
            try:
                await asyncio.to_thread(state.grammars.check, params[0])
            except ValueError as e:
                raise protocol.invalid_request(e) from None
        if params[0].stop and state.decoder is None:
            raise APIError(
                "stop strings need a tokenizer; this model has none: use stop_token_ids", param="stop"
            )
        if state.outstanding + len(params) > state.limit:
            raise APIError(
                f"the server is full ({state.outstanding} requests queued or running); retry later",
                status=503,
                type="server_error",
                code="server_overloaded",
            )
        return req, prompt_ids, params
    except APIError as e:
        return _error(e, {"Retry-After": "1"} if e.status == 503 else None)
    except ClientDisconnect:  # nobody to answer
        log_limited("disconnect", logging.INFO, "a client disconnected before its request arrived in full")
        return Response(status_code=400)


def _admit(state: ServerState, job: Job, params: list[SamplingParams], prompt_ids: list[int]) -> None:
    """Makes the job's choices, one per SamplingParams, and sends them to the scheduler (a replica's,
    under data parallelism)."""
    job.tokenized = time.perf_counter()
    client = state.client
    job.choices = [
        Choice(next(client.rids), i, p, IncrementalDetokenizer(state.decoder) if state.decoder else None, job)
        for i, p in enumerate(params)
    ]
    for choice in job.choices:
        if choice.params.logprobs is not None:
            choice.logprobs = TokenLogprobs(choice.params.logprobs)
        if choice.params.prompt_logprobs is not None:
            choice.prompt_ids = prompt_ids
            choice.prompt_logprobs = TokenLogprobs(choice.params.prompt_logprobs, prompt_ids[:1])
    state.outstanding += len(job.choices)
    client.submit(job.choices, ids_frame(prompt_ids), len(prompt_ids))
    job.sent = time.perf_counter()


async def _generate(state: ServerState, request: Request, kind: str) -> Response:
    job = Job(time.perf_counter())
    parse = protocol.parse_chat_request if kind == "chat" else protocol.parse_completion_request
    prepared = await _prepare(
        state, request, parse, lambda req: _prompt_ids(state, req, kind), protocol.sampling_params
    )
    if isinstance(prepared, Response):
        return prepared
    req, prompt_ids, params = prepared
    request_id = protocol.new_request_id(kind)
    _admit(state, job, params, prompt_ids)
    thinking = _thinking(state, req, prompt_ids)
    echo = _echo(state, req, prompt_ids)
    created = int(time.time())
    if req.stream:
        return StreamingResponse(
            _stream(state, req, kind, request_id, created, job, prompt_ids, thinking, echo),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    try:
        await _wait_all(job)
        respond = protocol.chat_response if kind == "chat" else protocol.completion_response
        return _json_response(
            respond(
                request_id,
                state.served_model,
                len(prompt_ids),
                [_Generation(c, thinking, echo, state.token_texts, kind) for c in job.choices],
                return_token_ids=req.wants_token_ids,
                created=created,
            )
        )
    except APIError as e:
        return _error(e)
    finally:
        _release(state, job, request_id, len(prompt_ids))


async def _native_generate(state: ServerState, request: Request) -> Response:
    """`POST /generate`, SGLang's native form (`minisgl/server/native.py`): one choice, answered whole
    or streamed as the text and token ids so far."""
    job = Job(time.perf_counter())
    prepared = await _prepare(
        state,
        request,
        native.parse_generate,
        lambda req: req.checked(_prompt_ids(state, req.request, "completion")),
        lambda req, prompt_len, max_context: req.sampling_params(prompt_len, max_context),
    )
    if isinstance(prepared, Response):
        return prepared
    req, prompt_ids, params = prepared
    _admit(state, job, params, prompt_ids)
    elapsed = lambda: time.perf_counter() - job.received  # noqa: E731
    release = lambda: _release(state, job, req.rid, len(prompt_ids))  # noqa: E731
    if req.stream:
        written = lambda: state.delivery.observe(job.written(time.perf_counter()))  # noqa: E731
        return StreamingResponse(
            native.stream_events(req, job, len(prompt_ids), elapsed, written, release),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    try:
        await _wait_all(job)
        [choice] = job.choices
        answer = native.generate_response(
            req, choice, choice.text, choice.token_ids, len(prompt_ids), elapsed()
        )
        return JSONResponse(answer)
    except APIError as e:
        return _error(e)
    finally:
        release()


@dataclass
class _Generation:
    choice: Choice
    thinking: bool | None = None  # separate_reasoning: whether the reply starts inside <think>
    echo: str | None = None  # completions with echo: the prompt's text, before the reply's
    texts: TokenTexts | None = None  # with log probabilities
    kind: str = "completion"

    @cached_property
    def _split(self) -> tuple[str, str]:
        """(reasoning, content) of the reply, split once (separate_reasoning)."""
        assert self.thinking is not None
        return split_reasoning(self.choice.text, self.thinking)

    @property
    def text(self) -> str:
        if self.thinking is None:
            return (self.echo or "") + self.choice.text
        return self._split[1]

    @property
    def logprobs(self) -> protocol.RawJSON | None:
        choice = self.choice
        if choice.logprobs is None or self.texts is None:
            return None
        if self.kind == "chat":
            return protocol.RawJSON(chat_logprobs(self.texts, choice.logprobs, 0, choice.text_logprobs()))
        runs = [(choice.logprobs, 0, choice.text_logprobs())]
        if self.echo is not None and choice.prompt_logprobs is not None:
            runs.insert(0, (choice.prompt_logprobs, 0, len(choice.prompt_logprobs)))
        return protocol.RawJSON(completion_logprobs(self.texts, runs)[0])

    @property
    def reasoning(self) -> str | None:  # None: not asked for, or none in the reply (as SGLang)
        return None if self.thinking is None else self._split[0] or None

    @property
    def token_ids(self) -> list[int]:
        return self.choice.token_ids

    @property
    def finish_reason(self) -> str:
        return self.choice.finish_reason or "error"

    @property
    def error(self) -> str | None:
        return self.choice.error


def _thinking(state: ServerState, req: Any, prompt_ids: list[int]) -> bool | None:
    """With separate_reasoning (chat): whether the reply starts inside a <think> the prompt opened (its
    template's doing); None without it."""
    if not getattr(req, "separate_reasoning", False) or state.decoder is None:
        return None
    tail = state.decoder.decode(prompt_ids[-8:], skip_special_tokens=False).rstrip()
    return tail.endswith(THINK_OPEN)


def _echo(state: ServerState, req: Any, prompt_ids: list[int]) -> str | None:
    """Completions with echo: the prompt's text (a token-id prompt decoded); None without echo."""
    if not getattr(req, "echo", False):
        return None
    if isinstance(req.prompt, str):
        return req.prompt
    return "" if state.decoder is None else state.decoder.decode(prompt_ids)


def _check_rejected(choice: Choice) -> None:
    if choice.finish_reason == "rejected":
        raise protocol.invalid_request(ValueError(choice.error))


async def _wait_all(job: Job) -> None:
    while True:
        for c in job.choices:
            _check_rejected(c)
        if all(c.finished for c in job.choices):
            return
        await job.wake.wait()
        job.wake.clear()


def _release(state: ServerState, job: Job, request_id: str, prompt_tokens: int) -> None:
    """Aborts the unfinished choices (a client gone mid-stream), frees their queue slots and writes
    the request's trace line."""
    client = state.client
    for choice in job.choices:
        running = not choice.finished
        if running:
            choice.end("abort")
        client.release(choice, running)
    state.outstanding -= len(job.choices)
    job.done = time.perf_counter()
    state.write_trace(job, request_id, prompt_tokens)


async def _prompt_ids(state: ServerState, req: Any, kind: str) -> list[int]:
    try:
        if kind == "chat":
            tok = state.encoder
            if tok is None or not tok.chat_template:
                raise APIError("this model has no chat template: use /v1/completions", param="messages")
            return await state.tokenizers.chat(req.messages, req.chat_template_kwargs)
        if isinstance(req.prompt, str):
            if state.encoder is None:
                raise APIError("this model has no tokenizer: send the prompt as token ids", param="prompt")
            return await state.tokenizers.text(req.prompt)
    except TemplateFailed as e:
        raise APIError(
            f"the chat template could not render this conversation ({e}); check the messages and "
            "chat_template_kwargs",
            param="messages",
        ) from None
    except PromptTooLong as e:
        max_context = state.client.info["max_context"]
        raise APIError(
            f"the prompt has {e.size} bytes of text, more than {max_context} tokens (this model's "
            f"context) can hold ({e.limit} bytes at most): shorten it",
            param="messages" if kind == "chat" else "prompt",
            code="context_length_exceeded",
        ) from None
    vocab = state.client.info["vocab_size"]
    bad = [t for t in req.prompt if not 0 <= t < vocab]
    if bad:
        raise APIError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})", param="prompt")
    return list(req.prompt)


async def _stream(
    state: ServerState,
    req: Any,
    kind: str,
    request_id: str,
    created: int,
    job: Job,
    prompt_ids: list[int],
    thinking: bool | None,
    echo: str | None,
) -> AsyncIterator[bytes]:
    """The response's server-sent events: each time the job is woken, one write with every choice's
    news (text and token ids, final chunks), then the delay since the step that made them is recorded.
    `thinking` (separate_reasoning; see `_thinking`): each text is split into reasoning and content.
    `echo` (completions): each choice's first chunk is the prompt's text (with its log probabilities
    once the prefill has them). Chunks with log probabilities carry them as `RawJSON` (`_streamed_logprobs`)."""
    prompt_tokens = len(prompt_ids)
    model = state.served_model
    wants_ids = req.wants_token_ids
    choices = job.choices
    formats = [
        protocol.ChunkFormat(kind, request_id, model, c.index, wants_ids, created, c.logprobs is not None)
        for c in choices
    ]
    splitters = None if thinking is None else [ReasoningSplitter(thinking) for _ in choices]
    try:
        if kind == "chat":
            yield "".join(
                protocol.sse(
                    protocol.chat_chunk(
                        request_id, model, c.index, role="assistant", content="", created=created
                    )
                )
                for c in choices
            ).encode()
        remaining = len(choices)
        while remaining:
            await job.wake.wait()
            job.wake.clear()
            parts, tokens = [], False
            for choice, fmt in zip(choices, formats):
                if choice.reported:
                    continue
                if choice.finish_reason == "rejected":
                    raise protocol.invalid_request(ValueError(choice.error))
                if echo is not None and not choice.text_offset:  # the prompt first, once scored
                    if choice.prompt_logprobs is not None and len(choice.prompt_logprobs) < prompt_tokens:
                        if not choice.finished:
                            continue
                    scored = _streamed_logprobs(state, kind, choice, echo)
                    parts.append(
                        protocol.sse(
                            _chunk(kind, request_id, model, choice.index, echo, None, None, created, scored)
                        )
                    )
                    choice.text_offset = max(len(echo), 1)
                text, ids = choice.take()
                scored = None if choice.logprobs is None else _streamed_logprobs(state, kind, choice)
                if splitters is not None:  # reasoning_content and content
                    reasoning, text = splitters[choice.index].feed(text, choice.finished)
                    if reasoning or text or (wants_ids and ids):
                        chunk = protocol.chat_chunk(
                            request_id,
                            model,
                            choice.index,
                            content=text or None,
                            reasoning_content=reasoning or None,
                            token_ids=ids if wants_ids else None,
                            created=created,
                            logprobs=scored,
                        )
                        parts.append(protocol.sse(chunk))
                        tokens = True
                elif scored is not None:
                    if text or ids:
                        parts.append(fmt.event(text, ids, scored))
                        tokens = True
                elif text or (wants_ids and ids):
                    parts.append(fmt.event(text, ids))
                    tokens = True
                if choice.finished:
                    choice.reported = True
                    remaining -= 1
                    reason = protocol.openai_finish_reason(choice.finish_reason, choice.error)
                    parts.append(
                        protocol.sse(_chunk(kind, request_id, model, choice.index, "", None, reason, created))
                    )
            if parts:
                yield "".join(parts).encode()
                if tokens:
                    state.delivery.observe(job.written(time.perf_counter()))
        if req.include_usage:
            completion = sum(len(c.token_ids) for c in choices)
            yield protocol.sse(
                protocol.usage_chunk(kind, request_id, model, prompt_tokens, completion, created=created)
            ).encode()
        yield protocol.SSE_DONE.encode()
    except APIError as e:
        yield (protocol.sse(protocol.error_body(e)) + protocol.SSE_DONE).encode()
    finally:
        _release(state, job, request_id, prompt_tokens)


def _chunk(
    kind: str,
    rid: str,
    model: str,
    index: int,
    text: str,
    ids: Any,
    reason: Any,
    created: int,
    logprobs: protocol.RawJSON | None = None,
) -> dict[str, Any]:
    if kind == "chat":
        return protocol.chat_chunk(
            rid,
            model,
            index,
            content=text if reason is None else None,
            finish_reason=reason,
            token_ids=ids,
            created=created,
            logprobs=logprobs,
        )
    return protocol.completion_chunk(
        rid, model, index, text, finish_reason=reason, token_ids=ids, created=created, logprobs=logprobs
    )


def _streamed_logprobs(
    state: ServerState, kind: str, choice: Choice, echo: str | None = None
) -> protocol.RawJSON | None:
    """The `logprobs` of a streamed chunk: its new tokens' (`Choice.take_logprobs`), or with `echo`
    the prompt's (completions; None without prompt log probabilities)."""
    texts = state.token_texts
    if echo is not None:
        prompt = choice.prompt_logprobs
        return (
            None
            if prompt is None
            else protocol.RawJSON(completion_logprobs(texts, [(prompt, 0, len(prompt))])[0])
        )
    assert choice.logprobs is not None
    start, end = choice.take_logprobs()
    if kind == "chat":
        return protocol.RawJSON(chat_logprobs(texts, choice.logprobs, start, end))
    scored, choice.text_offset = completion_logprobs(
        texts, [(choice.logprobs, start, end)], choice.text_offset
    )
    return protocol.RawJSON(scored)


# ------------------------------------------------------------------------------------------------ serving


class _Server(uvicorn.Server):
    """uvicorn, with minisgl's graceful shutdown: on SIGINT/SIGTERM new requests get 503 while running
    ones finish within `shutdown_grace_s`; the rest are aborted; then the server exits (a second signal
    exits at once)."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self.exit_code = 0
        state.on_failure = self._engine_failed

    def _engine_failed(self) -> None:
        """The engine could not start or died: open requests got their errors; the server exits 1
        after a moment (so their streams can send them), for a supervisor to restart it."""
        self.exit_code = 1
        asyncio.get_event_loop().call_later(0.5, setattr, self, "should_exit", True)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.state.draining or not self.state.ready:
            super().handle_exit(sig, frame)
            return
        self.state.draining = True
        logger.info("signal %d: draining (%d requests in flight)", sig, self.state.outstanding)
        asyncio.get_event_loop().create_task(self._drain())

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.state.server.shutdown_grace_s
        while self.state.outstanding > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.state.outstanding > 0:
            logger.info("aborting %d requests still running", self.state.outstanding)
            self.state.client.abort_all()
            await asyncio.sleep(0.5)  # let their streams send the abort and end
        self.should_exit = True


def serve(explicit: dict[str, Any], config: str | None) -> None:
    """Runs the server until SIGINT/SIGTERM (`minisgl-run serve`)."""
    from minisgl.settings import EngineSettings

    settings = EngineSettings.load(config, **explicit)
    state = ServerState(settings, explicit, config)
    server = state.server
    app = create_app(state)
    uv_config = uvicorn.Config(
        app,
        host=server.host,
        port=server.port,
        http=protocol_class(server, connection_cap(server.max_connections)),
        ws="none",
        timeout_keep_alive=server.idle_timeout_s,  # type: ignore[arg-type]  (a float works)
        log_level="warning",
        timeout_graceful_shutdown=max(1, int(server.shutdown_grace_s) + 5),
        lifespan="on",
    )
    logger.info("starting at http://%s:%d (the engine loads in the background)", server.host, server.port)
    runner = _Server(uv_config, state)
    become_subreaper()  # a dead scheduler's ranks and workers are reaped here
    runner.run()
    if runner.exit_code or state.client is None or state.client.failed is not None:
        reason = "it did not start" if state.client is None else state.client.failed
        raise SystemExit(f"minisgl-run serve: the engine failed ({reason})")
