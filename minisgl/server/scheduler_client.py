"""The front end's side of one scheduler process (`minisgl.server.worker`): `SchedulerClient` starts
it, sends it requests, aborts and questions over ZeroMQ, and routes each step's tokens (read from a
Unix stream socket by `_Inbox`, in the event loop's callback) to the choices (`minisgl.server.jobs`)
waiting for them. A failed or dead process ends every choice it held with "engine_died". Data
parallelism runs one client per replica (`minisgl.server.replicas`).
"""

from __future__ import annotations

import asyncio
import contextlib
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
from array import array
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import zmq
import zmq.asyncio

from minisgl.core import SamplingParams
from minisgl.launch.tp import exit_now
from minisgl.server.jobs import Choice
from minisgl.server.replicas import kill_process_group
from minisgl.server.worker import (
    encode_params,
    frame_ids,
    ids_frame,
    read_logprobs,
    scheduler_main,
    set_parent_death_signal,
    unpack,
)

logger = logging.getLogger(__name__)

STOP_JOIN_S = 30.0  # how long the front end waits for the scheduler process to end at shutdown
METRICS_TIMEOUT_S = 10.0
LORA_TIMEOUT_S = 600.0  # loading a LoRA adapter (a hub id is downloaded first)


def _scheduler_entry(devices: str | None, *args: Any) -> None:
    set_parent_death_signal()
    # the leader of a process group of its own: it, the ranks it spawns and their workers are killed
    # together when it dies (`kill_process_group`)
    os.setpgid(0, 0)
    # a terminal's Ctrl-C reaches the whole process group: the front end drains, then stops this one
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if devices is not None:  # a data-parallel replica's GPUs (before anything here touches CUDA)
        os.environ["CUDA_VISIBLE_DEVICES"] = devices
    scheduler_main(*args)  # raises SystemExit(1) when the engine fails
    exit_now()


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
        self.adapters: dict[str, str] = {}  # the LoRA adapters loaded: name -> path, in the order loaded
        self.failed: str | None = None
        self.on_failure: Any = None  # called once when the scheduler process fails or dies
        self.ready = asyncio.Event()
        self.choices: dict[int, Choice] = {}  # by rid, until finished
        self.rids = itertools.count()
        self._answers: dict[int, asyncio.Future] = {}  # `_ask` questions waiting for the scheduler
        self._metrics: asyncio.Future | None = None  # the metrics question in flight
        self._embeds: dict[int, asyncio.Future] = {}  # embeddings requests waiting for their vectors
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
        header = {"op": "add", "rid": choice.rid, "params": encode_params(params)}
        lora = getattr(choice.job, "lora", None)
        if lora is not None:
            header["lora"] = lora
        images = getattr(choice.job, "images", None)  # a third frame: the prompt's images (docs/vision.md)
        self._send(header, prompt, *([images] if images is not None else []))

    async def embed(self, inputs: list[list[int]], params: SamplingParams) -> list[list[float]]:
        """The pooled vectors of an embeddings request's inputs, queued in the scheduler together
        (one message); a ValueError with the scheduler's reason when it refuses or fails them."""
        rid = next(self.rids)
        future = asyncio.get_running_loop().create_future()
        self._embeds[rid] = future
        lens = [len(item) for item in inputs]
        self.load_tokens += sum(lens)
        try:
            header = {"op": "embed", "rid": rid, "params": encode_params(params), "lens": lens}
            self._send(header, ids_frame([t for item in inputs for t in item]))
            if self.failed is not None:
                raise RuntimeError(self.failed)
            error, frame = await future
        finally:
            self._embeds.pop(rid, None)
            self.load_tokens -= sum(lens)
        if error is not None:
            raise ValueError(error)
        values = array("f")
        values.frombytes(frame)
        size = len(values) // len(inputs)
        return [values[i * size : (i + 1) * size].tolist() for i in range(len(inputs))]

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

    async def load_lora(self, name: str, path: str) -> dict[str, Any]:
        """Loads a LoRA adapter in the scheduler process: its answer, {"error": None} or the error and
        its HTTP status."""
        answer = await self._ask("load_lora", LORA_TIMEOUT_S, name=name, path=path)
        if answer["error"] is None:
            self.adapters[name] = path
        return answer

    async def unload_lora(self, name: str) -> dict[str, Any]:
        """Unloads a LoRA adapter in the scheduler process (`load_lora`'s answer)."""
        answer = await self._ask("unload_lora", LORA_TIMEOUT_S, name=name)
        if answer["error"] is None:
            self.adapters.pop(name, None)
        return answer

    async def _ask(self, op: str, timeout: float = METRICS_TIMEOUT_S, **fields: Any) -> dict[str, Any]:
        """Sends a question to the scheduler process and waits for its answer (same op and id)."""
        key = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._answers[key] = future
        self._send({"op": op, "id": key, **fields})
        try:
            return await asyncio.wait_for(future, timeout)
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
                choice.rejected_status = header.get("status", 400)
                choice.job.wake.set()
        elif op == "embedded":
            future = self._embeds.get(header["rid"])
            if future is not None and not future.done():
                future.set_result((header["error"], frames[1] if len(frames) > 1 else b""))
        elif op in ("metrics", "flush", "load_lora", "unload_lora"):  # answers to `_ask`
            future = self._answers.get(header["id"])
            if future is not None and not future.done():
                future.set_result(header)
        elif op == "ready":
            self.info = header
            self.adapters = dict(header["lora_modules"])
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
                reason, error, choice.times, choice.spec = done[row]
                stopped = choice.feed(ids, True, reason, error)
            else:
                stopped = choice.feed(ids, False, None, None)
            if stopped:
                self.abort(rid)  # a stop string: the scheduler frees its pages
            elif finished:
                choices.pop(rid, None)
            choice.job.news(step_time, sent, now)

    async def _watch(self) -> None:
        """Fails the client when the scheduler process exits: at once when its sentinel turns readable,
        else (a process it forked holds the sentinel open) at the next check, every 0.5 s."""
        loop = asyncio.get_running_loop()
        exited = loop.create_future()
        sentinel = self.proc.sentinel
        loop.add_reader(sentinel, lambda: exited.done() or exited.set_result(None))
        try:
            while self.proc.is_alive():
                if exited.done():  # its end of the sentinel closed: it is exiting
                    self.proc.join()
                    break
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(asyncio.shield(exited), 0.5)
        finally:
            loop.remove_reader(sentinel)
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
        for future in self._embeds.values():
            if not future.done():
                future.set_exception(RuntimeError(error))
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
