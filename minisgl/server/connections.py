"""The server's connections, guarded: uvicorn's HTTP protocol (httptools) with the limits a server
exposed to slow or hostile clients needs, which uvicorn leaves out: timeouts, a cap on open connections
(the oldest idle one evicted, O(1) through `GuardedHttpProtocol.idle`), bounded request heads, and
rate-limited warnings (`LOG_EVERY_S`). Limits and answers: docs/server.md ("Security").
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import resource
import time
from collections import OrderedDict
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from minisgl.server.errors import APIError, error_body, short

logger = logging.getLogger(__name__)

MAX_URL_BYTES = 8 << 10
MAX_HEADER_BYTES = 64 << 10
MAX_HEADERS = 200
# body bytes read ahead of the app (uvicorn: 64 KiB, a wake-up of the app per 64 KiB of a large body)
BODY_BUFFER_BYTES = 256 << 10
LOG_EVERY_S = 10.0
FD_RESERVE = 128  # descriptors kept for everything but client connections (sockets, pipes, files)
REASONS = {408: "Request Timeout", 414: "URI Too Long", 431: "Request Header Fields Too Large"}


class RateLimitedLog:
    """Logs a message of each kind at most once per `every` seconds; the next one says how many were
    left out in between."""

    def __init__(self, every: float = LOG_EVERY_S) -> None:
        self.every = every
        self._last: dict[str, float] = {}
        self._dropped: dict[str, int] = {}

    def __call__(self, kind: str, level: int, message: str, *args: Any, exc_info: Any = None) -> None:
        now = time.monotonic()
        if now - self._last.get(kind, -self.every) < self.every:
            self._dropped[kind] = self._dropped.get(kind, 0) + 1
            return
        self._last[kind] = now
        dropped = self._dropped.pop(kind, 0)
        if dropped:
            message += f" ({dropped} more like it in the last {self.every:.0f} s not logged)"
        logger.log(level, message, *args, exc_info=exc_info)


log_limited = RateLimitedLog()


def loop_exception_handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """The event loop's errors (an accept that fails when descriptors run out, for one), rate-limited:
    one line per kind per LOG_EVERY_S, without a traceback."""
    exc = context.get("exception")
    kind = f"{context.get('message')}|{type(exc).__name__}"
    log_limited(kind, logging.ERROR, "event loop: %s: %r", context.get("message"), exc)


def raise_open_file_limit() -> int:
    """Raises the soft limit on open files to the hard one (as servers do); returns the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def connection_cap(wanted: int) -> int:
    """`wanted`, lowered so that client connections leave FD_RESERVE descriptors (and those open now)
    free under the open-file limit, once raised to the hard limit (`raise_open_file_limit`)."""
    soft = raise_open_file_limit()
    if soft == resource.RLIM_INFINITY:
        return wanted
    in_use = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 64
    cap = min(wanted, soft - in_use - FD_RESERVE)
    if cap < wanted:
        logger.warning(
            "at most %d open connections (max_connections=%d; open-file limit %d): raise the limit "
            "(ulimit -n) for more",
            max(cap, 1),
            wanted,
            soft,
        )
    return max(cap, 1)


def raw_response(status: int, error: APIError, reason: str = "") -> bytes:
    """A whole HTTP/1.1 response with an OpenAI error body that closes the connection."""
    body = json.dumps(error_body(error)).encode()
    head = (
        f"HTTP/1.1 {status} {reason or REASONS.get(status, 'Error')}\r\n"
        "content-type: application/json\r\n"
        f"content-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode() + body


class _Refused(Exception):
    """Raised in a parser callback (the parser then fails, and uvicorn calls `send_400_response`): the
    request is answered `status` and the connection closed."""

    def __init__(self, status: int, error: APIError) -> None:
        super().__init__(error.message)
        self.status, self.error = status, error


def protocol_class(limits: Any, max_connections: int) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol (uvicorn.Config(http=...)) with the timeouts of `limits` (a
    ServerConfig: idle_timeout_s, header_timeout_s, body_timeout_s) and a cap of `max_connections`."""
    fields = {"limits": limits, "max_connections": max_connections, "idle": OrderedDict()}
    return type("GuardedHttpProtocol", (GuardedHttpProtocol,), fields)


class GuardedHttpProtocol(HttpToolsProtocol):
    limits: Any  # set by protocol_class
    max_connections: int
    idle: OrderedDict[GuardedHttpProtocol, None]  # the connections with no request in flight, oldest first

    _timer: asyncio.TimerHandle | None = None  # the idle, head or body timeout
    _stall: asyncio.TimerHandle | None = None  # the send timeout, while the client reads nothing
    _refusal: _Refused | None = None
    _head_bytes = 0

    # -- the connection

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        if len(self.connections) > self.max_connections and not self._evict_idle():
            log_limited(
                "connections",
                logging.WARNING,
                "%d open connections, each with a request in flight: refusing more",
                len(self.connections) - 1,
            )
            error = APIError(
                f"the server has {self.max_connections} open connections, its limit; retry later",
                status=503,
                type="server_error",
                code="too_many_connections",
            )
            self._answer(503, error, "Service Unavailable")
            return
        self._arm(self.limits.idle_timeout_s, self._idle)
        self.idle[self] = None

    def _evict_idle(self) -> bool:
        """Closes the connection idle the longest (if any) to make room for this one."""
        if not self.idle:
            return False
        oldest, _ = self.idle.popitem(last=False)
        oldest._disarm()
        oldest.transport.close()
        log_limited(
            "evicted",
            logging.WARNING,
            "at the limit of %d open connections: closing the oldest idle one for each new one",
            self.max_connections,
        )
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self.idle.pop(self, None)
        self._disarm()
        if self._stall is not None:
            self._stall.cancel()
        super().connection_lost(exc)

    def pause_writing(self) -> None:  # the client reads nothing: it has send_timeout_s to start again
        super().pause_writing()
        if self._stall is None:
            self._stall = self.loop.call_later(self.limits.send_timeout_s, self._stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None

    def _stalled(self) -> None:
        """The client read nothing for send_timeout_s: the connection is dropped, which ends its request
        (a stream's request is aborted, its pages freed) rather than holding it forever."""
        self._stall = None
        seconds = self.limits.send_timeout_s
        log_limited(
            "stalled", logging.INFO, "dropped a connection whose client read nothing for %g s", seconds
        )
        self.transport.abort()

    def data_received(self, data: bytes) -> None:  # uvicorn's, without its warning per bad request
        if self.transport.is_closing():
            return
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
        except httptools.HttpParserError as e:
            self.send_400_response(str(e))

    def _arm(self, seconds: float, callback: Any) -> None:
        self._disarm()
        self._timer = self.loop.call_later(seconds, callback)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _idle(self) -> None:
        self._timer = None
        if not self.transport.is_closing():
            self.transport.close()

    def _answer(self, status: int, error: APIError, reason: str = "") -> None:
        """Answers `error` (when no response has begun) and closes the connection."""
        self._disarm()
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is None or not cycle.response_started:
            self.transport.write(raw_response(status, error, reason))
        if cycle is not None:  # the app sees a client gone: its response, if any, goes nowhere
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()

    def _too_slow(self, what: str, seconds: float) -> None:
        self._timer = None
        log_limited(
            "timeout", logging.INFO, "closed a connection whose %s took more than %g s", what, seconds
        )
        self._answer(
            408,
            APIError(
                f"the request's {what} did not arrive within {seconds:g} s; send it at once",
                status=408,
                code="request_timeout",
            ),
        )

    # -- the parser's callbacks

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_bytes = 0
        seconds = self.limits.header_timeout_s
        self._arm(seconds, lambda: self._too_slow("request line and headers", seconds))

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        if len(self.url) > MAX_URL_BYTES:
            self._refuse(414, APIError(f"the URL is longer than {MAX_URL_BYTES} bytes", status=414))

    def on_header(self, name: bytes, value: bytes) -> None:
        super().on_header(name, value)
        self._head_bytes += len(name) + len(value)
        if self._head_bytes > MAX_HEADER_BYTES or len(self.headers) > MAX_HEADERS:
            error = APIError(
                f"the request's headers are larger than {MAX_HEADER_BYTES} bytes or more than {MAX_HEADERS}",
                status=431,
            )
            self._refuse(431, error)

    def _refuse(self, status: int, error: APIError) -> None:
        self._refusal = _Refused(status, error)
        raise self._refusal

    def on_headers_complete(self) -> None:  # a request in flight: the connection is no longer idle
        self.idle.pop(self, None)
        seconds = self.limits.body_timeout_s
        self._arm(seconds, lambda: self._too_slow("body", seconds))
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:  # uvicorn's, with a larger buffer before reading pauses
        cycle = self.cycle
        if (self.parser.should_upgrade() and self._should_upgrade()) or cycle.response_complete:
            return
        cycle.body += body
        if len(cycle.body) > BODY_BUFFER_BYTES:
            self.flow.pause_reading()
        cycle.message_event.set()

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def on_response_complete(self) -> None:  # idle again, unless closing or a pipelined request began
        super().on_response_complete()
        if not self.transport.is_closing() and self.cycle.response_complete:
            self.idle[self] = None

    # -- uvicorn's answers, as OpenAI error bodies and rate-limited logs

    def send_400_response(self, msg: str) -> None:
        refusal = self._refusal
        if refusal is not None:
            self._answer(refusal.status, refusal.error)
            return
        log_limited("malformed", logging.WARNING, "malformed HTTP request from %s: %s", self.client, msg)
        self._answer(400, APIError(f"malformed HTTP request ({short(msg)})"), "Bad Request")

    def _unsupported_upgrade_warning(self) -> None:
        log_limited(
            "upgrade", logging.WARNING, "refused a protocol upgrade (WebSocket, h2c) from %s", self.client
        )
