"""Offline continuous batching over one Engine."""

from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.detokenizer import IncrementalDetokenizer
from minisgl.scheduler.scheduler import Request, Scheduler, Update

__all__ = ["IncrementalDetokenizer", "Request", "Scheduler", "SchedulerConfig", "Update"]
