"""Running a tensor-parallel group from one process: every rank runs its own scheduler, in lockstep.

`start_workers` spawns ranks 1..N-1 (`worker_main`); each builds its Engine (joining the process group),
connects to rank 0 (`minisgl.scheduler.lockstep`), and runs a following `Scheduler`: one step per
message from rank 0, which sends only what arrived from outside (new requests, aborts, the finishes it
decided) and each step's plan. Rank 0 is the `LLM`'s own process and scheduler (`TPGroup` holds its
side: the spawned processes and the leading link). A rank that fails reports it to rank 0 before it
exits; rank 0 raises it at its next step, naming the rank, and so it does for a spawned rank that died.

Ranks can also come from a launcher (torchrun, or one process per machine with RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT set): rank 0 runs the LLM as usual, the others run `worker_main`
(`minisgl-run` does this by itself when it finds those variables).
"""

from __future__ import annotations

import ast
import atexit
import contextlib
import dataclasses
import logging
import multiprocessing as mp
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from minisgl.core import FatalEngineError
from minisgl.engine import Engine
from minisgl.scheduler import Scheduler, SchedulerConfig
from minisgl.scheduler.lockstep import Leader, follower_link, leader_link

logger = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 30.0  # for a rank told to stop
BROKEN_JOIN_S = 5.0  # for a rank of a broken group (it may be stuck in a collective)

# a function run on each spawned rank once its scheduler exists (tests inject faults with it)
WorkerSetup = Callable[[int, Engine, Scheduler], None]


def worker_main(
    rank: int,
    settings: dict[str, Any],
    config: str | None,
    parent: int | None = None,
    setup: WorkerSetup | None = None,
) -> None:
    """Entry point of ranks 1..N-1: build the engine, follow rank 0's scheduler step by step until it
    says stop. `parent`: the pid of the process that spawned this one (its death ends the wait)."""
    os.environ.setdefault("TQDM_DISABLE", "1")  # rank 0 alone shows progress
    logging.basicConfig(level=logging.WARNING)
    from minisgl.settings import EngineSettings

    engine = Engine(EngineSettings.load(config, **settings).to_engine_config(rank))
    cfg = engine.config
    link = follower_link(rank, cfg.tp_info.size, cfg.distributed_addr, parent)
    try:
        hello = link.receive()
        if hello is None:
            return
        shared = hello["hello"]
        scheduler = Scheduler(
            engine, SchedulerConfig(**shared["config"]), eos_token_ids=shared["eos_token_ids"], link=link
        )
        if setup is not None:
            setup(rank, engine, scheduler)
        while link.wait_for_step():
            scheduler.step()
    except BaseException as e:
        failed = True
        link.send_report(e)
        raise
    else:
        failed = False
    finally:
        link.close()
        engine.shutdown(abort=failed)  # rank 0 tears down with us unless this rank failed


def exit_now(code: int = 0) -> NoReturn:
    """Ends this process as a return from its main would, less the interpreter's teardown: the atexit
    handlers run (logging's flush, multiprocessing's finalizers and children), the output is flushed,
    then the process exits. Freeing every module and object of torch and transformers one by one
    (seconds of a server's stop) changes nothing outside the process."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _spawned_worker(*args: Any) -> None:
    """`worker_main` in a rank `start_workers` spawned: the process ends with it."""
    worker_main(*args)
    exit_now()


class TPGroup:
    """Rank 0's view of its group: the leading link its scheduler uses and the ranks it spawned."""

    def __init__(self, engine: Engine, workers: list[mp.process.BaseProcess]) -> None:
        self.workers = workers
        cfg = engine.config
        self.link: Leader = leader_link(cfg.tp_info.size, cfg.distributed_addr, self._check_workers)
        self._closed = False
        self._broken: bool | None = None  # decided by `stop`

    def _check_workers(self) -> None:
        for rank, proc in enumerate(self.workers, start=1):
            if not proc.is_alive():
                raise FatalEngineError(
                    f"tensor-parallel rank {rank} exited (exit code {proc.exitcode}); the group was stopped"
                )

    def start(self, scheduler: Scheduler) -> None:
        """Tells the followers what their schedulers must share with `scheduler` (rank 0's)."""
        self.link.hello(
            {
                "config": dataclasses.asdict(scheduler.config),
                "eos_token_ids": sorted(scheduler.output.eos_token_ids),
            }
        )

    def stop(self) -> bool:
        """Tells the other ranks to stop if the group still works; returns whether it was broken (a rank
        failed or exited), in which case rank 0 aborts its communicators rather than finalizing them
        together with the others. Rank 0 shuts its engine down between `stop` and `join`: NCCL's
        teardown is collective, so a follower leaving the group waits for rank 0 to leave it too."""
        if self._broken is None:
            self._broken = self.link.broken or any(not proc.is_alive() for proc in self.workers)
            if not self._broken:
                try:
                    self.link.stop()
                except Exception as e:
                    logger.warning("could not tell the other ranks to stop: %s", e)
                    self._broken = True
        return self._broken

    def shutdown(self) -> None:
        """`stop`, then waits for the ranks it spawned (killing those that do not end). Idempotent."""
        if self._closed:
            return
        self._closed = True
        broken = self.stop()
        for proc in self.workers:
            proc.join(BROKEN_JOIN_S if broken else JOIN_TIMEOUT_S)
            if proc.is_alive():
                proc.kill()
                proc.join(JOIN_TIMEOUT_S)
        self.workers = []
        self.link.close()


def launched_rank() -> tuple[int, int] | None:
    """(rank, world size) when a launcher such as torchrun started this process (RANK and WORLD_SIZE set;
    the group then meets at MASTER_ADDR:MASTER_PORT through `env://`)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


def check_main_guard() -> None:
    """Raises a clear error if ranks are started from the main script's top level outside an
    ``if __name__ == "__main__":`` block: the spawned ranks import the main script again, and there
    they would try to start ranks of their own (multiprocessing's "bootstrapping phase" error)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_globals is vars(main) and frame.f_code.co_name == "<module>"):
        frame = frame.f_back
    if frame is None or path is None or not os.path.isfile(path):
        return  # not started from the main script's top level (a function, a REPL, `python -c`)
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, UnicodeDecodeError):
        return
    line = frame.f_lineno
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_main_test(node.test):
            if node.body[0].lineno <= line <= (node.body[-1].end_lineno or line):
                return
    raise RuntimeError(
        f"{path}, line {line}: tensor parallelism starts its ranks as new processes, which import this "
        'script again; put the code that creates the LLM under `if __name__ == "__main__":`'
    )


def _is_main_test(test: ast.expr) -> bool:
    """True for ``__name__ == "__main__"`` (either order)."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = {ast.unparse(test.left), ast.unparse(test.comparators[0])}
    return sides == {"__name__", "'__main__'"}


def start_workers(
    size: int, settings: dict[str, Any], config: str | None, setup: WorkerSetup | None = None
) -> list[mp.process.BaseProcess]:
    """Spawns ranks 1..size-1 (daemons: they end with this process; they also stop by themselves when
    it is killed). `setup(rank, engine, scheduler)` runs on each once its scheduler exists."""
    check_main_guard()
    ctx = mp.get_context("spawn")
    workers = [
        ctx.Process(
            target=_spawned_worker,
            args=(rank, settings, config, os.getpid(), setup),
            daemon=True,
            name=f"minisgl-rank{rank}",
        )
        for rank in range(1, size)
    ]
    for proc in workers:
        proc.start()
    return workers
