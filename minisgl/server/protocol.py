"""The OpenAI API's requests: a body (the decoded JSON) in, a checked request out, as pydantic models
(`parse_completion_request`, `parse_chat_request`; APIError 400 / 404 when the body is wrong). Pure
functions, no HTTP and no engine. Values are checked in strict mode, never coerced; unknown and
unimplemented parameters are refused: docs/server.md ("Endpoints").

`minisgl.server.sampling` turns a request into SamplingParams, `minisgl.server.responses` writes the
answer, `minisgl.server.tools` handles chat's tools.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

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

from minisgl.server.errors import APIError, context_exceeded, short
from minisgl.server.structured import ResponseFormat
from minisgl.server.tools import HistoryToolCall, Tool, check_chat, parse_tool_choice
from minisgl.templates import check_template_kwargs

MAX_N = 128  # choices per request


@dataclass(frozen=True)
class Served:
    """The names the `model` field may take: the base model's, then its LoRA adapters' (docs/lora.md)."""

    base: str
    adapters: tuple[str, ...] = ()

    def adapter(self, requested: str) -> str | None:
        """The LoRA adapter `requested` names (None: the base model); `check_model`'s 404 if neither."""
        check_model(requested, self)
        return None if requested == self.base else requested


def check_model(requested: str, served: str | Served) -> None:
    """A 404 in OpenAI's "model_not_found" shape unless `requested` is the served model's name (or, with
    `served` a `Served`, one of its adapters')."""
    served = served if isinstance(served, Served) else Served(served)
    if requested != served.base and requested not in served.adapters:
        adapters = f" and the LoRA adapters {', '.join(served.adapters)}" if served.adapters else ""
        raise APIError(
            f"The model {short(requested)} does not exist; this server serves `{served.base}`{adapters} "
            "(see GET /v1/models)",
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
    """One message of a conversation. "developer" (OpenAI's newer name for system) becomes "system";
    an assistant's `tool_calls` reach the template with their arguments as objects, a tool message
    carries its `tool_call_id` (`minisgl.server.tools.check_chat`)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str, BeforeValidator(_content)] = ""
    name: str | None = None
    tool_calls: list[HistoryToolCall] | None = None
    tool_call_id: str | None = None

    def as_dict(self) -> dict[str, Any]:
        message: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": self.content,
        }
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls is not None:
            message["tool_calls"] = [call.as_dict() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
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
    """`POST /v1/chat/completions`: `messages` are plain dicts {"role", "content"[, "name",
    "tool_calls", "tool_call_id"]} with text content, ready for a chat template."""

    messages: Annotated[list[dict[str, Any]], BeforeValidator(_messages)]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None  # alternatives per token, with logprobs
    # tool calling (minisgl.server.tools)
    tools: list[Tool] | None = None
    tool_choice: Annotated[Any, BeforeValidator(parse_tool_choice)] = None
    parallel_tool_calls: bool | None = None
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
        "tool_choice",
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
    served_model: str | Served,
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
        check_chat(request.tools, request.tool_choice, request.messages)
    return request


def parse_completion_request(
    body: Any, served_model: str | Served, limits: Limits | None = None
) -> CompletionRequest:
    """A `POST /v1/completions` body (the decoded JSON) as a checked request; APIError 400 or 404."""
    return _parse(CompletionRequest, body, served_model, _UNSUPPORTED_COMPLETION, limits)


def parse_chat_request(
    body: Any, served_model: str | Served, limits: Limits | None = None
) -> ChatCompletionRequest:
    """A `POST /v1/chat/completions` body as a checked request; APIError 400 or 404."""
    return _parse(ChatCompletionRequest, body, served_model, _UNSUPPORTED_CHAT, limits)
