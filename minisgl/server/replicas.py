"""The engine processes behind the front end and their supervision: data-parallel replicas
(`minisgl-run serve --dp N`, N scheduler processes behind one front end) and, with N = 1, the one
engine of a plain server (unless `engine_restart` is off, when a `SchedulerClient` stands alone).

`Replicas` stands where one `SchedulerClient` stands for the front end: it routes each request to the
replica with the fewest outstanding tokens, merges `/metrics`, and restarts a dead replica after a
back-off. Devices, routing, restarts and `/health`: docs/scale-out.md ("One host: `--dp N`").
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 30.0
STABLE_S = 60.0  # a replica that served this long starts its back-off from BACKOFF_FIRST_S again


def become_subreaper() -> None:
    """Linux: orphaned descendants of this process (a dead scheduler's tensor-parallel ranks, compile
    workers) become its children rather than init's, so that `kill_process_group` can reap them."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER


def _group_members(pgid: int) -> dict[int, str]:
    """pid -> state letter of each process in process group `pgid` (from /proc)."""
    members = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, pgrp, ...
            if int(fields[2]) == pgid:
                members[int(name)] = fields[0]
    return members


def kill_process_group(pgid: int, timeout: float = 10.0) -> int:
    """SIGKILLs every process of group `pgid` (a scheduler process leads its own: it, its ranks and
    their children) until none is left, reaping those that are this process's children; returns how
    many were alive. Zombies whose parent is another process are that parent's to reap."""
    deadline = time.monotonic() + timeout
    killed: set[int] = set()
    while time.monotonic() < deadline:
        members = _group_members(pgid)
        alive = [pid for pid, state in members.items() if state != "Z"]
        for pid in members:
            with contextlib.suppress(ChildProcessError, OSError):
                if members[pid] == "Z":
                    os.waitpid(pid, os.WNOHANG)
                else:
                    os.kill(pid, signal.SIGKILL)
                    killed.add(pid)
        if not alive:
            return len(killed)
        time.sleep(0.02)
    logger.error("process group %d: %s still alive after %.0f s", pgid, sorted(_group_members(pgid)), timeout)
    return len(killed)


def _cuda_ids() -> list[str]:
    """The GPUs this process sees, as CUDA_VISIBLE_DEVICES names them (or their indexes)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [part.strip() for part in visible.split(",") if part.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def replica_settings(settings: Any, explicit: dict[str, Any]) -> list[tuple[dict[str, Any], str | None]]:
    """Each replica's explicit settings and CUDA_VISIBLE_DEVICES (None: the front end's), for the
    effective `settings` (EngineSettings) and the ones given explicitly. ValueError, naming the values,
    when dp_size cannot work with the others."""
    dp, tp = settings.dp_size, settings.tp_size
    if dp == 1:
        return [(dict(explicit), None)]
    if tp > 1 and settings.distributed_addr != "auto":
        raise ValueError(
            f"distributed_addr={settings.distributed_addr!r} with dp_size={dp}: every replica's "
            f"tensor-parallel group would meet there; leave distributed_addr at auto (each group then "
            "meets at a file of its own)"
        )
    import torch

    device = settings.device
    kind = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else torch.device(device).type
    base = {**explicit, "dp_size": 1}
    if kind == "cpu":
        if settings.host_threads is None:  # each replica on its share of the cores
            base["host_threads"] = max(1, len(os.sched_getaffinity(0)) // dp)
        return [(dict(base), None) for _ in range(dp)]
    if torch.device(device).index is not None:
        raise ValueError(
            f"device={device!r} names one GPU; with dp_size={dp} leave device at auto or cuda: replica i "
            f"takes GPUs i*{tp}..(i+1)*{tp}-1 of those this process sees (set CUDA_VISIBLE_DEVICES to choose)"
        )
    ids = _cuda_ids()
    if len(ids) < dp * tp:
        raise ValueError(
            f"dp_size={dp} x tp_size={tp} needs {dp * tp} GPUs and this process sees {len(ids)} "
            f"({', '.join(ids) or 'none'}): lower dp_size or tp_size, or set CUDA_VISIBLE_DEVICES"
        )
    return [(dict(base), ",".join(ids[i * tp : (i + 1) * tp])) for i in range(dp)]


@dataclass(eq=False)
class Replica:
    """One replica: its scheduler client while it runs, and its history."""

    rank: int
    settings: dict[str, Any]
    devices: str | None
    client: Any = None  # its SchedulerClient; None between a death and the restart
    serving: bool = False
    pid: int | None = None
    error: str | None = None  # why it went down last
    restarts: int = 0
    failures: int = 0  # deaths in a row: the back-off doubles with each
    deaths: list[float] = field(default_factory=list)  # time.monotonic() of its recent deaths
    given_up: bool = False  # a crash loop: not started again
    up_since: float = 0.0  # time.monotonic() when it last became ready (0: not serving)
    retry_at: float | None = None  # time.monotonic() of the next start


@dataclass(eq=False)
class Replicas:
    """The front end's side of `dp_size` scheduler processes, in the shape of one `SchedulerClient`
    (`add`/`abort` are per replica: the front end uses `submit` and `release`). `make_client(settings,
    config, devices, name)` makes one replica's client."""

    specs: list[tuple[dict[str, Any], str | None]]
    config: str | None
    make_client: Callable[..., Any]
    info: dict[str, Any] | None = None  # replica 0's facts, max_running_req summed, once all are up
    on_failure: Any = None  # called once if the server cannot start (or, without restarts, on a death)
    restart: bool = True  # start a dead replica again (else its death ends the server)
    crash_limit: int = 5  # deaths within crash_window_s that end a replica's restarts
    crash_window_s: float = 600.0
    replicas: list[Replica] = field(default_factory=list)
    # the LoRA adapters every replica has loaded (name -> path), runtime loads included: a replica
    # started again loads them all
    adapters: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.ready = asyncio.Event()
        self.rids = itertools.count()
        self._failed: str | None = None
        self._owner: dict[int, Any] = {}  # rid -> the client its choice was sent to
        self._tasks: set[asyncio.Task] = set()
        self._restarts: set[asyncio.Task] = set()
        self._stop = asyncio.Event()
        self.replicas = [Replica(i, s, d) for i, (s, d) in enumerate(self.specs)]
        for replica in self.replicas:
            self._start(replica)

    # -- lifetime

    def _start(self, replica: Replica) -> None:
        settings = replica.settings
        if self.info is not None:  # started again: with the adapters the others have now
            settings = {**settings, "lora_modules": dict(self.adapters) or None}
        client = self.make_client(
            settings, self.config, replica.devices, f"minisgl-scheduler-dp{replica.rank}"
        )
        client.on_failure = functools.partial(self._down, replica, client)
        replica.client, replica.pid = client, client.proc.pid
        self._spawn(self._when_ready(replica, client), self._tasks)

    def _spawn(self, coroutine: Any, tasks: set[asyncio.Task]) -> None:
        task = asyncio.ensure_future(coroutine)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def _when_ready(self, replica: Replica, client: Any) -> None:
        await client.ready.wait()
        if replica.client is not client or client.failed is not None:
            return
        replica.serving, replica.error, replica.up_since = True, None, time.monotonic()
        logger.info("replica dp_rank=%d serving (pid %d)", replica.rank, replica.pid)
        if self.info is None and all(r.serving for r in self.replicas):
            info = dict(client.info)
            info["max_running_req"] = sum(r.client.info["max_running_req"] for r in self.replicas)
            self.info = info
            self.adapters = dict(getattr(client, "adapters", {}))
            self.ready.set()

    def _down(self, replica: Replica, client: Any) -> None:
        """`client`'s process failed or died (its requests got the error): no more requests for it; a
        restart after the back-off."""
        if replica.client is not client:
            return
        replica.client, replica.serving, replica.error = None, False, client.failed
        now = time.monotonic()
        replica.deaths = [t for t in replica.deaths if now - t < self.crash_window_s] + [now]
        if (
            self.info is None or not self.restart
        ):  # it never served (the settings cannot work), or no restarts
            self._failed = f"{self._name(replica)}{client.failed}"
            self._spawn(client.close(), self._restarts)
            if self.on_failure is not None:
                self.on_failure()
            return
        if len(replica.deaths) >= self.crash_limit:
            replica.given_up, replica.retry_at, replica.up_since = True, None, 0.0
            logger.error(
                "replica dp_rank=%d died %d times within %.0f s (%s): not starting it again",
                replica.rank,
                len(replica.deaths),
                self.crash_window_s,
                client.failed,
            )
            self._spawn(client.close(), self._restarts)
            return
        if replica.up_since and now - replica.up_since >= STABLE_S:
            replica.failures = 0
        replica.up_since = 0.0
        replica.failures += 1
        delay = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** (replica.failures - 1))
        replica.retry_at = now + delay
        logger.error(
            "replica dp_rank=%d is down (%s); starting it again in %.0f s", replica.rank, client.failed, delay
        )
        self._spawn(self._restart(replica, client, delay), self._restarts)

    async def _restart(self, replica: Replica, dead: Any, delay: float) -> None:
        await dead.close()  # its process joined, its sockets and folder removed
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._stop.wait(), delay)
        if self._stop.is_set():
            return
        replica.restarts += 1
        replica.retry_at = None
        logger.info("replica dp_rank=%d: starting again (restart %d)", replica.rank, replica.restarts)
        self._start(replica)

    async def close(self) -> None:
        """Stops every replica (each stops the ranks it spawned) and waits for them."""
        self._stop.set()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*list(self._restarts), return_exceptions=True)
        await asyncio.gather(*(r.client.close() for r in self.replicas if r.client is not None))

    # -- state

    def _name(self, replica: Replica) -> str:
        """How messages name a replica: by its dp_rank when there are several."""
        return f"replica dp_rank={replica.rank}: " if len(self.replicas) > 1 else ""

    @property
    def restarting(self) -> bool:
        """True while a replica that is not serving will serve again (not a crash loop, not the end)."""
        return self._failed is None and any(not r.serving and not r.given_up for r in self.replicas)

    @property
    def failed(self) -> str | None:
        """Why no request can be served: the server could not start, or no replica serves now (each
        one's last cause, and whether it is being started again)."""
        if self._failed is not None:
            return self._failed
        if self.info is not None and not any(r.serving for r in self.replicas):
            causes = "; ".join(
                f"{self._name(r)}{r.error or 'starting'}"
                + (
                    f" (died {len(r.deaths)} times within {self.crash_window_s:.0f} s: not started again)"
                    if r.given_up
                    else " (starting again)"
                )
                for r in self.replicas
            )
            return causes if len(self.replicas) == 1 else f"no replica is serving ({causes})"
        return None

    def status(self) -> dict[str, Any]:
        """`/health`'s body: every replica's state; `down` and status "degraded" when one is not serving."""
        now = time.monotonic()
        replicas = []
        for r in self.replicas:
            entry: dict[str, Any] = {
                "dp_rank": r.rank,
                "state": "serving"
                if r.serving
                else "failed"
                if r.given_up
                else "restarting"
                if r.restarts or r.error
                else "starting",
                "pid": r.pid,
                "restarts": r.restarts,
            }
            if r.error is not None and not r.serving:
                entry["error"] = r.error
            if r.retry_at is not None:
                entry["restart_in_s"] = round(max(0.0, r.retry_at - now), 1)
            replicas.append(entry)
        down = [r.rank for r in self.replicas if not r.serving]
        body: dict[str, Any] = {"replicas": replicas}
        if down and self.info is not None:
            body |= {"status": "degraded", "down": down}
        return body

    def loads(self) -> list[dict[str, Any]]:
        """`GET /get_load`'s entries, one per serving replica."""
        return [{**r.client.loads()[0], "dp_rank": r.rank} for r in self.replicas if r.serving]

    # -- requests

    def submit(self, choices: list[Any], prompt: bytes, prompt_len: int) -> None:
        """Sends a request's choices to the serving replica with the fewest outstanding tokens; with
        none serving (all died since the request was checked) they end with the error."""
        serving = [r for r in self.replicas if r.serving]
        if not serving:
            for choice in choices:
                choice.end("engine_died", self.failed)
                choice.job.wake.set()
            return
        client = min(serving, key=lambda r: r.client.load_tokens).client
        for choice in choices:
            self._owner[choice.rid] = client
        client.submit(choices, prompt, prompt_len)

    async def embed(self, inputs: list[list[int]], params: Any) -> list[list[float]]:
        """An embeddings request on the serving replica with the fewest outstanding tokens."""
        serving = [r for r in self.replicas if r.serving]
        if not serving:
            raise RuntimeError(self.failed or "no replica is serving")
        return await min(serving, key=lambda r: r.client.load_tokens).client.embed(inputs, params)

    def release(self, choice: Any, abort: bool) -> None:
        client = self._owner.pop(choice.rid, None)
        if client is not None:
            client.release(choice, abort)

    def abort_all(self) -> None:
        for r in self.replicas:
            if r.client is not None:
                r.client.abort_all()

    async def metrics(self) -> str:
        """The serving replicas' series, labelled with their dp_rank, and the replicas' own."""
        serving = [r for r in self.replicas if r.serving]
        texts = await asyncio.gather(*(r.client.metrics() for r in serving), return_exceptions=True)
        parts = [(r.rank, text) for r, text in zip(serving, texts) if isinstance(text, str)]
        # one replica (a plain server): its series as they are, without a dp_rank label
        merged = "".join(text for _, text in parts) if len(self.replicas) == 1 else merge_metrics(parts)
        up = "\n".join(f'minisgl_dp_replica_up{{dp_rank="{r.rank}"}} {int(r.serving)}' for r in self.replicas)
        restarts = "\n".join(
            f'minisgl_dp_replica_restarts_total{{dp_rank="{r.rank}"}} {r.restarts}' for r in self.replicas
        )
        own = (
            "# HELP minisgl_dp_replica_up Whether the data-parallel replica serves (1) or is down (0).\n"
            f"# TYPE minisgl_dp_replica_up gauge\n{up}\n"
            "# HELP minisgl_dp_replica_restarts_total Times the front end started the replica again.\n"
            f"# TYPE minisgl_dp_replica_restarts_total counter\n{restarts}\n"
        )
        return merged + own

    async def load_lora(self, name: str, path: str) -> dict[str, Any]:
        """Loads a LoRA adapter in every serving replica (`SchedulerClient.load_lora`'s answer: the first
        error, after the replicas that did load it unloaded it again)."""
        serving = [r.client for r in self.replicas if r.serving]
        answers = await asyncio.gather(*(c.load_lora(name, path) for c in serving), return_exceptions=True)
        failed = [a for a in answers if isinstance(a, BaseException) or a["error"] is not None]
        if failed:
            loaded = [
                c for c, a in zip(serving, answers) if not isinstance(a, BaseException) and a["error"] is None
            ]
            await asyncio.gather(*(c.unload_lora(name) for c in loaded), return_exceptions=True)
            first = failed[0]
            if isinstance(first, BaseException):
                return {"error": f"a replica did not answer ({type(first).__name__}: {first})", "status": 503}
            return first
        self.adapters[name] = path
        return {"error": None, "status": 200}

    async def unload_lora(self, name: str) -> dict[str, Any]:
        """Unloads a LoRA adapter from every serving replica (the first error, if any)."""
        serving = [r.client for r in self.replicas if r.serving]
        answers = await asyncio.gather(*(c.unload_lora(name) for c in serving), return_exceptions=True)
        self.adapters.pop(name, None)
        for answer in answers:
            if isinstance(answer, BaseException):
                return {
                    "error": f"a replica did not answer ({type(answer).__name__}: {answer})",
                    "status": 503,
                }
            if answer["error"] is not None:
                return answer
        return {"error": None, "status": 200}

    async def flush_cache(self) -> int:
        """Empties every serving replica's prefix cache; the KV pages freed in all."""
        serving = [r for r in self.replicas if r.serving]
        freed = await asyncio.gather(*(r.client.flush_cache() for r in serving), return_exceptions=True)
        return sum(pages for pages in freed if isinstance(pages, int))  # one that died meanwhile: none


def _labelled(line: str, rank: int) -> str:
    """A sample line `name{labels} value` (or `name value`) with dp_rank="rank" first among its labels."""
    cut = min(i for i in (line.find("{"), line.find(" ")) if i >= 0)
    if line[cut] == " ":
        return f'{line[:cut]}{{dp_rank="{rank}"}}{line[cut:]}'
    rest = line[cut + 1 :]
    return f'{line[:cut]}{{dp_rank="{rank}"{"" if rest.startswith("}") else ","}{rest}'


def merge_metrics(texts: list[tuple[int, str]]) -> str:
    """Prometheus text of several replicas (dp_rank, text) as one exposition: each family's HELP and
    TYPE once, then its samples from every replica together, each labelled with its dp_rank."""
    families: dict[str, tuple[list[str], list[str]]] = {}  # name -> (HELP and TYPE lines, samples)
    for rank, text in texts:
        current = families.setdefault("", ([], []))
        mine: set[str] = set()  # the families whose head this text gives
        for line in text.splitlines():
            if not line:
                continue
            if line.startswith("#"):
                words = line.split(" ", 3)
                if len(words) >= 3 and words[1] in ("HELP", "TYPE"):
                    if words[2] not in families:
                        families[words[2]] = ([], [])
                        mine.add(words[2])
                    current = families[words[2]]
                    if words[2] in mine:
                        current[0].append(line)
                continue
            current[1].append(_labelled(line, rank))
    lines = []
    for head, samples in families.values():
        if samples or head:
            lines += head + samples
    return "\n".join(lines) + "\n" if lines else ""
