"""Starting and running the processes of minisgl, above the engine, the scheduler and the settings.

`minisgl.launch.tp`: a tensor-parallel group run from one process (rank 0 schedules, spawned ranks
follow), or ranks started by a launcher such as torchrun. The server's processes will live here too.
"""

from minisgl.launch.tp import RankZeroEngine, launched_rank, start_workers, worker_main

__all__ = ["RankZeroEngine", "launched_rank", "start_workers", "worker_main"]
