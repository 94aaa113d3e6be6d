"""The HTTP client of `minisgl-run bench-serving`: each request on its own HTTP/1.1 connection
(`Connection: close`) over an asyncio protocol, its response read and measured as the bytes arrive.

No HTTP library sits between the socket and the measurement: `_Response` parses the status line and
headers, undoes `Transfer-Encoding: chunked` (or counts a `Content-Length`, or reads to the end of the
connection), and `_Measured` splits the body into server-sent events and handles each one in the
callback that received its bytes, so every event is timed at the moment its bytes arrived and costs
one JSON parse (orjson when importable, else json). Handled: non-2xx statuses (the error message of
their JSON body), error events (`data: {"error": ...}`), `data: [DONE]`, a connection dropped before
the response ended, and non-streamed JSON responses (a server that streams anyway is read as a stream).

`run_loop` runs a coroutine in a fresh event loop, uvloop's when importable.
"""

from __future__ import annotations

import asyncio
import json
import socket
import ssl as ssl_module
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

try:  # optional: about three times faster than json on the small objects of a stream
    import orjson

    _loads = orjson.loads
except ImportError:  # pragma: no cover - depends on the environment
    _loads = json.loads

MAX_HEAD = 64 * 1024  # bytes of status line and headers
MAX_BODY = 64 * 1024 * 1024  # bytes of a non-streamed body kept
CANCELLED = "cancelled: the benchmark's --timeout ran out"


@dataclass
class RequestResult:
    """What one request measured. Times in seconds; `start` is relative to the benchmark's start.

    `prompt_tokens` is the server's `usage.prompt_tokens` when it sent one (`prompt_tokens_source`
    "usage"), else the client's count ("client"). `output_tokens` comes from `usage.completion_tokens`
    ("usage"), else from the `token_ids` of the chunks ("token_ids"), else one per chunk with text
    ("chunks"); `output_tokens_source` says which. `n` is the number of choices asked for."""

    prompt_tokens: int
    max_tokens: int
    success: bool = False
    error: str | None = None
    start: float = 0.0
    ttft: float | None = None
    latency: float | None = None
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    chunks: int = 0
    n: int = 1
    prompt_tokens_source: str = "client"
    output_tokens_source: str = "none"

    @property
    def tpot(self) -> float | None:
        """(E2E - TTFT) / (output tokens - 1); with n choices, per choice: the tokens are output / n."""
        if not self.success or self.ttft is None or self.latency is None:
            return None
        per_choice = self.output_tokens / max(self.n, 1)
        if per_choice < 2:
            return None
        return (self.latency - self.ttft) / (per_choice - 1)


@dataclass(frozen=True)
class Server:
    """Where requests go: the API root of `base_url` (`http://host:port/v1`), resolved once."""

    host: str
    port: int
    prefix: str
    tls: bool
    address: str  # the resolved IP the connections go to
    api_key: str

    @classmethod
    def parse(cls, base_url: str, api_key: str = "EMPTY") -> Server:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"base_url must be http://HOST[:PORT]/PATH or https://..., got {base_url!r}")
        tls = parts.scheme == "https"
        port = parts.port or (443 if tls else 80)
        try:
            infos = socket.getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)
        except OSError as e:
            raise RuntimeError(f"cannot resolve {parts.hostname}: {e}") from e
        address = infos[0][4][0]
        return cls(parts.hostname, port, parts.path.rstrip("/"), tls, address, api_key)

    @property
    def base_url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.port}{self.prefix}"

    def request(self, method: str, path: str, body: bytes | None = None) -> bytes:
        """The bytes of one HTTP/1.1 request to `{prefix}{path}`, which closes its connection."""
        host = self.host if ":" not in self.host else f"[{self.host}]"
        head = (
            f"{method} {self.prefix}{path} HTTP/1.1\r\nHost: {host}:{self.port}\r\n"
            f"Authorization: Bearer {self.api_key}\r\nUser-Agent: minisgl-bench-serving\r\n"
            "Accept: application/json, text/event-stream\r\nConnection: close\r\n"
        )
        if body is not None:
            head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        return (head + "\r\n").encode("latin-1") + (body or b"")

    async def connect(self, protocol: asyncio.Protocol) -> asyncio.Transport:
        loop = asyncio.get_running_loop()
        context = ssl_module.create_default_context() if self.tls else None
        transport, _ = await loop.create_connection(
            lambda: protocol,
            self.address,
            self.port,
            ssl=context,
            server_hostname=self.host if self.tls else None,
        )
        return transport


class _Response(asyncio.Protocol):
    """One request written on connect; the response's head parsed and its body unframed. Subclasses
    get the body through `body_received(payload, now)` and its end through `body_ended(now)`;
    `fail(message)` ends the exchange with an error. `done` resolves when the exchange is over."""

    def __init__(self, request: bytes) -> None:
        self.request = request
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.transport: asyncio.Transport | None = None
        self.head = bytearray()
        self.status: int | None = None
        self.headers: dict[str, str] = {}
        self.chunked = False
        self.length: int | None = None  # Content-Length left to read
        self.chunk_left = 0  # bytes left in the current chunk
        self.chunk_crlf = False  # the CRLF after a chunk's data is next
        self.frames = bytearray()  # chunked framing not parsed yet
        self.finished = False

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        transport.write(self.request)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        if self.finished:
            return
        now = time.perf_counter()
        if self.status is None:
            self.head += data
            data = self._parse_head()
            if self.status is None or self.finished:
                return
        if self.chunked:
            self._unchunk(data, now)
        elif self.length is not None:
            if len(data) >= self.length:
                data, self.length = data[: self.length], 0
            else:
                self.length -= len(data)
            if data:
                self.body_received(data, now)
            if self.length == 0 and not self.finished:
                self.body_ended(now)
        elif data:
            self.body_received(data, now)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.finished:
            return
        if self.status is not None and not self.chunked and self.length is None:
            self.body_ended(time.perf_counter())  # a body delimited by the end of the connection
        else:
            reason = f": {exc}" if exc else ""
            self.fail(f"ConnectionError: the server closed the connection before the response ended{reason}")

    # -- framing

    def _parse_head(self) -> bytes:
        while True:
            end = self.head.find(b"\r\n\r\n")
            if end < 0:
                if len(self.head) > MAX_HEAD:
                    self.fail("ProtocolError: the response's headers are too long")
                return b""
            lines = bytes(self.head[:end]).decode("latin-1").split("\r\n")
            rest = bytes(self.head[end + 4 :])
            parts = lines[0].split(" ", 2)
            if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
                self.fail(f"ProtocolError: not an HTTP response: {lines[0][:100]!r}")
                return b""
            status = int(parts[1])
            if 100 <= status < 200:  # 100 Continue and the like: the real response follows
                self.head = bytearray(rest)
                continue
            headers = {}
            for line in lines[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            self.status, self.headers = status, headers
            self.head = bytearray()
            if "chunked" in headers.get("transfer-encoding", "").lower():
                self.chunked = True
            elif "content-length" in headers:
                try:
                    self.length = int(headers["content-length"])
                except ValueError:
                    self.fail(f"ProtocolError: bad Content-Length {headers['content-length']!r}")
                    return b""
            self.head_received()
            if self.length == 0 and not self.finished:
                self.body_ended(time.perf_counter())
            return rest

    def _unchunk(self, data: bytes, now: float) -> None:
        if self.frames:
            self.frames += data
            data = bytes(self.frames)
            self.frames = bytearray()
        pos, size, out = 0, len(data), []
        left, crlf = self.chunk_left, self.chunk_crlf
        while True:
            if left:
                end = pos + left
                if end > size:
                    out.append(data[pos:])
                    left -= size - pos
                    pos = size
                    break
                out.append(data[pos:end])
                pos, left, crlf = end, 0, True
            if crlf:
                if size - pos < 2:
                    break
                pos += 2
                crlf = False
            eol = data.find(b"\r\n", pos)
            if eol < 0:
                break
            try:
                length = int(data[pos:eol], 16)
            except ValueError:
                try:
                    length = int(data[pos:eol].split(b";", 1)[0], 16)  # a chunk extension
                except ValueError:
                    self.fail("ProtocolError: bad chunk size in a chunked response")
                    return
            pos = eol + 2
            if length == 0:  # the last chunk (trailers, if any, are not read)
                self.chunk_left, self.chunk_crlf = 0, False
                if out:
                    self.body_received(b"".join(out), now)
                if not self.finished:
                    self.body_ended(now)
                return
            left = length
        self.chunk_left, self.chunk_crlf = left, crlf
        if pos < size:
            self.frames += data[pos:]
        if out:
            self.body_received(out[0] if len(out) == 1 else b"".join(out), now)

    # -- for subclasses

    def head_received(self) -> None:
        pass

    def body_received(self, payload: bytes, now: float) -> None:
        raise NotImplementedError

    def body_ended(self, now: float) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self.finished = True
        if self.transport is not None:
            self.transport.close()
        if not self.done.done():
            self.done.set_result(None)

    def fail(self, message: str) -> None:
        self.on_error(message)
        if self.transport is not None:
            self.transport.abort()
        self.close()

    def on_error(self, message: str) -> None:
        pass


def error_message(status: int, body: bytes) -> str:
    """`HTTP {status}: {message}`, the message taken from OpenAI's error body when it has one."""
    try:
        obj = json.loads(body)
    except ValueError:
        obj = None
    message: Any = None
    if isinstance(obj, dict):
        error = obj.get("error", obj.get("detail"))
        message = error.get("message", error) if isinstance(error, dict) else error
    if message is None:
        message = body.decode("utf-8", "replace").strip()[:500] or "(empty body)"
    return f"HTTP {status}: {message}"


class _JSONResponse(_Response):
    """A plain request: the status and the whole body."""

    def __init__(self, request: bytes) -> None:
        super().__init__(request)
        self.body = bytearray()
        self.error: str | None = None

    def body_received(self, payload: bytes, now: float) -> None:
        self.body += payload
        if len(self.body) > MAX_BODY:
            self.fail("ProtocolError: the response body is too long")

    def body_ended(self, now: float) -> None:
        self.close()

    def on_error(self, message: str) -> None:
        self.error = message


async def get_json(server: Server, path: str) -> Any:
    """`GET {prefix}{path}`'s JSON body; RuntimeError on an error status or a broken response."""
    exchange = _JSONResponse(server.request("GET", path))
    transport = await server.connect(exchange)
    try:
        await exchange.done
    finally:
        transport.close()
    if exchange.error is not None:
        raise RuntimeError(f"GET {server.prefix}{path}: {exchange.error}")
    body = bytes(exchange.body)
    if not 200 <= (exchange.status or 0) < 300:
        raise RuntimeError(f"GET {server.prefix}{path}: {error_message(exchange.status or 0, body)}")
    try:
        return json.loads(body)
    except ValueError as e:
        raise RuntimeError(f"GET {server.prefix}{path}: the body is not JSON ({e})") from None


class _Measured(_Response):
    """A generation request, measured into `result` as its response arrives (see bench_serving)."""

    def __init__(self, request: bytes, result: RequestResult, started: float) -> None:
        super().__init__(request)
        self.result = result
        self.started = started
        self.stream = False
        self.body = bytearray()  # a non-streamed body, or an error status's body
        self.lines = bytearray()  # an SSE line not complete yet
        self.event: bytes | None = None  # the data of an event whose blank line has not come yet
        self.last: dict[int, float] = {}  # per choice: the time of its last chunk with tokens
        self.id_tokens = 0
        self.chunk_tokens = 0
        self.usage_completion: int | None = None
        self.usage_prompt: int | None = None
        self.seen_done = False

    def head_received(self) -> None:
        status = self.status or 0
        content_type = self.headers.get("content-type", "")
        self.stream = 200 <= status < 300 and content_type.startswith("text/event-stream")

    def body_received(self, payload: bytes, now: float) -> None:
        if not self.stream:
            self.body += payload
            if len(self.body) > MAX_BODY:
                self.fail("ProtocolError: the response body is too long")
            return
        if self.lines:
            self.lines += payload
            payload = bytes(self.lines)
            self.lines = bytearray()
        end = payload.rfind(b"\n")
        if end < 0:
            self.lines += payload
            return
        if end + 1 < len(payload):
            self.lines += payload[end + 1 :]
        lines = payload[:end].split(b"\n")
        event = self.event
        for line in lines:
            if line[:5] == b"data:":
                data = line[6:] if line[5:6] == b" " else line[5:]
                if data[-1:] == b"\r":
                    data = data[:-1]
                event = data if event is None else event + b"\n" + data
            elif line == b"" or line == b"\r":  # the blank line that ends an event
                if event is not None:
                    self.event = None
                    self._on_event(event, now)
                    if self.finished:
                        return
                    event = None
            # other fields (event:, id:, retry:) and comments (":") carry nothing here
        self.event = event

    def _object(self, data: bytes, what: str, error_prefix: str) -> dict[str, Any] | None:
        """`data` as a JSON object, its usage taken; None (the request failed) if it is not one or it
        is an error object."""
        try:
            obj = _loads(data)
        except ValueError:
            self.fail(f"ProtocolError: {what} is not JSON: {data[:200]!r}")
            return None
        if type(obj) is not dict:
            self.fail(f"ProtocolError: {what} is not a JSON object: {data[:200]!r}")
            return None
        if "error" in obj:
            error = obj["error"]
            message = error.get("message", error) if isinstance(error, dict) else error
            self.fail(f"APIError: {error_prefix}{message}")
            return None
        if obj.get("usage"):
            self._usage(obj["usage"])
        return obj

    def _on_event(self, data: bytes, now: float) -> None:
        if data == b"[DONE]":
            self.seen_done = True
            self._succeed(now)
            return
        obj = self._object(data, "an event", "an error event in the stream: ")
        if obj is None:
            return
        for choice in obj.get("choices") or ():
            ids = choice.get("token_ids")
            if ids is not None:
                tokens = len(ids)
                self.id_tokens += tokens
            else:
                text = choice.get("text")
                if text is None:
                    delta = choice.get("delta")
                    text = delta.get("content") if delta else None
                tokens = 1 if text else 0
                self.chunk_tokens += tokens
            if tokens == 0:
                continue  # a choice's final chunk (finish_reason only), the role chunk, an empty one
            result = self.result
            result.chunks += 1
            index = choice.get("index", 0)
            last = self.last.get(index)
            if last is None:  # the choice's first tokens: no gap before them
                if result.ttft is None:
                    result.ttft = now - self.started
            elif tokens == 1:
                result.itl.append(now - last)
            else:  # SGLang's adjustment: a chunk of k tokens adds k gaps of gap / k
                result.itl.extend([(now - last) / tokens] * tokens)
            self.last[index] = now

    def _usage(self, usage: Any) -> None:
        if isinstance(usage, dict):
            completion, prompt = usage.get("completion_tokens"), usage.get("prompt_tokens")
            if isinstance(completion, int):
                self.usage_completion = completion
            if isinstance(prompt, int):
                self.usage_prompt = prompt

    def body_ended(self, now: float) -> None:
        status = self.status or 0
        if not 200 <= status < 300:
            self.fail(error_message(status, bytes(self.body)))
        elif self.stream:
            if self.lines.strip():  # a last line without its newline
                self.body_received(b"\n\n", now)
            if self.event is not None and not self.finished:
                event, self.event = self.event, None
                self._on_event(event, now)
            if not self.finished:
                self._succeed(now)
        else:
            self._whole_body(now)

    def _whole_body(self, now: float) -> None:
        """A non-streamed response: TTFT is the latency; tokens from usage, else the choices' token_ids."""
        obj = self._object(bytes(self.body), "the response", "")
        if obj is None:
            return
        for choice in obj.get("choices") or ():
            ids = choice.get("token_ids")
            if isinstance(ids, list):
                self.id_tokens += len(ids)
        self.result.chunks = 1
        self.result.ttft = now - self.started
        self._succeed(now)

    def _succeed(self, now: float) -> None:
        result = self.result
        result.latency = now - self.started
        self._count()
        result.success = True
        self.close()

    def _count(self) -> None:
        result = self.result
        if self.usage_completion is not None:
            result.output_tokens, result.output_tokens_source = self.usage_completion, "usage"
        elif self.id_tokens:
            result.output_tokens = self.id_tokens + self.chunk_tokens
            result.output_tokens_source = "token_ids"
        elif self.chunk_tokens:
            result.output_tokens, result.output_tokens_source = self.chunk_tokens, "chunks"
        else:
            result.output_tokens, result.output_tokens_source = 0, "none"
        if self.usage_prompt is not None:
            result.prompt_tokens, result.prompt_tokens_source = self.usage_prompt, "usage"

    def on_error(self, message: str) -> None:
        if self.result.error is None:
            self.result.error = message
        self._count()


async def measure(server: Server, request: bytes, result: RequestResult, t0: float) -> None:
    """Sends `request` (bytes from `Server.request`) on a new connection and measures its response into
    `result` (success, error, times, tokens). Cancelled (the run's timeout), the connection is dropped
    and `result` keeps what came so far."""
    started = time.perf_counter()
    result.start = started - t0
    exchange = _Measured(request, result, started)
    try:
        await server.connect(exchange)
        await exchange.done
    except asyncio.CancelledError:
        if not exchange.finished:
            exchange.fail(CANCELLED)
        raise
    except OSError as e:  # refused, reset, unreachable, TLS...
        exchange.fail(f"{type(e).__name__}: {e}")


def run_loop(coro: Any, use_uvloop: bool = True) -> Any:
    """`asyncio.run(coro)`, on uvloop's event loop when `use_uvloop` and it is importable."""
    if use_uvloop:
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.run(coro)
    return asyncio.run(coro)


def loop_name(use_uvloop: bool = True) -> str:
    """The event loop `run_loop` uses: "uvloop" or "asyncio"."""
    if use_uvloop:
        try:
            import uvloop  # noqa: F401
        except ImportError:
            return "asyncio"
        return "uvloop"
    return "asyncio"
