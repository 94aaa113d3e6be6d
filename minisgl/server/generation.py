"""The steps every generation route takes (OpenAI's completions and chat, SGLang's `/generate`), in
order: `prepare_request` (the server available, the body read, parsed and checked, the prompt
tokenized by `tokenize_prompt`, one SamplingParams per choice, room in the queue), `admit_job` (the
choices made and sent to the scheduler), `wait_all` (a whole answer) or the route's own stream, and
`release_job` (unfinished choices aborted, their slots freed, the trace line written).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from starlette.requests import ClientDisconnect

from minisgl.core import SamplingParams, TokenLogprobs
from minisgl.scheduler.detokenizer import IncrementalDetokenizer
from minisgl.server import protocol
from minisgl.server.connections import log_limited
from minisgl.server.errors import APIError, invalid_request
from minisgl.server.guards import error_response, load_json, read_body, why_unavailable
from minisgl.server.jobs import Choice, Job
from minisgl.server.state import ServerState
from minisgl.server.tokenize import PromptTooLong, TemplateFailed
from minisgl.server.worker import ids_frame

LARGE_BODY_BYTES = 256 << 10  # bodies parsed and checked off the event loop past this size


def _parse_body(parse: Any, raw: bytes, served_model: protocol.Served, limits: protocol.Limits) -> Any:
    """The checked request of the body `raw` (`parse`: protocol.parse_chat_request or _completion_,
    native.parse_generate)."""
    return parse(load_json(raw), served_model, limits)


async def prepare_request(
    state: ServerState, request: Request, parse: Any, tokenize: Any, plan: Any
) -> tuple[Any, list[int], list[SamplingParams]] | Response:
    """What every generation route checks before anything runs: the server available, the body read and
    parsed (`parse(body, served_model, limits)`), the prompt's ids (`await tokenize(req)`), one
    SamplingParams per choice (`plan(req, prompt_len, max_context)`) and room for them. Returns the
    request, the prompt's ids and the params, or the error response."""
    try:
        unavailable = why_unavailable(state)
        if unavailable is not None:
            raise unavailable
        raw = await read_body(state, request)
        args = (parse, raw, state.served(), state.limits)
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
                raise invalid_request(e) from None
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
        return error_response(e, {"Retry-After": "1"} if e.status == 503 else None)
    except ClientDisconnect:  # nobody to answer
        return client_gone("before its request arrived in full")


def admit_job(
    state: ServerState,
    job: Job,
    params: list[SamplingParams],
    prompt_ids: list[int],
    keep_special_tokens: bool = False,
    model: str | None = None,
) -> None:
    """Makes the job's choices, one per SamplingParams, and sends them to the scheduler (a replica's,
    under data parallelism). `keep_special_tokens`: their text keeps special tokens (tool-call markup);
    `model`: the request's `model` field (a LoRA adapter's name runs them on it)."""
    job.tokenized = time.perf_counter()
    job.lora = None if model is None or model == state.served_model else model
    client = state.client
    skip = not keep_special_tokens
    job.choices = [
        Choice(
            next(client.rids),
            i,
            p,
            IncrementalDetokenizer(state.decoder, skip) if state.decoder else None,
            job,
        )
        for i, p in enumerate(params)
    ]
    for choice in job.choices:
        if choice.params.logprobs is not None:
            choice.logprobs = TokenLogprobs(choice.params.logprobs)
        if choice.params.prompt_logprobs is not None:
            choice.prompt_ids = prompt_ids
            choice.prompt_logprobs = TokenLogprobs(choice.params.prompt_logprobs, prompt_ids[:1])
    state.outstanding += len(job.choices)
    # a prompt with images (tokenize.PromptWithImages): their bytes for the scheduler, counts for the trace
    job.images, job.image_counts = getattr(prompt_ids, "images", None), getattr(prompt_ids, "counts", (0, 0))
    client.submit(job.choices, ids_frame(prompt_ids), len(prompt_ids))
    job.sent = time.perf_counter()


def check_rejected(choice: Choice) -> None:
    """The error of a choice the scheduler rejected (a 400; a 404 for an adapter unloaded meanwhile)."""
    if choice.finish_reason == "rejected":
        if choice.rejected_status == 404:  # its LoRA adapter was unloaded after the request was checked
            raise APIError(choice.error or "", status=404, param="model", code="model_not_found")
        raise invalid_request(ValueError(choice.error))


async def wait_all(job: Job, request: Request) -> None:
    """Until every choice of `job` has finished (a 400 for one the scheduler rejected). A client that
    disconnects first raises ClientDisconnect: the caller's `release_job` then aborts the choices, so an
    abandoned answer stops taking steps and pages (`client_gone` is the response)."""
    gone = asyncio.ensure_future(_watch_disconnect(request, job))
    try:
        while True:
            for c in job.choices:
                check_rejected(c)
            if all(c.finished for c in job.choices):
                return
            if gone.done():
                raise ClientDisconnect()
            await job.wake.wait()
            job.wake.clear()
    finally:
        gone.cancel()


async def _watch_disconnect(request: Request, job: Job) -> None:
    """Returns (waking the job) once the ASGI server says the client is gone; the body is read already,
    so nothing else comes from `receive` before that."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    job.wake.set()


def client_gone(what: str = "before its answer was ready") -> Response:
    """What a route returns for a client that is gone (nobody reads it), logged without a traceback."""
    log_limited("disconnect", logging.INFO, "a client disconnected %s", what)
    return Response(status_code=400)


def release_job(state: ServerState, job: Job, request_id: str, prompt_tokens: int) -> None:
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


async def tokenize_prompt(
    state: ServerState,
    req: Any,
    kind: str,
    template_kwargs: Any = None,
    tools: Any = None,
    images: tuple[str, ...] = (),
) -> list[int]:
    """The prompt's token ids: a chat's messages under the model's template (`template_kwargs`, its
    variables: the request's unless given; `tools`, the functions rendered), a text tokenized (with
    `images`, /generate's image_data, for its image placeholders), or the ids given (checked against
    the vocabulary); 400s naming the field."""
    try:
        if kind == "chat":
            tok = state.encoder
            if tok is None or not tok.chat_template:
                raise APIError("this model has no chat template: use /v1/completions", param="messages")
            kwargs = req.chat_template_kwargs if template_kwargs is None else template_kwargs
            return await state.tokenizers.chat(req.messages, kwargs, tools)
        if isinstance(req.prompt, str):
            if state.encoder is None:
                raise APIError("this model has no tokenizer: send the prompt as token ids", param="prompt")
            if images:  # a vision-language model's prompt with images (docs/vision.md)
                return await state.tokenizers.text_with_images(req.prompt, list(images))
            return await state.tokenizers.text(req.prompt)
    except ValueError as e:  # images: a MediaError, too many, a text-only model
        raise APIError(str(e), param="messages" if kind == "chat" else "image_data") from None
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
