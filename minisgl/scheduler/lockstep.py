"""Ranks in lockstep: every tensor-parallel rank runs its own `Scheduler` over the same request stream.

Rank 0 (`Leader`) alone sees the outside world; each of its steps sends every follower (`Follower`) the
events since the last step (add, finish, clear, an adapter loaded or unloaded) and the step's plan, which the follower checks against
its own, so nothing about a batch travels. docs/tensor-parallel-and-moe.md, "Ranks in lockstep".
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import logging
import os
import socket
import time
import zlib
from array import array
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlparse

import torch
import torch.distributed as dist
import zmq

from minisgl.core import FatalEngineError, SamplingParams
from minisgl.distributed import cpu_group
from minisgl.scheduler.request import RequestState

Scheduler = Any  # minisgl.scheduler.Scheduler, which imports this module

logger = logging.getLogger(__name__)

ADDRESS_BYTES = 256  # room for one rank's socket address in the start-up exchange
POLL_MS = 1000  # a follower waiting for the leader checks this often that its parent still lives
CHECK_S = 0.005  # the leader waiting for a step's tokens checks this often that every rank still runs
# how long rank 0, after a collective failed, looks for the rank that caused it (its report or exit)
RANK_FAILURE_GRACE_S = 2.0

# phase ("" when the step runs no forward), requests, tokens, sum of their uids; then the scheduler's
# state after admission: requests running and waiting, KV pages in use; then a digest of the tokens
# the rank read last (`token_digest`)
Plan = tuple[str, int, int, int, int, int, int, int]
PLAN_FIELDS = "phase, requests, tokens, uid sum, running, waiting, pages used, digest of the last tokens"


def step_plan(scheduler: Scheduler, states: Sequence[RequestState], chunks: Sequence[int] | None) -> Plan:
    """What a step runs and where the scheduler stands, in numbers that every rank must agree on."""
    phase = "" if not states else "decode" if chunks is None else "prefill"
    tokens = len(states) if chunks is None else sum(chunks)
    return (
        phase,
        len(states),
        tokens,
        sum(s.uid for s in states),
        len(scheduler.running),
        len(scheduler.waiting),
        scheduler.prep.pages.num_used,
        scheduler.last_token_digest,
    )


def token_digest(tokens: list[int]) -> int:
    """A digest of a step's tokens, the same in every process and Python version (CRC-32 of int64s)."""
    return zlib.crc32(array("q", tokens).tobytes())


def _params_to_data(params: SamplingParams) -> dict[str, Any]:
    return dataclasses.asdict(params)


def _params_from_data(data: dict[str, Any]) -> SamplingParams:
    return SamplingParams(**data)


class Leader:
    """Rank 0's side: records what its scheduler does to requests, sends it with each step's plan."""

    is_leader = True

    def __init__(
        self, peers: list[zmq.Socket], reports: zmq.Socket, check_alive: Callable[[], None] | None = None
    ) -> None:
        """`peers`: one PUSH socket per follower; `reports`: the PULL socket followers report failures
        to; `check_alive`: raises if a follower process is known to be gone (spawned ranks)."""
        self.peers, self.reports, self.check_alive = peers, reports, check_alive
        self._events: list[list[Any]] = []
        self._prompts = array("q")
        self._step = 0
        self._mark = 0  # events from here on happened inside the current step, before its plan
        self._broken: FatalEngineError | None = None

    # -- what the scheduler tells it ------------------------------------------------------------

    def added(self, state: RequestState) -> None:
        lora = None if state.lora is None else state.lora.name
        self._events.append(["add", state.uid, len(state.prompt_ids), _params_to_data(state.params), lora])
        self._prompts.extend(state.prompt_ids)

    def finished(self, state: RequestState) -> None:
        self._events.append(["finish", state.uid, state.finish_reason, state.error])

    def cleared(self) -> None:
        self._events.append(["clear"])

    def lora_changed(self, name: str, path: str | None) -> None:
        """Adapter `name` was loaded from `path` (None: unloaded): every rank does the same, in order."""
        self._events.append(["lora", name, path])

    def begin(self, scheduler: Scheduler) -> None:
        """Marks the start of a step: what finishes from here to the plan (a request that failed at
        admission) must reach the followers inside their admission, not before it."""
        self._mark = len(self._events)

    def admission_error(self, state: RequestState) -> str | None:
        return None

    def agree(self, plan: Plan, error: Exception | None) -> Exception | None:
        """Sends the events since the last step, this step's plan and the verdict on preparing it
        (`error`, None when the batch is ready). Returns `error`. Raises `FatalEngineError` if a follower
        failed or exited."""
        self.check_ranks()
        header = {
            "step": self._step,
            "events": self._events[: self._mark],
            "admission_errors": {e[1]: e[3] for e in self._events[self._mark :] if e[0] == "finish"},
            "plan": plan,
            "error": None if error is None else f"{type(error).__name__}: {error}",
        }
        self._send([json.dumps(header).encode(), self._prompts.tobytes()])
        self._events, self._prompts, self._mark = [], array("q"), 0
        self._step += 1
        return error

    def hello(self, data: dict[str, Any]) -> None:
        """The first message: what every follower's scheduler must share with the leader's."""
        self._send([json.dumps({"hello": data}).encode()])

    @property
    def broken(self) -> bool:
        """True once a follower failed or exited (the group cannot run steps any more)."""
        return self._broken is not None

    def stop(self) -> None:
        """Tells the followers to leave their loops (they then shut down their engines)."""
        if not self.broken:
            self._send([json.dumps({"stop": True}).encode()])

    def wait(self, event: Any) -> None:
        """Waits for `event` (a step's tokens reaching the host), raising `FatalEngineError` if a
        follower fails meanwhile: its peers would otherwise wait in a collective until the timeout."""
        next_check = time.monotonic() + CHECK_S
        while not event.query():
            if time.monotonic() >= next_check:
                self.check_ranks()
                next_check = time.monotonic() + CHECK_S

    def _send(self, frames: list[bytes]) -> None:
        for peer in self.peers:
            peer.send_multipart(frames)

    def check_ranks(self, grace_s: float = 0.0) -> None:
        """Raises `FatalEngineError` naming the rank if a follower reported a failure or exited; with
        `grace_s`, keeps looking that long (a collective that failed because a peer died can fail
        before the peer's report arrives or its exit can be seen)."""
        deadline = time.monotonic() + grace_s
        while True:
            self._check_ranks_once()
            if time.monotonic() >= deadline:
                return
            time.sleep(CHECK_S)

    def _check_ranks_once(self) -> None:
        if self._broken is not None:
            raise self._broken
        if self.reports.poll(0):
            report = json.loads(self.reports.recv())
            self._broken = FatalEngineError(
                f"tensor-parallel rank {report['rank']} failed ({report['error']}); the group was stopped"
            )
            raise self._broken
        if self.check_alive is not None:
            try:
                self.check_alive()
            except FatalEngineError as e:
                self._broken = e
                raise

    def close(self) -> None:
        for s in [*self.peers, self.reports]:
            s.close(linger=0)


class Follower:
    """The side of ranks 1..N-1: receives the leader's message before each step and applies it."""

    is_leader = False

    def __init__(self, rank: int, inbox: zmq.Socket, report: zmq.Socket, parent: int | None = None) -> None:
        """`inbox`: the PULL socket the leader's messages arrive on; `report`: a PUSH socket to the
        leader for this rank's failure; `parent`: the pid whose death ends the wait (spawned ranks)."""
        self.rank, self.inbox, self.report = rank, inbox, report
        self.parent = parent
        self._header: dict[str, Any] | None = None
        self._prompts: array = array("q")
        self._step = 0

    def receive(self) -> dict[str, Any] | None:
        """Waits for the leader's next message; None when it says stop (or its process is gone)."""
        while not self.inbox.poll(POLL_MS):
            if self.parent is not None and os.getppid() != self.parent:
                logger.warning("rank %d: the process that started it is gone; stopping", self.rank)
                return None
        frames = self.inbox.recv_multipart()
        header = json.loads(frames[0])
        if header.get("stop"):
            return None
        if "hello" in header:
            return header
        self._header, self._prompts = header, array("q")
        if len(frames) > 1:
            self._prompts.frombytes(frames[1])
        return header

    def wait_for_step(self) -> bool:
        """Receives the next step's message (skipping none); False when the leader says stop."""
        header = self.receive()
        if header is not None and "hello" in header:
            raise FatalEngineError(f"rank {self.rank}: a second hello from rank 0 (protocol error)")
        return header is not None

    def added(self, state: RequestState) -> None:
        pass

    def finished(self, state: RequestState) -> None:
        pass

    def cleared(self) -> None:
        pass

    def lora_changed(self, name: str, path: str | None) -> None:
        pass

    def begin(self, scheduler: Scheduler) -> None:
        """Applies the leader's events, in order, to this rank's scheduler."""
        header = self._header
        if header is None:
            raise FatalEngineError(f"rank {self.rank}: a step without the leader's message")
        if header["step"] != self._step:
            raise FatalEngineError(
                f"rank {self.rank} is at step {self._step} but rank 0 sent step {header['step']}"
            )
        offset = 0
        for event in header["events"]:
            if event[0] == "add":
                _, uid, length, params, lora = event
                prompt = self._prompts[offset : offset + length].tolist()
                offset += length
                scheduler.follow_add(uid, prompt, _params_from_data(params), lora)
            elif event[0] == "clear":
                scheduler.follow_clear()
            elif event[0] == "lora":
                scheduler.follow_lora(*event[1:])
            else:
                _, uid, reason, error = event
                scheduler.follow_finish(uid, reason, error)

    def admission_error(self, state: RequestState) -> str | None:
        """The leader's error for `state` if admitting it failed there in this step (JSON keys are
        strings)."""
        assert self._header is not None
        return self._header["admission_errors"].get(str(state.uid))

    def agree(self, plan: Plan, error: Exception | None) -> Exception | None:
        """Checks this rank's plan against the leader's and adopts the leader's verdict: the step fails
        on every rank if it failed on the leader; a step that fails only here stops the group."""
        header, self._header = self._header, None
        assert header is not None
        self._step += 1
        leader_plan = tuple(header["plan"])
        if leader_plan != tuple(plan):
            raise FatalEngineError(
                f"rank {self.rank} diverged from rank 0 at step {header['step']}: it has {plan} where rank 0 "
                f"has {leader_plan} ({PLAN_FIELDS})"
            )
        if header["error"] is not None:
            return RuntimeError(f"on rank 0: {header['error']}")
        if error is not None:
            raise FatalEngineError(
                f"rank {self.rank} failed to prepare step {header['step']} that rank 0 prepared: "
                f"{type(error).__name__}: {error}"
            ) from error
        return None

    def wait(self, event: Any) -> None:
        event.synchronize()

    def check_ranks(self, grace_s: float = 0.0) -> None:
        """Only the leader watches the other ranks."""

    def send_report(self, error: BaseException) -> None:
        """Tells the leader why this rank stops (best effort: the leader may be gone)."""
        try:
            message = json.dumps({"rank": self.rank, "error": f"{type(error).__name__}: {error}"})
            self.report.send(message.encode(), flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def close(self) -> None:
        self.inbox.close(linger=0)
        self.report.close(linger=1000)  # let a failure report reach the leader


def bind_host(distributed_addr: str) -> str:
    """The host this rank's sockets bind to: loopback when the group meets on this machine (a file,
    a loopback address), else this machine's address on the interface that reaches the group's address."""
    if distributed_addr.startswith("env://"):
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    elif distributed_addr.startswith("tcp://"):
        host = urlparse(distributed_addr).hostname or "127.0.0.1"
    else:  # file://: the ranks share a file system, so a machine
        return "127.0.0.1"
    try:
        if ipaddress.ip_address(socket.gethostbyname(host)).is_loopback:
            return "127.0.0.1"
    except (OSError, ValueError):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:  # no packet is sent
        probe.connect((socket.gethostbyname(host), 9))
        return probe.getsockname()[0]


def connect(rank: int, size: int, distributed_addr: str) -> tuple[zmq.Context, zmq.Socket, list[str]]:
    """Binds this rank's inbox (PULL) on an ephemeral port and learns every rank's inbox address,
    exchanged once over the engine's gloo group (plain bytes). Collective: every rank calls it."""
    context = zmq.Context()
    inbox = context.socket(zmq.PULL)
    host = bind_host(distributed_addr)
    port = inbox.bind_to_random_port(f"tcp://{host}")
    own = f"tcp://{host}:{port}".encode()
    mine = torch.zeros(ADDRESS_BYTES, dtype=torch.uint8)
    mine[: len(own)] = torch.tensor(list(own), dtype=torch.uint8)
    everyone = [torch.zeros_like(mine) for _ in range(size)]
    dist.all_gather(everyone, mine, group=cpu_group())
    addresses = [bytes(t.tolist()).rstrip(b"\0").decode() for t in everyone]
    return context, inbox, addresses


def leader_link(size: int, distributed_addr: str, check_alive: Callable[[], None] | None) -> Leader:
    """Rank 0's `Leader`, connected to every follower (collective with `follower_link`)."""
    context, reports, addresses = connect(0, size, distributed_addr)
    peers = []
    for address in addresses[1:]:
        peer = context.socket(zmq.PUSH)
        peer.connect(address)
        peers.append(peer)
    return Leader(peers, reports, check_alive)


def follower_link(rank: int, size: int, distributed_addr: str, parent: int | None) -> Follower:
    """Rank `rank`'s `Follower`, connected to the leader (collective with `leader_link`)."""
    context, inbox, addresses = connect(rank, size, distributed_addr)
    report = context.socket(zmq.PUSH)
    report.connect(addresses[0])
    return Follower(rank, inbox, report, parent)


def fatal_under_tp(
    link: Leader | Follower, error: Exception, grace_s: float = RANK_FAILURE_GRACE_S
) -> Exception:
    """A forward that failed on one rank leaves the others inside its collectives: every such failure
    is fatal, and a rank that reported its own failure (or exited) is named as the cause."""
    if isinstance(error, FatalEngineError):
        return error
    if not link.is_leader:  # reported to rank 0 as it is
        fatal = FatalEngineError(f"{type(error).__name__}: {error}")
    else:
        try:
            link.check_ranks(grace_s=grace_s)
        except FatalEngineError as rank_error:
            fatal = rank_error
        else:
            fatal = FatalEngineError(
                "a forward failed under tensor parallelism, so the ranks no longer run the same "
                f"collectives: {type(error).__name__}: {error}"
            )
    fatal.__cause__ = error
    return fatal
