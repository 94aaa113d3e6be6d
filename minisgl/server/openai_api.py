"""The OpenAI API's routes (`add_routes`): `GET /v1/models` and `/v1/models/{model}`, `POST
/v1/completions` and `/v1/chat/completions`, answered whole or streamed as server-sent events.

A request goes through the steps every generation route shares (`minisgl.server.generation`); its
body is parsed by `minisgl.server.protocol`, its choices become SamplingParams in
`minisgl.server.sampling`, and the answer is shaped by `minisgl.server.responses`. Here: the choices'
text as OpenAI's `text` or `message` (with separate_reasoning split into reasoning and content, with
echo the prompt first), their log probabilities (`minisgl.server.logprobs`), and the stream: one write
per scheduler step with news, each write's delay since that step recorded
(`minisgl_token_delivery_seconds`).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from minisgl.server import protocol, responses
from minisgl.server.errors import APIError, error_body, invalid_request
from minisgl.server.generation import admit_job, prepare_request, release_job, tokenize_prompt, wait_all
from minisgl.server.guards import error_response, why_unavailable
from minisgl.server.jobs import Choice, Job
from minisgl.server.logprobs import TokenTexts, chat_logprobs, completion_logprobs
from minisgl.server.sampling import sampling_params
from minisgl.server.state import ServerState
from minisgl.templates import THINK_OPEN, ReasoningSplitter, split_reasoning


def add_routes(app: FastAPI, state: ServerState) -> None:
    """OpenAI's routes on `app`: the model list and card, completions and chat completions."""

    @app.get("/v1/models")
    async def models() -> Response:
        unavailable = why_unavailable(state)
        if unavailable is not None:
            return error_response(unavailable)
        return JSONResponse(responses.model_list(state.served_model))

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> Response:
        unavailable = why_unavailable(state)
        if unavailable is not None:
            return error_response(unavailable)
        try:
            protocol.check_model(model, state.served_model)
        except APIError as e:
            return error_response(e)
        return JSONResponse(responses.model_card(state.served_model))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _generate(state, request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _generate(state, request, "chat")


def _json_response(body: dict[str, Any]) -> Response:
    """A JSON response whose body may hold `responses.RawJSON` values (log probabilities)."""
    return Response(responses.to_json(body), media_type="application/json")


async def _generate(state: ServerState, request: Request, kind: str) -> Response:
    """`POST /v1/completions` (`kind` "completion") or `/v1/chat/completions` ("chat")."""
    job = Job(time.perf_counter())
    parse = protocol.parse_chat_request if kind == "chat" else protocol.parse_completion_request
    prepared = await prepare_request(
        state, request, parse, lambda req: tokenize_prompt(state, req, kind), sampling_params
    )
    if isinstance(prepared, Response):
        return prepared
    req, prompt_ids, params = prepared
    request_id = responses.new_request_id(kind)
    admit_job(state, job, params, prompt_ids)
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
        await wait_all(job)
        respond = responses.chat_response if kind == "chat" else responses.completion_response
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
        return error_response(e)
    finally:
        release_job(state, job, request_id, len(prompt_ids))


@dataclass
class _Generation:
    """A finished choice as the responses read it (`responses.Generation`): its text (the prompt's
    first with echo; split into reasoning and content with separate_reasoning) and log probabilities."""

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
    def logprobs(self) -> responses.RawJSON | None:
        choice = self.choice
        if choice.logprobs is None or self.texts is None:
            return None
        if self.kind == "chat":
            return responses.RawJSON(chat_logprobs(self.texts, choice.logprobs, 0, choice.text_logprobs()))
        runs = [(choice.logprobs, 0, choice.text_logprobs())]
        if self.echo is not None and choice.prompt_logprobs is not None:
            runs.insert(0, (choice.prompt_logprobs, 0, len(choice.prompt_logprobs)))
        return responses.RawJSON(completion_logprobs(self.texts, runs)[0])

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
        responses.ChunkFormat(kind, request_id, model, c.index, wants_ids, created, c.logprobs is not None)
        for c in choices
    ]
    splitters = None if thinking is None else [ReasoningSplitter(thinking) for _ in choices]
    try:
        if kind == "chat":
            yield "".join(
                responses.sse(
                    responses.chat_chunk(
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
                    raise invalid_request(ValueError(choice.error))
                if echo is not None and not choice.text_offset:  # the prompt first, once scored
                    if choice.prompt_logprobs is not None and len(choice.prompt_logprobs) < prompt_tokens:
                        if not choice.finished:
                            continue
                    scored = _streamed_logprobs(state, kind, choice, echo)
                    parts.append(
                        responses.sse(
                            _chunk(kind, request_id, model, choice.index, echo, None, None, created, scored)
                        )
                    )
                    choice.text_offset = max(len(echo), 1)
                text, ids = choice.take()
                scored = None if choice.logprobs is None else _streamed_logprobs(state, kind, choice)
                if splitters is not None:  # reasoning_content and content
                    reasoning, text = splitters[choice.index].feed(text, choice.finished)
                    if reasoning or text or (wants_ids and ids):
                        chunk = responses.chat_chunk(
                            request_id,
                            model,
                            choice.index,
                            content=text or None,
                            reasoning_content=reasoning or None,
                            token_ids=ids if wants_ids else None,
                            created=created,
                            logprobs=scored,
                        )
                        parts.append(responses.sse(chunk))
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
                    reason = responses.openai_finish_reason(choice.finish_reason, choice.error)
                    parts.append(
                        responses.sse(
                            _chunk(kind, request_id, model, choice.index, "", None, reason, created)
                        )
                    )
            if parts:
                yield "".join(parts).encode()
                if tokens:
                    state.delivery.observe(job.written(time.perf_counter()))
        if req.include_usage:
            completion = sum(len(c.token_ids) for c in choices)
            yield responses.sse(
                responses.usage_chunk(kind, request_id, model, prompt_tokens, completion, created=created)
            ).encode()
        yield responses.SSE_DONE.encode()
    except APIError as e:
        yield (responses.sse(error_body(e)) + responses.SSE_DONE).encode()
    finally:
        release_job(state, job, request_id, prompt_tokens)


def _chunk(
    kind: str,
    rid: str,
    model: str,
    index: int,
    text: str,
    ids: Any,
    reason: Any,
    created: int,
    logprobs: responses.RawJSON | None = None,
) -> dict[str, Any]:
    if kind == "chat":
        return responses.chat_chunk(
            rid,
            model,
            index,
            content=text if reason is None else None,
            finish_reason=reason,
            token_ids=ids,
            created=created,
            logprobs=logprobs,
        )
    return responses.completion_chunk(
        rid, model, index, text, finish_reason=reason, token_ids=ids, created=created, logprobs=logprobs
    )


def _streamed_logprobs(
    state: ServerState, kind: str, choice: Choice, echo: str | None = None
) -> responses.RawJSON | None:
    """The `logprobs` of a streamed chunk: its new tokens' (`Choice.take_logprobs`), or with `echo`
    the prompt's (completions; None without prompt log probabilities)."""
    texts = state.token_texts
    if echo is not None:
        prompt = choice.prompt_logprobs
        return (
            None
            if prompt is None
            else responses.RawJSON(completion_logprobs(texts, [(prompt, 0, len(prompt))])[0])
        )
    assert choice.logprobs is not None
    start, end = choice.take_logprobs()
    if kind == "chat":
        return responses.RawJSON(chat_logprobs(texts, choice.logprobs, start, end))
    scored, choice.text_offset = completion_logprobs(
        texts, [(choice.logprobs, start, end)], choice.text_offset
    )
    return responses.RawJSON(scored)
