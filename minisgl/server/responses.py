"""The OpenAI API's answers: engine results in, OpenAI-shaped JSON out. Pure functions, no HTTP and no
engine.

Non-streamed: `completion_response`, `chat_response`. Streamed, each choice sends a role chunk, a
content chunk per piece of text and a finish chunk, then `usage_chunk` (if asked) and `SSE_DONE`, all
through `sse`; `ChunkFormat` writes one choice's chunks cheaply. Finish reasons "error" and "abort"
become APIErrors (500 `generation_failed`, 503 `request_aborted`). docs/server.md, docs/tools.md.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from minisgl.scheduler.grammar import DEAD_END
from minisgl.server.errors import APIError, engine_unavailable

SSE_DONE = "data: [DONE]\n\n"


class Generation(Protocol):
    """One finished choice as the engine reports it (`minisgl.llm.RequestOutput` is one)."""

    text: str
    token_ids: list[int]
    finish_reason: str  # "stop", "length", "abort" or "error"
    error: str | None


def openai_finish_reason(reason: str, error: str | None = None) -> Literal["stop", "length", "tool_calls"]:
    """The engine's finish reason as OpenAI's ("tool_calls": a reply with tool calls); "error" and
    "abort" raise the APIError that replaces the choice (see the module docstring): a 400 where the
    request's grammar reached a dead end (`GrammarDeadEnd`), else a 500 (503 for "abort")."""
    if reason in ("stop", "length", "tool_calls"):
        return reason  # type: ignore[return-value]
    if reason == "abort":
        raise APIError(
            "the request was aborted before it finished (the server is shutting down); retry it",
            status=503,
            type="server_error",
            code="request_aborted",
        )
    if reason == "engine_died":  # its engine process died under it
        raise engine_unavailable(error or "the engine process died", restarting=True)
    if reason == "error" and error and DEAD_END in error:  # the request's grammar, not the server
        raise APIError(f"generation stopped: {error}", code="grammar_dead_end")
    detail = f": {error}" if error else ""
    raise APIError(
        f"generation failed{detail}"
        if reason == "error"
        else f"generation ended with an unknown finish reason {reason!r}",
        status=500,
        type="server_error",
        code="generation_failed",
    )


def new_request_id(kind: Literal["completion", "chat"]) -> str:
    """A fresh response id: "cmpl-..." or "chatcmpl-..."."""
    return ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """OpenAI's usage object (the prompt counts once, the completion tokens of every choice add up)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _envelope(request_id: str, obj: str, model: str, created: int | None) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": obj,
        "created": int(time.time()) if created is None else created,
        "model": model,
    }


def completion_response(
    request_id: str, model: str, prompt_tokens: int, generations: Sequence[Generation], **options: Any
) -> dict[str, Any]:
    """The non-streamed `text_completion` object, one choice per generation (in order); `options`:
    `return_token_ids`, `created`."""
    content = lambda gen: {"text": gen.text}  # noqa: E731
    return _response("text_completion", request_id, model, prompt_tokens, generations, content, **options)


def chat_response(
    request_id: str, model: str, prompt_tokens: int, generations: Sequence[Generation], **options: Any
) -> dict[str, Any]:
    """The non-streamed `chat.completion` object, one assistant message per generation (in order);
    `options`: `return_token_ids`, `created`."""

    def content(gen: Generation) -> dict[str, Any]:
        reasoning = getattr(gen, "reasoning", None)  # set with separate_reasoning
        extra = {} if reasoning is None else {"reasoning_content": reasoning}
        calls = getattr(gen, "tool_calls", None)  # a chat with tools
        if calls:
            return {
                "message": {"role": "assistant", **extra, "content": gen.text or None, "tool_calls": calls}
            }
        return {"message": {"role": "assistant", **extra, "content": gen.text}}

    return _response("chat.completion", request_id, model, prompt_tokens, generations, content, **options)


def _response(
    kind: str,
    request_id: str,
    model: str,
    prompt_tokens: int,
    generations: Sequence[Generation],
    content: Callable[[Generation], dict[str, Any]],
    *,
    return_token_ids: bool = False,
    created: int | None = None,
) -> dict[str, Any]:
    """A non-streamed response object: `content(gen)` gives each choice's text or message."""
    choices = []
    for index, gen in enumerate(generations):
        choice: dict[str, Any] = {
            "index": index,
            **content(gen),
            "logprobs": getattr(gen, "logprobs", None),
            "finish_reason": openai_finish_reason(gen.finish_reason, gen.error),
        }
        if return_token_ids:
            choice["token_ids"] = list(gen.token_ids)
        choices.append(choice)
    completion_tokens = sum(len(gen.token_ids) for gen in generations)
    return {
        **_envelope(request_id, kind, model, created),
        "choices": choices,
        "usage": usage(prompt_tokens, completion_tokens),
    }


def completion_chunk(
    request_id: str,
    model: str,
    index: int,
    text: str,
    *,
    finish_reason: Literal["stop", "length"] | None = None,
    token_ids: Sequence[int] | None = None,
    created: int | None = None,
    logprobs: dict[str, Any] | RawJSON | None = None,
) -> dict[str, Any]:
    """A streamed `text_completion` chunk: new text of choice `index` (the last one with its
    finish_reason); `token_ids` (the new tokens) when the request wants them; `logprobs`, theirs."""
    choice = _chunk_choice(index, "text", text, logprobs, finish_reason, token_ids)
    return {**_envelope(request_id, "text_completion", model, created), "choices": [choice]}


def _chunk_choice(
    index: int, key: str, value: Any, logprobs: Any, finish_reason: Any, token_ids: Sequence[int] | None
) -> dict[str, Any]:
    """A streamed chunk's one choice: its text (`key` "text") or delta ("delta"), and the rest."""
    choice = {"index": index, key: value, "logprobs": logprobs, "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = list(token_ids)
    return choice


def chat_chunk(
    request_id: str,
    model: str,
    index: int,
    *,
    role: Literal["assistant"] | None = None,
    content: str | None = None,
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None,
    token_ids: Sequence[int] | None = None,
    created: int | None = None,
    reasoning_content: str | None = None,
    logprobs: dict[str, Any] | RawJSON | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A `chat.completion.chunk` for choice `index`: the first carries ``role="assistant"`` (and
    ``content=""``), later ones ``content`` (and, with separate_reasoning, ``reasoning_content``; with
    tools, ``tool_calls`` deltas), the last an empty delta and the finish_reason."""
    delta: dict[str, Any] = {}
    if role is not None:
        delta["role"] = role
    if reasoning_content is not None:
        delta["reasoning_content"] = reasoning_content
    if content is not None:
        delta["content"] = content
    if tool_calls is not None:
        delta["tool_calls"] = tool_calls
    choice = _chunk_choice(index, "delta", delta, logprobs, finish_reason, token_ids)
    return {**_envelope(request_id, "chat.completion.chunk", model, created), "choices": [choice]}


def usage_chunk(
    kind: Literal["completion", "chat"],
    request_id: str,
    model: str,
    prompt_tokens: int,
    completion_tokens: int,
    *,
    created: int | None = None,
) -> dict[str, Any]:
    """The last chunk of a stream with `stream_options.include_usage`: no choices, the usage."""
    obj = "text_completion" if kind == "completion" else "chat.completion.chunk"
    return {
        **_envelope(request_id, obj, model, created),
        "choices": [],
        "usage": usage(prompt_tokens, completion_tokens),
    }


def model_card(
    model: str, *, created: int | None = None, owned_by: str = "minisgl", parent: str | None = None
) -> dict[str, Any]:
    """One `model` object (`GET /v1/models/{model}`); a LoRA adapter's names its base model (`parent`)."""
    card = {
        "id": model,
        "object": "model",
        "created": int(time.time()) if created is None else created,
        "owned_by": owned_by,
    }
    return card if parent is None else {**card, "parent": parent}


def model_list(
    model: str, *, created: int | None = None, owned_by: str = "minisgl", adapters: Sequence[str] = ()
) -> dict[str, Any]:
    """The `GET /v1/models` list: the served model, then its LoRA adapters (their `parent`: it)."""
    created = int(time.time()) if created is None else created
    cards = [model_card(name, created=created, owned_by=owned_by, parent=model) for name in adapters]
    return {"object": "list", "data": [model_card(model, created=created, owned_by=owned_by), *cards]}


@dataclass(frozen=True)
class RawJSON:
    """A value already written as JSON (log probabilities, `minisgl.server.logprobs`): `to_json` puts
    its text in as it is."""

    text: str


_RAW_SLOT = "\x00raw-" + uuid.uuid4().hex  # stands for a RawJSON while `to_json` writes: no text holds it
_RAW_SLOT_JSON = json.dumps(_RAW_SLOT)


def to_json(payload: Any) -> str:
    """A response body or event as JSON on one line (non-ASCII kept), its `RawJSON` values as they are."""
    raws: list[str] = []

    def raw(value: Any) -> str:
        if not isinstance(value, RawJSON):
            raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")
        raws.append(value.text)
        return _RAW_SLOT

    text = json.dumps(payload, ensure_ascii=False, separators=(",", ":"), default=raw)
    if not raws:
        return text
    parts = text.split(_RAW_SLOT_JSON)
    return "".join(part + value for part, value in zip(parts, raws)) + parts[-1]


def sse(payload: Mapping[str, Any]) -> str:
    """One server-sent event: ``data: {json}`` and a blank line (the JSON on one line)."""
    return f"data: {to_json(payload)}\n\n"


_TEXT_SLOT, _IDS_SLOT, _LOGPROBS_SLOT = "\x00text\x00", "\x00ids\x00", "\x00logprobs\x00"  # no text is one


class ChunkFormat:
    """The streamed chunks of one choice as server-sent events, cheaply: the chunk is built once by
    `completion_chunk` / `chat_chunk` with placeholders for the text and the token ids and serialized
    as `sse` does; `event(text, ids)` then joins the parts around the JSON-encoded text and ids (and,
    made `with_logprobs`, their log probabilities). The bytes equal ``sse(completion_chunk(...))`` (or
    the chat chunk) for the same values."""

    def __init__(
        self,
        kind: Literal["completion", "chat"],
        request_id: str,
        model: str,
        index: int,
        with_ids: bool,
        created: int,
        with_logprobs: bool = False,
    ) -> None:
        ids = [_IDS_SLOT] if with_ids else None
        options = {
            "token_ids": ids,
            "created": created,
            "logprobs": _LOGPROBS_SLOT if with_logprobs else None,
        }
        if kind == "chat":
            payload = chat_chunk(request_id, model, index, content=_TEXT_SLOT, **options)
        else:
            payload = completion_chunk(request_id, model, index, _TEXT_SLOT, **options)
        event = sse(payload)
        text_slot, ids_slot, logprobs_slot = (
            json.dumps(_TEXT_SLOT),
            json.dumps([_IDS_SLOT]),
            json.dumps(_LOGPROBS_SLOT),
        )
        self._head, rest = event.split(text_slot)
        self._scored, rest = rest.split(logprobs_slot) if with_logprobs else ("", rest)
        self._mid, self._tail = rest.split(ids_slot) if with_ids else (rest, "")
        self.with_ids = with_ids

    def event(self, text: str, ids: Sequence[int], logprobs: RawJSON | None = None) -> str:
        """One chunk carrying `text` (and, if the request wants them, the token ids `ids`; `logprobs`,
        theirs, for a format made `with_logprobs`)."""
        head = self._head + _encode_str(text)
        if logprobs is not None:
            head += self._scored + logprobs.text
        if not self.with_ids:
            return head + self._mid
        return f"{head}{self._mid}[{','.join(map(str, ids))}]{self._tail}"


_encode_str = json.encoder.encode_basestring  # a str as JSON, non-ASCII kept (sse's ensure_ascii=False)
