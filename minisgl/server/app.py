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
import itertools
import json
import logging
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import uvicorn
import zmq
import zmq.asyncio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from minisgl.core import SamplingParams
from minisgl.scheduler.detokenizer import IncrementalDetokenizer
from minisgl.scheduler.output import find_stop
from minisgl.server import protocol
from minisgl.server.protocol import APIError
from minisgl.server.worker import encode_params, frame_ids, ids_frame, scheduler_main

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
STOP_JOIN_S = 30.0  # how long the front end waits for the scheduler process to end at shutdown
METRICS_TIMEOUT_S = 10.0


def _set_parent_death_signal() -> None:
    """Linux: this process gets SIGKILL when its parent dies (a killed front end leaves no scheduler)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _scheduler_entry(*args: Any) -> None:
    _set_parent_death_signal()
    scheduler_main(*args)


# ---------------------------------------------------------------------------------------------- choices


@dataclass(eq=False)
class Choice:
    """One choice of one request as the front end makes it: token ids from the scheduler in, text out."""

    rid: int  # the scheduler process's name for it (the front end counts them)
    index: int
    params: SamplingParams  # the request's, with its stop strings
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    emitted: int = 0
    emitted_ids: int = 0
    finish_reason: str | None = None
    error: str | None = None

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
                break
            if self.detokenizer is not None:
                self.detokenizer.add(token)
                self.text = self.detokenizer.text
                if params.stop and len(self.token_ids) > params.min_tokens:
                    cut = find_stop(self.text, params.stop, self.emitted)
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
            upto = max(self.emitted, upto - max(map(len, self.params.stop)) + 1)
        delta = self.text[self.emitted : upto]
        self.emitted = upto
        new_ids = self.token_ids[self.emitted_ids :]
        self.emitted_ids = len(self.token_ids)
        return delta, new_ids


# ------------------------------------------------------------------------------------ scheduler client


class SchedulerClient:
    """The front end's side of the scheduler process: starts it, sends requests and aborts, and routes
    each step's tokens to the choices waiting for them."""

    def __init__(self, settings: dict[str, Any], config: str | None) -> None:
        self.settings, self.config = settings, config
        self.info: dict[str, Any] | None = None
        self.failed: str | None = None
        self.on_failure: Any = None  # called once when the scheduler process fails or dies
        self.ready = asyncio.Event()
        self.choices: dict[int, tuple[Choice, asyncio.Queue]] = {}
        self.rids = itertools.count()
        self._answers: dict[int, asyncio.Future] = {}  # `_ask` questions waiting for the scheduler
        self._ids = itertools.count()
        self._dir = tempfile.mkdtemp(prefix="minisgl-serve-")  # private (0700): the sockets live here
        self._ctx = zmq.asyncio.Context()
        self._out = self._ctx.socket(zmq.PUSH)
        self._in = self._ctx.socket(zmq.PULL)
        inbox, outbox = f"ipc://{self._dir}/requests", f"ipc://{self._dir}/tokens"
        self._out.bind(inbox)
        self._in.bind(outbox)
        self.proc = mp.get_context("spawn").Process(
            target=_scheduler_entry,
            args=(dict(settings), config, inbox, outbox, os.getpid()),
            name="minisgl-scheduler",
        )
        self.proc.start()
        self._tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._watch())]

    # -- to the scheduler

    def add(self, choice: Choice, prompt_ids: list[int], queue: asyncio.Queue) -> None:
        """Queues `choice` in the scheduler; its progress is put on `queue` (one per request)."""
        self.choices[choice.rid] = (choice, queue)
        params = replace(choice.params, stop=())  # stop strings are found here
        self._send({"op": "add", "rid": choice.rid, "params": encode_params(params)}, ids_frame(prompt_ids))

    def abort(self, rid: int) -> None:
        if self.choices.pop(rid, None) is not None:
            self._send({"op": "abort", "rid": rid})

    async def metrics(self) -> str:
        """The scheduler process's Prometheus series, as text."""
        return (await self._ask("metrics"))["text"]

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

    async def _read(self) -> None:
        while True:
            frames = await self._in.recv_multipart()
            header = json.loads(frames[0])
            op = header["op"]
            if op == "step":
                served, tokens = frame_ids(frames[1]), frame_ids(frames[2])
                counts = header["n"]
                done = {row: (reason, error) for row, reason, error in header["done"]}
                at = 0
                for row, rid in enumerate(served):
                    n = 1 if counts is None else counts[row]
                    ids, at = tokens[at : at + n], at + n
                    entry = self.choices.get(rid)
                    if entry is None:
                        continue
                    choice, queue = entry
                    finished = row in done
                    reason, error = done.get(row, (None, None))
                    if choice.feed(ids, finished, reason, error):
                        self.abort(rid)  # a stop string: the scheduler frees its pages
                    elif finished:
                        self.choices.pop(rid, None)
                    queue.put_nowait(choice)
            elif op == "rejected":
                entry = self.choices.pop(header["rid"], None)
                if entry is not None:
                    entry[0].end("rejected", header["error"])
                    entry[1].put_nowait(entry[0])
            elif op in ("metrics", "flush"):  # answers to `_ask`
                future = self._answers.get(header["id"])
                if future is not None and not future.done():
                    future.set_result(header)
            elif op == "ready":
                self.info = header
                self.ready.set()
            elif op == "failed":
                self._fail(header["error"])

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
        for choice, queue in self.choices.values():
            choice.end("error", error)
            queue.put_nowait(choice)
        self.choices.clear()
        if self.on_failure is not None:
            self.on_failure()

    def abort_all(self) -> None:
        """Ends every unfinished choice with finish reason "abort" (shutdown) and aborts it."""
        for rid, (choice, queue) in list(self.choices.items()):
            self.abort(rid)
            choice.end("abort")
            queue.put_nowait(choice)

    async def close(self) -> None:
        """Stops the scheduler process (which stops the ranks it spawned) and waits for it."""
        for task in self._tasks:
            task.cancel()
        with contextlib.suppress(zmq.ZMQError, asyncio.TimeoutError):  # no peer: the process is gone
            await asyncio.wait_for(self._out.send_multipart([json.dumps({"op": "stop"}).encode()]), 1.0)
        await asyncio.to_thread(self.proc.join, STOP_JOIN_S)
        if self.proc.is_alive():
            self.proc.kill()
            await asyncio.to_thread(self.proc.join, 5)
        self._out.close(linger=0)
        self._in.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)


# ----------------------------------------------------------------------------------------------- the app


class ServerState:
    """What the endpoints share: the scheduler client, the tokenizers, the limits."""

    def __init__(self, settings: Any, explicit: dict[str, Any], config: str | None) -> None:
        self.server = settings.to_server_config()
        self.explicit, self.config = explicit, config
        self.client: SchedulerClient | None = None
        self.served_model = self.server.served_model_name
        self.encoder: Any = None  # tokenizer used by the tokenizing thread
        self.decoder: Any = None  # tokenizer used on the event loop (detokenizing)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="minisgl-tokenize")
        self.outstanding = 0  # choices admitted by the front end and not finished
        self.draining = False
        self.limit = 0
        self.on_failure: Any = None

    async def start(self) -> None:
        self.client = SchedulerClient(self.explicit, self.config)
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
        self.limit = info["max_running_req"] + self.server.max_waiting_requests
        self.ready = True
        logger.info("serving %s at http://%s:%d/v1", self.served_model, self.server.host, self.server.port)

    ready = False

    async def tokenize(self, fn: Any) -> list[int]:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn)


def _error(e: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(protocol.error_body(e), status_code=e.status, headers=headers)


async def _read_body(request: Request, limit: int) -> bytes:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise APIError(f"the request body has {length} bytes, more than the limit of {limit}", status=413)
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise APIError(f"the request body is larger than the limit of {limit} bytes", status=413)
    return bytes(body)


def create_app(state: ServerState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.start()
        try:
            yield
        finally:
            if state.client is not None:
                await state.client.close()
            state.pool.shutdown(wait=False)

    app = FastAPI(title="minisgl", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.middleware("http")
    async def guard(request: Request, call_next: Any) -> Response:
        if request.url.path.startswith("/v1/") or request.url.path == "/flush_cache":
            key = state.server.api_key
            if key is not None:
                given = request.headers.get("authorization", "")
                if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
                    return _error(
                        APIError(
                            "a valid API key is required: send the header Authorization: Bearer KEY",
                            status=401,
                            code="invalid_api_key",
                        )
                    )
        return await call_next(request)

    @app.get("/health")
    async def health() -> Response:
        client = state.client
        if client is not None and client.failed is not None:
            return JSONResponse({"status": "failed", "error": client.failed}, status_code=503)
        if not state.ready:
            return JSONResponse({"status": "starting"}, status_code=503)
        if state.draining:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        if not state.ready or state.client.failed is not None:
            return PlainTextResponse("# the engine is not running\n", status_code=503)
        text = await state.client.metrics()
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/flush_cache")
    async def flush_cache() -> Response:
        if not state.ready or state.client.failed is not None:
            return JSONResponse({"error": "the engine is not running"}, status_code=503)
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

    return app


def _unavailable(state: ServerState) -> APIError | None:
    client = state.client
    if client is not None and client.failed is not None:
        return APIError(f"the engine failed: {client.failed}", status=503, type="server_error")
    if not state.ready:
        return APIError(
            "the server is starting; retry when GET /health answers 200", status=503, type="server_error"
        )
    if state.draining:
        return APIError("the server is shutting down", status=503, type="server_error")
    return None


async def _generate(state: ServerState, request: Request, kind: str) -> Response:
    try:
        unavailable = _unavailable(state)
        if unavailable is not None:
            raise unavailable
        body = protocol.load_json(await _read_body(request, state.server.max_request_bytes))
        if kind == "chat":
            req = protocol.parse_chat_request(body, state.served_model)
        else:
            req = protocol.parse_completion_request(body, state.served_model)
        prompt_ids = await _prompt_ids(state, req, kind)
        params = protocol.sampling_params(req, len(prompt_ids), state.client.info["max_context"])
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
    except APIError as e:
        return _error(e, {"Retry-After": "1"} if e.status == 503 else None)
    request_id = protocol.new_request_id(kind)
    choices = [
        Choice(
            next(state.client.rids), i, p, IncrementalDetokenizer(state.decoder) if state.decoder else None
        )
        for i, p in enumerate(params)
    ]
    queue: asyncio.Queue = asyncio.Queue()
    state.outstanding += len(choices)
    for choice in choices:
        state.client.add(choice, prompt_ids, queue)
    created = int(time.time())
    if req.stream:
        return StreamingResponse(
            _stream(state, req, kind, request_id, created, choices, queue, len(prompt_ids)),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    try:
        await _wait_all(choices, queue)
        respond = protocol.chat_response if kind == "chat" else protocol.completion_response
        return JSONResponse(
            respond(
                request_id,
                state.served_model,
                len(prompt_ids),
                [_Generation(c) for c in choices],
                return_token_ids=req.wants_token_ids,
                created=created,
            )
        )
    except APIError as e:
        return _error(e)
    finally:
        _release(state, choices)


@dataclass
class _Generation:
    choice: Choice

    @property
    def text(self) -> str:
        return self.choice.text

    @property
    def token_ids(self) -> list[int]:
        return self.choice.token_ids

    @property
    def finish_reason(self) -> str:
        return self.choice.finish_reason or "error"

    @property
    def error(self) -> str | None:
        return self.choice.error


def _check_rejected(choice: Choice) -> None:
    if choice.finish_reason == "rejected":
        raise protocol.invalid_request(ValueError(choice.error))


async def _wait_all(choices: list[Choice], queue: asyncio.Queue) -> None:
    while not all(c.finished for c in choices):
        _check_rejected(await queue.get())
    for c in choices:
        _check_rejected(c)


def _release(state: ServerState, choices: list[Choice]) -> None:
    """Aborts the unfinished choices (a client gone mid-stream) and frees their queue slots."""
    for choice in choices:
        if not choice.finished:
            choice.end("abort")
            state.client.abort(choice.rid)
        else:
            state.client.choices.pop(choice.rid, None)
    state.outstanding -= len(choices)


async def _prompt_ids(state: ServerState, req: Any, kind: str) -> list[int]:
    if kind == "chat":
        tok = state.encoder
        if tok is None or not tok.chat_template:
            raise APIError("this model has no chat template: use /v1/completions", param="messages")

        def encode() -> list[int]:
            text = tok.apply_chat_template(req.messages, add_generation_prompt=True, tokenize=False)
            return tok(text, add_special_tokens=False)["input_ids"]

        return await state.tokenize(encode)
    if isinstance(req.prompt, str):
        tok = state.encoder
        if tok is None:
            raise APIError("this model has no tokenizer: send the prompt as token ids", param="prompt")
        return await state.tokenize(lambda: tok(req.prompt)["input_ids"])
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
    choices: list[Choice],
    queue: asyncio.Queue,
    prompt_tokens: int,
) -> AsyncIterator[str]:
    model = state.served_model
    wants_ids = req.wants_token_ids
    try:
        if kind == "chat":
            for c in choices:
                yield protocol.sse(
                    protocol.chat_chunk(
                        request_id, model, c.index, role="assistant", content="", created=created
                    )
                )
        done: set[int] = set()
        while len(done) < len(choices):
            choice = await queue.get()
            if choice.index in done:
                continue
            if choice.finish_reason == "rejected":
                raise protocol.invalid_request(ValueError(choice.error))
            text, ids = choice.take()
            if text or (wants_ids and ids):
                yield protocol.sse(
                    _chunk(
                        kind, request_id, model, choice.index, text, ids if wants_ids else None, None, created
                    )
                )
            if choice.finished:
                done.add(choice.index)
                reason = protocol.openai_finish_reason(choice.finish_reason, choice.error)
                yield protocol.sse(_chunk(kind, request_id, model, choice.index, "", None, reason, created))
        if req.include_usage:
            completion = sum(len(c.token_ids) for c in choices)
            yield protocol.sse(
                protocol.usage_chunk(kind, request_id, model, prompt_tokens, completion, created=created)
            )
        yield protocol.SSE_DONE
    except APIError as e:
        yield protocol.sse(protocol.error_body(e))
        yield protocol.SSE_DONE
    finally:
        _release(state, choices)


def _chunk(
    kind: str, rid: str, model: str, index: int, text: str, ids: Any, reason: Any, created: int
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
        )
    return protocol.completion_chunk(
        rid, model, index, text, finish_reason=reason, token_ids=ids, created=created
    )


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
        log_level="warning",
        timeout_graceful_shutdown=max(1, int(server.shutdown_grace_s) + 5),
        lifespan="on",
    )
    logger.info("starting at http://%s:%d (the engine loads in the background)", server.host, server.port)
    runner = _Server(uv_config, state)
    runner.run()
    if runner.exit_code or state.client is None or state.client.failed is not None:
        reason = "it did not start" if state.client is None else state.client.failed
        raise SystemExit(f"minisgl-run serve: the engine failed ({reason})")
