"""FlashInfer attention on CUDA: `fi` (FA2 paged prefill, FlashInfer's paged decode kernel) and `fa` (the
FlashAttention-3 kernels FlashInfer ships, sm90 only).

Small decode batches go to minisgl's Triton split-KV kernel and prefill graphs to its Triton prefill
kernel (no FlashInfer plan); planning runs in `prepare_metadata`, outside compiled regions and graphs.
Tensor-core choice, split-KV, FP8 KV and sliding windows: docs/gpu.md ("Attention backends").

The window is a plan argument of FlashInfer's wrappers (`window_left`), so a model whose layers differ
(Gemma: sliding and full layers) gets one wrapper per window, each planned for every batch; the softmax
scale and the scores' soft cap (`AttnOptions`) go to every plan, and to the Triton kernels.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from minisgl.attention.base import AttnOptions, BaseAttnBackend, BaseAttnMetadata, check_kv_dtype
from minisgl.attention.torch_backend import planned
from minisgl.core import Batch
from minisgl.kernels.decode_attention import decode_attention
from minisgl.kernels.fp8 import FP8_DTYPE
from minisgl.kernels.prefill_attention import ALIGN, prefill_attention
from minisgl.kvcache import MHAKVCachePool

WORKSPACE_BYTES = 256 << 20
logger = logging.getLogger(__name__)


@dataclass
class FlashInferMetadata(BaseAttnMetadata):
    wrapper: Any  # the planned prefill or decode wrapper; None: a Triton kernel
    # every window's planned wrapper (`FlashInferAttnBackend.layer_group` picks a layer's); wrapper first
    wrappers: tuple[Any, ...] = ()
    rows: torch.Tensor | None = None  # Triton decode: each request's page-table row (device)
    lens: torch.Tensor | None = None  # and its token count (device, int32); Triton prefill: each token's
    block_rows: torch.Tensor | None = None  # Triton prefill (a prefill graph): each block's row (device)


# one build thread per set of module arguments in the process: a second engine waits on the first's
_prefill_builds: dict[tuple, threading.Thread] = {}
_prefill_builds_lock = threading.Lock()


def _build_prefill_kernels_ahead(
    q_dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int, sliding_window: bool, soft_cap: bool = False
) -> threading.Thread:
    """Starts (once per process and shape) a thread that builds, or loads from FlashInfer's cache, the FA3
    prefill module the prefill plan will ask for, with the arguments that plan passes: q, kv and output
    dtypes, the index dtype, head dims qk and vo, no positional encoding in the kernel, whether there is
    a sliding window, whether there is a logits soft cap, no fp16 qk reduction. A failure is only
    logged: the plan then builds it."""
    args = (q_dtype, kv_dtype, q_dtype, torch.int32, head_dim, head_dim, 0, sliding_window, soft_cap, False)

    def build() -> None:
        started = time.perf_counter()
        try:
            from flashinfer.prefill import get_batch_prefill_module

            get_batch_prefill_module("fa3", *args)
        except Exception as e:  # noqa: BLE001 - any failure leaves the build to the plan
            logger.warning("building FA3 prefill kernels ahead failed (the first prefill will): %s", e)
            return
        logger.info(
            "FA3 prefill kernels ready in %.1f s (built alongside the start)", time.perf_counter() - started
        )

    with _prefill_builds_lock:
        thread = _prefill_builds.get(args)
        if thread is None:
            thread = _prefill_builds[args] = threading.Thread(target=build, name="fa3-jit", daemon=True)
            thread.start()
    return thread


class FlashInferAttnBackend(BaseAttnBackend):
    def __init__(
        self,
        kv_cache: MHAKVCachePool,
        page_table: torch.Tensor,
        device: torch.device,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        prefill: str,
        decode: str,
        sliding_window: int | None = None,
        decode_tensor_cores: bool | None = None,
        tensor_core_min_group: int = 1,
        split_kv_max_bs: int | None = None,
        triton_decode_max_bs: int = 0,
        q_dtype: torch.dtype | None = None,
        options: AttnOptions | None = None,
    ) -> None:
        """`q_dtype`: the queries' (the model's) dtype; None: the pool's, which must then not be FP8.
        `sliding_window`: the model's attention window in tokens (None: full attention), on the layers
        of `options.window_layers` (None: all); `options`: also the softmax scale and the soft cap.
        `decode_tensor_cores` None: `fi` decode uses tensor cores when each KV head serves at least
        `tensor_core_min_group` query heads (an integer >= 1). `split_kv_max_bs`: the largest captured
        batch whose tensor-core decode splits the KV (None: every batch, FlashInfer's own behaviour).
        `triton_decode_max_bs`: the largest decode batch (padded) that runs the Triton kernel (0: none)."""
        if not isinstance(tensor_core_min_group, int) or tensor_core_min_group < 1:
            got = f"tensor_core_min_group={tensor_core_min_group!r}"
            raise ValueError(
                f"tensor_core_min_group must be an integer >= 1 (1: always tensor cores), got {got}"
            )
        if split_kv_max_bs is not None and (not isinstance(split_kv_max_bs, int) or split_kv_max_bs < 0):
            raise ValueError(
                f"split_kv_max_bs must be None (always split) or an integer >= 0 (0: never split), "
                f"got split_kv_max_bs={split_kv_max_bs!r}"
            )
        self.split_kv_max_bs = split_kv_max_bs
        if not isinstance(triton_decode_max_bs, int) or triton_decode_max_bs < 0:
            raise ValueError(
                f"triton_decode_max_bs must be an integer >= 0 (0: FlashInfer always), "
                f"got triton_decode_max_bs={triton_decode_max_bs!r}"
            )
        self.triton_decode_max_bs = triton_decode_max_bs
        self._set_sliding_window(sliding_window, options)
        self.window_left = -1 if sliding_window is None else sliding_window - 1  # FlashInfer's form
        # the window_left of each wrapper group (the window's first), and each layer's group
        layers = range(kv_cache.num_layers)
        self.window_lefts = (self.window_left,) + (
            (-1,) if any(self.window(i) is None for i in layers) and sliding_window is not None else ()
        )
        self.layer_group = [0 if sliding_window is None or self.window(i) is not None else 1 for i in layers]
        self.kv_dtype = kv_cache.dtype
        if q_dtype is None:
            if self.kv_dtype == FP8_DTYPE:
                raise ValueError("an FP8 KV pool needs q_dtype, the model's dtype (bfloat16 or float16)")
            q_dtype = self.kv_dtype
        self.q_dtype = q_dtype
        check_kv_dtype(f"{prefill},{decode}", prefill, decode, self.kv_dtype)
        # FlashInfer's k_scale / v_scale per layer (numbers: its kernels take them so); read once here
        self.layer_scales: list[dict[str, float]] = [{} for _ in range(kv_cache.num_layers)]
        if self.kv_dtype == FP8_DTYPE:
            scales = kv_cache.scales.tolist()  # one host read at creation; fixed after the model's load
            self.layer_scales = [{"k_scale": k, "v_scale": v} for k, v in scales]
        import flashinfer

        self.flashinfer = flashinfer
        self.kv_cache, self.page_table, self.device = kv_cache, page_table, device
        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim
        self.page_size = kv_cache.page_size
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.prefill_wrappers = [
            flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                self.workspace, "NHD", backend="fa3" if prefill == "fa" else "fa2"
            )
            for _ in self.window_lefts
        ]
        self.prefill_wrapper = self.prefill_wrappers[0]
        self.names = (prefill, decode)
        if decode_tensor_cores is None:
            decode_tensor_cores = num_qo_heads // num_kv_heads >= tensor_core_min_group
        self.decode_tensor_cores = decode_tensor_cores
        self._graph_wrappers: dict[int, tuple[Any, ...]] = {}  # per captured batch size, one per group
        self._graph_buffers: dict[str, torch.Tensor] = {}
        self.decode_wrappers = tuple(self._decode_wrapper() for _ in self.window_lefts)
        self.decode_wrapper = self.decode_wrappers[0]
        # FlashInfer's plan() stages its plan in a pinned host buffer of the wrapper and copies it to the
        # GPU asynchronously; planning the same wrapper again before that copy ran would overwrite it.
        # An event after each plan, waited on before the wrapper's next plan, orders the two. In a loop
        # that reads each step's tokens it has long completed, so the wait costs nothing.
        self._planned: dict[int, torch.cuda.Event] = {}
        # FA3's prefill kernels are JIT-compiled (a minute and more on a fresh machine): built in a thread
        # from here on, while the decode graphs compile and capture; the first prefill plan waits for it
        self._prefill_builds: list[threading.Thread] = []
        if prefill == "fa" and decode != "fa":
            self._prefill_builds = [
                _build_prefill_kernels_ahead(
                    self.q_dtype, self.kv_dtype, head_dim, left >= 0, self.options.soft_cap is not None
                )
                for left in self.window_lefts
            ]

    def _wait_prefill_build(self) -> None:
        for build in self._prefill_builds:
            build.join()
        self._prefill_builds = []

    # -- planning ----------------------------------------------------------------------------------

    def _plan_inputs(self, batch: Batch, pad_to: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(kv indptr (host), page indices (device), last page lengths (host)) for the batch's requests,
        padded with requests of one token on the dummy page up to `pad_to` requests."""
        ps = self.page_size
        seq_lens = [req.device_len for req in batch.reqs]
        num_pages = [-(-n // ps) for n in seq_lens]
        table_idx = torch.tensor([req.table_idx for req in batch.reqs], dtype=torch.int64)
        pages_t = torch.tensor(num_pages, dtype=torch.int64)
        total = int(sum(num_pages))
        starts = pages_t.cumsum(0) - pages_t
        rows = table_idx.repeat_interleave(pages_t)
        cols = (torch.arange(total) - starts.repeat_interleave(pages_t)) * ps
        flat = (rows * self.page_table.shape[1] + cols).to(self.device, non_blocking=True)
        indices = self.page_table.view(-1)[flat] // ps
        last = [n - (p - 1) * ps for n, p in zip(seq_lens, num_pages)]
        if pad_to > len(seq_lens):
            extra = pad_to - len(seq_lens)
            dummy = torch.full((extra,), self.kv_cache.dummy_page, dtype=torch.int32, device=self.device)
            indices = torch.cat([indices, dummy])
            num_pages += [1] * extra
            last += [1] * extra
        indptr = torch.zeros(len(num_pages) + 1, dtype=torch.int32)
        indptr[1:] = torch.tensor(num_pages, dtype=torch.int32).cumsum(0)
        return indptr, indices.to(torch.int32), torch.tensor(last, dtype=torch.int32)

    def _plan(self, wrappers: tuple[Any, ...], *args: Any, **kwargs: Any) -> None:
        """Plans each group's wrapper (`window_lefts`) with the same batch."""
        for wrapper, window_left in zip(wrappers, self.window_lefts):
            previous = self._planned.get(id(wrapper))
            if previous is not None:
                previous.synchronize()
            wrapper.plan(
                *args,
                q_data_type=self.q_dtype,
                kv_data_type=self.kv_dtype,
                window_left=window_left,
                sm_scale=self.options.sm_scale,
                logits_soft_cap=self.options.soft_cap,
                **kwargs,
            )
            event = torch.cuda.Event()
            event.record()
            self._planned[id(wrapper)] = event

    def _decode_wrapper(self, bs: int = 0) -> Any:
        """A decode wrapper; with `bs`, one for CUDA graphs of that batch size over the fixed buffers."""
        fi, buffers = self.flashinfer, self._graph_buffers
        graph = {}
        if self.names[1] == "fa":  # FA3 prefill kernels with one query token per request
            if bs:
                graph = {
                    "use_cuda_graph": True,
                    "qo_indptr_buf": buffers["qo_indptr"][: bs + 1],
                    "paged_kv_indptr_buf": buffers["indptr"][: bs + 1],
                    "paged_kv_indices_buf": buffers["indices"],
                    "paged_kv_last_page_len_buf": buffers["last"][:bs],
                }
            return fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend="fa3", **graph)
        if bs:
            graph = {
                "use_cuda_graph": True,
                "paged_kv_indptr_buffer": buffers["indptr"][: bs + 1],
                "paged_kv_indices_buffer": buffers["indices"],
                "paged_kv_last_page_len_buffer": buffers["last"][:bs],
            }
        return fi.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.decode_tensor_cores, **graph
        )

    def prepare_metadata(self, batch: Batch, graph_bs: int = 0) -> None:
        heads = (self.num_qo_heads, self.num_kv_heads, self.head_dim, self.page_size)
        if batch.is_decode and (graph_bs or len(batch.reqs)) <= self.triton_decode_max_bs:
            self._prepare_triton_decode(batch, graph_bs)
            return
        if batch.is_decode:
            wrappers = self._graph_wrappers[graph_bs] if graph_bs else self.decode_wrappers
            inputs = self._plan_inputs(batch, pad_to=graph_bs)
            if self.names[1] == "fa":
                qo_indptr = torch.arange(len(inputs[0]), dtype=torch.int32)
                self._plan(wrappers, qo_indptr, *inputs, *heads, causal=True)
            elif graph_bs and not self.graph_splits_kv(graph_bs):
                self._plan(wrappers, *inputs, *heads, disable_split_kv=True)
            else:
                self._plan(wrappers, *inputs, *heads)
            batch.attn_metadata = FlashInferMetadata(
                last_indices=None, wrapper=wrappers[0], wrappers=wrappers
            )
            return
        self._wait_prefill_build()
        extend = torch.tensor([req.extend_len for req in batch.reqs], dtype=torch.int32)
        qo_indptr = torch.zeros(len(batch.reqs) + 1, dtype=torch.int32)
        qo_indptr[1:] = extend.cumsum(0)
        wrappers = tuple(self.prefill_wrappers)
        self._plan(wrappers, qo_indptr, *self._plan_inputs(batch), *heads, causal=True)
        last_indices = (qo_indptr[1:].long() - 1).to(self.device, non_blocking=True)
        batch.attn_metadata = FlashInferMetadata(
            last_indices=last_indices, wrapper=wrappers[0], wrappers=wrappers
        )

    def _prepare_triton_decode(self, batch: Batch, graph_bs: int) -> None:
        """Rows and lengths for the Triton decode kernel, padded to `graph_bs` with the dummy request
        (the page table's last row, one token) and written into the graphs' buffers; fresh tensors
        without a graph."""
        pad = max(graph_bs - len(batch.reqs), 0)
        dummy_row = self.page_table.shape[0] - 1
        # pinned: a copy from pageable memory would wait for the forward in flight (overlap)
        pin = self.device.type == "cuda"
        rows = torch.tensor(
            [req.table_idx for req in batch.reqs] + [dummy_row] * pad, dtype=torch.int32, pin_memory=pin
        )
        lens = torch.tensor(
            [req.device_len for req in batch.reqs] + [1] * pad, dtype=torch.int32, pin_memory=pin
        )
        if graph_bs:
            bs = len(rows)
            self._graph_buffers["rows"][:bs].copy_(rows, non_blocking=True)
            self._graph_buffers["lens"][:bs].copy_(lens, non_blocking=True)
            rows, lens = self._graph_buffers["rows"][:bs], self._graph_buffers["lens"][:bs]
        else:
            rows, lens = rows.to(self.device, non_blocking=True), lens.to(self.device, non_blocking=True)
        if batch.shift is not None:  # a pending verify batch's rows (`GraphRunner.as_decode_rows`) move
            lens[: len(batch.reqs)] += batch.shift[1].to(lens.dtype)
        batch.attn_metadata = FlashInferMetadata(last_indices=None, wrapper=None, rows=rows, lens=lens)

    # -- CUDA graphs ---------------------------------------------------------------------------------

    def init_prefill_graphs(self, max_tokens: int) -> None:
        """The buffers of the prefill graphs' plans: a page-table row per block of `ALIGN` tokens and a
        length per token, for up to `max_tokens` tokens."""
        self._graph_buffers["block_rows"] = torch.zeros(
            max_tokens // ALIGN + 1, dtype=torch.int32, device=self.device
        )
        self._graph_buffers["token_lens"] = torch.ones(max_tokens + 1, dtype=torch.int32, device=self.device)

    def prepare_prefill_graph(self, batch: Batch, plan: torch.Tensor, num_tokens: int) -> None:
        """Plans a prefill graph's batch of `num_tokens` (padded) tokens: `plan` (on the device) holds
        the `num_tokens / ALIGN` blocks' page-table rows, then the tokens' lengths (see
        `minisgl.kernels.prefill_attention`)."""
        blocks = num_tokens // ALIGN
        block_rows = self._graph_buffers["block_rows"][:blocks]
        lens = self._graph_buffers["token_lens"][:num_tokens]
        block_rows.copy_(plan[:blocks], non_blocking=True)
        lens.copy_(plan[blocks : blocks + num_tokens], non_blocking=True)
        batch.attn_metadata = FlashInferMetadata(
            last_indices=None, wrapper=None, lens=lens, block_rows=block_rows
        )

    def graph_splits_kv(self, bs: int) -> bool:
        """Whether the decode graph of batch size `bs` splits the KV and merges (see the module's doc):
        FlashInfer's `fa` and CUDA-core decode always do under a graph; tensor-core decode up to
        `split_kv_max_bs`."""
        if self.names[1] == "fa" or not self.decode_tensor_cores or self.split_kv_max_bs is None:
            return True
        return bs <= self.split_kv_max_bs

    def init_graph_wrappers(self, batch_sizes: list[int], max_pages_per_req: int) -> None:
        """One decode wrapper per captured batch size, over shared fixed buffers."""
        max_bs = max(batch_sizes)
        buffers = {
            "qo_indptr": torch.arange(max_bs + 1, dtype=torch.int32, device=self.device),
            "indptr": torch.zeros(max_bs + 1, dtype=torch.int32, device=self.device),
            "indices": torch.zeros(max_bs * max_pages_per_req, dtype=torch.int32, device=self.device),
            "last": torch.zeros(max_bs, dtype=torch.int32, device=self.device),
            "rows": torch.zeros(max_bs, dtype=torch.int32, device=self.device),
            "lens": torch.ones(max_bs, dtype=torch.int32, device=self.device),
        }
        self._graph_buffers = buffers
        for bs in batch_sizes:
            if bs > self.triton_decode_max_bs:  # the smaller graphs run the Triton kernel
                self._graph_wrappers[bs] = tuple(self._decode_wrapper(bs) for _ in self.window_lefts)

    # -- the op ------------------------------------------------------------------------------------

    def attend(self, q: torch.Tensor, layer_id: int, batch: Batch) -> torch.Tensor:
        meta = planned(batch, FlashInferMetadata)
        if meta.wrapper is None:
            k, v = self.kv_cache.flat(layer_id)
            scales = self.kv_cache.layer_scales(layer_id)
            options = self.options
            if meta.block_rows is not None:
                return prefill_attention(
                    q, k, v, self.page_table, meta.block_rows, meta.lens, kv_scales=scales,
                    window=self.window(layer_id), sm_scale=options.sm_scale, soft_cap=options.soft_cap,
                )  # fmt: skip
            return decode_attention(
                q, k, v, self.page_table, meta.rows, meta.lens, kv_scales=scales,
                window=self.window(layer_id), sm_scale=options.sm_scale, soft_cap=options.soft_cap,
            )  # fmt: skip
        kv = (self.kv_cache.k_cache(layer_id), self.kv_cache.v_cache(layer_id))
        wrapper = meta.wrappers[self.layer_group[layer_id]] if meta.wrappers else meta.wrapper
        return wrapper.run(q, kv, **self.layer_scales[layer_id])
