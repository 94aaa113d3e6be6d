"""Attention backends. `torch` runs everywhere and is the reference; FlashInfer backends need CUDA."""

from __future__ import annotations

import importlib.util
import logging

import torch

from minisgl.attention.base import (
    AttnOptions,
    BaseAttnBackend,
    BaseAttnMetadata,
    check_kv_dtype,
    parse_attention_backend,
)
from minisgl.attention.torch_backend import TorchAttnBackend
from minisgl.kvcache import MHAKVCachePool

logger = logging.getLogger(__name__)

__all__ = [
    "AttnOptions",
    "BaseAttnBackend",
    "BaseAttnMetadata",
    "TorchAttnBackend",
    "create_attention_backend",
]


def resolve_attention_backend(
    name: str, device: torch.device, kv_dtype: torch.dtype | None = None
) -> tuple[str, str]:
    """(prefill, decode) backend names; 'auto' picks by the hardware and the KV cache's storage dtype
    `kv_dtype` (an FP8 cache: FA2 prefill on sm90, FA3 cannot read it), and the choice is checked."""
    prefill, decode = parse_attention_backend(name)
    if prefill == "auto":
        fp8 = kv_dtype == torch.float8_e4m3fn
        if device.type != "cuda":
            prefill = decode = "torch"
        else:
            major = torch.cuda.get_device_capability(device)[0]
            sm90_prefill = "fi" if fp8 else "fa"
            prefill, decode = (
                ("trtllm", "trtllm") if major >= 10 else (sm90_prefill, "fi") if major == 9 else ("fi", "fi")
            )
        why = " for the FP8 KV cache" if fp8 and device.type == "cuda" else ""
        logger.info("attention backend 'auto' -> %s (device %s%s)", f"{prefill},{decode}", device, why)
    for choice in (prefill, decode):
        if choice == "torch":
            continue
        if device.type != "cuda":
            raise ValueError(f"attention_backend={name!r}: {choice!r} needs a CUDA GPU; on CPU use 'torch'")
        major, minor = torch.cuda.get_device_capability(device)
        if choice == "fa" and major != 9:
            raise ValueError(
                f"attention_backend={name!r}: 'fa' (FlashAttention-3) needs sm90, this GPU is sm{major}{minor}"
            )
        if choice == "trtllm":
            raise ValueError(
                f"attention_backend={name!r}: 'trtllm' needs sm100 or later"
                + (f", this GPU is sm{major}{minor}" if major < 10 else "; it is not built in this version")
            )
    if (prefill == "torch") != (decode == "torch"):
        raise ValueError(f"attention_backend={name!r}: 'torch' cannot be paired with a FlashInfer backend")
    check_kv_dtype(name, prefill, decode, kv_dtype)
    return prefill, decode


def create_attention_backend(
    name: str,
    kv_cache: MHAKVCachePool,
    page_table: torch.Tensor,
    device: torch.device,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    tensor_core_min_group: int = 1,
    split_kv_max_bs: int | None = None,
    triton_decode_max_bs: int = 0,
    dtype: torch.dtype | None = None,
    sliding_window: int | None = None,
    options: AttnOptions | None = None,
) -> BaseAttnBackend:
    """Builds the backend that `name` asks for ('auto', a name, or a 'prefill,decode' pair), for this
    rank's `num_heads` query and `num_kv_heads` KV heads of `head_dim` and queries of `dtype` (the
    model's; None: the pool's storage dtype), attending within `sliding_window` tokens (None: all; see
    `BaseAttnBackend`; `options`: which layers have the window, the softmax scale and soft cap, and
    whether the model has attention sinks); `tensor_core_min_group`, `split_kv_max_bs` and
    `triton_decode_max_bs` go to `FlashInferAttnBackend`. Sinks (gpt-oss) are read by the `torch`
    backend only (FlashInfer 0.6's FA2 and FA3 wrappers take none), so 'auto' picks it for them."""
    options = options or AttnOptions()
    if options.sinks and name == "auto":
        logger.info("attention backend 'auto' -> torch (the model's attention sinks)")
        name = "torch"
    elif options.sinks and parse_attention_backend(name) != ("torch", "torch"):
        raise ValueError(
            f"attention_backend={name!r} cannot run this model: its attention sinks (gpt-oss) are read by "
            "the 'torch' backend only; use attention_backend 'auto' or 'torch'"
        )
    prefill, decode = resolve_attention_backend(name, device, kv_cache.dtype)
    if prefill == "torch":
        return TorchAttnBackend(kv_cache, page_table, device, sliding_window=sliding_window, options=options)
    if importlib.util.find_spec("flashinfer") is None:
        raise ValueError(f"attention_backend={name!r} needs flashinfer: pip install 'minisgl[cuda]'")
    from minisgl.attention.flashinfer_backend import FlashInferAttnBackend

    return FlashInferAttnBackend(
        kv_cache,
        page_table,
        device,
        num_heads,
        num_kv_heads,
        head_dim,
        prefill,
        decode,
        tensor_core_min_group=tensor_core_min_group,
        split_kv_max_bs=split_kv_max_bs,
        triton_decode_max_bs=triton_decode_max_bs,
        q_dtype=dtype,
        sliding_window=sliding_window,
        options=options,
    )
