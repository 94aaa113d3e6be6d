"""The server's scheduler process: rank 0's engine and scheduler (and, under tensor parallelism, the
other ranks it spawns), fed by the front end over ZeroMQ. It never touches HTTP, JSON bodies or the
tokenizer's text: requests arrive as token ids and sampling parameters, and each step's new token ids go
back in one message.

Messages (plain data: a JSON header, token ids as raw int64 frames; nothing is unpickled):

front end -> scheduler
    {"op": "add", "rid": int, "params": {...}} + prompt ids    queue a request (stop strings stay in
                                                               the front end, which makes the text)
    {"op": "abort", "rid": int}                                finish it now, freeing its pages
    {"op": "metrics", "id": int}                               the scheduler's Prometheus series
    {"op": "flush", "id": int}                                 empty the prefix cache
    {"op": "stop"}                                             shut down
scheduler -> front end
    {"op": "ready", ...the facts the front end needs}          once, when the engine is up
    {"op": "step", "n": [...] or null, "done": [[row, reason, error], ...]} + rids + token ids
                                                               one step: the rids of the requests it
                                                               served (int64), their new tokens (n[i]
                                                               each; null: one each), which finished
    {"op": "rejected", "rid": int, "error": str}               a request the engine cannot run
    {"op": "metrics", "id": int, "text": str}
    {"op": "flush", "id": int, "pages": int}                   the KV pages the flush freed
    {"op": "failed", "error": str}                             the engine could not start, or died
"""

from __future__ import annotations

import json
import logging
import os
import time
from array import array
from dataclasses import asdict
from typing import Any

import zmq

from minisgl.core import FATAL_ERRORS, SamplingParams

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 50  # how long an idle scheduler waits for a message before checking its parent again


def encode_params(params: SamplingParams) -> dict[str, Any]:
    return asdict(params)


def decode_params(data: dict[str, Any]) -> SamplingParams:
    data = dict(data)
    data["stop"] = tuple(data.get("stop", ()))
    data["stop_token_ids"] = tuple(data.get("stop_token_ids", ()))
    return SamplingParams(**data)


def ids_frame(ids: list[int]) -> bytes:
    return array("q", ids).tobytes()


def frame_ids(frame: bytes) -> list[int]:
    ids = array("q")
    ids.frombytes(frame)
    return ids.tolist()


def _send(sock: zmq.Socket, header: dict[str, Any], *frames: bytes) -> None:
    sock.send_multipart([json.dumps(header).encode(), *frames])


def scheduler_main(
    settings: dict[str, Any], config: str | None, inbox_addr: str, outbox_addr: str, parent: int
) -> None:
    """Entry point of the scheduler process (spawned by the front end, whose pid is `parent`: when it
    is gone this process stops, and with it the ranks it spawned)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("TQDM_DISABLE", "1")
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(inbox_addr)
    outbox = ctx.socket(zmq.PUSH)
    outbox.connect(outbox_addr)
    llm = None
    try:
        from minisgl.llm import LLM

        model = settings.pop("model_path", None)
        llm = LLM(model, config=config, detokenize=False, **settings)
        engine = llm.engine
        _send(
            outbox,
            {
                "op": "ready",
                "model_path": engine.config.model_path,
                "model_name": llm.model_name,
                "max_context": engine.max_seq_len,
                "max_running_req": engine.config.max_running_req,
                "vocab_size": engine.config.model_config.vocab_size,
                "eos_token_ids": sorted(llm.scheduler.output.eos_token_ids),
            },
        )
        _serve(llm, inbox, outbox, parent)
    except BaseException as e:  # the front end reports it (health stays 503, requests fail)
        logger.exception("the scheduler process failed")
        try:
            _send(outbox, {"op": "failed", "error": f"{type(e).__name__}: {e}"})
        except zmq.ZMQError:
            pass
        raise SystemExit(1) from e
    finally:
        if llm is not None:
            llm.shutdown()
        inbox.close(linger=0)
        outbox.close(linger=1000)  # let the last messages reach the front end
        ctx.term()


def _serve(llm: Any, inbox: zmq.Socket, outbox: zmq.Socket, parent: int) -> None:
    """The loop: take every message waiting, run one step if there is work, send its tokens."""
    scheduler = llm.scheduler
    states: dict[int, Any] = {}  # rid -> RequestState of the unfinished requests
    rids: dict[int, int] = {}  # uid -> rid
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    next_parent_check = 0.0
    while True:
        now = time.monotonic()
        if now >= next_parent_check:
            if os.getppid() != parent:
                logger.warning("the front end (pid %d) is gone: stopping", parent)
                return
            next_parent_check = now + 1.0
        timeout = 0 if scheduler.has_work() else IDLE_POLL_MS
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
                        state = scheduler.add_request(frame_ids(frames[1]), decode_params(header["params"]))
                    except (TypeError, ValueError) as e:
                        _send(outbox, {"op": "rejected", "rid": rid, "error": str(e)})
                        continue
                    states[rid] = state
                    rids[state.uid] = rid
                elif op == "abort":
                    state = states.pop(header["rid"], None)
                    if state is not None:
                        rids.pop(state.uid, None)
                        scheduler.abort(state)
                elif op == "metrics":
                    from prometheus_client import generate_latest

                    from minisgl import metrics

                    text = generate_latest(metrics.REGISTRY).decode()
                    _send(outbox, {"op": "metrics", "id": header["id"], "text": text})
                elif op == "flush":
                    _send(
                        outbox, {"op": "flush", "id": header["id"], "pages": scheduler.clear_prefix_cache()}
                    )
        if not scheduler.has_work():
            continue
        try:
            updates = scheduler.step()
        except FATAL_ERRORS:
            raise
        if not updates:
            continue
        served, counts, tokens, done = [], [], [], []
        for update in updates:
            state = update.state
            rid = rids.get(state.uid)
            if rid is None:  # aborted meanwhile
                continue
            if update.finished:
                done.append([len(served), state.finish_reason, state.error])
                states.pop(rid, None)
                rids.pop(state.uid, None)
            served.append(rid)
            counts.append(len(update.token_ids))
            tokens += update.token_ids
        if served:
            n = None if all(c == 1 for c in counts) else counts
            _send(outbox, {"op": "step", "n": n, "done": done}, ids_frame(served), ids_frame(tokens))
