"""How long the server takes to refuse the largest bodies one request can send, and how long `/health`
waits meanwhile: `python -m perf.server_abuse` starts `minisgl-run serve` (the default model, on a free
loopback port, bodies up to 16 MiB), sends each case twice while a thread polls `/health` every 10 ms,
prints a table and stops the server. Figures in docs/server.md#security."""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time

import httpx2 as httpx

from perf.common import OFFLINE_ENV, ServerProcess, free_port

MODEL = "smollm2-135m-instruct"
TEXT = "word " * ((8 << 20) // 5)  # 8 MiB
CASES = [
    ("8 MiB prompt", "completions", {"model": MODEL, "prompt": TEXT, "max_tokens": 2}),
    (
        "8 MiB chat message",
        "chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": TEXT}]},
    ),
    (
        "280k chat messages",
        "chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": ""}] * 280_000},
    ),
    ("2M token ids", "completions", {"model": MODEL, "prompt": [7] * 2_000_000, "max_tokens": 2}),
    ("100k stop strings", "completions", {"model": MODEL, "prompt": "x", "stop": ["s"] * 100_000}),
]


class Poller(threading.Thread):
    def __init__(self, base: str) -> None:
        super().__init__(daemon=True)
        self.base, self.worst, self.stopped = base, 0.0, False

    def run(self) -> None:
        with httpx.Client(timeout=10) as client:
            for _ in range(100_000):  # bounded; stopped long before
                if self.stopped:
                    return
                start = time.monotonic()
                client.get(self.base + "/health")
                self.worst = max(self.worst, time.monotonic() - start)
                time.sleep(0.01)


def main() -> None:
    argparse.ArgumentParser(prog="python -m perf.server_abuse", description=__doc__).parse_args()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "minisgl.cli", "serve", "--port", str(port)]
    cmd += ["--max-request-bytes", str(16 << 20)]
    with ServerProcess(cmd, None, base + "/health", OFFLINE_ENV, group=False, timeout=120):
        poller = Poller(base)
        poller.start()
        print(f"{'case':20s} {'MB':>5s}  status  {'refused in':>10s}  /health worst")
        for name, route, body in CASES * 2:
            raw = json.dumps(body).encode()
            with httpx.Client(timeout=120) as client:
                client.get(base + "/health")  # connected before the clock starts
                poller.worst = 0.0
                start = time.perf_counter()
                r = client.post(
                    f"{base}/v1/{route}", content=raw, headers={"Content-Type": "application/json"}
                )
                elapsed = time.perf_counter() - start
            time.sleep(0.05)
            print(
                f"{name:20s} {len(raw) / 1e6:5.1f}  {r.status_code:6d}  {elapsed * 1e3:7.1f} ms  {poller.worst * 1e3:7.1f} ms"
            )
        poller.stopped = True


if __name__ == "__main__":
    main()
