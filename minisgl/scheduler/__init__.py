"""Continuous batching over one Engine: the scheduler and its parts (docs/scheduler.md)."""

from minisgl.scheduler.batching import BatchPreparer, generate
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.detokenizer import IncrementalDetokenizer
from minisgl.scheduler.radix import RadixCache
from minisgl.scheduler.request import FinishReason, RequestState, Update
from minisgl.scheduler.scheduler import Scheduler
from minisgl.scheduler.stats import StepRecord

__all__ = [
    "BatchPreparer",
    "FinishReason",
    "IncrementalDetokenizer",
    "RadixCache",
    "RequestState",
    "Scheduler",
    "SchedulerConfig",
    "StepRecord",
    "Update",
    "generate",
]
