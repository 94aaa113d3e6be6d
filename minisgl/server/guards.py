"""The request guards: what a request must pass before a route does any work for it, each refusal an
OpenAI error body (`error_response`): `Guard` (Host, Origin, API key, content type), `read_body` (size
limits), `load_json` (a bounded, well-formed JSON object) and `why_unavailable` (starting, failed,
shutting down). Limits and answers: docs/server.md ("Security"). The connections themselves are guarded
below the app (`minisgl.server.connections`).
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import re
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from minisgl.server.errors import LONE_SURROGATE, APIError, engine_unavailable, error_body, short
from minisgl.server.state import ServerState

BODY_BUDGET = 32  # request bodies read at the same time hold at most this many times max_request_bytes


def error_response(e: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(e), status_code=e.status, headers=headers)


LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
# with an API key, these need it too (besides /v1/*): all but /health and /metrics
KEYED_PATHS = frozenset(
    {
        "/flush_cache",
        "/generate",
        "/server_info",
        "/get_server_info",
        "/model_info",
        "/get_model_info",
        "/get_load",
    }
)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _host_name(value: bytes) -> str:
    """The name in a Host header: "127.0.0.1:8000" -> "127.0.0.1", "[::1]:8000" -> "::1"."""
    host = value.decode("latin-1").strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class Guard:
    """What every request passes before the app (a plain ASGI middleware: responses, streams included,
    pass through untouched), in order: `Host` (403), `Origin` and CORS (403), with an API key the
    `Authorization` header on /v1/* and KEYED_PATHS (401), a POST's JSON content type (415). Each rule
    and why: docs/server.md#security."""

    def __init__(self, app: Any, server: Any) -> None:
        self.app = app
        self.key = None if server.api_key is None else server.api_key.encode()
        hosts = server.allowed_hosts
        if hosts is None and _is_loopback(server.host):
            hosts = (*LOOPBACK_HOSTS, server.host)
        self.hosts = None if hosts is None or "*" in hosts else frozenset(h.lower() for h in hosts)
        self.origins = frozenset(server.cors_allow_origins or ())

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        first: dict[bytes, bytes] = {}  # each header's first value
        for name, value in scope["headers"]:
            first.setdefault(name, value)
        host, origin, auth = first.get(b"host"), first.get(b"origin"), first.get(b"authorization")
        ctype, length, chunked = (
            first.get(b"content-type"),
            first.get(b"content-length"),
            first.get(b"transfer-encoding"),
        )
        error = None
        if self.hosts is not None and host is not None and _host_name(host) not in self.hosts:
            shown = short(host.decode("latin-1"))
            error = (
                403,
                "host_not_allowed",
                f"this server does not answer to the Host {shown}; see --allowed-hosts",
            )
        elif origin is not None and origin.decode("latin-1") not in self.origins:
            shown = short(origin.decode("latin-1"))
            error = (
                403,
                "origin_not_allowed",
                f"requests from the web origin {shown} are not allowed; see --cors-allow-origins",
            )
        elif origin is not None and scope["method"] == "OPTIONS":  # a CORS preflight of an allowed origin
            headers = _cors_headers(origin.decode("latin-1"), True)
            return await Response(status_code=204, headers=headers)(scope, receive, send)
        elif self.key is not None and (scope["path"].startswith("/v1/") or scope["path"] in KEYED_PATHS):
            scheme, _, given = (auth or b"").strip().partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(given.strip(), self.key):
                error = (
                    401,
                    "invalid_api_key",
                    "a valid API key is required: send the header Authorization: Bearer KEY",
                )
        if (
            error is None
            and scope["method"] == "POST"
            and (chunked or (length or b"0").strip() not in (b"0", b""))
        ):
            if (ctype or b"").split(b";", 1)[0].strip().lower() != b"application/json":
                shown = "none" if ctype is None else short(ctype.decode("latin-1"))
                message = f"the request body must be JSON with the header Content-Type: application/json (got {shown})"
                error = (415, "unsupported_media_type", message)
        if error is not None:
            status, code, message = error
            return await error_response(APIError(message, status=status, code=code))(scope, receive, send)
        if origin is not None:
            send = _with_cors(send, origin.decode("latin-1"))
        await self.app(scope, receive, send)


def _cors_headers(origin: str, preflight: bool) -> dict[str, str]:
    headers = {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}
    if preflight:
        headers |= {
            "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
            "Access-Control-Allow-Headers": "Authorization, Content-Type",
            "Access-Control-Max-Age": "600",
        }
    return headers


def _with_cors(send: Any, origin: str) -> Any:
    extra = [(k.lower().encode(), v.encode()) for k, v in _cors_headers(origin, False).items()]

    async def send_with_cors(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), *extra]}
        await send(message)

    return send_with_cors


async def read_body(state: ServerState, request: Request) -> bytes:
    """The request's body: 413 past `max_request_bytes`, 503 when the bodies being read at the same
    time would hold more than BODY_BUDGET times that (memory stays bounded whatever the clients)."""
    limit = state.server.max_request_bytes
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise APIError(f"the request body has {length} bytes, more than the limit of {limit}", status=413)
    parts, size = [], 0
    try:
        async for part in request.stream():
            parts.append(part)
            size += len(part)
            state.body_bytes += len(part)
            if size > limit:
                raise APIError(f"the request body is larger than the limit of {limit} bytes", status=413)
            if state.body_bytes > BODY_BUDGET * limit:
                raise APIError(
                    "the server is reading too many large request bodies at once; retry later",
                    status=503,
                    type="server_error",
                    code="server_overloaded",
                )
        return b"".join(parts)
    finally:
        state.body_bytes -= size


def why_unavailable(state: ServerState) -> APIError | None:
    """The 503 that says why the server does not serve now (None when it does)."""
    client = state.client
    if client is not None and client.failed is not None:
        return engine_unavailable(client.failed, getattr(client, "restarting", False))
    if not state.ready:
        return APIError(
            "the server is starting; retry when GET /health answers 200", status=503, type="server_error"
        )
    if state.draining:
        return APIError("the server is shutting down", status=503, type="server_error")
    return None


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
            if isinstance(key, str) and LONE_SURROGATE.search(key):
                raise APIError(
                    f"the request body holds a lone surrogate in the name of a field of {where or 'the body'}; "
                    "send valid Unicode",
                    param=where or None,
                )
            if isinstance(item, str) and (match := LONE_SURROGATE.search(item)):
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
