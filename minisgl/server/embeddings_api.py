"""`POST /v1/embeddings` (OpenAI's shape; docs/embeddings.md): the inputs checked and tokenized here,
queued in the scheduler together as one message, their pooled vectors finished (normalized, truncated
to `dimensions`, encoded) here."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from minisgl import embeddings
from minisgl.core import SamplingParams
from minisgl.server import protocol
from minisgl.server.errors import APIError
from minisgl.server.guards import error_response, load_json, read_body, why_unavailable
from minisgl.server.jobs import Job, trace_record
from minisgl.server.state import ServerState
from minisgl.server.tokenize import PromptTooLong

_FIELDS = ("model", "input", "encoding_format", "dimensions", "user")


def add_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/embeddings")
    async def create_embeddings(request: Request) -> Response:
        job, body = Job(time.perf_counter()), None
        try:
            body = await _embed(state, request, job)
            return JSONResponse(body)
        except APIError as e:
            return error_response(e)
        finally:
            job.done = time.perf_counter()
            if state.trace is not None:  # one line per request, marked as an embeddings request
                tokens = 0 if body is None else body["usage"]["prompt_tokens"]
                record = trace_record(job, f"embd-{uuid.uuid4().hex}", tokens, state.clock_offset)
                state.trace.write(json.dumps({**record, "kind": "embedding"}, separators=(",", ":")) + "\n")


async def _embed(state: ServerState, request: Request, job: Job) -> dict[str, Any]:
    unavailable = why_unavailable(state)
    if unavailable is not None:
        raise unavailable
    body = load_json(await read_body(state, request))
    unknown = sorted(set(body) - set(_FIELDS))
    if unknown:
        raise APIError(
            f"unknown field {unknown[0]!r}: an embeddings request takes {', '.join(_FIELDS)}",
            param=unknown[0],
        )
    model = body.get("model")
    if not isinstance(model, str):
        raise APIError("model must be a string: the served model's name", param="model")
    protocol.check_model(model, state.served_model)
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise APIError("user must be a string", param="user")
    info = state.client.info
    if info["pooling"] is None:
        raise APIError(f"this model serves no embeddings: {info['pooling_error']}", param="model")
    encoding_format, dimensions = body.get("encoding_format"), body.get("dimensions")
    encoding_format = "float" if encoding_format is None else encoding_format
    try:
        embeddings.check_options(encoding_format, dimensions, info["hidden_size"])
    except ValueError as e:
        raise APIError(str(e), param=str(e).split(" ", 1)[0]) from None
    if "input" not in body:
        raise APIError(
            "input is required: a string, a list of strings or (lists of) token ids", param="input"
        )
    try:
        items = embeddings.split_inputs(body["input"])
    except ValueError as e:
        raise APIError(str(e), param="input") from None
    # the strings tokenized at once (the tokenizer pool's processes take them side by side)
    texts = [_tokenize(state, item, i) for i, item in enumerate(items) if isinstance(item, str)]
    tokenized = iter(await asyncio.gather(*texts))
    ids = [next(tokenized) if isinstance(item, str) else item for item in items]
    try:
        for i, item in enumerate(ids):
            if not item:
                raise ValueError(f"input[{i}] has no tokens once tokenized: give some text")
            embeddings.check_ids(item, i, info["vocab_size"], info["max_context"])
    except ValueError as e:
        code = "context_length_exceeded" if "context" in str(e) else None
        raise APIError(str(e), param="input", code=code) from None
    job.tokenized = job.sent = time.perf_counter()
    params = SamplingParams(max_tokens=0, pooling=info["pooling"])
    if state.outstanding + 1 > state.limit:  # one unit of the queue, as a choice is (a drain waits for it)
        raise APIError(
            f"the server is full ({state.outstanding} requests queued or running); retry later",
            status=503,
            type="server_error",
            code="server_overloaded",
        )
    state.outstanding += 1
    try:
        vectors = await state.client.embed(ids, params)
    except ValueError as e:  # the scheduler refused or failed them
        raise APIError(str(e), param="input") from None
    except RuntimeError as e:
        raise APIError(
            f"the engine failed: {e}", status=503, type="server_error", code="engine_failed"
        ) from None
    finally:
        state.outstanding -= 1
    normalize = info["normalize_embeddings"]
    data = [
        {
            "object": "embedding",
            "index": i,
            "embedding": embeddings.encode(embeddings.finish(v, normalize, dimensions), encoding_format),
        }
        for i, v in enumerate(vectors)
    ]
    tokens = sum(map(len, ids))
    return {
        "object": "list",
        "data": data,
        "model": state.served_model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


async def _tokenize(state: ServerState, text: str, index: int) -> list[int]:
    if state.encoder is None:
        raise APIError("this model has no tokenizer: send the inputs as token ids", param="input")
    try:
        return await state.tokenizers.text(text)
    except PromptTooLong as e:
        raise APIError(
            f"input[{index}] has {e.size} bytes of text, more than the context of "
            f"{state.client.info['max_context']} tokens can hold: shorten it",
            param="input",
            code="context_length_exceeded",
        ) from None
