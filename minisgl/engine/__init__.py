"""The engine: EngineConfig, Engine.forward_batch -> ForwardOutput, and the batch-preparation helper."""

from minisgl.engine.config import EngineConfig
from minisgl.engine.engine import Engine, ForwardMode, ForwardOutput, check_tensor_parallel

from minisgl.engine.batching import BatchPreparer, generate  # isort: skip  (imports Engine)

__all__ = [
    "BatchPreparer",
    "Engine",
    "EngineConfig",
    "ForwardMode",
    "ForwardOutput",
    "check_tensor_parallel",
    "generate",
]
