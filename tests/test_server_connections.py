"""The cap on open connections (minisgl/server/connections.py): at the cap a new connection
closes the oldest idle one (no request in flight), never one whose request is in flight (a stream
included); only when every connection has a request in flight is the new one refused (503). Against a
real server under a low open-file limit (idle floods), and an in-process uvicorn with a stream that
the test releases (which connections are evicted, and when a new one is refused)."""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import resource
import socket
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import httpx2 as httpx
import pytest
import uvicorn
from test_server import Server, _free_port, _wait_for
from test_server_abuse import AUTH, KEY, NORMAL, _normal

from minisgl.server.connections import protocol_class

HEADLESS = b"POST /v1/completions HT"  # a request line cut short


def _kept_alive(port: int, path: str = "/health") -> http.client.HTTPConnection:
    """A connection that has had one answer and is kept alive."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", path)
    response = conn.getresponse()
    assert response.status == 200 and response.read() and not response.will_close
    return conn


def _connected(port: int, send: bytes = b"") -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    if send:
        s.sendall(send)
    return s


def _peek(s: socket.socket) -> bytes | None:
    """None while `s` is open with nothing to read; else what the server sent (b"": closed)."""
    s.setblocking(False)
    try:
        return s.recv(4096)
    except BlockingIOError:
        return None
    except ConnectionResetError:
        return b""
    finally:
        s.settimeout(10)


# ------------------------------------------------------------------------------ a real server, floods


@pytest.mark.parametrize(
    ("limit", "kept", "connected", "headless"), [(256, 150, 150, 50), (1024, 500, 500, 0)]
)
def test_an_idle_connection_flood_cannot_lock_clients_out(
    limit, kept, connected, headless, tiny_server_args: list[str]
) -> None:
    """`kept` connections kept alive after a request, `connected` that sent nothing and `headless`
    that sent part of a request line, under an open-file limit of `limit`: far more than the cap. An
    authenticated request gets its 200 at once (a 10 s bound for a loaded machine), a stream running
    through the flood gets all its tokens, the oldest idle connections are closed (without an answer)
    and the newest kept, and nothing is refused."""

    def low_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

    timeouts = ("--idle-timeout-s", "120", "--header-timeout-s", "120")  # only evictions close them
    # the front end's connections: a tiny model served as the default one (conftest.py)
    srv = Server(*tiny_server_args, "--api-key", KEY, *timeouts, preexec_fn=low_limit)
    flood: list[socket.socket] = []
    conns: list[http.client.HTTPConnection] = []
    try:
        cap = int(re.search(r"at most (\d+) open connections", srv.output()).group(1))
        assert kept + connected + headless > cap + 50
        usual = _normal(srv)
        streamed: list[str] = []
        body = {**NORMAL, "max_tokens": 8, "ignore_eos": True, "stream": True}

        def stream() -> None:
            with httpx.stream("POST", srv.url + "/completions", json=body, headers=AUTH, timeout=120) as r:
                streamed.extend(line for line in r.iter_lines() if line.startswith("data:"))

        streaming = threading.Thread(target=stream)
        streaming.start()
        for _ in range(kept):
            conns.append(_kept_alive(srv.port))
            flood.append(conns[-1].sock)
        flood += [_connected(srv.port) for _ in range(connected)]
        flood += [_connected(srv.port, HEADLESS) for _ in range(headless)]

        start = time.monotonic()
        r = httpx.get(srv.url + "/models", headers=AUTH, timeout=10)
        models_s = time.monotonic() - start
        assert r.status_code == 200, r.text
        start = time.monotonic()
        assert _normal(srv) == usual
        completion_s = time.monotonic() - start
        print(
            f"\nflood of {len(flood)} (cap {cap}): /v1/models {models_s:.3f} s, completion {completion_s:.3f} s"
        )

        states = [_peek(s) for s in flood]
        assert all(state in (None, b"") for state in states)  # closed without an answer, or open
        _wait_for(lambda: sum(_peek(s) is None for s in flood) <= cap, 10, "the flood evicted")
        assert all(_peek(s) is None for s in flood[-20:])  # the newest are kept
        streaming.join(120)
        assert streamed[-1] == "data: [DONE]", streamed  # the stream ran to its end: its 8 tokens
        assert json.loads(streamed[-2][5:])["choices"][0]["finish_reason"] == "length", streamed
        log = srv.output()
        assert "closing the oldest idle one" in log and "refusing more" not in log
        assert len(log) < 20000 and "Traceback" not in log, log
    finally:
        for s in flood:
            s.close()
        for c in conns:
            c.close()
        assert srv.stop() == 0


# ------------------------------------------------------------------ in-process: what is evicted, when


class _InProcess:
    """uvicorn with the guarded protocol (a cap of `cap`) on a thread; GET /stream sends "first", then
    "last" once `release` is set (30 s at most); any other path answers "ok"."""

    def __init__(self, cap: int) -> None:
        self.release = threading.Event()
        self.port = _free_port()
        limits = SimpleNamespace(idle_timeout_s=60, header_timeout_s=60, body_timeout_s=60, send_timeout_s=60)
        config = uvicorn.Config(
            self.app,
            host="127.0.0.1",
            port=self.port,
            http=protocol_class(limits, cap),
            ws="none",
            lifespan="off",
            interface="asgi3",
            log_level="warning",
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        _wait_for(lambda: self.server.started, 10, "uvicorn started")

    async def app(self, scope, receive, send) -> None:
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]}
        )
        if scope["path"] == "/stream":
            await send({"type": "http.response.body", "body": b"first\n", "more_body": True})
            for _ in range(600):
                if self.release.is_set():
                    break
                await asyncio.sleep(0.05)
            await send({"type": "http.response.body", "body": b"last\n"})
        else:
            await send({"type": "http.response.body", "body": b"ok\n"})

    def stop(self) -> None:
        self.release.set()
        self.server.should_exit = True
        self.thread.join(10)
        assert not self.thread.is_alive()


@pytest.fixture
def small() -> Iterator[_InProcess]:
    srv = _InProcess(cap=4)
    try:
        yield srv
    finally:
        srv.stop()


def _stream(port: int) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """A stream in flight (its first line read) on a connection that had a request before it."""
    conn = _kept_alive(port, "/ok")
    conn.request("GET", "/stream")
    response = conn.getresponse()
    assert response.readline() == b"first\n"
    return conn, response


def test_at_the_cap_the_oldest_idle_connections_are_closed_never_a_stream(small) -> None:
    conn, response = _stream(small.port)
    kept = [_kept_alive(small.port, "/ok") for _ in range(3)]  # the cap reached
    flood = [_connected(small.port, HEADLESS if i % 2 else b"") for i in range(10)]
    _wait_for(lambda: sum(_peek(s) is None for s in flood) == 3, 5, "the flood evicted")
    assert [_peek(s) for s in flood[-3:]] == [None] * 3  # the newest kept, the oldest closed
    assert all(_peek(c.sock) == b"" for c in kept)  # closed, without an answer
    kept.append(_kept_alive(small.port, "/ok"))  # a new client is served: the oldest flood one goes
    _wait_for(lambda: [_peek(s) for s in flood[-3:]] == [b"", None, None], 5, "one more evicted")
    small.release.set()
    assert response.read() == b"last\n"  # the stream went on, and its connection stays open
    conn.request("GET", "/ok")
    assert conn.getresponse().read() == b"ok\n"
    for s in flood:
        s.close()
    for c in kept:
        c.close()


def test_when_every_connection_has_a_request_in_flight_a_new_one_gets_503(small) -> None:
    streams = [_stream(small.port) for _ in range(4)]
    refused = _connected(small.port)
    answer = refused.recv(4096)
    assert answer.startswith(b"HTTP/1.1 503") and b'"too_many_connections"' in answer, answer[:200]
    small.release.set()
    for _, response in streams:
        assert response.read() == b"last\n"
    _kept_alive(small.port, "/ok").close()  # every connection idle again: the oldest makes room
    assert _peek(streams[0][0].sock) == b""
    refused.close()
    for conn, _ in streams:
        conn.close()
