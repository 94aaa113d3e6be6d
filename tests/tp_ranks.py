"""Tensor-parallel ranks for tests/test_tp.py: a pool of spawned processes, each a rank of one group
after another.

A job is one run of `size` ranks: every member of the pool up to `size` builds its Engine as its rank
of a new group, runs the prompts, shuts the engine down (which leaves the group, so the process can
join the next one) and reports. The processes outlive the jobs: a test pays for a rank's start (its
imports of torch and minisgl, seconds of CPU each) once a module, not once a rank and run. A member
that died (killed, crashed on purpose) is started again by the next job that needs it.

The spawned processes import this module (not the test module, which imports transformers and
conftest's hypothesis), so it imports only what a rank needs.
"""

from __future__ import annotations

import os
import socket
import time
import traceback
from multiprocessing.connection import Connection, wait
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from minisgl.core import SamplingParams
from minisgl.distributed import DistributedInfo, destroy_process_group
from minisgl.engine import Engine, EngineConfig
from minisgl.scheduler import BatchPreparer, generate

PROMPTS = [[5, 17, 42, 9, 100, 3], [7], list(range(20, 61)), [300, 12, 250, 8]]
MAX_TOKENS = 8
RUN_TIMEOUT_S = 240.0  # a whole multi-rank run, a rank's start included
COLLECTIVE_TIMEOUT_S = 60.0  # a dead rank fails the others' collectives after this long

Outcome = tuple[str, object]  # ("ok", (tokens, first-step logits)) or ("error", message)


class RankFailure(Exception):
    """A rank of a job died without reporting, or the job ran past its deadline."""


def make_engine(model_path: Path, tp: DistributedInfo, port: int = 0, dummy: bool = False) -> Engine:
    return Engine(
        EngineConfig(
            model_path=str(model_path),
            tp_info=tp,
            device="cpu",
            dtype=torch.float32,
            max_running_req=len(PROMPTS),
            max_seq_len_override=128,
            distributed_addr=f"tcp://127.0.0.1:{port}",
            distributed_timeout=COLLECTIVE_TIMEOUT_S,
            use_dummy_weight=dummy,
        )
    )


def run_prompts(
    engine: Engine, prompts: list[list[int]], max_tokens: int
) -> tuple[list[list[int]], np.ndarray]:
    """(generated tokens, first-step logits) of the prompts."""
    prep = BatchPreparer(engine)
    reqs = [prep.add_request(p, SamplingParams(max_tokens=1)) for p in prompts]
    logits = engine.forward_logits(prep.prefill(reqs)).numpy()
    prep.release(reqs)
    return generate(engine, prompts, SamplingParams(max_tokens=max_tokens), preparer=prep), logits


def _job(
    rank: int,
    size: int,
    model_path: Path,
    port: int,
    prompts: list[list[int]],
    max_tokens: int,
    dummy: bool,
    crash_rank: int | None,
) -> Outcome:
    engine = None
    try:
        engine = make_engine(model_path, DistributedInfo(rank, size), port, dummy)
        if rank == crash_rank:
            os._exit(1)  # dies without a word, as a crashed process would
        return "ok", run_prompts(engine, prompts, max_tokens)
    except BaseException as e:  # noqa: BLE001  (reported to the test, which fails)
        return "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    finally:
        if engine is not None:
            engine.shutdown()
        if dist.is_initialized():  # an engine that failed after joining its group: leave it for the next
            destroy_process_group()


def _serve(conn: Connection) -> None:
    """A pool member: runs the jobs it receives, one at a time, until it receives None."""
    torch.set_num_threads(1)  # the ranks share this machine's few cores
    while (job := conn.recv()) is not None:
        conn.send(_job(*job))
    os._exit(0)  # nothing to flush or free: torch's teardown would only cost the machine seconds


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankPool:
    """Spawned rank processes, started when a job first needs them and reused by the jobs after."""

    def __init__(self) -> None:
        self._ctx = mp.get_context("spawn")
        self._members: list[tuple[mp.Process, Connection] | None] = []

    def _ensure(self, size: int) -> list[tuple[mp.Process, Connection]]:
        """Members 0..size-1, starting those missing or dead (all at once: they import side by side)."""
        self._members += [None] * (size - len(self._members))
        for i in range(size):
            member = self._members[i]
            if member is None or not member[0].is_alive():
                self._drop(i)
                ours, theirs = self._ctx.Pipe()
                proc = self._ctx.Process(target=_serve, args=(theirs,), daemon=True, name=f"tp-rank{i}")
                proc.start()
                theirs.close()
                self._members[i] = proc, ours
        return self._members[:size]  # type: ignore[return-value]

    def _drop(self, i: int) -> None:
        """Kills member i (if any) and forgets it."""
        member = self._members[i]
        self._members[i] = None
        if member is not None:
            proc, conn = member
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=10)
            conn.close()

    def run(
        self,
        model_path: Path,
        size: int,
        prompts: list[list[int]] = PROMPTS,
        max_tokens: int = MAX_TOKENS,
        dummy: bool = False,
        crash_rank: int | None = None,
    ) -> list[Outcome]:
        """Runs one job of `size` ranks; returns each rank's outcome. Never hangs: a rank that dies
        without reporting, or a job past the deadline, raises `RankFailure` at once, and the job's
        ranks that have not reported (stuck in a collective with the dead one) are killed."""
        members = self._ensure(size)
        port = _free_port()
        for rank, (_, conn) in enumerate(members):
            conn.send((rank, size, model_path, port, prompts, max_tokens, dummy, crash_rank))
        got: dict[int, Outcome] = {}
        deadline = time.monotonic() + RUN_TIMEOUT_S
        try:
            while len(got) < size:
                waiting = {r: members[r] for r in range(size) if r not in got}
                conns = {conn: r for r, (_, conn) in waiting.items()}
                sentinels = {proc.sentinel: r for r, (proc, _) in waiting.items()}
                ready = wait([*conns, *sentinels], timeout=max(0.0, deadline - time.monotonic()))
                dead = {sentinels[s] for s in ready if s in sentinels}
                for conn in (c for c in ready if c in conns):
                    try:
                        got[conns[conn]] = conn.recv()  # a rank's last words before its exit count
                    except EOFError:  # it died: its end of the pipe closed with it
                        members[conns[conn]][0].join(timeout=10)
                        dead.add(conns[conn])
                if exited := sorted(dead - got.keys()):
                    codes = [members[r][0].exitcode for r in exited]
                    raise RankFailure(f"rank(s) {exited} of {size} exited (codes {codes}) without a result")
                if not ready:
                    raise RankFailure(
                        f"TP={size} run did not finish in {RUN_TIMEOUT_S:.0f} s; results from ranks {sorted(got)}"
                    )
        finally:
            for rank in range(size):
                if rank not in got:
                    self._drop(rank)
        return [got[rank] for rank in range(size)]

    def close(self) -> None:
        """Stops every member (asks, then kills those that do not end)."""
        for member in self._members:
            if member is not None:
                try:
                    member[1].send(None)
                except OSError:
                    pass
        for i in range(len(self._members)):
            member = self._members[i]
            if member is not None:
                member[0].join(timeout=10)
                self._drop(i)
        self._members = []
