"""Offline continuous batching over one Engine."""

from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.detokenizer import IncrementalDetokenizer
from minisgl.scheduler.request import FinishReason, RequestState, Update
from minisgl.scheduler.scheduler import Scheduler
from minisgl.scheduler.stats import StepRecord

__all__ = [
    "FinishReason",
    "IncrementalDetokenizer",
    "RequestState",
    "Scheduler",
    "SchedulerConfig",
    "StepRecord",
    "Update",
]
