"""The OpenAI API's routes (`add_routes`): `GET /v1/models` and `/v1/models/{model}`, `POST
/v1/completions` and `/v1/chat/completions`, answered whole or streamed as server-sent events.

Here: the choices' text as `text` or `message` (reasoning, echo, tool calls), their log probabilities
and the stream (one write per scheduler step with news); the shared steps live in the modules that
docs/server.md lists.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from minisgl.harmony import is_harmony_template
from minisgl.server import embeddings_api, protocol, responses
from minisgl.server.errors import APIError, error_body
from minisgl.server.generation import (
    admit_job,
    check_rejected,
    client_gone,
    prepare_request,
    release_job,
    tokenize_prompt,
    wait_all,
)
from minisgl.server.guards import error_response, why_unavailable
from minisgl.server.jobs import Choice, Job
from minisgl.server.logprobs import TokenTexts, chat_logprobs, completion_logprobs
from minisgl.server.sampling import sampling_params
from minisgl.server.state import ServerState
from minisgl.server.tools import ChoiceTools, HarmonyTools, ToolPlan, plan_tools
from minisgl.templates import THINK_OPEN, ReasoningSplitter, split_reasoning


def add_routes(app: FastAPI, state: ServerState) -> None:
    """OpenAI's routes on `app`: the model list and card, completions and chat completions."""

    @app.get("/v1/models")
    async def models() -> Response:
        unavailable = why_unavailable(state)
        if unavailable is not None:
            return error_response(unavailable)
        return JSONResponse(responses.model_list(state.served_model, adapters=state.served().adapters))

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> Response:
        unavailable = why_unavailable(state)
        if unavailable is not None:
            return error_response(unavailable)
        try:
            adapter = state.served().adapter(model)
        except APIError as e:
            return error_response(e)
        parent = None if adapter is None else state.served_model
        return JSONResponse(responses.model_card(model, parent=parent))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _generate(state, request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _generate(state, request, "chat")

    embeddings_api.add_routes(app, state)  # POST /v1/embeddings


def _json_response(body: dict[str, Any]) -> Response:
    """A JSON response whose body may hold `responses.RawJSON` values (log probabilities)."""
    return Response(responses.to_json(body), media_type="application/json")


async def _generate(state: ServerState, request: Request, kind: str) -> Response:
    """`POST /v1/completions` (`kind` "completion") or `/v1/chat/completions` ("chat")."""
    job = Job(time.perf_counter())
    tools = _ToolRequest(state) if kind == "chat" else None
    if tools is not None:  # its tools planned, rendered and forced
        steps = protocol.parse_chat_request, tools.tokenize, tools.params
    else:
        steps = (
            protocol.parse_completion_request,
            lambda req: tokenize_prompt(state, req, kind),
            sampling_params,
        )
    prepared = await prepare_request(state, request, *steps)
    if isinstance(prepared, Response):
        return prepared
    req, prompt_ids, params = prepared
    request_id = responses.new_request_id(kind)
    plan = None if tools is None else tools.plan
    harmony = tools is not None and tools.harmony  # gpt-oss: its channels and calls read from the text
    keep = harmony or (plan is not None and plan.fmt.keep_special_tokens)
    admit_job(state, job, params, prompt_ids, keep, req.model)
    thinking = None if harmony else _thinking(state, req, prompt_ids)
    echo = _echo(state, req, prompt_ids)
    created = int(time.time())
    readers = None
    if harmony:
        readers = [HarmonyTools(plan) for _ in job.choices]
    elif plan is not None:  # each choice's calls, read from its text
        readers = [plan.choice(tools.in_think, thinking is not None) for _ in job.choices]
    if req.stream:
        return StreamingResponse(
            _stream(state, req, kind, request_id, created, job, prompt_ids, thinking, echo, readers),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    try:
        await wait_all(job, request)
        respond = responses.chat_response if kind == "chat" else responses.completion_response
        return _json_response(
            respond(
                request_id,
                req.model,
                len(prompt_ids),
                [
                    _Generation(c, thinking, echo, state.token_texts, kind, readers and readers[c.index])
                    for c in job.choices
                ],
                return_token_ids=req.wants_token_ids,
                created=created,
            )
        )
    except APIError as e:
        return error_response(e)
    except ClientDisconnect:  # its choices are aborted below
        return client_gone()
    finally:
        release_job(state, job, request_id, len(prompt_ids))


class _ToolRequest:
    """A chat request's tools from its prompt to its sampling parameters: the plan (`plan_tools`; None
    without tools), the parameter schemas checked, the tools rendered, and forced calls' grammar (off
    the event loop: xgrammar compiles the schemas)."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.plan: ToolPlan | None = None
        self.grammar: str | None = None
        self.in_think = False  # the prompt ends inside <think>
        self.harmony = is_harmony_template(state.encoder.chat_template if state.encoder else None)

    async def tokenize(self, req: Any) -> list[int]:
        state = self.state
        parser = "hermes" if self.harmony else state.server.tool_call_parser  # harmony reads its own
        plan = self.plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, parser)
        if plan is not None and plan.forced and self.harmony:
            raise APIError(
                f"tool_choice {plan.mode!r} is not supported for this model's harmony format (gpt-oss) yet: "
                'use tool_choice "auto"',
                param="tool_choice",
            )
        if plan is None:
            return await tokenize_prompt(state, req, "chat")
        await asyncio.to_thread(plan.check_schemas)
        kwargs = plan.template_kwargs(req.chat_template_kwargs)
        prompt_ids = await tokenize_prompt(state, req, "chat", kwargs, plan.template_tools())
        self.in_think = _opens_think(state, prompt_ids)
        if plan.forced:  # a thinking model may think first: as its prompt or the client says
            think = "open" if self.in_think else "optional" if (kwargs or {}).get("enable_thinking") else None
            try:
                self.grammar = await asyncio.to_thread(plan.grammar, think)
            except Exception as e:  # the schemas compiled alone: a failure here is xgrammar's
                raise APIError(f"the forced tool calls' grammar failed: {e}", param="tool_choice") from None
        return prompt_ids

    def params(self, req: Any, prompt_len: int, max_context: int) -> list[Any]:
        return sampling_params(req, prompt_len, max_context, self.grammar)


@dataclass
class _Generation:
    """A finished choice as the responses read it (`responses.Generation`): its text (the prompt's
    first with echo; split into reasoning and content with separate_reasoning; read for tool calls)
    and log probabilities."""

    choice: Choice
    thinking: bool | None = None  # separate_reasoning: whether the reply starts inside <think>
    echo: str | None = None  # completions with echo: the prompt's text, before the reply's
    texts: TokenTexts | None = None  # with log probabilities
    kind: str = "completion"
    tools: ChoiceTools | HarmonyTools | None = None  # a chat with tools (or harmony's): reads its calls

    @cached_property
    def _split(self) -> tuple[str, str]:
        """(reasoning, content) of the reply, split once (separate_reasoning)."""
        assert self.thinking is not None
        return split_reasoning(self.choice.text, self.thinking)

    @cached_property
    def _parsed(self) -> tuple[str, list[dict[str, Any]]]:
        """(content, tool calls) of the reply, read once (tools)."""
        assert self.tools is not None
        text = self.choice.text if self.thinking is None else self._split[1]
        content, calls = self.tools.feed(text, final=True, stopped=self.choice.finish_reason == "stop")
        return content, [call.as_json() for call in calls]

    @property
    def text(self) -> str:
        if self.tools is not None:
            return self._parsed[0]
        if self.thinking is None:
            return (self.echo or "") + self.choice.text
        return self._split[1]

    @property
    def tool_calls(self) -> list[dict[str, Any]] | None:
        return None if self.tools is None else self._parsed[1]

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
        if isinstance(self.tools, HarmonyTools):  # the analysis channel, always apart
            _ = self._parsed  # the reply read (once)
            return self.tools.all_reasoning or None
        return None if self.thinking is None else self._split[0] or None

    @property
    def token_ids(self) -> list[int]:
        return self.choice.token_ids

    @property
    def finish_reason(self) -> str:
        reason = self.choice.finish_reason or "error"
        return reason if self.tools is None or not self._parsed[1] else self.tools.finish_reason(reason)

    @property
    def error(self) -> str | None:
        return self.choice.error


def _thinking(state: ServerState, req: Any, prompt_ids: list[int]) -> bool | None:
    """With separate_reasoning (chat): whether the reply starts inside a <think> the prompt opened (its
    template's doing); None without it."""
    if not getattr(req, "separate_reasoning", False) or state.decoder is None:
        return None
    return _opens_think(state, prompt_ids)


def _opens_think(state: ServerState, prompt_ids: list[int]) -> bool:
    """Whether the prompt ends inside a <think> (a template that forces thinking)."""
    if state.decoder is None:
        return False
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
    readers: list[ChoiceTools] | list[HarmonyTools] | None = None,
) -> AsyncIterator[bytes]:
    """The response's server-sent events: each time the job is woken, one write with every choice's
    news (text and token ids, final chunks), then the delay since the step that made them is recorded.
    `thinking` (separate_reasoning; see `_thinking`): each text is split into reasoning and content.
    `readers` (a chat with tools): each text is read for calls (`_read_events`).
    `echo` (completions): each choice's first chunk is the prompt's text (with its log probabilities
    once the prefill has them). Chunks with log probabilities carry them as `RawJSON` (`_streamed_logprobs`)."""
    prompt_tokens = len(prompt_ids)
    model = req.model  # the base model's name or a LoRA adapter's
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
                check_rejected(choice)
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
                if splitters is not None or readers is not None:  # reasoning, content, tool calls
                    splitter = None if splitters is None else splitters[choice.index]
                    reader = None if readers is None else readers[choice.index]
                    wanted = ids if wants_ids else []
                    events = _read_events(
                        request_id, model, created, choice, splitter, reader, text, wanted, scored
                    )
                    parts += events
                    tokens = tokens or bool(events)
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
                    if readers is not None:
                        reason = readers[choice.index].finish_reason(reason)
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


def _read_events(
    rid: str,
    model: str,
    created: int,
    choice: Choice,
    splitter: ReasoningSplitter | None,
    reader: ChoiceTools | HarmonyTools | None,
    text: str,
    ids: list[int],
    scored: responses.RawJSON | None,
) -> list[str]:
    """A chat choice's news as events when its text is read: split into reasoning and content
    (`splitter`, separate_reasoning) and read for tool calls (`reader`). One chunk with its reasoning
    and content (and the token ids `ids` when asked for, the log probabilities `scored`), then per call
    completed a chunk with its index, id, type and name and one with its arguments."""
    reasoning, calls = "", []
    if splitter is not None:
        reasoning, text = splitter.feed(text, choice.finished)
    if reader is not None:
        text, calls = reader.feed(text, choice.finished, choice.finish_reason == "stop")
        if isinstance(reader, HarmonyTools):
            reasoning = reader.reasoning
    events = []
    if reasoning or text or scored is not None or ids:
        chunk = responses.chat_chunk(
            rid,
            model,
            choice.index,
            content=text or None,
            reasoning_content=reasoning or None,
            token_ids=ids or None,
            created=created,
            logprobs=scored,
        )
        events.append(responses.sse(chunk))
    first = 0 if reader is None else len(reader.calls) - len(calls)
    for index, call in enumerate(calls, first):
        for delta in call.deltas(index):
            chunk = responses.chat_chunk(rid, model, choice.index, tool_calls=[delta], created=created)
            events.append(responses.sse(chunk))
    return events


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
