"""The engine: EngineConfig, Engine.forward_batch -> ForwardOutput."""

from minisgl.engine.config import EngineConfig
from minisgl.engine.engine import Engine
from minisgl.engine.forward import ForwardMode, ForwardOutput
from minisgl.engine.start import check_tensor_parallel

__all__ = [
    "Engine",
    "EngineConfig",
    "ForwardMode",
    "ForwardOutput",
    "check_tensor_parallel",
]
