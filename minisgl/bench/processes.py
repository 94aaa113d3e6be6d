"""The sending side of `minisgl-run bench-serving`: one share of the requests sent on an event loop
(`run_share`), and the shares spread over client processes (`run_processes`), each `python -m
minisgl.bench.processes FD` talking to the parent over a socket pair. Standard library and the HTTP
client only: a client process imports nothing more. docs/bench-serving.md#client-processes.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, Pipe
from typing import Any

from minisgl.bench.client import RequestResult, Server, measure, run_loop

START_MARGIN = 0.05  # seconds between the start signal and the common start time of client processes
REPORT_GRACE = 10.0  # seconds client processes get after the deadline to send their results
STOP_GRACE = 1.0  # seconds client processes get to send what they have once SIGINT or SIGTERM stopped the run

# one request as a client process gets it: (index, HTTP request bytes, client prompt tokens, max_tokens,
# n, send offset in seconds after the common start)
Item = tuple[int, bytes, int, int, int, float]


async def run_share(
    server: Server,
    items: Sequence[Item],
    t0: float,
    deadline: float,
    max_concurrency: int | None,
    progress: Callable[[], None] | None = None,
    stop: asyncio.Event | None = None,
) -> tuple[dict[int, RequestResult], bool, float]:
    """Sends `items` at t0 + their offsets (perf_counter times, shared by all processes of the host),
    at most `max_concurrency` in flight; cancels what still runs at `deadline` or once `stop` is set.
    Returns (the results by index, whether it was cut short, the perf_counter time it ended)."""
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    results: dict[int, RequestResult] = {}

    async def one(item: Item) -> None:
        index, request, prompt_tokens, max_tokens, n, _ = item
        result = RequestResult(prompt_tokens=prompt_tokens, max_tokens=max_tokens, n=n)
        if semaphore is None:
            results[index] = result
            await measure(server, request, result, t0)
        else:
            async with semaphore:
                results[index] = result
                await measure(server, request, result, t0)
        if progress is not None:
            progress()

    tasks: list[asyncio.Task] = []

    async def send_all() -> None:
        for item in items:
            delay = t0 + item[5] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(item)))
        await asyncio.gather(*tasks)

    sending = asyncio.ensure_future(send_all())
    waiters: set[asyncio.Future] = {sending}
    if stop is not None:
        waiters.add(asyncio.ensure_future(stop.wait()))
    await asyncio.wait(
        waiters, timeout=max(0.0, deadline - time.perf_counter()), return_when="FIRST_COMPLETED"
    )
    cut = not sending.done()
    for waiter in waiters:
        waiter.cancel()
    if cut:
        for task in tasks:
            task.cancel()
    await asyncio.gather(*waiters, *tasks, return_exceptions=True)
    return results, cut, time.perf_counter()


async def _child_share(
    conn: Connection, server: Server, items: list[Item], t0: float, deadline: float, limit: int | None
) -> tuple[dict[int, RequestResult], bool, float]:
    """A client process's share: `_run_share`, a progress message per finished request, stopped by a
    ("stop",) from the parent or by the parent's end (EOF on `conn`)."""
    stop = asyncio.Event()

    def readable() -> None:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            message = ("stop",)
        if message[0] == "stop":
            asyncio.get_running_loop().remove_reader(conn.fileno())
            stop.set()

    asyncio.get_running_loop().add_reader(conn.fileno(), readable)
    return await run_share(server, items, t0, deadline, limit, lambda: conn.send(("progress",)), stop)


def _client_process(fd: int) -> None:
    """A client process (`python -m minisgl.bench.processes FD`, started by `run_processes`; it imports
    no more than this module and the HTTP client): reads its share from the connection on `fd`, says it is ready, waits for
    ("start", t0, deadline), sends its share and returns the results through the connection. Ctrl-C
    reaches the whole process group: the parent decides, so SIGINT is ignored here."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Connection(fd)
    try:
        server, items, limit, use_uvloop = conn.recv()
        conn.send(("ready",))
        message = conn.recv()
        if message[0] != "start":
            return
        _, t0, deadline = message
        results, cut, end = run_loop(_child_share(conn, server, items, t0, deadline, limit), use_uvloop)
        conn.send(("done", sorted(results.items()), cut, end))
    except (EOFError, BrokenPipeError, ConnectionResetError):  # the parent is gone
        pass
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc(limit=5)))
        except OSError:
            pass


def split_concurrency(max_concurrency: int | None, processes: int) -> list[int | None]:
    """`max_concurrency` over `processes` client processes: the first ones get one more when it does
    not divide (10 over 4: 3, 3, 2, 2); None (unlimited) for each when None."""
    if max_concurrency is None:
        return [None] * processes
    base, extra = divmod(max_concurrency, processes)
    return [base + (1 if p < extra else 0) for p in range(processes)]


class _Client:
    """One client process and the parent's end of its connection."""

    def __init__(self, index: int, share: list[Item], setup: tuple) -> None:
        self.index = index
        self.conn, child = Pipe()
        cmd = [sys.executable, "-m", "minisgl.bench.processes", str(child.fileno())]
        # its own output stays off the parent's (a pipe the caller reads to its end), stderr kept for
        # a failure's message; the share goes after the start so that a large one cannot block it
        self.proc = subprocess.Popen(
            cmd,
            pass_fds=(child.fileno(),),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        child.close()
        self.share = (setup[0], share, *setup[1:])

    def failure(self) -> str:
        """Why the process ended without its results: its exit code and the end of its stderr."""
        code = self.proc.poll()
        tail = self.proc.stderr.read().decode(errors="replace").strip()[-800:] if code is not None else ""
        return f"client process {self.index} exited with code {code}" + (f": {tail}" if tail else "")

    def end(self, grace: float) -> None:
        """Waits up to `grace` seconds for the process to exit, then kills it; closes the pipes."""
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stderr.close()
        self.conn.close()


async def run_processes(
    server: Server,
    items: list[Item],
    processes: int,
    max_concurrency: int | None,
    deadline: float,
    use_uvloop: bool,
    bar: Any,
    stop: asyncio.Event,
) -> tuple[dict[int, RequestResult], bool, float, float, list[str]]:
    """The items over `processes` client processes (`python -m minisgl.bench.processes`, not
    multiprocessing: a spawned child would import the caller's main module, the engine with it, and
    leave a resource tracker holding the caller's output), request i to process i % processes. Once
    `stop` is set, each is told to stop and gets STOP_GRACE seconds to send what it has. Returns
    (results by index, cut short, t0, end, errors of processes that failed)."""
    limits = split_concurrency(max_concurrency, processes)
    clients: list[_Client] = []
    results: dict[int, RequestResult] = {}
    problems: list[str] = []
    cut = False
    t0 = end = time.perf_counter()
    try:
        for p in range(processes):
            clients.append(_Client(p, items[p::processes], (server, limits[p], use_uvloop)))
        for client in clients:
            client.conn.send(client.share)
        # every process ready (imported, listening) before the common start time
        waiting = set(clients)
        while waiting:
            for client in list(waiting):
                if client.conn.poll():
                    message = client.conn.recv()
                    if message[0] != "ready":
                        raise RuntimeError(f"client process {client.index} failed to start: {message[-1]}")
                    waiting.discard(client)
                elif client.proc.poll() is not None:
                    raise RuntimeError(client.failure() + " at start")
            if waiting and (time.perf_counter() > deadline or stop.is_set()):
                return results, True, t0, time.perf_counter(), ["the client processes did not start"]
            if waiting:
                await asyncio.sleep(0.01)
        t0 = time.perf_counter() + START_MARGIN
        for client in clients:
            client.conn.send(("start", t0, deadline))
        pending = set(clients)
        ends = []
        give_up = deadline + REPORT_GRACE
        while pending:
            if stop.is_set() and give_up > time.perf_counter() + STOP_GRACE:
                for client in pending:
                    client.conn.send(("stop",))
                give_up = time.perf_counter() + STOP_GRACE
            for client in list(pending):
                while client in pending and client.conn.poll():
                    try:
                        message = client.conn.recv()
                    except EOFError:
                        message = ("error", client.failure())
                    if message[0] == "progress":
                        if bar is not None:
                            bar.update(1)
                        continue
                    pending.discard(client)
                    if message[0] == "done":
                        results.update(message[1])
                        cut |= message[2]
                        ends.append(message[3])
                    else:
                        problems.append(f"client process {client.index} failed: {message[-1].strip()}")
                if client in pending and client.proc.poll() is not None:
                    pending.discard(client)
                    problems.append(client.failure())
            if pending and time.perf_counter() > give_up:
                cut = True
                problems.extend(f"client process {c.index} did not report in time" for c in pending)
                break
            if pending:
                await asyncio.sleep(0.01)
        end = max(ends) if ends else time.perf_counter()
    finally:
        for client in clients:
            try:
                client.conn.send(("stop",))  # to a process still waiting for its share or its start
            except OSError:
                pass
        for client in clients:
            client.end(grace=1.0)
    return results, cut, t0, end, problems


if __name__ == "__main__":  # a client process of `run_processes`
    _client_process(int(sys.argv[1]))
