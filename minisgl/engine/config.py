"""EngineConfig: everything one engine process needs to know, frozen."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch

from minisgl.attention.base import parse_attention_backend
from minisgl.distributed import DistributedInfo
from minisgl.models.config import ModelConfig

MAX_PAGE_SIZE = 256
MOE_BACKENDS = ("auto", "torch", "fused")
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def parse_dtype(value: str | torch.dtype | None) -> torch.dtype | None:
    if value is None or value == "auto":
        return None
    if isinstance(value, torch.dtype):
        if value not in DTYPES.values():
            raise ValueError(f"dtype={value} is not supported: use one of {', '.join(DTYPES)}")
        return value
    if value not in DTYPES:
        raise ValueError(f"dtype={value!r} is not supported: use 'auto' or one of {', '.join(DTYPES)}")
    return DTYPES[value]


@dataclass(frozen=True)
class EngineConfig:
    """Configuration of one engine (one tensor-parallel rank). Field names follow Mini-SGLang's Engine.

    ``dtype`` None picks float32 on CPU and bfloat16 on CUDA. ``device`` 'auto' picks CUDA when present.
    ``cpu_kv_budget_gib`` bounds the KV pool on CPU (None: 10% of available RAM).
    ``overlap_scheduling`` is read by the scheduler over this engine (see minisgl.scheduler).
    ``batch_invariant`` keeps every kernel choice independent of the batch (on CUDA: no one-row GEMV
    kernel, prefill eager), so a request's logits, and its seeded tokens, do not depend on its batch.
    """

    model_path: str
    dtype: torch.dtype | None = None
    tp_info: DistributedInfo = field(default_factory=DistributedInfo)
    page_size: int = 16
    max_running_req: int = 256
    attention_backend: str = "auto"
    moe_backend: str = "auto"
    cuda_graph_bs: tuple[int, ...] | None = None
    cuda_graph_max_bs: int | None = None
    memory_ratio: float = 0.9
    num_page_override: int | None = None
    max_seq_len_override: int | None = None
    use_dummy_weight: bool = False
    distributed_addr: str = "tcp://127.0.0.1:23333"
    distributed_timeout: float = 300.0
    device: str = "auto"
    cpu_kv_budget_gib: float | None = None
    overlap_scheduling: bool = True
    batch_invariant: bool = False
    # CUDA: run the sampler as one compiled function (false: the same function eagerly; ablation)
    compile_sampler: bool = True
    # CUDA: run prefill and batches above the largest graph compiled (false: eagerly); batch_invariant: false
    compile_prefill: bool = True
    # CUDA: run one-row half-precision linear layers on the Triton GEMV kernel; batch_invariant: false
    use_gemv_kernel: bool = True
    # CUDA: store K and V with one Triton kernel (false: two index_copy_ kernels; ablation)
    use_kv_store_kernel: bool = True
    # query heads per KV head from which `fi` decode uses FlashInfer's tensor-core kernel (below: CUDA-core)
    tensor_core_min_group: int = 1

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalise once, here
        set_(self, "model_path", os.fspath(self.model_path))
        set_(self, "dtype", parse_dtype(self.dtype))
        if self.cuda_graph_bs is not None:
            set_(self, "cuda_graph_bs", tuple(self.cuda_graph_bs))
        _check_int("page_size", self.page_size, 1, MAX_PAGE_SIZE)
        _check_int("max_running_req", self.max_running_req, 1)
        if not (isinstance(self.memory_ratio, int | float) and 0.0 < self.memory_ratio <= 1.0):
            raise ValueError(f"memory_ratio must be in (0, 1], got memory_ratio={self.memory_ratio!r}")
        if self.num_page_override is not None:
            _check_int("num_page_override", self.num_page_override, 1)
        if self.max_seq_len_override is not None:
            _check_int("max_seq_len_override", self.max_seq_len_override, 1)
        if self.cuda_graph_max_bs is not None:
            _check_int("cuda_graph_max_bs", self.cuda_graph_max_bs, 0)
        for bs in self.cuda_graph_bs or ():
            _check_int("cuda_graph_bs entry", bs, 1)
        if self.cpu_kv_budget_gib is not None and not self.cpu_kv_budget_gib > 0:
            raise ValueError(
                f"cpu_kv_budget_gib must be > 0, got cpu_kv_budget_gib={self.cpu_kv_budget_gib!r}"
            )
        parse_attention_backend(self.attention_backend)
        if self.moe_backend not in MOE_BACKENDS:
            raise ValueError(
                f"moe_backend={self.moe_backend!r} is not valid: use one of {', '.join(MOE_BACKENDS)}"
            )
        if not isinstance(self.tp_info, DistributedInfo):
            raise TypeError(f"tp_info must be a DistributedInfo, got {type(self.tp_info).__name__}")
        if not Path(self.model_path).is_dir():
            raise FileNotFoundError(
                f"model_path={self.model_path!r} is not a folder. Pass a local model folder holding "
                "config.json and *.safetensors (download hub models first, e.g. with `hf download`), "
                "or use minisgl.models.default_model_path() for the embedded SmolLM2-135M-Instruct."
            )
        _ = self.torch_device  # validates `device`

    @cached_property
    def model_config(self) -> ModelConfig:
        return ModelConfig.from_path(self.model_path)

    @cached_property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            if torch.cuda.is_available():
                return torch.device("cuda", self.tp_info.rank % torch.cuda.device_count())
            return torch.device("cpu")
        try:
            device = torch.device(self.device)
        except RuntimeError as e:
            raise ValueError(
                f"device={self.device!r} is not valid: use 'auto', 'cpu', 'cuda' or 'cuda:N'"
            ) from e
        if device.type not in ("cpu", "cuda"):
            raise ValueError(
                f"device={self.device!r} is not supported: use 'auto', 'cpu', 'cuda' or 'cuda:N'"
            )
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(
                f"device={self.device!r} was asked for but CUDA is not available here; use 'cpu'"
            )
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", self.tp_info.rank % torch.cuda.device_count())
        return device

    @cached_property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype is not None:
            return self.dtype
        return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32

    @cached_property
    def max_seq_len(self) -> int:
        """Longest sequence (prompt + output) a request may reach, before the KV pool is sized."""
        limit = self.model_config.max_position_embeddings
        if self.max_seq_len_override is not None:
            return self.max_seq_len_override
        return limit


def _check_int(name: str, value: object, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, got {name}={value!r}")
    if value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {bounds}, got {name}={value!r}")
