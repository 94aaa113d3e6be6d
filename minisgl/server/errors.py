"""The errors of the server's HTTP API, in OpenAI's shape: `APIError` (an HTTP status and OpenAI's
error fields) and its body `{"error": {...}}` (`error_body`), an error event once a stream has begun;
plus the errors raised in several places (`invalid_request`, `context_exceeded`,
`engine_unavailable`). A message never echoes a large value (`short`) nor a lone surrogate. Pure
functions, no HTTP and no engine; docs/server.md#security.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import fields as dataclass_fields
from typing import Any

from minisgl.core import SamplingParams
from minisgl.server.structured import GRAMMAR_PARAMS

MAX_MESSAGE_CHARS, MAX_PARAM_CHARS = 2000, 200  # an error never echoes a large value back
LONE_SURROGATE = re.compile("[\ud800-\udfff]")


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


def _encodable(text: str, limit: int) -> str:
    """`text` cut to `limit` characters, its lone surrogates (which UTF-8 cannot encode) escaped."""
    if not text.isascii() and LONE_SURROGATE.search(text):
        text = LONE_SURROGATE.sub(_escape, text[:limit])
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _escape(match: re.Match[str]) -> str:
    return f"\\u{ord(match.group()):04x}"


def error_body(error: APIError) -> dict[str, Any]:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": error.message, "type": error.type, "param": error.param, "code": error.code}}


def short(value: Any, limit: int = 60) -> str:
    """A value the client sent, for an error message: repr-quoted, at most `limit` characters."""
    cut = isinstance(value, str | bytes | list | tuple) and len(value) > limit  # repr only a prefix
    text = repr(value[:limit] if cut else value)
    return text if len(text) <= limit and not cut else text[: limit - 3] + "..."


_SAMPLING_FIELDS = frozenset(f.name for f in dataclass_fields(SamplingParams))


def invalid_request(exc: Exception, aliases: Mapping[str, str] | None = None) -> APIError:
    """A 400 from the TypeError / ValueError of SamplingParams (or of the engine's request checks): the
    message stays, `param` is the field it starts with ("top_p must be ..."), renamed by `aliases`."""
    message = str(exc)
    first = message.split(" ", 1)[0]
    param = first if first in _SAMPLING_FIELDS else None
    aliases = {**GRAMMAR_PARAMS, **(aliases or {})}  # structured output: the request's own field names
    return APIError(message, param=param and aliases.get(param, param))


def context_exceeded(prompt_len: int, max_context: int, param: str) -> APIError:
    """The 400 of a prompt of `prompt_len` tokens that leaves no room in a context of `max_context`."""
    return APIError(
        f"the prompt has {prompt_len} tokens and this model's context holds {max_context} tokens "
        f"(prompt and reply together): shorten the prompt to at most {max_context - 1} tokens",
        param=param,
        code="context_length_exceeded",
    )


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
