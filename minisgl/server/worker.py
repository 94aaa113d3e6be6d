"""The server's scheduler process: rank 0's engine and scheduler (and, under tensor parallelism, the
other ranks it spawns), fed by the front end over ZeroMQ. It never touches HTTP, JSON bodies or text.

Messages are a JSON header plus raw int64 frames, nothing unpickled; the scheduler's go back over a Unix
stream socket (`Outbox`) that it never waits on. The messages and why: docs/server.md ("Processes").
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import signal
import socket
import struct
import time
from array import array
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from typing import Any

import zmq

from minisgl.core import FATAL_ERRORS, SamplingParams, TokenLogprobs
from minisgl.multimodal.inputs import ImageInputs

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 50  # how long an idle scheduler waits for a message before checking its parent again
BACKLOG_POLL_MS = 1  # ... while messages to the front end wait in its outbox's backlog


def set_parent_death_signal() -> None:
    """Linux: this process gets SIGKILL when its parent dies (a killed front end leaves no scheduler
    and no tokenizer process)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def encode_params(params: SamplingParams) -> dict[str, Any]:
    return asdict(params)


def decode_params(data: dict[str, Any]) -> SamplingParams:
    data = dict(data)
    data["stop"] = tuple(data.get("stop", ()))
    data["stop_token_ids"] = tuple(data.get("stop_token_ids", ()))
    return SamplingParams(**data)


def ids_frame(ids: list[int]) -> bytes:
    return array("q", ids).tobytes()


def frame_ids(frame: bytes, typecode: str = "q") -> list[Any]:
    """`ids_frame`'s ids again (typecode "d": float64 numbers)."""
    ids = array(typecode)
    ids.frombytes(frame)
    return ids.tolist()


class LogprobFrames:
    """A step's log probabilities in four frames, block after block (a block: a served row's prompt
    entries, or its new tokens'): per block [row, 1 for tokens or 0 for the prompt, entries, k] (int64),
    then each entry's log probability (float64), its k alternatives' ids (int64) and their log
    probabilities (float64). Token ids are not sent: they are the step's, or the prompt's."""

    def __init__(self) -> None:
        self.blocks: list[int] = []
        self.values: list[float] = []
        self.top_ids: list[int] = []
        self.top_values: list[float] = []

    def add(self, row: int, tokens: bool, entries: TokenLogprobs, n: int) -> None:
        """The last `n` entries of `entries`, as row `row`'s new tokens' or its prompt's."""
        k = entries.k
        self.blocks += (row, tokens, n, k)
        self.values += entries.values[len(entries.values) - n :]
        self.top_ids += entries.top_ids[len(entries.top_ids) - n * k :]
        self.top_values += entries.top_values[len(entries.top_values) - n * k :]

    def frames(self) -> tuple[bytes, ...]:
        floats = array("d", self.values).tobytes(), array("d", self.top_values).tobytes()
        return ids_frame(self.blocks), floats[0], ids_frame(self.top_ids), floats[1]


def read_logprobs(frames: list[bytes]) -> Iterator[tuple[int, bool, list[float], list[int], list[float]]]:
    """`LogprobFrames`' blocks: (row, tokens or prompt, log probabilities, alternatives' ids, theirs)."""
    blocks, values, top_ids = frame_ids(frames[0]), frame_ids(frames[1], "d"), frame_ids(frames[2])
    top_values = frame_ids(frames[3], "d")
    at = top = 0
    for b in range(0, len(blocks), 4):
        row, tokens, n, k = blocks[b : b + 4]
        yield (
            row,
            bool(tokens),
            values[at : at + n],
            top_ids[top : top + n * k],
            top_values[top : top + n * k],
        )
        at, top = at + n, top + n * k


def pack(header: dict[str, Any], *frames: bytes) -> bytes:
    """One message on a stream: its length, the number of frames and each frame's length (little-endian
    uint32s), then the frames, the JSON header first."""
    parts = [json.dumps(header).encode(), *frames]
    head = struct.pack(f"<{len(parts) + 1}I", len(parts), *map(len, parts))
    return struct.pack("<I", len(head) + sum(map(len, parts))) + head + b"".join(parts)


def unpack(message: bytes) -> list[bytes]:
    """The frames of a message `pack` made (without its leading length)."""
    (count,) = struct.unpack_from("<I", message)
    lengths = struct.unpack_from(f"<{count}I", message, 4)
    frames, at = [], 4 + 4 * count
    for length in lengths:
        frames.append(message[at : at + length])
        at += length
    return frames


class Outbox:
    """The scheduler's messages to the front end, on a Unix stream socket that never blocks a step:
    what the socket does not take now waits in `backlog`, sent first next time (`flush`)."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self.sock.setblocking(False)
        self.backlog = bytearray()

    def send(self, header: dict[str, Any], *frames: bytes) -> None:
        data = pack(header, *frames)
        if self.backlog:
            self.backlog += data
            self.flush()
            return
        try:
            sent = self.sock.send(data)
        except BlockingIOError:
            sent = 0
        if sent < len(data):
            self.backlog += data[sent:]

    def flush(self) -> None:
        while self.backlog:
            try:
                sent = self.sock.send(self.backlog)
            except BlockingIOError:
                return
            del self.backlog[:sent]

    def close(self, timeout: float = 1.0) -> None:
        """Sends what is left (for at most `timeout` seconds: the last messages reach the front end)."""
        with contextlib.suppress(OSError):
            self.sock.settimeout(timeout)
            self.sock.sendall(self.backlog)
        self.sock.close()


def scheduler_main(
    settings: dict[str, Any], config: str | None, inbox_addr: str, outbox_path: str, parent: int
) -> None:
    """Entry point of the scheduler process (spawned by the front end, whose pid is `parent`: when it
    is gone this process stops, and with it the ranks it spawned)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("TQDM_DISABLE", "1")
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(inbox_addr)
    outbox = Outbox(outbox_path)
    llm = None
    try:
        from minisgl.llm import LLM

        model = settings.pop("model_path", None)
        llm = LLM(model, config=config, detokenize=False, **settings)
        engine = llm.engine
        outbox.send(
            {
                "op": "ready",
                "model_path": engine.config.model_path,
                "model_name": llm.model_name,
                "max_context": engine.max_seq_len,
                "max_running_req": engine.config.max_running_req,
                "vocab_size": engine.config.model_config.vocab_size,
                "eos_token_ids": sorted(llm.scheduler.output.eos_token_ids),
                "hidden_size": engine.config.model_config.hidden_size,
                "pooling": llm.pooling,
                "pooling_error": llm.pooling_error,
                "normalize_embeddings": llm.normalize_embeddings,
                "lora_modules": _adapters(llm),
            },
        )
        _serve(llm, inbox, outbox, parent)
    except BaseException as e:  # the front end reports it (health stays 503, requests fail)
        logger.exception("the scheduler process failed")
        with contextlib.suppress(OSError):
            outbox.send({"op": "failed", "error": f"{type(e).__name__}: {e}"})
        raise SystemExit(1) from e
    finally:
        if llm is not None:
            llm.shutdown()
        inbox.close(linger=0)
        outbox.close()
        ctx.term()


def _adapters(llm: Any) -> dict[str, str]:
    """The LoRA adapters loaded: name -> path."""
    lora = llm.scheduler.lora
    return {} if lora is None else {name: loaded.adapter.path for name, loaded in lora.by_name.items()}


def _lora_answer(header: dict[str, Any], change: Any, *args: Any) -> dict[str, Any]:
    """The answer to a load_lora / unload_lora question once `change(*args)` ran: its error (None: done) and
    the HTTP status that goes with it (404: no such adapter; 400: anything else wrong)."""
    answer = {"op": header["op"], "id": header["id"], "error": None, "status": 200}
    try:
        change(*args)
    except KeyError as e:
        answer |= {"error": e.args[0] if e.args else str(e), "status": 404}
    except (ValueError, OSError) as e:  # LoraError (a ValueError) names what is wrong
        answer |= {"error": str(e), "status": 400}
    return answer


class _LoraReads:
    """Runtime loads of LoRA adapters: each adapter's files are read on a thread while steps go on,
    then it is added to the scheduler between steps (`finished`)."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.pending: list[tuple[dict[str, Any], Future]] = []
        self._pool: ThreadPoolExecutor | None = None

    def start(self, header: dict[str, Any]) -> dict[str, Any] | None:
        """Starts reading the adapter of a load_lora question; its answer now if it is refused at once."""
        name, path, scheduler = header["name"], header["path"], self.scheduler
        refused = _lora_answer(header, scheduler.check_new_lora, name)
        if refused["error"] is not None:
            return refused
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="minisgl-lora")
        self.pending.append((header, self._pool.submit(scheduler.engine.read_lora, name, path)))
        return None

    def finished(self) -> list[dict[str, Any]]:
        """The answers of the loads whose reading ended (each adapter added to the scheduler, in order)."""
        answers = []
        while self.pending and self.pending[0][1].done():
            header, future = self.pending.pop(0)
            answers.append(_lora_answer(header, self._add, header, future))
        return answers

    def _add(self, header: dict[str, Any], read: Future) -> None:
        self.scheduler.load_lora(header["name"], header["path"], read.result())

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _serve(llm: Any, inbox: zmq.Socket, outbox: Outbox, parent: int) -> None:
    """The loop: take every message waiting, run one step if there is work, send its tokens."""
    reads = _LoraReads(llm.scheduler)
    try:
        _loop(llm.scheduler, inbox, outbox, parent, reads)
    finally:
        reads.close()


def _loop(scheduler: Any, inbox: zmq.Socket, outbox: Outbox, parent: int, reads: _LoraReads) -> None:
    states: dict[int, Any] = {}  # rid -> RequestState of the unfinished requests
    rids: dict[int, int] = {}  # uid -> rid
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    embeds: dict[int, list[Any]] = {}  # rid -> the RequestStates of an embeddings request's inputs
    next_parent_check = 0.0
    while True:
        now = time.monotonic()
        if now >= next_parent_check:
            if os.getppid() != parent:
                logger.warning("the front end (pid %d) is gone: stopping", parent)
                return
            next_parent_check = now + 1.0
        if outbox.backlog:
            outbox.flush()
        # idle: wait for a message, or (a backlog for the front end) for its socket to take more
        waiting = outbox.backlog or reads.pending
        timeout = 0 if scheduler.has_work() else BACKLOG_POLL_MS if waiting else IDLE_POLL_MS
        if poller.poll(timeout):
            while True:
                try:
                    frames = inbox.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                header = json.loads(frames[0])
                op = header["op"]
                if op == "stop":
                    return
                if op == "add":
                    rid = header["rid"]
                    try:
                        ids, params = frame_ids(frames[1]), decode_params(header["params"])
                        # a third frame: the prompt's images (minisgl.multimodal.inputs, docs/vision.md)
                        images = ImageInputs.from_bytes(frames[2]) if len(frames) > 2 else None
                        state = scheduler.add_request(ids, params, lora=header.get("lora"), images=images)
                    except (TypeError, ValueError) as e:
                        outbox.send({"op": "rejected", "rid": rid, "error": str(e)})
                        continue
                    except KeyError as e:  # its LoRA adapter was unloaded after the front end checked it
                        outbox.send({"op": "rejected", "rid": rid, "error": e.args[0], "status": 404})
                        continue
                    states[rid] = state
                    rids[state.uid] = rid
                elif op == "embed":
                    embed_request(scheduler, header, frames[1], embeds, outbox)
                elif op == "abort":
                    state = states.pop(header["rid"], None)
                    if state is not None:
                        rids.pop(state.uid, None)
                        scheduler.abort(state)
                elif op == "metrics":
                    from prometheus_client import generate_latest

                    from minisgl import metrics

                    text = generate_latest(metrics.REGISTRY).decode()
                    outbox.send({"op": "metrics", "id": header["id"], "text": text})
                elif op == "flush":
                    outbox.send({"op": "flush", "id": header["id"], "pages": scheduler.clear_prefix_cache()})
                elif op == "load_lora":
                    refused = reads.start(header)
                    if refused is not None:
                        outbox.send(refused)
                elif op == "unload_lora":
                    outbox.send(_lora_answer(header, scheduler.unload_lora, header["name"]))
        for answer in reads.finished():
            outbox.send(answer)
        if not scheduler.has_work():
            continue
        try:
            updates = scheduler.step()
        except FATAL_ERRORS:
            raise
        if embeds:
            send_embeddings(embeds, outbox)
        if not updates:
            continue
        message = step_message(updates, rids, states, scheduler.tokens_time)
        if message is not None:
            outbox.send(*message)


def embed_request(
    scheduler: Any, header: dict[str, Any], frame: bytes, embeds: dict[int, list[Any]], outbox: Outbox
) -> None:
    """Queues an embeddings request's inputs together (the front end sent their ids in one frame,
    `header["lens"]` each), all checked before any is queued; a bad one rejects the request."""
    rid, params, ids = header["rid"], decode_params(header["params"]), frame_ids(frame)
    starts = [0, *itertools.accumulate(header["lens"])]
    inputs = [ids[a:b] for a, b in zip(starts, starts[1:])]
    try:
        for i, item in enumerate(inputs):
            try:
                scheduler.check_request(item, params)
            except ValueError as e:
                raise ValueError(f"input[{i}]: {e}") from None
    except (TypeError, ValueError) as e:
        outbox.send({"op": "embedded", "rid": rid, "error": str(e)})
        return
    embeds[rid] = [scheduler.add_request(item, params) for item in inputs]


def send_embeddings(embeds: dict[int, list[Any]], outbox: Outbox) -> None:
    """Sends each embeddings request whose inputs have all finished: their pooled vectors as one float32
    frame, input after input (or the error of the first that failed)."""
    for rid, states in list(embeds.items()):
        if not all(state.finished for state in states):
            continue
        del embeds[rid]
        failed = next((i for i, state in enumerate(states) if state.embedding is None), None)
        if failed is not None:
            state = states[failed]
            error = f"input[{failed}] failed: {state.error or state.finish_reason}"
            outbox.send({"op": "embedded", "rid": rid, "error": error})
            continue
        vectors = b"".join(state.embedding.tobytes() for state in states)  # float32 arrays, in order
        outbox.send({"op": "embedded", "rid": rid, "error": None}, vectors)


def step_message(
    updates: list[Any], rids: dict[int, int], states: dict[int, Any], tokens_time: float
) -> tuple[Any, ...] | None:
    """A step's message to the front end (its header, then its frames) from the step's updates; None
    when none of their requests is still wanted. Finished requests leave `states` and `rids`."""
    served, counts, tokens, done = [], [], [], []
    scored = LogprobFrames()
    for update in updates:
        state = update.state
        rid = rids.get(state.uid)
        if rid is None:  # aborted meanwhile
            continue
        if update.finished:
            times = [state.arrival_time, state.admit_time, state.first_token_time, state.finish_time]
            spec = [state.spec_drafted, state.spec_accepted]  # speculative decoding's, per request
            done.append([len(served), state.finish_reason, state.error, times, spec])
            states.pop(rid, None)
            rids.pop(state.uid, None)
        if update.prompt_logprobs is not None:
            prompt = update.prompt_logprobs
            scored.add(len(served), False, prompt, len(prompt.values))
        if update.logprobs is not None:
            scored.add(len(served), True, update.logprobs, len(update.token_ids))
        served.append(rid)
        counts.append(len(update.token_ids))
        tokens += update.token_ids
    if not served:
        return None
    n = None if all(c == 1 for c in counts) else counts
    header = {"op": "step", "t": tokens_time, "s": time.perf_counter(), "n": n, "done": done}
    frames = ids_frame(served), ids_frame(tokens), *(scored.frames() if scored.blocks else ())
    return header, *frames
