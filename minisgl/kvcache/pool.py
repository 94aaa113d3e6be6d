"""Paged KV storage: per layer, K and V pools of shape (num_pages + 1, page_size, kv_heads, head_dim).

A KV location is `page * page_size + offset`; the flat views index by location. The last page
(index `num_pages`) is the dummy page that padding and the dummy request write into. An FP8 pool
(`kv_cache_dtype: fp8_e4m3`) stores e4m3 of value / scale with one float32 scale per layer for K and
one for V (`scales`), fixed once the model is loaded: docs/quantization.md ("FP8 KV cache").
"""

from __future__ import annotations

import math
import mmap
from abc import ABC, abstractmethod

import torch

from minisgl.kernels.fp8 import FP8_DTYPE, dequantize_kv, quantize_kv
from minisgl.kernels.kv_store import kv_store_applies, store_kv


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`torch.zeros`, except on the CPU: there an anonymous memory map that the OS fills with zeroed
    pages at once (MAP_POPULATE): 1.1 s for the default CPU budget's 2.2 GB on a 2-core machine, where
    `torch.zeros` writes them in 1.5 to 1.7 s. Committed at start, as `torch.zeros` is, so that the
    process's memory does not grow as the pages are first used (the soak's leak check reads it)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    size = math.prod(shape) * dtype.itemsize
    if size == 0:
        return torch.zeros(shape, dtype=dtype)
    # the tensor holds the map (a buffer's tensor keeps its exporter alive)
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    return torch.frombuffer(mmap.mmap(-1, size, flags=flags), dtype=torch.uint8).view(dtype).view(shape)


def bytes_per_page(
    num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    return 2 * num_layers * page_size * num_kv_heads * head_dim * dtype.itemsize


class BaseKVCachePool(ABC):
    num_pages: int
    page_size: int

    @property
    def dummy_page(self) -> int:
        return self.num_pages

    @abstractmethod
    def k_cache(self, layer_id: int) -> torch.Tensor: ...

    @abstractmethod
    def v_cache(self, layer_id: int) -> torch.Tensor: ...

    @abstractmethod
    def store_kv(self, k: torch.Tensor, v: torch.Tensor, out_loc: torch.Tensor, layer_id: int) -> None: ...


class MHAKVCachePool(BaseKVCachePool):
    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        use_kernel: bool = True,
        scales: torch.Tensor | None = None,
    ) -> None:
        """`dtype`: the storage dtype; `scales` (num_layers, 2): each layer's K and V scale of an FP8 pool
        (default 1.0)."""
        # store_kv runs the Triton KV-store kernel where it applies (False: two index_copy_, ablation)
        self.use_kernel = use_kernel
        self.is_fp8 = dtype == FP8_DTYPE
        if scales is None:
            scales = torch.ones(num_layers, 2)
        if tuple(scales.shape) != (num_layers, 2):
            raise ValueError(f"scales must be (num_layers, 2) = ({num_layers}, 2), got {tuple(scales.shape)}")
        self.scales = scales.to(device=device, dtype=torch.float32)
        self.num_layers, self.num_pages, self.page_size = num_layers, num_pages, page_size
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        # zeroed, so that never-written locations (the dummy page, padding) hold finite values
        self.buffer = zeros((2, num_layers, num_pages + 1, page_size, num_kv_heads, head_dim), dtype, device)
        num_locations = (num_pages + 1) * page_size  # the flat views: (locations, kv_heads, head_dim)
        self._k_flat = self.buffer[0].view(num_layers, num_locations, num_kv_heads, head_dim)
        self._v_flat = self.buffer[1].view(num_layers, num_locations, num_kv_heads, head_dim)

    @property
    def size_bytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def k_cache(self, layer_id: int) -> torch.Tensor:
        """(num_pages + 1, page_size, kv_heads, head_dim)"""
        return self.buffer[0, layer_id]

    def v_cache(self, layer_id: int) -> torch.Tensor:
        return self.buffer[1, layer_id]

    def flat(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K and V caches indexed by location: two (locations, kv_heads, head_dim) views."""
        return self._k_flat[layer_id], self._v_flat[layer_id]

    def gather(
        self, layer_id: int, pages: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K and V pages `pages` (P,) in `dtype`: two (P, page_size, kv_heads, head_dim)."""
        k_cache, v_cache = self.k_cache(layer_id), self.v_cache(layer_id)
        if self.is_fp8:  # the bytes are selected (float8 kernels are not everywhere), then dequantized
            k_scale, v_scale = self.scales[layer_id]
            keys = k_cache.view(torch.uint8).index_select(0, pages).view(FP8_DTYPE)
            values = v_cache.view(torch.uint8).index_select(0, pages).view(FP8_DTYPE)
            return dequantize_kv(keys, k_scale, dtype), dequantize_kv(values, v_scale, dtype)
        # index_select: much faster than advanced indexing on CPU
        return k_cache.index_select(0, pages).to(dtype), v_cache.index_select(0, pages).to(dtype)

    def layer_scales(self, layer_id: int) -> torch.Tensor | None:
        """An FP8 pool's K and V scales of the layer, a (2,) float32 view on the device; None otherwise."""
        return self.scales[layer_id] if self.is_fp8 else None

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, out_loc: torch.Tensor, layer_id: int) -> None:
        k_flat, v_flat = self.flat(layer_id)
        if self.use_kernel and kv_store_applies(k, v, k_flat):  # one Triton kernel for both (FP8 too)
            store_kv(k, v, out_loc, k_flat, v_flat, self.layer_scales(layer_id))
        elif self.is_fp8:  # index_copy_ has no float8 kernels: the bytes are copied
            k_scale, v_scale = self.scales[layer_id]
            k_flat.view(torch.uint8).index_copy_(0, out_loc, quantize_kv(k, k_scale).view(torch.uint8))
            v_flat.view(torch.uint8).index_copy_(0, out_loc, quantize_kv(v, v_scale).view(torch.uint8))
        else:
            k_flat.index_copy_(0, out_loc, k)
            v_flat.index_copy_(0, out_loc, v)
