"""The server's front end alone at 256 streams: how many tokens a second it can take from the scheduler
and write to its HTTP streams. A fake scheduler client (no engine, no ZeroMQ) in the front end's event
loop makes one token per running request per step, as fast as the loop takes the steps; a raw-socket
client in another process reads the streams and only counts their events. Run with `nox -s perf`: the
rate is printed and kept in extra_info. It is the front end's ceiling on this machine (the client shares
its two cores), not a serving figure. FE_LOOP=asyncio FE_HTTP=h11 in the environment runs uvicorn
without uvloop and httptools (its fallbacks), for comparison; MINISGL_REQUEST_TRACE=FILE adds the trace."""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
import time
from types import SimpleNamespace
from typing import Any

import pytest

from perf.common import free_port, wait_ready

STREAMS = 256
TOKENS = 200  # per stream
TOKEN = 1000  # the token every step makes (" the"-like in SmolLM2's vocabulary)


def _fake_client_class() -> type:
    from minisgl.server.scheduler_client import SchedulerClient

    class FakeSchedulerClient(SchedulerClient):
        """Takes `add` and `abort` messages and makes steps in this event loop, one token per request."""

        def __init__(self, settings: dict[str, Any], config: str | None, *where: Any) -> None:
            self.settings, self.config, self.failed, self.on_failure = settings, config, None, None
            self.proc = SimpleNamespace(pid=os.getpid())  # what the supervisor (`Replicas`) names
            self.choices, self._answers = {}, {}
            self.rids, self._ids = iter(range(1 << 62)), iter(range(1 << 62))
            self.running: dict[int, int] = {}  # rid -> tokens left
            model_path = settings.get("model_path") or ""
            self.info = {
                "model_path": model_path,
                "model_name": "fake",
                "max_context": 1 << 20,
                "max_running_req": 4096,
                "vocab_size": 50000,
                "eos_token_ids": [],
            }
            self.ready = asyncio.Event()
            self.ready.set()
            self.steps = 0
            self._tasks = [asyncio.create_task(self._run())]

        def _send(self, header: dict[str, Any], *frames: bytes) -> None:
            if header["op"] == "add":
                self.running[header["rid"]] = header["params"]["max_tokens"]
            elif header["op"] == "abort":
                self.running.pop(header["rid"], None)

        async def _run(self) -> None:
            arrived = time.perf_counter()
            while True:
                await asyncio.sleep(0)
                if not self.running:
                    await asyncio.sleep(0.001)
                    continue
                served, done = list(self.running), []
                now = time.perf_counter()
                for row, rid in enumerate(served):
                    self.running[rid] -= 1
                    if self.running[rid] == 0:
                        del self.running[rid]
                        done.append([row, "length", None, [arrived, arrived, arrived, now], [0, 0]])
                self._step({"t": now, "s": now, "n": None, "done": done}, served, [TOKEN] * len(served))
                self.steps += 1

        async def close(self) -> None:
            for task in self._tasks:
                task.cancel()

    return FakeSchedulerClient


def _serve(port: int, model_path: str | None) -> None:
    import uvicorn

    from minisgl.server import app as server_app
    from minisgl.server.state import ServerState
    from minisgl.settings import EngineSettings

    explicit = {"port": port, "model_path": model_path} if model_path else {"port": port}
    settings = EngineSettings.load(None, **explicit)
    state = ServerState(settings, explicit, None)
    state.client_class = _fake_client_class()
    config = uvicorn.Config(
        server_app.create_app(state),
        host="127.0.0.1",
        port=port,
        log_level="warning",
        loop=os.environ.get("FE_LOOP", "auto"),
        http=os.environ.get("FE_HTTP", "auto"),
    )
    uvicorn.Server(config).run()


async def _read_all(port: int, body: bytes) -> tuple[int, float]:
    """Sends STREAMS requests at once; returns (token events read, seconds)."""

    async def one() -> int:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        events = 0
        while data := await reader.read(1 << 16):
            events += data.count(b'"token_ids":[')
        writer.close()
        return events

    start = time.perf_counter()
    counts = await asyncio.wait_for(asyncio.gather(*[one() for _ in range(STREAMS)]), 120)
    return sum(counts), time.perf_counter() - start


@pytest.mark.parametrize("detokenize", [True, False], ids=["text", "token-ids"])
def test_front_end_256_streams(benchmark, detokenize):
    from minisgl.models import default_model_path

    port = free_port()
    model = str(default_model_path()) if detokenize else None
    proc = mp.get_context("spawn").Process(target=_serve, args=(port, model))
    proc.start()
    try:
        wait_ready(f"http://127.0.0.1:{port}/health", 60, interval=0.2)
        body = json.dumps(
            {
                "model": "fake",
                "prompt": [1, 2, 3],
                "max_tokens": TOKENS,
                "stream": True,
                "return_token_ids": True,
                **({"stop": ["\n\n"]} if detokenize else {}),
            }
        ).encode()
        events, seconds = benchmark.pedantic(
            lambda: asyncio.run(_read_all(port, body)), rounds=1, iterations=1
        )
    finally:
        proc.terminate()
        proc.join(10)
    rate = STREAMS * TOKENS / seconds
    benchmark.extra_info.update({"streams": STREAMS, "tokens_per_s": rate, "writes": events})
    print(
        f"\nfront end, {STREAMS} streams ({'text, a stop string each' if detokenize else 'token ids'}): "
        f"{rate:,.0f} tokens/s through HTTP ({events} writes for {STREAMS * TOKENS} tokens)"
    )
    assert events >= STREAMS  # every stream wrote (the counts are the benchmark's, not a test's)
