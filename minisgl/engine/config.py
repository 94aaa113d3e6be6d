"""EngineConfig: everything one engine process needs to know, frozen.

Each field is a setting declared once, here (see minisgl.config_fields for the style): its type, default,
description and bounds. minisgl.settings builds the YAML keys, MINISGL_* variables and CLI options from
these fields; ``EngineConfig(...)`` called directly is checked by the same declarations.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch

from minisgl.attention.base import check_kv_dtype, parse_attention_backend
from minisgl.config_fields import as_tuple, check_fields, internal, setting
from minisgl.distributed import DistributedInfo
from minisgl.models.config import QUANT_METHODS, ModelConfig

MAX_PAGE_SIZE = 256
# upper bounds that keep a mistyped value from allocating without end (the page table has
# max_running_req + 1 rows of max_seq_len entries; RoPE tables have max_seq_len rows)
MAX_RUNNING_REQ = 16384
MAX_SEQ_LEN = 2**20
# intra-op threads of a process driving a GPU: its host work is small tensor ops, where a thread per core
# only waits for threads the OS has parked once the host is busy (docs/gpu.md#host-threads)
CUDA_HOST_THREADS = 1
MOE_BACKENDS = ("auto", "torch", "fused")
DEVICE_TYPES = ("cpu", "cuda")
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
# the setting `kv_cache_dtype`: its storage dtype (None: the model's dtype)
FP8 = torch.float8_e4m3fn
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {"auto": None, "fp8_e4m3": FP8}


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


def check_device(value: str) -> None:
    """'auto', 'cpu', 'cuda' or 'cuda:N' (whether CUDA is there is checked when the config is built)."""
    if value == "auto":
        return
    try:
        device_type = torch.device(value).type
    except RuntimeError:
        device_type = None
    if device_type not in DEVICE_TYPES:
        raise ValueError(f"device={value!r} is not valid: use 'auto', 'cpu', 'cuda' or 'cuda:N'")


def _model_folder(value: object) -> object:
    """A path given as os.PathLike becomes a str; an empty path is refused."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if value == "":
        raise ValueError("model_path='' is empty: give a local model folder (config.json + *.safetensors)")
    return value


@dataclass(frozen=True)
class EngineConfig:
    """Configuration of one engine (one tensor-parallel rank). Field names follow Mini-SGLang's Engine.

    Every field but ``tp_info`` is a setting (YAML key, MINISGL_* variable, minisgl-run option, LLM
    keyword), declared with its description and bounds; ``__post_init__`` checks them all.
    """

    model_path: str = setting(
        description="Local model folder (config.json + *.safetensors); unset or 'smollm2-135m' = the "
        "embedded default model.",
        parse=_model_folder,
    )
    dtype: torch.dtype | None = setting(
        "auto",
        "Weight and activation dtype: auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16 or float16 "
        "(from Python also a torch.dtype).",
        given_as=str,
        parse=parse_dtype,
    )
    tp_info: DistributedInfo = internal(
        DistributedInfo, "this rank's place in the group: built from the tp_size setting and the rank"
    )
    quantization: str | None = setting(
        None,
        "fp8: quantize the linear layers of an unquantized model (checkpoint or dummy weights) at load to "
        "e4m3 weights with one float32 scale per 128x128 block, activations quantized per token in groups "
        "of 128; embeddings, norms and the LM head stay in dtype. Unset: as the checkpoint is (an FP8 "
        "checkpoint loads as FP8 either way). docs/quantization.md.",
        choices=QUANT_METHODS,
    )
    kv_cache_dtype: str = setting(
        "auto",
        "KV-cache storage: auto (the model's dtype) or fp8_e4m3 (float8_e4m3fn pages, half of bf16's bytes: "
        "about twice the pages; one float32 scale per layer for K and one for V, 1.0 unless the checkpoint "
        "has self_attn.k_scale/v_scale). fp8_e4m3 runs on CPU and on CUDA from sm89, with the torch or fi "
        "attention backends ('auto' picks FA2 prefill on sm90: FA3, 'fa', cannot read FP8 KV). "
        "docs/quantization.md.",
        choices=tuple(KV_CACHE_DTYPES),
    )
    page_size: int = setting(16, "Tokens per KV-cache page.", ge=1, le=MAX_PAGE_SIZE)
    max_running_req: int = setting(
        256, "Request slots: most requests running (decoded together) at once.", ge=1, le=MAX_RUNNING_REQ
    )
    attention_backend: str = setting(
        "auto",
        "Attention backend: auto, torch, fi, fa, trtllm, or a 'prefill,decode' pair such as 'fa,fi'.",
        check=parse_attention_backend,
    )
    moe_backend: str = setting(
        "auto",
        "Mixture-of-experts backend: auto (fused on CUDA sm90/sm100, torch elsewhere), torch or fused; "
        "only models with experts use it.",
        choices=MOE_BACKENDS,
    )
    cuda_graph_bs: tuple[int, ...] | None = setting(
        None,
        "Batch sizes to capture CUDA graphs for, e.g. [1, 2, 4] (or '1,2,4'); unset = automatic.",
        ge=1,
        parse=as_tuple,
        given_as=list[int] | None,
    )
    cuda_graph_max_bs: int | None = setting(
        None,
        "Largest batch size to capture a CUDA graph for; 0 disables CUDA graphs; unset = automatic.",
        ge=0,
    )
    memory_ratio: float = setting(
        0.9, "Share of free GPU memory (measured before loading) the engine may use.", gt=0.0, le=1.0
    )
    num_page_override: int | None = setting(
        None, "Fixed number of KV-cache pages instead of sizing from free memory.", ge=1
    )
    max_seq_len_override: int | None = setting(
        None, "Longest sequence (prompt + output); unset = the model's max positions.", ge=1, le=MAX_SEQ_LEN
    )
    use_dummy_weight: bool = setting(
        False, "Random weights made on the device instead of loading checkpoints (only config.json is read)."
    )
    distributed_addr: str = setting(
        "auto",
        "Rendezvous of the tensor-parallel group: auto (LLM(tp=N) and --tp N: a new file in a private "
        "temporary folder, no port), tcp://HOST:PORT, file:///PATH or env:// (torchrun's variables).",
    )
    distributed_timeout: float = setting(
        300.0, "Seconds before a tensor-parallel collective gives up.", gt=0.0
    )
    device: str = setting(
        "auto", "Device: auto (CUDA when present), cpu, cuda or cuda:N.", check=check_device
    )
    cpu_kv_budget_gib: float | None = setting(
        None, "KV-cache budget on CPU in GiB; unset = 10% of available RAM.", gt=0.0
    )
    batch_invariant: bool = setting(
        False,
        "Give a request the same logits (and seeded tokens) alone or in any batch: on CUDA no one-row "
        "GEMV kernel and eager prefill; slower.",
    )
    # ablation switches: each fast path can be turned off to measure what it brings
    compile_sampler: bool = setting(
        True,
        "On CUDA, run the sampler as one compiled function; false: the same function eagerly (ablation).",
    )
    compile_prefill: bool = setting(
        True,
        "On CUDA, run prefill and batches above the largest CUDA graph compiled; false: eagerly (ablation). "
        "batch_invariant implies false.",
    )
    compile_vision: bool = setting(
        True,
        "On CUDA, run a vision-language model's encoder blocks under torch.compile (dynamic shapes: one "
        "graph for every image size), compiled at start on a small dummy image; false: eagerly.",
    )
    prefill_graph_max_tokens: int = setting(
        1024,
        "On CUDA, prefill batches of up to this many tokens (each request's padded to a block of 16) "
        "replay a CUDA graph captured per token-count bucket (16, 32, ..., a power of two), their "
        "attention on minisgl's Triton prefill kernel; larger ones, and sequences past "
        "prefill_graph_max_context tokens, run the compiled forward. 0: no prefill graphs. Needs "
        "compile_prefill, the fi/fa backends and a dense model.",
        ge=0,
        le=8192,
    )
    prefill_graph_max_context: int = setting(
        8192,
        "The longest sequence (cached prefix + chunk) a prefill CUDA graph takes: its Triton attention "
        "reads a request's KV once per block of 16 query tokens, FlashInfer's prefill reads it fewer times.",
        ge=1,
    )
    use_gemv_kernel: bool = setting(
        True,
        "On CUDA, run one-row half-precision linear layers on the Triton GEMV kernel; false: cuBLAS "
        "(ablation). batch_invariant implies false.",
    )
    use_kv_store_kernel: bool = setting(
        True, "On CUDA, store K and V with one Triton kernel; false: two index_copy_ kernels (ablation)."
    )
    use_fused_kernels: bool = setting(
        True,
        "On CUDA, run the fused Triton kernels: q/k-norm, RoPE and the KV store in one kernel; for one-row "
        "batches, the residual add and RMSNorm, and SiLU-and-multiply, as prologues of the GEMV kernel "
        "(those also need use_gemv_kernel); false: the unfused layers (ablation).",
    )
    use_pdl: bool = setting(
        True,
        "On CUDA (compute capability 9 and up), launch the decode step's Triton kernels (GEMV, q/k-norm + "
        "RoPE + KV store, Triton decode attention) with programmatic dependent launch: each starts while "
        "the one before finishes, the GEMV kernels reading their weights before they wait; false: plain "
        "launches (ablation).",
    )
    tensor_core_min_group: int = setting(
        1,
        "Query heads per KV head from which `fi` decode uses FlashInfer's tensor-core kernel, below it the "
        "CUDA-core one.",
        ge=1,
    )
    decode_split_kv_max_bs: int | None = setting(
        None,
        "The largest CUDA-graph batch whose `fi` tensor-core decode splits each request's KV over several "
        "blocks and merges them (FlashInfer's split-KV: fills the GPU at small batches); larger graphs run "
        "one block per request and KV head, with no merge kernel. Unset: every graph splits; 0: none.",
        ge=0,
    )
    decode_triton_max_bs: int = setting(
        8,
        "The largest decode batch (a CUDA graph's size) whose attention runs minisgl's Triton split-KV "
        "kernel instead of FlashInfer's (`fi` and `fa` backends); 0: FlashInfer always. batch_invariant "
        "implies 0.",
        ge=0,
    )

    tp_broadcast_tokens: bool = setting(
        False,
        "Under tensor parallelism, broadcast rank 0's sampled tokens to the other ranks inside each step "
        "(one small collective); false: every rank samples the same tokens from the same all-gathered "
        "logits with the same seeds (checked every step).",
    )
    one_shot_all_reduce_max_bytes: int = setting(
        2 << 20,
        "Under tensor parallelism on CUDA, all-reduces up to this many bytes (a decode step's; 2097152 "
        "covers 256 x 4096 bf16) run as one kernel over memory the ranks share (torch symmetric memory), "
        "larger ones on NCCL; 0: NCCL always. Where the memory cannot be shared, NCCL does it all.",
        ge=0,
        le=1 << 30,
    )
    host_threads: int | None = setting(
        None,
        "Intra-op threads of torch's host (CPU) work in this process (torch.set_num_threads); unset = "
        f"{CUDA_HOST_THREADS} when the engine runs on CUDA, torch's default (all cores) on CPU.",
        ge=1,
        le=4096,
    )
    cache_dir: str | None = setting(
        None,
        "One folder for the compile caches: torch inductor's (DIR/inductor), Triton's (DIR/triton) and "
        "FlashInfer's JIT kernels (DIR/flashinfer), set as the first step of the engine's start (it sets "
        "TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR and FLASHINFER_WORKSPACE_BASE for this process); "
        "unset = each tool's own default or environment variable.",
    )
    max_loras: int = setting(
        4,
        "LoRA adapters resident on the device at once (the pool's slots, sized in the KV cache's memory "
        "budget); more adapters wait in host memory and are swapped in when a batch needs them. "
        "docs/lora.md.",
        ge=1,
        le=1024,
    )
    max_lora_rank: int = setting(
        64,
        "The largest LoRA rank accepted: every device slot holds this rank (smaller ones are zero-padded). "
        "docs/lora.md.",
        ge=1,
        le=4096,
    )
    enable_lora: bool = internal(
        lambda: False, "the settings: true with lora_modules or allow_runtime_lora (a LoRA pool of slots)"
    )

    def __post_init__(self) -> None:
        check_fields(self)  # each field against its declaration above; `dtype` 'auto' becomes None
        if not Path(self.model_path).is_dir():
            raise FileNotFoundError(
                f"model_path={self.model_path!r} is not a folder. Pass a local model folder holding "
                "config.json and *.safetensors (download hub models first, e.g. with `hf download`), "
                "or use minisgl.models.default_model_path() for the embedded SmolLM2-135M-Instruct."
            )
        _ = self.torch_device  # CUDA asked for where there is none
        if self.kv_torch_dtype == torch.float8_e4m3fn:
            self._check_fp8_kv_cache()

    def _check_fp8_kv_cache(self) -> None:
        """An FP8 KV cache needs an attention backend that reads it and, on CUDA, float8 in Triton."""
        check_kv_dtype(self.attention_backend, *parse_attention_backend(self.attention_backend), FP8)
        device = self.torch_device
        if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
            major, minor = torch.cuda.get_device_capability(device)
            raise ValueError(
                f"kv_cache_dtype={self.kv_cache_dtype!r} on CUDA needs compute capability 8.9 or later "
                f"(Ada, Hopper, Blackwell: float8 in the Triton decode kernel); this GPU is sm{major}{minor}. "
                "Use kv_cache_dtype 'auto' here (docs/quantization.md)"
            )

    @cached_property
    def model_config(self) -> ModelConfig:
        """config.json's model, with the setting `quantization` applied."""
        return ModelConfig.from_path(self.model_path).with_quantization(self.quantization)

    @cached_property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            if torch.cuda.is_available():
                return torch.device("cuda", self.tp_info.rank % torch.cuda.device_count())
            return torch.device("cpu")
        device = torch.device(self.device)  # its form was checked with the fields
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
    def kv_torch_dtype(self) -> torch.dtype:
        """The KV cache's storage dtype: the model's (auto) or float8_e4m3fn (fp8_e4m3)."""
        return KV_CACHE_DTYPES[self.kv_cache_dtype] or self.torch_dtype

    @cached_property
    def configured_max_seq_len(self) -> int:
        """Longest sequence (prompt + output) a request may reach as configured (the model's
        max_position_embeddings or max_seq_len_override), before the KV pool is sized; the engine's
        `Engine.max_seq_len` is this capped by the pool."""
        limit = self.model_config.max_position_embeddings
        if self.max_seq_len_override is not None:
            return self.max_seq_len_override
        return limit
