"""A stub OpenAI-compatible server that streams as fast as it can, to measure what the benchmark client
(`minisgl-run bench-serving`) can count when the server does no work (docs/bench-serving.md#the-client).

    python -m perf.stub_server --port 30000 --tokens-per-chunk 1 [--processes 2] [--max-seconds 300]
    python -m perf.stub_server --measure-client 256 --tokens-per-chunk 3   # stub + client, prints tok/s

Raw asyncio on 127.0.0.1 only (`GET /v1/models`, `POST /v1/completions` and `/v1/chat/completions`, one
request per connection): OpenAI-shaped SSE chunks of `--tokens-per-chunk` tokens (with `token_ids`
unless `return_token_ids: false`), a usage chunk when asked, `data: [DONE]`; a non-streamed request
gets the whole response. Like an engine's decode loop, one step writes the next chunk of every stream
whose client keeps up. `--processes M` listen on one port (SO_REUSEPORT); each stops by itself after
`--max-seconds`, on SIGTERM or SIGINT, or when its parent is gone. `measure_client(...)` runs the stub
in a subprocess and the client against it (perf/cpu/test_bench_client.py, perf.gpu.serving).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODEL = "stub-model"
HOST = "127.0.0.1"
DEFAULT_MAX_SECONDS = 300.0
ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class StubOptions:
    tokens_per_chunk: int = 1
    model: str = MODEL
    framing: str = "chunked"  # or "close": the body ends with the connection
    max_seconds: float = DEFAULT_MAX_SECONDS
    step_interval: float = 0.0  # seconds between steps; 0: as fast as the clients read


def _json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


class _Stream:
    """One streamed response: the next chunk of each choice per step."""

    __slots__ = ("conn", "chat", "ids", "n", "total", "sent", "k", "usage", "rid", "prompt_tokens", "model")

    def __init__(
        self, conn: _Connection, body: dict[str, Any], chat: bool, prompt_tokens: int, k: int
    ) -> None:
        self.conn = conn
        self.chat = chat
        self.ids = body.get("return_token_ids", True) is not False
        self.n = int(body.get("n") or 1)
        self.total = int(body.get("max_tokens") or 16)
        self.sent = 0
        self.k = k
        self.usage = bool((body.get("stream_options") or {}).get("include_usage"))
        self.rid = conn.server.next_id()
        self.prompt_tokens = prompt_tokens
        self.model = body.get("model", MODEL)

    def head(self) -> bytes:
        if not self.chat:
            return b""
        events = []
        for i in range(self.n):
            choice = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
            events.append(self._event({**choice, "finish_reason": None}))
        return b"".join(events)

    def _event(self, choice: dict[str, Any]) -> bytes:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        obj = {"id": self.rid, "object": kind, "created": 0, "model": self.model, "choices": [choice]}
        return b"data: " + _json(obj) + b"\n\n"

    def step(self) -> tuple[bytes, bool]:
        """The next chunk of every choice; True when the stream is complete (the tail included)."""
        k = min(self.k, self.total - self.sent)
        start, self.sent = self.sent, self.sent + k
        ids = ",".join(str(100 + (start + j) % 1000) for j in range(k))
        text = " w" * k
        parts = []
        for i in range(self.n):
            if self.chat:
                piece = f'"delta":{{"content":"{text}"}}'
                kind = "chat.completion.chunk"
            else:
                piece = f'"text":"{text}"'
                kind = "text_completion"
            extra = f',"token_ids":[{ids}]' if self.ids else ""
            parts.append(
                f'data: {{"id":"{self.rid}","object":"{kind}","created":0,"model":"{self.model}",'
                f'"choices":[{{"index":{i},{piece},"logprobs":null,"finish_reason":null{extra}}}]}}\n\n'
            )
        data = "".join(parts).encode()
        if self.sent < self.total:
            return data, False
        tail = []
        for i in range(self.n):
            delta = {"delta": {}} if self.chat else {"text": ""}
            tail.append(self._event({"index": i, **delta, "logprobs": None, "finish_reason": "length"}))
        if self.usage:
            kind = "chat.completion.chunk" if self.chat else "text_completion"
            usage = {
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.total * self.n,
                "total_tokens": self.prompt_tokens + self.total * self.n,
            }
            obj = {"id": self.rid, "object": kind, "created": 0, "model": self.model, "choices": []}
            tail.append(b"data: " + _json({**obj, "usage": usage}) + b"\n\n")
        tail.append(b"data: [DONE]\n\n")
        return data + b"".join(tail), True


class _Connection(asyncio.Protocol):
    """One request per connection: read it, answer, close."""

    def __init__(self, server: StubServer) -> None:
        self.server = server
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self.paused = False
        self.closed = False
        self.handled = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True

    def data_received(self, data: bytes) -> None:
        if self.handled:
            return
        self.buf += data
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        lines = bytes(self.buf[:end]).decode("latin-1").split("\r\n")
        length = 0
        for line in lines[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "content-length":
                length = int(value.strip())
        if len(self.buf) < end + 4 + length:
            return
        self.handled = True
        method, path = (lines[0].split(" ") + ["", ""])[:2]
        self.server.handle(self, method, path, bytes(self.buf[end + 4 : end + 4 + length]))

    # -- answers

    def send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        reason = {200: "OK", 400: "Bad Request", 404: "Not Found"}.get(status, "Error")
        head = (
            f"HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        )
        assert self.transport is not None
        self.transport.write(head.encode() + body)
        self.transport.close()

    def error(self, status: int, message: str) -> None:
        body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}}
        self.send(status, _json(body))

    def start_stream(self, first: bytes) -> None:
        chunked = self.server.options.framing == "chunked"
        head = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
        head += "Transfer-Encoding: chunked\r\n" if chunked else ""
        assert self.transport is not None
        self.transport.write((head + "Connection: close\r\n\r\n").encode())
        if first:
            self.write(first)

    def write(self, data: bytes, last: bool = False) -> None:
        assert self.transport is not None
        if self.server.options.framing == "chunked":
            data = b"%x\r\n%b\r\n" % (len(data), data) + (b"0\r\n\r\n" if last else b"")
        self.transport.write(data)
        if last:
            self.transport.close()


class StubServer:
    """The stub's state in one process: the streams in flight and the step loop that feeds them."""

    def __init__(self, options: StubOptions) -> None:
        self.options = options
        self.streams: list[_Stream] = []
        self.incoming: list[_Stream] = []
        self.wakeup = asyncio.Event()
        self.ids = 0
        self.requests = 0
        self.tokens = 0

    def next_id(self) -> str:
        self.ids += 1
        return f"cmpl-{os.getpid()}-{self.ids}"

    def handle(self, conn: _Connection, method: str, path: str, raw: bytes) -> None:
        path = path.split("?", 1)[0]
        if method == "GET" and path == "/v1/models":
            card = {"id": self.options.model, "object": "model", "created": 0, "owned_by": "stub"}
            conn.send(200, _json({"object": "list", "data": [card]}))
            return
        if method != "POST" or path not in ("/v1/completions", "/v1/chat/completions"):
            conn.error(404, f"no route {method} {path}")
            return
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("not an object")
        except ValueError as e:
            conn.error(400, f"the body is not a JSON object: {e}")
            return
        chat = path.endswith("/chat/completions")
        if chat:
            messages = body.get("messages") or []
            prompt_tokens = sum(3 + len(str(m.get("content", "")).split()) for m in messages)
        else:
            prompt = body.get("prompt", "")
            prompt_tokens = len(prompt) if isinstance(prompt, list) else len(str(prompt).split())
        self.requests += 1
        stream = _Stream(conn, body, chat, prompt_tokens, self.options.tokens_per_chunk)
        if not body.get("stream"):
            self.tokens += stream.total * stream.n
            conn.send(200, _json(self._whole(stream)))
            return
        conn.start_stream(stream.head())
        self.incoming.append(stream)
        self.wakeup.set()

    def _whole(self, s: _Stream) -> dict[str, Any]:
        choices = []
        for i in range(s.n):
            text = " w" * s.total
            choice: dict[str, Any] = {"index": i, "logprobs": None, "finish_reason": "length"}
            if s.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            if s.ids:
                choice["token_ids"] = [100 + j % 1000 for j in range(s.total)]
            choices.append(choice)
        usage = {
            "prompt_tokens": s.prompt_tokens,
            "completion_tokens": s.total * s.n,
            "total_tokens": s.prompt_tokens + s.total * s.n,
        }
        kind = "chat.completion" if s.chat else "text_completion"
        return {
            "id": s.rid,
            "object": kind,
            "created": 0,
            "model": s.model,
            "choices": choices,
            "usage": usage,
        }

    async def step_loop(self) -> None:
        """Each step: the next chunk of every stream whose client keeps up, then the event loop's turn
        (with a step interval: until the next step's time, like an engine's decode loop)."""
        interval = self.options.step_interval
        next_step = time.perf_counter()
        while True:
            if self.incoming:
                self.streams.extend(self.incoming)
                self.incoming.clear()
            if not self.streams:
                self.wakeup.clear()
                await self.wakeup.wait()
                continue
            wrote = False
            keep = []
            for s in self.streams:
                conn = s.conn
                if conn.closed:
                    continue
                if conn.paused:
                    keep.append(s)
                    continue
                before = s.sent
                data, last = s.step()
                self.tokens += (s.sent - before) * s.n
                conn.write(data, last)
                wrote = True
                if not last:
                    keep.append(s)
            self.streams = keep
            if interval > 0:
                next_step = max(next_step + interval, time.perf_counter() - interval)
                await asyncio.sleep(max(0.0, next_step - time.perf_counter()))
            else:
                await asyncio.sleep(0 if wrote else 0.0005)


def _socket(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if hasattr(socket, "SO_REUSEPORT"):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((HOST, port))
    sock.listen(4096)
    sock.setblocking(False)
    return sock


async def serve(
    sock: socket.socket, options: StubOptions, ready: Any = None, parent: int | None = None
) -> None:
    """Serves on `sock` until `options.max_seconds` pass, SIGTERM/SIGINT, or process `parent` is gone."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread, or Windows
            pass
    stub = StubServer(options)
    server = await loop.create_server(lambda: _Connection(stub), sock=sock)
    stepper = asyncio.create_task(stub.step_loop())
    if ready is not None:
        ready.set()
    deadline = time.monotonic() + options.max_seconds
    try:
        while not stop.is_set() and time.monotonic() < deadline:
            if parent is not None and os.getppid() != parent:
                break
            try:
                await asyncio.wait_for(stop.wait(), min(1.0, max(0.01, deadline - time.monotonic())))
            except asyncio.TimeoutError:
                pass
    finally:
        stepper.cancel()
        server.close()


def _run(coro: Any) -> None:
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro)
    else:
        uvloop.run(coro)


def _worker(port: int, options: StubOptions, ready: Any, parent: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops its workers
    try:
        _run(serve(_socket(port), options, ready, parent))
    except KeyboardInterrupt:
        pass


def run_stub(port: int, options: StubOptions, processes: int = 1, announce: bool = True) -> None:
    """Serves on 127.0.0.1:`port` (0: any free port) in `processes` processes until stopped."""
    sock = _socket(port)
    port = sock.getsockname()[1]
    workers = []
    ctx = multiprocessing.get_context("spawn")
    try:
        for _ in range(processes - 1):
            ready = ctx.Event()
            proc = ctx.Process(target=_worker, args=(port, options, ready, os.getpid()), daemon=True)
            proc.start()
            workers.append((proc, ready))
        for _, ready in workers:
            if not ready.wait(60):
                raise RuntimeError("a stub worker process did not start")
        if announce:
            print(f"stub_server: listening on http://{HOST}:{port}/v1 ({processes} processes)", flush=True)
        _run(serve(sock, options))
    except KeyboardInterrupt:
        pass
    finally:
        for proc, _ in workers:
            proc.terminate()
        for proc, _ in workers:
            proc.join(5)
            if proc.is_alive():
                proc.kill()


# -- the client measured against the stub ---------------------------------------------------------


class StubProcess:
    """`python -m perf.stub_server` in a subprocess on a free port; `url` is its API root."""

    def __init__(self, tokens_per_chunk: int = 1, processes: int = 1, max_seconds: float = 600, **kw: Any):
        args = [sys.executable, "-m", "perf.stub_server", "--port", "0"]
        args += ["--tokens-per-chunk", str(tokens_per_chunk), "--processes", str(processes)]
        args += ["--max-seconds", str(max_seconds)]
        if kw.get("framing"):
            args += ["--framing", kw["framing"]]
        if kw.get("step_interval"):
            args += ["--step-interval", str(kw["step_interval"])]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, text=True, env=env)
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(60)
        if not line or "listening on" not in line[0]:
            self.stop()
            raise RuntimeError(f"the stub server did not start: {line[0] if line else 'no output in 60 s'}")
        self.url = line[0].split("listening on ", 1)[1].split()[0]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def __enter__(self) -> StubProcess:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def measure_client(
    num_prompts: int = 256,
    tokens_per_chunk: int = 1,
    client_processes: int | None = None,
    stub_processes: int = 1,
    *,
    output_len: int = 1024,
    max_concurrency: int = 256,
    endpoint: str = "completions",
    timeout: float = 300.0,
    use_uvloop: bool = True,
    step_interval: float = 0.0,
) -> dict[str, Any]:
    """The stub (`stub_processes` processes, `tokens_per_chunk` tokens per chunk) in a subprocess, and
    `bench_serving` against it: `num_prompts` requests of `output_len` tokens each (16-token prompts)
    at most `max_concurrency` at a time, all sent at once, in `client_processes` client processes
    (None: the client's default). `step_interval` > 0 paces the stub (one chunk per stream every
    `step_interval` seconds, like an engine's decode steps) instead of streaming as fast as it can.
    Returns the client's report plus `tokens_per_chunk` and
    `stub_processes`; `output_throughput` is the tokens per second the client counted."""
    from minisgl.bench.serving import bench_serving, workload

    requests = workload(num_prompts, 16, 16, output_len, output_len)
    stub = StubProcess(
        tokens_per_chunk, stub_processes, max_seconds=timeout + 60, step_interval=step_interval
    )
    with stub:
        report = bench_serving(
            requests,
            base_url=stub.url,
            model=MODEL,
            max_concurrency=max_concurrency,
            client_processes=client_processes,
            endpoint=endpoint,
            timeout=timeout,
            use_uvloop=use_uvloop,
        )
    return {
        **report,
        "tokens_per_chunk": tokens_per_chunk,
        "stub_processes": stub_processes,
        "step_interval": step_interval,
    }


def summary(report: dict[str, Any]) -> str:
    """One line: what the client counted against the stub."""
    return (
        f"{report['output_throughput']:,.0f} tok/s counted ({report['total_output_tokens']:,} tokens in "
        f"{report['duration_s']:.2f} s), {report['tokens_per_chunk']} tokens/chunk, "
        f"{report['client_processes']} client / {report['stub_processes']} stub processes, "
        f"{report['completed']}/{report['num_prompts']} requests, max concurrency {report['max_concurrency']}, "
        f"TTFT p50 {report['ttft_ms']['p50']:.1f} ms, ITL p50 {report['itl_ms']['p50']:.3f} ms"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m perf.stub_server", description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=30000, help="port on 127.0.0.1 (0: any free one)")
    parser.add_argument("--tokens-per-chunk", type=int, default=1)
    parser.add_argument("--processes", type=int, default=1, help="server processes on the port")
    parser.add_argument("--max-seconds", type=float, default=DEFAULT_MAX_SECONDS, help="stop after this")
    parser.add_argument("--framing", choices=["chunked", "close"], default="chunked")
    parser.add_argument("--model", default=MODEL)
    parser.add_argument(
        "--step-interval", type=float, default=0.0, help="seconds between steps (0: as fast as read)"
    )
    parser.add_argument(
        "--measure-client",
        type=int,
        metavar="NUM_PROMPTS",
        default=None,
        help="instead of serving: run the stub and the benchmark client against it, print the figures",
    )
    parser.add_argument("--client-processes", type=int, default=None, help="with --measure-client")
    parser.add_argument("--output-len", type=int, default=1024, help="with --measure-client")
    parser.add_argument("--max-concurrency", type=int, default=256, help="with --measure-client")
    parser.add_argument("--json", action="store_true", help="with --measure-client: the whole report")
    args = parser.parse_args(argv)
    if args.tokens_per_chunk < 1 or args.processes < 1 or args.max_seconds <= 0:
        parser.error("--tokens-per-chunk and --processes must be at least 1, --max-seconds above 0")
    if args.measure_client is not None:
        report = measure_client(
            args.measure_client,
            args.tokens_per_chunk,
            args.client_processes,
            args.processes,
            output_len=args.output_len,
            max_concurrency=args.max_concurrency,
            timeout=args.max_seconds,
            step_interval=args.step_interval,
        )
        print(json.dumps(report, indent=2) if args.json else summary(report))
        return
    options = StubOptions(
        args.tokens_per_chunk, args.model, args.framing, args.max_seconds, args.step_interval
    )
    run_stub(args.port, options, args.processes)


if __name__ == "__main__":
    main()
