"""The CUDA graph runner's interface. Capture of the compiled decode forward per batch size is part of the
GPU path; until it lands here the runner is always disabled and every batch runs the model directly,
as the documentation prescribes for batch sizes without a graph."""

from __future__ import annotations

import logging

import torch

from minisgl.core import Batch

logger = logging.getLogger(__name__)


class GraphRunner:
    def __init__(self, device: torch.device, max_bs: int | None) -> None:
        self.batch_sizes: tuple[int, ...] = ()
        if device.type != "cuda":
            reason = "no CUDA device"
        elif max_bs == 0:
            reason = "cuda_graph_max_bs=0"
        else:
            reason = "not built in this version"
        logger.info("CUDA graphs: disabled (%s)", reason)

    @property
    def enabled(self) -> bool:
        return bool(self.batch_sizes)

    def can_use_cuda_graph(self, batch: Batch) -> bool:
        return False

    def replay(self, batch: Batch) -> torch.Tensor:
        raise RuntimeError("no CUDA graph was captured")

    def destroy(self) -> None:
        self.batch_sizes = ()
