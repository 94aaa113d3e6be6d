"""Starting and running the processes of minisgl, above the engine, the scheduler and the settings.

`minisgl.launch.tp`: a tensor-parallel group run from one process (every rank runs a scheduler in
lockstep with rank 0's), or ranks started by a launcher such as torchrun. The server's processes will
live here too.
"""

from minisgl.launch.tp import TPGroup, launched_rank, start_workers, worker_main

__all__ = ["TPGroup", "launched_rank", "start_workers", "worker_main"]
