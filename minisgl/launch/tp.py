"""Running a tensor-parallel group from one process: rank 0 schedules, the other ranks follow.

`start_workers` spawns ranks 1..N-1; each builds its Engine (joining the process group) and then
replays what rank 0 sends before every forward: the page-table writes since the last step and the
batch (each request's slot and lengths, the host lists of input_ids, positions and out_loc). Rank 0's
scheduler sees a `RankZeroEngine`, which sends that message and then runs its own forward, so every
rank runs the same batch and takes part in the same collectives. Only rank 0's sampled tokens are used;
the other ranks sample greedily and discard theirs. Messages travel over a gloo group (also on GPUs,
where tensors use NCCL). A rank that died is noticed before the next step and reported by name.

Ranks can also come from a launcher (torchrun, or one process per machine with RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT set): rank 0 runs the LLM as usual, the others run `worker_main`
(`minisgl-run` does this by itself when it finds those variables).
"""

from __future__ import annotations

import ast
import logging
import multiprocessing as mp
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

from minisgl.core import Batch, FatalEngineError, Req
from minisgl.engine import Engine, ForwardOutput
from minisgl.engine.sample import BatchSamplingArgs

logger = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 30.0


def _broadcast(message: Any, group: Any) -> Any:
    box = [message]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def _replay(engine: Engine, message: dict) -> None:
    for table_idx, start, pages in message["writes"]:
        engine.write_page_table(table_idx, start, pages)
    reqs = [
        Req(input_ids=[], table_idx=t, cached_len=c, output_len=0, uid=-1, device_len=d)
        for t, c, d in message["reqs"]
    ]
    batch = Batch(reqs=reqs, phase=message["phase"])
    input_ids, positions, out_loc = message["inputs"]
    batch.input_ids = torch.tensor(input_ids, dtype=torch.int32).to(engine.device)
    batch.positions = torch.tensor(positions, dtype=torch.int64).to(engine.device)
    batch.out_loc = torch.tensor(out_loc, dtype=torch.int64).to(engine.device)
    engine.forward_batch(batch, BatchSamplingArgs(all_greedy=True, need_filter=False))


def worker_main(rank: int, settings: dict[str, Any], config: str | None) -> None:
    """Entry point of ranks 1..N-1: build the engine, then replay rank 0's steps until told to stop."""
    os.environ.setdefault("TQDM_DISABLE", "1")  # rank 0 alone shows progress
    logging.basicConfig(level=logging.WARNING)
    from minisgl.settings import EngineSettings

    engine = Engine(EngineSettings.load(config, **settings).to_engine_config(rank))
    group = dist.new_group(backend="gloo")
    try:
        while (message := _broadcast(None, group)) is not None:
            _replay(engine, message)
    finally:
        engine.shutdown()


class RankZeroEngine:
    """Rank 0's engine as its scheduler sees it: it tells the other ranks what to run, then runs it."""

    def __init__(self, engine: Engine, workers: list[mp.process.BaseProcess]) -> None:
        self.engine, self.workers = engine, workers
        self.group = dist.new_group(backend="gloo")
        self._writes: list[tuple[int, int, list[int]]] = []
        self._closed = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def write_page_table(self, table_idx: int, start: int, pages: list[int]) -> None:
        self._writes.append((table_idx, start, list(pages)))
        self.engine.write_page_table(table_idx, start, pages)

    def _check_workers(self) -> None:
        for rank, proc in enumerate(self.workers, start=1):
            if not proc.is_alive():
                self.shutdown(notify=False)
                raise FatalEngineError(
                    f"tensor-parallel rank {rank} exited (exit code {proc.exitcode}); the group was stopped"
                )

    def forward_batch(self, batch: Batch, args: BatchSamplingArgs) -> ForwardOutput:
        if batch.host_inputs is None or batch.host_inputs[0] is None:
            raise ValueError(
                "under tensor parallelism batches must come from BatchPreparer with their tokens on the "
                "host (no pending decode batches: overlap scheduling is off under tensor parallelism)"
            )
        self._check_workers()
        message = {
            "writes": self._writes,
            "phase": batch.phase,
            "reqs": [(r.table_idx, r.cached_len, r.device_len) for r in batch.reqs],
            "inputs": batch.host_inputs,
        }
        self._writes = []
        _broadcast(message, self.group)
        return self.engine.forward_batch(batch, args)

    def shutdown(self, notify: bool = True) -> None:
        """Tells the other ranks to stop (if all still run), waits for the ones it spawned, shuts the
        engine down. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if notify and all(proc.is_alive() for proc in self.workers):
            _broadcast(None, self.group)
        for proc in self.workers:
            proc.join(JOIN_TIMEOUT_S)
            if proc.is_alive():
                proc.kill()
        self.workers = []
        self.engine.shutdown()


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


def start_workers(size: int, settings: dict[str, Any], config: str | None) -> list[mp.process.BaseProcess]:
    """Spawns ranks 1..size-1 (daemons: they end with this process)."""
    check_main_guard()
    ctx = mp.get_context("spawn")
    workers = [
        ctx.Process(
            target=worker_main, args=(rank, settings, config), daemon=True, name=f"minisgl-rank{rank}"
        )
        for rank in range(1, size)
    ]
    for proc in workers:
        proc.start()
    return workers
