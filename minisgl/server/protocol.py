"""The protocol layer of the OpenAI-compatible server: request bodies in, engine inputs out; engine results
in, OpenAI-shaped JSON out. Pure functions and pydantic models, no HTTP and no engine.

What the server around it does with one request (`POST /v1/chat/completions`)::

    request = parse_chat_request(body, served_model)  # APIError 400 / 404 when the body is wrong
    prompt_ids = ...  # the chat template over request.messages (plain dicts), tokenized
    params = sampling_params(request, len(prompt_ids), max_context)  # one SamplingParams per choice
    outputs = ...  # the engine runs them
    return chat_response(request_id, served_model, len(prompt_ids), outputs)

Streamed (`request.stream`), each choice i sends `chat_chunk(..., i, role="assistant", content="")`, then
`chat_chunk(..., i, content=delta)` per piece of text, then `chat_chunk(..., i,
finish_reason=openai_finish_reason(...))`; after all choices `usage_chunk(...)` if
`request.include_usage`, and `SSE_DONE`; every object goes out through `sse`. Any `APIError` becomes the
HTTP status `error.status` with the body `error_body(error)`, or, once a stream has begun, the event
`sse(error_body(error))` followed by `SSE_DONE`. `/v1/completions` is the same with
`parse_completion_request`, `completion_response` and `completion_chunk`.

The request's fields onto `minisgl.core.SamplingParams`:

- ``max_tokens`` (chat: ``max_completion_tokens``, or ``max_tokens``, its older name) -> ``max_tokens``.
  Unset: the rest of the context, ``max_context - prompt_len``. The prompt and max_tokens must fit in
  the context, else a 400 with code "context_length_exceeded".
- ``temperature`` -> ``temperature``; unset or null: 1.0, OpenAI's default (the engine's own default is 0,
  greedy). 0 is greedy.
- ``top_p``, ``seed``, ``stop`` (a string or a list of strings) -> the same fields.
- ``n`` (1 to 128) -> n SamplingParams. With a seed, choice i uses ``seed + i``: the choices differ and
  each one is reproducible. Without a seed each choice draws a random seed of its own.
- The engine's own fields, as extra body fields (the names vLLM and SGLang use): ``top_k``, ``min_p``,
  ``min_tokens``, ``ignore_eos``, ``stop_token_ids`` -> the same fields.
- ``chat_template_kwargs`` (chat, extra): the chat template's own variables (``minisgl.templates``).
- ``separate_reasoning`` (chat, extra; SGLang's): the ``<think>...</think>`` of a thinking model goes to
  the message's (or delta's) ``reasoning_content``, the rest to ``content``.
- ``logit_bias`` -> ``logit_bias`` (keys: token ids as strings; values in [-100, 100]; ids in the
  vocabulary, checked by the scheduler).
- ``presence_penalty``, ``frequency_penalty`` (OpenAI's, in [-2, 2]) and ``repetition_penalty`` (extra,
  in (0, 10]) -> the same fields.
- ``response_format`` (both endpoints; ``text``, ``json_object``, ``json_schema``) and ``regex``,
  ``ebnf`` (extra, SGLang's) -> ``json_object``, ``json_schema``, ``regex``, ``ebnf``
  (``minisgl.server.structured``; docs/structured-output.md).
- Log probabilities (of the model's own distribution, before logit_bias, penalties and temperature):
  completions ``logprobs`` k (0 to 20) -> ``logprobs`` k, and with ``echo`` also ``prompt_logprobs`` k
  (``echo`` puts the prompt before the text; with it ``max_tokens`` may be 0, to score a prompt); chat
  ``logprobs: true`` with ``top_logprobs`` k -> ``logprobs`` k. Shapes: `minisgl.server.logprobs`.
- ``return_token_ids`` (extra): each choice, and each streamed chunk, carries the generated token ids in
  a ``token_ids`` field. Default: true when the completion prompt is a list of token ids (the mode of
  models without a tokenizer, whose text is empty), false otherwise.

Values are checked, never coerced ("0.5" is no number, true and 2.0 are no integers): by pydantic in
strict mode, then by SamplingParams, whose TypeError / ValueError become 400s naming the parameter.

Parameters of OpenAI's API that minisgl does not implement (best_of, suffix, tools,
...) are refused with a 400 naming them (code "unsupported_parameter"), unless they carry the value that
asks for nothing (see ``_UNSUPPORTED``: ``best_of: 1``, ``tools: []``...).
Metadata that cannot change the output (``user``, ``metadata``, ``service_tier``, ``prompt_cache_key``,
``safety_identifier``; chat: ``parallel_tool_calls``) is type-checked and ignored. Any other field is
refused with a 400 (code "unknown_parameter"). A batch of several prompts is refused with a 400: one
request per prompt (a list holding one prompt is that prompt).

Finish reasons: the engine's "stop" and "length" are OpenAI's. "error" (a step failed for the request)
and "abort" (the server shut down or the request was cancelled) have no OpenAI counterpart: they become
an APIError, 500 "server_error" with code "generation_failed", or 503 "server_error" with code
"request_aborted". Non-streamed, the whole response is that error; streamed (status and headers already
sent), the error event takes the place of the choice's final chunk, and the openai client raises it.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from dataclasses import fields as dataclass_fields
from typing import Annotated, Any, Literal, Protocol

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
)
from pydantic_core import PydanticCustomError

from minisgl.core import INT64_MAX, MAX_LOGPROBS, SamplingParams
from minisgl.scheduler.grammar import DEAD_END
from minisgl.server.structured import GRAMMAR_PARAMS, ResponseFormat, StructuredOutputError, grammar_fields
from minisgl.templates import check_template_kwargs

MAX_N = 128  # choices per request
SSE_DONE = "data: [DONE]\n\n"


class APIError(Exception):
    """A request the server refuses or cannot finish: HTTP `status` and OpenAI's error fields."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        message, param = _encodable(message, MAX_MESSAGE_CHARS), param and _encodable(param, MAX_PARAM_CHARS)
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code


MAX_MESSAGE_CHARS, MAX_PARAM_CHARS = 2000, 200  # an error never echoes a large value back
_SURROGATE = re.compile("[\ud800-\udfff]")


def _encodable(text: str, limit: int) -> str:
    """`text` cut to `limit` characters, its lone surrogates (which UTF-8 cannot encode) escaped."""
    if not text.isascii() and _SURROGATE.search(text):
        text = _SURROGATE.sub(_escape, text[:limit])
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _escape(match: re.Match[str]) -> str:
    return f"\\u{ord(match.group()):04x}"


def error_body(error: APIError) -> dict[str, Any]:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": error.message, "type": error.type, "param": error.param, "code": error.code}}


_SAMPLING_FIELDS = frozenset(f.name for f in dataclass_fields(SamplingParams))


def invalid_request(exc: Exception, aliases: Mapping[str, str] | None = None) -> APIError:
    """A 400 from the TypeError / ValueError of SamplingParams (or of the engine's request checks): the
    message stays, `param` is the field it starts with ("top_p must be ..."), renamed by `aliases`."""
    message = str(exc)
    first = message.split(" ", 1)[0]
    param = first if first in _SAMPLING_FIELDS else None
    aliases = {**GRAMMAR_PARAMS, **(aliases or {})}  # structured output: the request's own field names
    return APIError(message, param=param and aliases.get(param, param))


MAX_DEPTH = 64  # nesting of arrays and objects in a request body (OpenAI's bodies need a handful)
_SURROGATE_ESCAPE = re.compile(
    rb"\\u[dD][89a-fA-F]"
)  # a \uXXXX escape of a surrogate (a pair's half, or alone)
_BRACKETS = bytes.maketrans(b"{}", b"[]")  # for the depth, objects count as arrays
_NOT_BRACKETS = bytes(set(range(256)) - set(b'"[]{}'))


def load_json(raw: bytes) -> dict[str, Any]:
    """The request body as a dict; a 400 when it is not UTF-8, not JSON, not a JSON object, nested
    deeper than MAX_DEPTH, or holds a lone surrogate (an escaped half of a UTF-16 pair, which no
    tokenizer takes): the body is refused before it reaches anything else. The checks scan the bytes
    (C loops, a few ms for 8 MiB), not the parsed objects."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(
            f"the request body is not valid UTF-8 (byte {e.start}: {raw[e.start : e.start + 4]!r}); "
            "send JSON encoded as UTF-8"
        ) from None
    too_deep = APIError(
        f"the request body nests arrays and objects more than {MAX_DEPTH} deep; flatten it", code="too_deep"
    )
    try:
        body = json.loads(text)
    except RecursionError:  # deeper than the interpreter's recursion
        raise too_deep from None
    except ValueError as e:
        raise APIError(f"the request body is not valid JSON ({e}); send a JSON object") from None
    unescaped = raw.replace(b"\\\\", b"")  # an escaped backslash escapes nothing after it
    if raw.count(b"[") + raw.count(b"{") > MAX_DEPTH and _depth(unescaped) > MAX_DEPTH:
        raise too_deep
    if _SURROGATE_ESCAPE.search(unescaped):  # pairs decode to one character: UTF-8 takes all but one alone
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            _find_lone_surrogate(body)
    if not isinstance(body, dict):
        raise APIError(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _depth(json_bytes: bytes) -> int:
    """How deep the arrays and objects of valid JSON (with no escaped backslash) nest, up to
    MAX_DEPTH + 1: its brackets outside strings, innermost pairs removed one level at a time."""
    brackets = json_bytes.replace(b'\\"', b"").translate(_BRACKETS, _NOT_BRACKETS)
    brackets = brackets.replace(b'""', b"")  # strings without brackets (adjacent ones merge: the same)
    if b'"' in brackets:  # strings with brackets: every other piece is one
        brackets = b"".join(brackets.split(b'"')[0::2])
    for depth in range(MAX_DEPTH + 1):
        if not brackets:
            return depth
        brackets = brackets.replace(b"[]", b"")
    return MAX_DEPTH + 1


def _find_lone_surrogate(body: Any) -> None:
    """A 400 naming where `body` has a lone surrogate, in a string or a key (a walk: only when the
    bytes have one)."""
    stack: list[tuple[Any, str]] = [(body, "")] if isinstance(body, dict | list) else []
    while stack:
        value, where = stack.pop()
        for key, item in value.items() if isinstance(value, dict) else enumerate(value):
            if isinstance(key, str) and _SURROGATE.search(key):
                raise APIError(
                    f"the request body holds a lone surrogate in the name of a field of {where or 'the body'}; "
                    "send valid Unicode",
                    param=where or None,
                )
            if isinstance(item, str) and (match := _SURROGATE.search(item)):
                path = _path(where, key)
                raise APIError(
                    f"the request body holds a lone surrogate (\\u{ord(match.group()):04x}) in {path}; send "
                    "valid Unicode (a UTF-16 surrogate pair, or UTF-8)",
                    param=path,
                )
            if isinstance(item, dict | list):
                stack.append((item, _path(where, key)))


def _path(where: str, key: int | str) -> str:
    """'messages' and 0 -> 'messages[0]'; 'messages[0]' and 'content' -> 'messages[0].content'."""
    return f"{where}[{key}]" if isinstance(key, int) else f"{where}.{key}" if where else key


def check_model(requested: str, served: str) -> None:
    """A 404 in OpenAI's "model_not_found" shape unless `requested` is the served model's name."""
    if requested != served:
        raise APIError(
            f"The model {short(requested)} does not exist; this server serves `{served}` (see GET /v1/models)",
            status=404,
            param="model",
            code="model_not_found",
        )


# ----------------------------------------------------------------------------------------------- requests


def _prompt(value: Any, info: ValidationInfo) -> Any:
    """One prompt: a text or a non-empty list of token ids (a list holding one of those is that one);
    a list too long for the context is refused before its ids are looked at."""
    if isinstance(value, list) and len(value) > 1 and all(isinstance(p, str | list) for p in value):
        raise PydanticCustomError(
            "batch",
            "a batch of {count} prompts is not supported: send one request per prompt",
            {"count": len(value)},
        )
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]
    if isinstance(value, str):
        return value
    max_context = _limits(info).max_context
    if isinstance(value, list) and max_context is not None and len(value) >= max_context:
        raise context_exceeded(len(value), max_context, "prompt")
    if isinstance(value, list) and all(type(t) is int for t in value):
        if not value:
            raise PydanticCustomError("empty", "the prompt is empty: give a text or at least one token id")
        if min(value) < 0:
            raise PydanticCustomError("token_id", "token ids are integers >= 0")
        return value
    raise PydanticCustomError("prompt_type", "the prompt must be a string or a list of integer token ids")


@dataclass(frozen=True)
class Limits:
    """Bounds on what one request may ask of the front end (settings `max_stop_strings`,
    `max_stop_string_length`): its stop strings are searched in every token's text."""

    max_stop_strings: int = 32
    max_stop_string_length: int = 256
    max_context: int | None = None  # the model's, once known: longer token-id prompts are refused first


def _limits(info: ValidationInfo) -> Limits:
    return (info.context or {}).get("limits") or Limits()


def _stop(value: Any, info: ValidationInfo) -> Any:
    limits = _limits(info)
    if value is None:
        return value
    strings = [value] if isinstance(value, str) else value
    if not isinstance(strings, list) or not all(
        isinstance(s, str) for s in strings[: limits.max_stop_strings + 1]
    ):
        raise PydanticCustomError("stop_type", "give a string or a list of strings")
    if len(strings) > limits.max_stop_strings:
        raise PydanticCustomError(
            "limit",
            "{count} stop strings is more than this server takes ({limit}, setting max_stop_strings)",
            {"count": len(strings), "limit": limits.max_stop_strings},
        )
    longest = max(map(len, strings), default=0)
    if longest > limits.max_stop_string_length:
        raise PydanticCustomError(
            "limit",
            "a stop string of {length} characters is longer than this server takes ({limit}, setting "
            "max_stop_string_length)",
            {"length": longest, "limit": limits.max_stop_string_length},
        )
    return value


def _content(value: Any) -> Any:
    """A message's content as one string: null is "", text parts are joined with newlines."""
    if value is None:
        return ""
    if isinstance(value, list):
        texts = []
        for part in value:
            text = part.get("text") if isinstance(part, dict) else None
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(text, str):
                kind = short(part.get("type")) if isinstance(part, dict) else type(part).__name__
                raise PydanticCustomError(
                    "content_part",
                    f"only text parts (type 'text' with a string 'text') are supported, got {kind}",
                )
            texts.append(text)
        return "\n".join(texts)
    return value


def _template_kwargs(value: Any) -> Any:
    if value is None:
        return None
    try:
        return check_template_kwargs(value)
    except ValueError as e:
        raise PydanticCustomError("template_kwargs", str(e).split(" ", 1)[1]) from None


def _logit_bias(value: Any) -> Any:
    """OpenAI's logit_bias, its keys (token ids as JSON strings) as integers; the values are checked by
    SamplingParams."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise PydanticCustomError("logit_bias", 'give an object {"token id": bias}')
    bad = next((k for k in value if not (isinstance(k, str) and k.isascii() and k.isdigit())), None)
    if bad is not None:
        raise PydanticCustomError(
            "logit_bias", "its keys are token ids (decimal digits), got {key}", {"key": short(bad)}
        )
    return {int(k): v for k, v in value.items()}


class _Strict(BaseModel):
    # strict: no coercion ("1" is no number, true no integer); forbid: no field passes unchecked
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class StreamOptions(_Strict):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # ignored: nothing is padded


class ChatMessage(_Strict):
    """One message of a conversation. "developer" (OpenAI's newer name for system) becomes "system"."""

    role: Literal["system", "developer", "user", "assistant"]
    content: Annotated[str, BeforeValidator(_content)] = ""
    name: str | None = None

    def as_dict(self) -> dict[str, str]:
        message = {"role": "system" if self.role == "developer" else self.role, "content": self.content}
        if self.name is not None:
            message["name"] = self.name
        return message


_MESSAGES = TypeAdapter(list[ChatMessage])


def _messages(value: Any) -> Any:
    messages = _MESSAGES.validate_python(value, strict=True)
    if not messages:
        raise PydanticCustomError("empty", "the conversation is empty: give at least one message")
    return [m.as_dict() for m in messages]


class _GenerationRequest(_Strict):
    """Fields both endpoints share."""

    model: str
    temperature: float | None = None
    top_p: float | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    seed: int | None = None
    stop: Annotated[str | list[str] | None, BeforeValidator(_stop)] = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    # the engine's own sampling fields
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    # OpenAI's: {"token id": bias in [-100, 100]}, the ids as strings (JSON's keys)
    logit_bias: Annotated[dict[int, float] | None, BeforeValidator(_logit_bias)] = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # the engines' extra field (transformers' definition)
    return_token_ids: bool | None = None
    # structured output (minisgl.server.structured): OpenAI's response_format, SGLang's regex and ebnf
    response_format: ResponseFormat | None = None
    regex: str | None = None
    ebnf: str | None = None
    # metadata: checked, then ignored
    user: str | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    @property
    def include_usage(self) -> bool:
        """A streamed response ends with a usage chunk (`stream_options.include_usage`)."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def wants_token_ids(self) -> bool:
        """Choices and chunks carry `token_ids`."""
        return bool(self.return_token_ids)

    def max_tokens_param(self) -> tuple[str, int | None]:
        """(the name the client used, its value or None)."""
        return "max_tokens", self.max_tokens


class CompletionRequest(_GenerationRequest):
    """`POST /v1/completions`: `prompt` is a text or a list of token ids."""

    prompt: Annotated[str | list[int], BeforeValidator(_prompt)]
    logprobs: int | None = None  # k: each token's log probability and the k most likely alternatives
    echo: bool | None = None  # the prompt before the text (and, with logprobs, its log probabilities)

    @property
    def wants_token_ids(self) -> bool:
        if self.return_token_ids is None:
            return isinstance(self.prompt, list)
        return self.return_token_ids


class ChatCompletionRequest(_GenerationRequest):
    """`POST /v1/chat/completions`: `messages` are plain dicts {"role", "content"[, "name"]} with text
    content, ready for a chat template."""

    messages: Annotated[list[dict[str, str]], BeforeValidator(_messages)]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None  # alternatives per token, with logprobs
    parallel_tool_calls: bool | None = None  # ignored: no tools
    # the chat template's own variables (vLLM's and SGLang's field), e.g. {"enable_thinking": false}
    chat_template_kwargs: Annotated[dict[str, Any] | None, BeforeValidator(_template_kwargs)] = None
    # SGLang's field: a thinking model's <think>...</think> goes to the message's reasoning_content
    separate_reasoning: bool | None = None

    def max_tokens_param(self) -> tuple[str, int | None]:
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens


def _is_none(v: Any) -> bool:
    return v is None


def _is_false(v: Any) -> bool:
    return v is None or v is False


def _is_empty(v: Any) -> bool:
    return v is None or v == [] or v == {} or v == ""


# parameters of OpenAI's API that minisgl does not implement -> the values that ask for nothing
_UNSUPPORTED_BOTH: dict[str, Callable[[Any], bool]] = {
    "store": _is_false,
}
_UNSUPPORTED_COMPLETION: dict[str, Callable[[Any], bool]] = {
    **_UNSUPPORTED_BOTH,
    "best_of": lambda v: v is None or (type(v) is int and v == 1),
    "suffix": _is_empty,
}
_UNSUPPORTED_CHAT: dict[str, Callable[[Any], bool]] = {
    **_UNSUPPORTED_BOTH,
    "tools": _is_empty,
    "tool_choice": lambda v: v is None or v == "none",
    "functions": _is_empty,
    "function_call": lambda v: v is None or v == "none",
    "modalities": lambda v: v is None or v == ["text"],
    "audio": _is_none,
    "prediction": _is_none,
    "reasoning_effort": _is_none,
    "verbosity": _is_none,
    "web_search_options": _is_none,
}

# SGLang's own fields, which its router (sglang-router) adds to every request it forwards, at these
# values (docs/scale-out.md); other values ask for what minisgl does not do
_SGLANG_FIELDS: dict[str, Callable[[Any], bool]] = {
    "no_stop_trim": _is_false,
    "skip_special_tokens": lambda v: v is None or v is True,
    "return_hidden_states": _is_false,
}
_UNSUPPORTED_COMPLETION.update(_SGLANG_FIELDS)
_UNSUPPORTED_CHAT.update(
    _SGLANG_FIELDS,
    continue_final_message=_is_false,
    stream_reasoning=lambda v: v is None or v is True,  # reasoning streams as it comes
)


def short(value: Any, limit: int = 60) -> str:
    """A value the client sent, for an error message: repr-quoted, at most `limit` characters."""
    cut = isinstance(value, str | bytes | list | tuple) and len(value) > limit  # repr only a prefix
    text = repr(value[:limit] if cut else value)
    return text if len(text) <= limit and not cut else text[: limit - 3] + "..."


def _param(loc: Sequence[int | str]) -> str:
    """('messages', 0, 'role') -> 'messages[0].role'."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _validation_error(e: ValidationError) -> APIError:
    err = e.errors(include_url=False)[0]
    param = _param(err["loc"])
    if err["type"] == "missing":
        return APIError(f"missing required parameter '{param}'", param=param)
    quoted = short(param, 100)
    if err["type"] == "extra_forbidden":
        return APIError(f"unknown parameter {quoted}; leave it out", param=param, code="unknown_parameter")
    message = err["msg"]
    custom = {
        "batch",
        "empty",
        "token_id",
        "prompt_type",
        "stop_type",
        "content_part",
        "limit",
        "template_kwargs",
        "logit_bias",
    }
    if err["type"] in custom:
        return APIError(f"invalid {quoted}: {message}", param=param)
    return APIError(f"invalid {quoted}: {message}, got {short(err['input'])}", param=param)


def check_unsupported(name: str, value: Any, unsupported: Mapping[str, Callable[[Any], bool]]) -> None:
    """A field the request model does not have: accepted if `unsupported[name]` takes its value (it
    asks for nothing); else a 400 naming it, "unsupported_parameter" or "unknown_parameter"."""
    if name not in unsupported:
        raise APIError(f"unknown parameter {short(name)}; leave it out", param=name, code="unknown_parameter")
    if not unsupported[name](value):
        raise APIError(
            f"parameter '{name}' is not supported by this server (got {name}={short(value)}); leave it out",
            param=name,
            code="unsupported_parameter",
        )


def _parse(
    cls: type[_GenerationRequest],
    body: Any,
    served_model: str,
    unsupported: Mapping[str, Callable[[Any], bool]],
    limits: Limits | None,
) -> Any:
    if not isinstance(body, dict):
        raise APIError(f"the request body must be a JSON object, got {type(body).__name__}")
    known = {}
    for name, value in body.items():
        if name in cls.model_fields:
            known[name] = value
        else:
            check_unsupported(name, value, unsupported)
    try:
        request = cls.model_validate(known, context={"limits": limits})
    except ValidationError as e:
        raise _validation_error(e) from None
    check_model(request.model, served_model)
    if request.stream_options is not None and not request.stream:
        raise APIError("stream_options is only allowed with stream: true", param="stream_options")
    if isinstance(request, ChatCompletionRequest):
        both = request.max_tokens, request.max_completion_tokens
        if None not in both and both[0] != both[1]:
            raise APIError(
                f"max_tokens={both[0]} and max_completion_tokens={both[1]} disagree: give only "
                "max_completion_tokens (max_tokens is its older name)",
                param="max_tokens",
            )
    return request


def parse_completion_request(body: Any, served_model: str, limits: Limits | None = None) -> CompletionRequest:
    """A `POST /v1/completions` body (the decoded JSON) as a checked request; APIError 400 or 404."""
    return _parse(CompletionRequest, body, served_model, _UNSUPPORTED_COMPLETION, limits)


def parse_chat_request(body: Any, served_model: str, limits: Limits | None = None) -> ChatCompletionRequest:
    """A `POST /v1/chat/completions` body as a checked request; APIError 400 or 404."""
    return _parse(ChatCompletionRequest, body, served_model, _UNSUPPORTED_CHAT, limits)


def context_exceeded(prompt_len: int, max_context: int, param: str) -> APIError:
    """The 400 of a prompt of `prompt_len` tokens that leaves no room in a context of `max_context`."""
    return APIError(
        f"the prompt has {prompt_len} tokens and this model's context holds {max_context} tokens "
        f"(prompt and reply together): shorten the prompt to at most {max_context - 1} tokens",
        param=param,
        code="context_length_exceeded",
    )


def sampling_params(
    request: CompletionRequest | ChatCompletionRequest, prompt_len: int, max_context: int
) -> list[SamplingParams]:
    """One SamplingParams per choice (`n`) for a prompt of `prompt_len` tokens on a model whose context
    holds `max_context` tokens (prompt and reply); APIError 400 when the request cannot run."""
    prompt_param = "messages" if isinstance(request, ChatCompletionRequest) else "prompt"
    if prompt_len < 1:
        raise APIError("the prompt is empty: give at least one token", param=prompt_param)
    room = max_context - prompt_len
    if room < 1:
        raise context_exceeded(prompt_len, max_context, prompt_param)
    name, max_tokens = request.max_tokens_param()
    echo = bool(getattr(request, "echo", False))
    if max_tokens is None:
        max_tokens = room
    elif max_tokens < (0 if echo else 1):
        raise APIError(
            f"{name} must be at least 1 (0 only with echo, to score a prompt), got {name}={max_tokens}",
            param=name,
        )
    elif max_tokens > room:
        raise APIError(
            f"{name}={max_tokens} and the prompt's {prompt_len} tokens make {prompt_len + max_tokens}, "
            f"more than this model's context of {max_context} tokens: ask for at most {room} tokens or "
            "shorten the prompt",
            param=name,
            code="context_length_exceeded",
        )
    given = {
        "top_p": request.top_p,
        "seed": request.seed,
        "top_k": request.top_k,
        "min_p": request.min_p,
        "min_tokens": request.min_tokens,
        "ignore_eos": request.ignore_eos,
        "stop": request.stop,
        "stop_token_ids": request.stop_token_ids,
        "logit_bias": request.logit_bias,
        "presence_penalty": request.presence_penalty,
        "frequency_penalty": request.frequency_penalty,
        "repetition_penalty": request.repetition_penalty,
        **_logprob_params(request),
    }
    temperature = 1.0 if request.temperature is None else request.temperature
    try:
        given.update(grammar_fields(request.response_format, request.regex, request.ebnf))
    except StructuredOutputError as e:
        raise APIError(str(e), param=e.param) from None
    try:
        params = SamplingParams(
            temperature=temperature,
            max_tokens=max_tokens,
            **{key: value for key, value in given.items() if value is not None},
        )
    except (TypeError, ValueError) as e:
        logprobs = "top_logprobs" if isinstance(request, ChatCompletionRequest) else "logprobs"
        raise invalid_request(
            e, {"max_tokens": name, "logprobs": logprobs, "prompt_logprobs": "logprobs"}
        ) from None
    n = request.n or 1
    if params.seed is None:
        return [params] * n
    if params.seed + n - 1 > INT64_MAX:
        raise APIError(
            f"seed={params.seed} with n={n}: choice i uses seed + i, which must stay below 2**63; "
            f"use a seed of at most {INT64_MAX - n + 1}",
            param="seed",
        )
    return [replace(params, seed=params.seed + i) for i in range(n)]


def _logprob_params(request: CompletionRequest | ChatCompletionRequest) -> dict[str, int | None]:
    """SamplingParams' `logprobs` and `prompt_logprobs` of a request (their ranges checked there)."""
    if isinstance(request, ChatCompletionRequest):
        k = request.top_logprobs
        if k is not None and not 0 <= k <= MAX_LOGPROBS:
            raise APIError(
                f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}] (the alternatives given per "
                f"token), got top_logprobs={k}",
                param="top_logprobs",
            )
        if not request.logprobs:
            if k:
                raise APIError(
                    f"top_logprobs={k} needs logprobs: true (it says how many alternatives each token's "
                    "log probability comes with)",
                    param="top_logprobs",
                )
            return {}
        return {"logprobs": k or 0}
    k = request.logprobs
    return {"logprobs": k, "prompt_logprobs": k if request.echo else None}


# ---------------------------------------------------------------------------------------------- responses


class Generation(Protocol):
    """One finished choice as the engine reports it (`minisgl.llm.RequestOutput` is one)."""

    text: str
    token_ids: list[int]
    finish_reason: str  # "stop", "length", "abort" or "error"
    error: str | None


def engine_unavailable(cause: str, restarting: bool) -> APIError:
    """The 503 of a request that the engine cannot serve because its process died: `engine_restarting`
    while it is being started again (retry), `engine_failed` when it will not be (the server exits,
    or a crash loop ended the restarts)."""
    if restarting:
        return APIError(
            f"the engine process died ({cause}); it is being started again: retry the request",
            status=503,
            type="server_error",
            code="engine_restarting",
        )
    return APIError(f"the engine failed: {cause}", status=503, type="server_error", code="engine_failed")


def openai_finish_reason(reason: str, error: str | None = None) -> Literal["stop", "length"]:
    """The engine's finish reason as OpenAI's; "error" and "abort" raise the APIError that replaces the
    choice (see the module docstring): a 400 where the request's grammar reached a dead end
    (`GrammarDeadEnd`), else a 500 (503 for "abort")."""
    if reason in ("stop", "length"):
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
    finish_reason: Literal["stop", "length"] | None = None,
    token_ids: Sequence[int] | None = None,
    created: int | None = None,
    reasoning_content: str | None = None,
    logprobs: dict[str, Any] | RawJSON | None = None,
) -> dict[str, Any]:
    """A `chat.completion.chunk` for choice `index`: the first carries ``role="assistant"`` (and
    ``content=""``), later ones ``content`` (and, with separate_reasoning, ``reasoning_content``), the
    last an empty delta and the finish_reason."""
    delta: dict[str, Any] = {}
    if role is not None:
        delta["role"] = role
    if reasoning_content is not None:
        delta["reasoning_content"] = reasoning_content
    if content is not None:
        delta["content"] = content
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


def model_card(model: str, *, created: int | None = None, owned_by: str = "minisgl") -> dict[str, Any]:
    """One `model` object (`GET /v1/models/{model}`)."""
    return {
        "id": model,
        "object": "model",
        "created": int(time.time()) if created is None else created,
        "owned_by": owned_by,
    }


def model_list(model: str, *, created: int | None = None, owned_by: str = "minisgl") -> dict[str, Any]:
    """The `GET /v1/models` list: the one served model."""
    return {"object": "list", "data": [model_card(model, created=created, owned_by=owned_by)]}


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
