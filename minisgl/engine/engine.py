"""The Engine: one per tensor-parallel rank. Its constructor reads top to bottom as the init steps."""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal, NamedTuple, TypeVar

import torch

from minisgl.attention import create_attention_backend
from minisgl.attention.torch_backend import TorchAttnBackend
from minisgl.core import Batch, Context, FatalEngineError, Req
from minisgl.distributed import (
    DistributedInfo,
    HeadShard,
    close_one_shot_all_reduce,
    destroy_process_group,
    divide,
    init_one_shot_all_reduce,
    init_process_group,
    set_tp_info,
    shard_heads,
)
from minisgl.engine.config import CUDA_HOST_THREADS, EngineConfig
from minisgl.engine.graph import GraphRunner
from minisgl.engine.lora import EngineLora, pool_bytes
from minisgl.engine.sample import Sampler
from minisgl.engine.sampling_args import BatchSamplingArgs
from minisgl.kernels import verify as verify_kernels
from minisgl.kvcache import MHAKVCachePool, bytes_per_page
from minisgl.lora import LoraAdapter, LoraPool
from minisgl.models import build_model
from minisgl.models.llama import check_tensor_parallel_fp8
from minisgl.moe import create_moe_backend

logger = logging.getLogger(__name__)

GIB = 1 << 30
CPU_KV_FRACTION = 0.10  # default CPU KV budget: this share of the RAM available at start


# how a forward runs: a CUDA graph replay, the compiled forward without a graph, or the eager model
ForwardMode = Literal["cuda_graph", "compiled", "eager"]


class ForwardOutput(NamedTuple):
    next_tokens_gpu: torch.Tensor  # (B,) int32 on the engine's device
    next_tokens_cpu: torch.Tensor  # (B,) int32 on the host, valid once copy_done_event has completed
    copy_done_event: torch.cuda.Event | _CompletedEvent
    # with log probabilities asked (`BatchSamplingArgs.logprobs`), `Sampler.logprobs`' three tensors on
    # the host, valid with the tokens
    logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    mode: ForwardMode = "eager"  # how the forward ran (`Engine.forward_mode`)
    # embedding requests (`SamplingParams.pooling`) whose prefill ended in this forward: their pooled
    # vectors (E, hidden) float32 on the host in batch order, valid with the tokens
    pooled: torch.Tensor | None = None


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A pinned host copy of a device tensor, made without blocking (valid once the stream reaches it)."""
    out = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return out.copy_(tensor, non_blocking=True)


class _CompletedEvent:
    """Stands in for the CUDA event on CPU, where the tokens are on the host as soon as they exist."""

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


class _Timer:
    """The time of device work from construction to `stop()`: CUDA events on CUDA (read once `done`,
    without a sync), the host clock elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.events = None
        if device.type == "cuda":
            self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self.events[0].record()
        self.started = time.perf_counter()
        self.elapsed = 0.0

    def stop(self) -> _Timer:
        if self.events is not None:
            self.events[1].record()
        self.elapsed = time.perf_counter() - self.started
        return self

    def done(self) -> bool:
        return self.events is None or self.events[1].query()

    def seconds(self) -> float:
        return self.elapsed if self.events is None else self.events[0].elapsed_time(self.events[1]) / 1000


T = TypeVar("T")


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        *,
        companion: object | None = None,
        page_table: torch.Tensor | None = None,
    ) -> None:
        """Builds the engine in the documented order (docs/architecture.md#the-engines-init-steps).

        For speculative decoding's draft model, which keeps its KV at this engine's page ids:
        `companion`, its footprint (int attributes `weight_bytes` and `page_bytes`, as
        `minisgl.scheduler.draft.DraftFootprint`), sizes the pool so both models' weights and as many
        pages of each fit; `page_table`, the target's, replaces the draft engine's own (same shape;
        `last_tokens` stays its own)."""
        self.companion = companion
        self._shared_page_table = page_table
        self._encoder_timers: list[_Timer] = []  # vision encoder runs not yet read (`take_encoder_seconds`)
        self.config = config
        self.device, self.dtype = config.torch_device, config.torch_dtype
        self._closed = False
        started = time.perf_counter()
        # seconds of each start phase, in order (each also logged as it ends)
        self.start_phases: dict[str, float] = {}
        # this rank's attention heads; sizes the ranks cannot split fail here, before any process group
        self.local_heads = check_tensor_parallel(config)
        self._init_host_threads()
        self._init_cache_dir()
        available_before = self._phase("communication", self._init_communication)
        model_bytes = self._phase("model", self._load_model)
        self.lora: EngineLora | None = None
        if config.enable_lora:
            self._phase("lora pool", self._init_lora)
        self._phase("kv cache", lambda: self._init_kv_cache(available_before, model_bytes))
        self._phase("page table", self._init_page_table)
        self._phase("backends", self._init_backends)
        self.sampler = Sampler(
            self.device,
            config.model_config.vocab_size,
            compile=config.compile_sampler,
            slots=config.max_running_req + 1,
        )
        self._phase("cuda graphs", self._init_cuda_graphs)
        self._phase("sampler", self.sampler.warm_up)  # compiles the sampler on CUDA
        self._phase("sampler graphs", lambda: self.sampler.capture_graphs(self.graph_runner.decode_logits()))
        # last: it waits for the attention backend's prefill kernels, built in a thread meanwhile
        self._phase("prefill warm-up", self.graph_runner.warm_up_prefill)
        self._log_ready(time.perf_counter() - started, model_bytes)

    def _phase(self, name: str, step: Callable[[], T]) -> T:
        """Runs one start phase, records its seconds in `start_phases` and logs them."""
        started = time.perf_counter()
        result = step()
        self.start_phases[name] = seconds = time.perf_counter() - started
        logger.info("start phase %s: %.2f s", name, seconds)
        return result

    def _init_cache_dir(self) -> None:
        """Points the compile caches of this process at `cache_dir` (see its setting): before anything
        compiles or imports FlashInfer (whose JIT folder is fixed at its import)."""
        folder = self.config.cache_dir
        if folder is None:
            return
        root = Path(folder).expanduser().resolve()
        dirs = {
            "TORCHINDUCTOR_CACHE_DIR": root / "inductor",
            "TRITON_CACHE_DIR": root / "triton",
            "FLASHINFER_WORKSPACE_BASE": root / "flashinfer",
        }
        for variable, path in dirs.items():
            path.mkdir(parents=True, exist_ok=True)
            os.environ[variable] = str(path)
        if "flashinfer" in sys.modules:
            logger.warning(
                "cache_dir=%s: FlashInfer was imported before this engine started, so its JIT kernels stay "
                "in its earlier folder (set cache_dir for the first engine of the process)",
                folder,
            )
        logger.info("compile caches under %s (inductor, triton, flashinfer)", root)

    def _init_host_threads(self) -> None:
        """Sets torch's intra-op threads for this process: `host_threads`, or where unset
        CUDA_HOST_THREADS on CUDA (on CPU the model's GEMMs use every core, as torch chooses)."""
        threads = self.config.host_threads
        if threads is None and self.device.type == "cuda":
            threads = CUDA_HOST_THREADS
        if threads is not None and torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
            logger.info("host threads: %d (torch intra-op threads of this process)", threads)

    def _init_communication(self) -> int:
        """Joins the tensor-parallel group; returns the device memory free before the model loads."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        cfg = self.config
        self._owns_process_group = init_process_group(
            cfg.tp_info, cfg.distributed_addr, cfg.distributed_timeout, self.device
        )
        set_tp_info(cfg.tp_info)  # read by the model's construction and the layer functions' collectives
        init_one_shot_all_reduce(cfg.one_shot_all_reduce_max_bytes, cfg.torch_dtype, self.device)
        return _available_memory(self.device)

    def _load_model(self) -> int:
        """Builds the model and loads this rank's weights; returns their size in bytes."""
        cfg = self.config
        self.model = build_model(
            cfg.model_config,
            cfg.model_path,
            cfg.configured_max_seq_len,
            self.device,
            self.dtype,
            dummy=cfg.use_dummy_weight,
        )
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    @property
    def lora_pool(self) -> LoraPool | None:
        """The device slots of LoRA adapters (`enable_lora`), or None."""
        return None if self.lora is None else self.lora.pool

    def _init_lora(self) -> None:
        """The LoRA pool of `max_loras` slots at `max_lora_rank`, given to the model (its bytes come off
        the KV cache's budget, `_num_pages`)."""
        cfg = self.config
        self.lora = EngineLora(
            cfg.model_config, cfg.max_loras, cfg.max_lora_rank, self.dtype, self.device, cfg.tp_info.rank,
            cfg.tp_info.size,
        )  # fmt: skip
        self.model.lora_pool = self.lora.pool

    def read_lora(self, name: str, path: str) -> LoraAdapter:
        """The PEFT adapter at `path` read (on the host) for this engine's model, dtype, `max_lora_rank`
        and tensor-parallel rank; raises `minisgl.lora.LoraError`."""
        if self.lora is None:
            raise ValueError("this engine has no LoRA pool (enable_lora is off)")
        return self.lora.read(name, path)

    def load_lora(self, slot: int, adapter: LoraAdapter) -> None:
        """Puts `adapter` in device slot `slot` (requests with `lora_slot` = slot then use it). Ordered
        on the device after the forwards already queued and before any later one; no sync."""
        if self.lora is None:
            raise ValueError("this engine has no LoRA pool (enable_lora is off)")
        self.lora.load(slot, adapter)

    def clear_lora(self, slot: int) -> None:
        """Empties device slot `slot` (ordered as `load_lora`)."""
        if self.lora is None:
            raise ValueError("this engine has no LoRA pool (enable_lora is off)")
        self.lora.clear(slot)

    def _lora_bytes(self) -> int:
        cfg = self.config
        if not cfg.enable_lora:
            return 0
        return pool_bytes(cfg.model_config, cfg.max_loras, cfg.max_lora_rank, self.dtype, cfg.tp_info.size)

    def _init_kv_cache(self, available_before: int, model_bytes: int) -> None:
        """Sizes and allocates the KV pool; `max_seq_len` becomes the configured limit capped by the pool."""
        cfg, model_config = self.config, self.config.model_config
        self.num_pages = self._num_pages(available_before, model_bytes)
        self.kv_cache = MHAKVCachePool(
            model_config.num_layers,
            self.num_pages,
            cfg.page_size,
            self.local_heads.num_kv_heads,
            model_config.head_dim,
            cfg.kv_torch_dtype,
            self.device,
            use_kernel=cfg.use_kv_store_kernel,
            scales=self.model.kv_scales,
        )
        self.max_seq_len = min(cfg.configured_max_seq_len, self.num_pages * cfg.page_size)

    def _init_page_table(self) -> None:
        """The page table maps (table_idx, position) to a KV location; its last row, table_idx
        `max_running_req`, is the dummy request's, on the dummy page. A shared one (the `page_table`
        argument) is taken as it is: its owner writes it, and its page ids must be this pool's (as many
        pages, so the same dummy page)."""
        page_size, max_running_req = self.config.page_size, self.config.max_running_req
        aligned_max_seq_len = -(-self.max_seq_len // page_size) * page_size
        shared = self._shared_page_table
        if shared is not None:
            expected = (max_running_req + 1, aligned_max_seq_len)
            if tuple(shared.shape) != expected or shared.dtype != torch.int32 or shared.device != self.device:
                raise ValueError(
                    f"the shared page table is {tuple(shared.shape)} {shared.dtype} on {shared.device}; this "
                    f"engine needs {expected} torch.int32 on {self.device} (max_running_req={max_running_req}, "
                    f"max_seq_len={self.max_seq_len}, page_size={page_size})"
                )
            self.page_table = shared
            self._init_last_tokens()
            return
        _check_fits(
            (max_running_req + 1) * aligned_max_seq_len * 4,
            _available_memory(self.device),
            f"a page table of max_running_req={max_running_req} (+1) rows x max_seq_len={self.max_seq_len}",
        )
        self.page_table = torch.zeros(
            (max_running_req + 1, aligned_max_seq_len), dtype=torch.int32, device=self.device
        )
        dummy_loc = self.kv_cache.dummy_page * page_size
        self.page_table[max_running_req] = dummy_loc + torch.arange(aligned_max_seq_len) % page_size
        self._init_last_tokens()

    def _init_last_tokens(self) -> None:
        rows = self.config.max_running_req + 1
        # the token each table_idx sampled last: a pending decode batch reads its input_ids here
        self.last_tokens = torch.zeros(rows, dtype=torch.int32, device=self.device)
        # each table_idx's latest verify step: accepted drafts minus drafts (<= 0), which a pending verify
        # batch (built as if every draft were accepted) adds to its positions
        self.verify_shift = torch.zeros(rows, dtype=torch.int64, device=self.device)

    @property
    def attention_window(self) -> int | None:
        """The model's sliding attention window (`ModelConfig.sliding_window`), or None where it is
        absent or reaches past `max_seq_len`: such a window hides no token, so the kernels run without."""
        window = self.config.model_config.sliding_window
        return None if window is None or window >= self.max_seq_len else window

    def _init_backends(self) -> None:
        """The attention backend (which sees this rank's heads), the MoE backend and the context."""
        cfg, model_config = self.config, self.config.model_config
        self.attn_backend = create_attention_backend(
            cfg.attention_backend,
            self.kv_cache,
            self.page_table,
            self.device,
            num_heads=self.local_heads.num_heads,
            num_kv_heads=self.local_heads.num_kv_heads,
            head_dim=model_config.head_dim,
            tensor_core_min_group=cfg.tensor_core_min_group,
            split_kv_max_bs=cfg.decode_split_kv_max_bs,
            # its split count follows the batch size, so a request's logits would depend on its batch
            triton_decode_max_bs=0 if cfg.batch_invariant else cfg.decode_triton_max_bs,
            dtype=self.dtype,
            sliding_window=self.attention_window,
        )
        self.moe_backend = (
            create_moe_backend(cfg.moe_backend, self.device, self.dtype) if model_config.num_experts else None
        )
        self.ctx = Context(
            batch_invariant=cfg.batch_invariant,
            use_gemv_kernel=cfg.use_gemv_kernel,
            use_fused_kernels=cfg.use_fused_kernels,
            use_pdl=cfg.use_pdl,
            page_size=cfg.page_size,
            kv_cache=self.kv_cache,
            page_table=self.page_table,
            attn_backend=self.attn_backend,
            moe_backend=self.moe_backend,
        )

    def _init_cuda_graphs(self) -> None:
        cfg = self.config
        sizes = (cfg.max_running_req, self.max_seq_len, cfg.cuda_graph_bs, cfg.cuda_graph_max_bs)
        prefill = ("compile_prefill", "prefill_graph_max_tokens", "prefill_graph_max_context")
        self.graph_runner = GraphRunner(
            self.model,
            self.ctx,
            self.device,
            *sizes,
            **{name: getattr(cfg, name) for name in prefill},
            lora=self.lora,
        )

    def _log_ready(self, seconds: float, model_bytes: int) -> None:
        model_config, tp_info = self.config.model_config, self.config.tp_info
        speculative = ""
        if self.companion is not None:  # what the pool's sizing left for the draft model
            draft_kv = (self.num_pages + 1) * self.companion.page_bytes  # type: ignore[attr-defined]
            draft_weights = self.companion.weight_bytes  # type: ignore[attr-defined]
            speculative = (
                f"; room left for a draft model: {draft_weights / GIB:.2f} GiB of weights and "
                f"{self.num_pages} KV pages at the same page ids ({draft_kv / GIB:.2f} GiB)"
            )
        if self._shared_page_table is not None:
            speculative = "; a draft model: its KV at the target's page ids (the target's page table)"
        if self.lora is not None:
            pool = self.lora.pool
            speculative += (
                f"; LoRA: {pool.max_loras} adapter slots of rank up to {pool.max_rank} "
                f"({self._lora_bytes() / GIB:.2f} GiB, from the KV cache's budget)"
            )
        logger.info(
            "engine ready in %.1f s: %s (%s, %s, %.2f GiB of weights%s), %d KV pages of %d tokens "
            "(%.2f GiB%s), max_seq_len %d%s",
            seconds,
            model_config.architecture,
            self.device,
            str(self.dtype).removeprefix("torch."),
            model_bytes / GIB,
            f", tp rank {tp_info.rank} of {tp_info.size}" if tp_info.size > 1 else "",
            self.num_pages,
            self.config.page_size,
            self.kv_cache.size_bytes / GIB,
            "" if self.config.kv_cache_dtype == "auto" else f", {self.config.kv_cache_dtype}",
            self.max_seq_len,
            speculative,
        )

    def _num_pages(self, available_before: int, model_bytes: int) -> int:
        cfg, mc = self.config, self.config.model_config
        kv_heads = self.local_heads.num_kv_heads  # this rank's share of the KV cache
        page_bytes = bytes_per_page(mc.num_layers, cfg.page_size, kv_heads, mc.head_dim, cfg.kv_torch_dtype)
        # a companion (the draft model) takes its weights from the same memory and a page of its own KV
        # per page id: the budget pays for both pools, page for page
        companion = self.companion
        draft_weights = 0 if companion is None else companion.weight_bytes  # type: ignore[attr-defined]
        draft_page = 0 if companion is None else companion.page_bytes  # type: ignore[attr-defined]
        # the LoRA pool's slots come out of the same memory, before the pages are counted
        lora_bytes = self._lora_bytes()
        lora = f" - {lora_bytes / GIB:.2f} GiB of LoRA slots" if lora_bytes else ""
        free = available_before - model_bytes - draft_weights - lora_bytes
        if cfg.num_page_override is not None:
            _check_fits(
                cfg.num_page_override * (page_bytes + draft_page),
                free,
                f"num_page_override={cfg.num_page_override}",
            )
            logger.info("KV cache: num_page_override=%d", cfg.num_page_override)
            return cfg.num_page_override
        if self.device.type == "cuda":
            budget = int(available_before * cfg.memory_ratio) - model_bytes - draft_weights - lora_bytes
            how = (
                f"{available_before / GIB:.2f} GiB free before loading x memory_ratio {cfg.memory_ratio}"
                f" - {model_bytes / GIB:.2f} GiB of weights"
            )
            if companion is not None:
                how += f" - {draft_weights / GIB:.2f} GiB of draft-model weights"
            how += lora
        elif cfg.cpu_kv_budget_gib is not None:
            budget = int(cfg.cpu_kv_budget_gib * GIB)
            _check_fits(budget, free, f"cpu_kv_budget_gib={cfg.cpu_kv_budget_gib}")
            how = f"cpu_kv_budget_gib={cfg.cpu_kv_budget_gib}"
        else:
            budget = int(available_before * CPU_KV_FRACTION) - lora_bytes
            how = f"{CPU_KV_FRACTION:.0%} of {available_before / GIB:.2f} GiB RAM available{lora} (set cpu_kv_budget_gib)"
        num_pages = budget // (page_bytes + draft_page)
        if num_pages < 1:
            needs = f"{page_bytes} bytes" + (f" + {draft_page} for the draft model's" if draft_page else "")
            raise MemoryError(
                f"KV cache does not fit: one page of {cfg.page_size} tokens needs {needs}, the "
                f"budget is {max(budget, 0)} bytes ({how}). Free memory, raise the budget, or set num_page_override."
            )
        # more pages than every table_idx can fill at the configured max_seq_len would never be used
        useful = cfg.max_running_req * -(-cfg.configured_max_seq_len // cfg.page_size)
        if num_pages > useful:
            num_pages = useful
            how += f", capped at max_running_req x max_seq_len = {useful} pages"
        if companion is not None:
            how += f"; each page id also holds {draft_page} bytes of the draft model's KV"
        logger.info("KV cache: %d pages x %d bytes (%s)", num_pages, page_bytes, how)
        return num_pages

    def write_page_table(self, table_idx: int, start: int, pages: list[int]) -> None:
        """Maps positions [start, start + len(pages) * page_size) of `table_idx` to `pages`."""
        ps = self.config.page_size
        locs = torch.tensor(pages, dtype=torch.int32).repeat_interleave(ps) * ps
        locs += torch.arange(len(pages) * ps, dtype=torch.int32) % ps
        if self.device.type == "cuda":  # a copy from pageable memory would wait for the forwards in flight
            locs = locs.pin_memory()
        self.page_table[table_idx, start : start + len(locs)] = locs.to(self.device, non_blocking=True)

    @torch.inference_mode()
    def forward_batch(self, batch: Batch, args: BatchSamplingArgs) -> ForwardOutput:
        """Runs the model on a prepared batch and samples one token per request (also kept in
        `last_tokens`, by table_idx, for a pending decode batch to read)."""
        scoring = args.logprobs
        rows = None if scoring is None else scoring.rows
        pool = [req.sampling_params.pooling is not None for req in batch.reqs]
        pooled = None
        if any(pool):  # embedding requests need the hidden states: the eager model gives them
            mode: ForwardMode = "eager"
            logits, pooled = self._forward_pooled(batch, pool, rows)
        else:
            mode = self.forward_mode(batch, all_rows=rows is not None)
            logits = self._forward(batch, rows=rows, mode=mode)
        if scoring is not None and scoring.last is not None:  # more rows than the requests' last ones
            next_tokens = self.sampler.sample(logits[scoring.last], args)
        else:
            graph_bs = self.graph_runner.graph_size(batch) if mode == "cuda_graph" else 0
            next_tokens = self.sampler.sample(logits, args, graph_bs=graph_bs)
        if self.config.tp_broadcast_tokens and self.config.tp_info.size > 1:
            torch.distributed.broadcast(next_tokens, src=0)  # rank 0's tokens, on the device
        logprobs = None if scoring is None else self.sampler.logprobs(logits, next_tokens, scoring)
        table_idx = batch.table_idx
        if table_idx is None:
            table_idx = torch.tensor([req.table_idx for req in batch.reqs]).to(self.device, non_blocking=True)
        self.last_tokens[table_idx] = next_tokens
        return self._output(next_tokens, logprobs, mode, pooled)

    def _forward_pooled(
        self, batch: Batch, pool: list[bool], rows: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`_forward` (eager) of a batch holding embedding requests (`pool`: which): the logits, and the
        pooled vectors of those whose prefill ends here (docs/embeddings.md). Mean and CLS pooling keep
        their sum or first row in `req.pooled` across chunks; everything stays on the device."""
        self._check_batch(batch)
        with self.ctx.forward_batch(batch):
            if batch.attn_metadata is None:
                self.attn_backend.prepare_metadata(batch)
            if rows is not None:
                batch.attn_metadata.last_indices = rows
            lora = None if self.lora is None else self.lora.batch(batch)
            images = {} if batch.images is None else {"images": batch.images}  # VL prefills in the batch
            hidden = self.model.hidden_states(batch.input_ids, batch.positions, lora, **images)
            logits = self.model.logits(self.model.final_norm(hidden[batch.attn_metadata.last_indices]))
            pooled = self._pool(batch, pool, hidden)
        for req in batch.reqs:
            req.complete_one()
        return logits, pooled

    def _pool(self, batch: Batch, pool: list[bool], hidden: torch.Tensor) -> torch.Tensor | None:
        """The pooled vectors (E, hidden) float32 of the embedding requests whose prefill ends in this
        forward, in batch order: the rows they need normed in one gather and summed per request in one
        `index_add_`, on the device. A chunked mean or CLS input carries its sum or first row over in
        `req.pooled` (mean and CLS compute every position: they never start from a cached prefix)."""
        take: list[int] = []  # rows of `hidden` pooled
        segment: list[int] = []  # each one's request (its index among the pooled ones)
        final: list[int] = []  # the requests whose prefill ends here
        scale: list[float] = []  # ... and what their sum is multiplied by
        pooled: list[Req] = []
        start = 0
        for req, pooling in zip(batch.reqs, pool):
            end = start + req.extend_len
            mode = req.sampling_params.pooling if pooling else None
            if mode is not None:
                if mode == "mean":
                    rows = range(start, end)
                elif mode == "cls":
                    rows = range(start, start + 1) if req.cached_len == 0 else range(0)
                else:
                    rows = range(0) if req.is_partial else range(end - 1, end)
                take += rows
                segment += [len(pooled)] * len(rows)
                if not req.is_partial:
                    final.append(len(pooled))
                    scale.append(1.0 / req.device_len if mode == "mean" else 1.0)
                pooled.append(req)
            start = end
        host = torch.tensor([*take, *segment, *final], dtype=torch.int64)
        ints = host.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else host
        n, width = len(take), hidden.shape[-1]
        sums = torch.zeros(len(pooled), width, dtype=torch.float32, device=self.device)
        if n:
            sums.index_add_(0, ints[n : 2 * n], self.model.final_norm(hidden[ints[:n]]).float())
        for i, req in enumerate(pooled):
            if req.pooled is not None:  # an earlier chunk's
                sums[i] += req.pooled
            req.pooled = sums[i] if req.is_partial else None
        if not final:
            return None
        factors = torch.tensor(scale, dtype=torch.float32)
        if self.device.type == "cuda":
            factors = factors.pin_memory().to(self.device, non_blocking=True)
        return sums[ints[2 * n :]] * factors[:, None]

    @torch.inference_mode()
    def encode_images(self, req: Req) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A vision-language request's images through the model's vision encoder (its placeholder
        tokens' embeddings and DeepStack features, on the device), once per request at its first prefill
        chunk with an image token (`minisgl.multimodal.inputs.chunk_images`)."""
        if not self.config.model_config.is_multimodal:
            raise ValueError(
                f"{self.config.model_config.architecture} is a text-only model: it takes no images"
            )
        images = req.images
        timer = _Timer(self.device)
        out = self.model.encode_images(images.pixel_values.to(self.device), images.grid_thw.to(self.device))
        self._encoder_timers.append(timer.stop())
        return out

    def take_encoder_seconds(self) -> list[float]:
        """The times of the `encode_images` calls that completed on the device since the last call (the
        metric minisgl_vision_encoder_seconds; on CUDA read from events, no sync)."""
        done = [timer for timer in self._encoder_timers if timer.done()]
        self._encoder_timers = [timer for timer in self._encoder_timers if not timer.done()]
        return [timer.seconds() for timer in done]

    @torch.inference_mode()
    def forward_verify(self, batch: Batch, args: BatchSamplingArgs, pending: bool = False) -> ForwardOutput:
        """Speculative decoding's verify step (docs/speculative.md): `batch`, prefill-phase, holds each
        request's newest token and its drafts; `args` has one entry per token row (row j: the token at
        its position + 1). Returns a token per row, and on the device accepts the drafts into
        `last_tokens` and `verify_shift`. `pending`: the batch was built before the previous verify step
        was read; it is moved by `verify_shift` on the device (needs `can_shift`)."""
        ext = [req.extend_len for req in batch.reqs]  # before the forward marks the tokens cached
        host = torch.tensor([*ext, *(sum(ext[:i]) for i in range(len(ext)))], dtype=torch.int64)
        packed = host.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else host
        ext_d, starts = packed[: len(ext)], packed[len(ext) :]
        table_idx = batch.table_idx
        if table_idx is None:
            table_idx = torch.tensor([req.table_idx for req in batch.reqs]).to(self.device, non_blocking=True)
        if pending:
            self.move_pending(batch, args, table_idx, ext_d, starts, max(ext))
        rows = torch.arange(sum(ext), device=self.device)
        mode = self.forward_mode(batch, all_rows=True, verify=True)
        logits = self._forward(batch, rows=rows, verify=True, mode=mode)
        tokens = self.sampler.sample(logits, args)
        logprobs = None if args.logprobs is None else self.sampler.logprobs(logits, tokens, args.logprobs)
        verify_kernels.accept(
            tokens, batch.input_ids, ext_d, starts, table_idx, self.last_tokens, self.verify_shift, max(ext)
        )
        return self._output(tokens, logprobs, mode)

    def move_pending(
        self,
        batch: Batch,
        args: BatchSamplingArgs | None,
        table_idx: torch.Tensor,
        ext: torch.Tensor,
        starts: torch.Tensor,
        width: int,
    ) -> None:
        """A pending verify batch moved on the device to what its requests' previous verify step
        accepted (`forward_verify`, `minisgl.kernels.verify.move`): `ext` (B,) each request's rows,
        `starts` (B,) its first row, on the device; `width` the most rows a request has."""
        offsets = args.ints[2] if args is not None and args.ints is not None else None
        batch.shift = verify_kernels.move(
            batch.input_ids, batch.positions, batch.out_loc, offsets, ext, starts, table_idx,
            self.last_tokens, self.verify_shift, self.page_table, width,
        )  # fmt: skip

    def can_shift(self, batch: Batch) -> bool:
        """Whether `forward_verify(batch, args, pending=True)` can move the batch on the device: it
        replays a verify CUDA graph (its attention plan is on the device), or the torch backend plans
        it (from device tensors)."""
        if any(req.images is not None for req in batch.reqs):  # VL: positions (+ mrope_delta) are not
            return False  # the KV slots `move` derives out_loc from; such a batch waits for the previous step
        return self.graph_runner.can_replay_verify(batch) or isinstance(self.attn_backend, TorchAttnBackend)

    def _output(
        self,
        next_tokens: torch.Tensor,
        logprobs: tuple[torch.Tensor, ...] | None,
        mode: ForwardMode,
        pooled: torch.Tensor | None = None,
    ) -> ForwardOutput:
        """The forward's output, its tokens (log probabilities, pooled vectors) copied to the host
        without blocking."""
        if self.device.type != "cuda":
            return ForwardOutput(next_tokens, next_tokens, _CompletedEvent(), logprobs, mode, pooled)
        next_tokens_cpu = _to_host(next_tokens)
        if logprobs is not None:
            logprobs = tuple(map(_to_host, logprobs))
        if pooled is not None:
            pooled = _to_host(pooled)
        copy_done_event = torch.cuda.Event()
        copy_done_event.record()
        return ForwardOutput(next_tokens, next_tokens_cpu, copy_done_event, logprobs, mode, pooled)

    @torch.inference_mode()
    def forward_logits(self, batch: Batch) -> torch.Tensor:
        """The model part of `forward_batch`: float32 logits (B, vocab) of each request's last computed
        token. Marks the computed tokens cached, as `forward_batch` does."""
        return self._forward(batch, own_output=True)

    def forward_mode(self, batch: Batch, all_rows: bool = False, verify: bool = False) -> ForwardMode:
        """How `forward_batch` runs this prepared batch: a CUDA graph replay, the compiled forward
        without a graph, or the eager model. `all_rows`: logits of more rows than the requests' last
        tokens are asked for (prompt log probabilities), which a prefill graph does not give. `verify`:
        a verify step's batch (`forward_verify`), which replays a verify graph where one fits."""
        positions = getattr(batch, "positions", None)
        if batch.images is not None or (positions is not None and positions.dim() == 2):  # VL prefill
            return "eager"
        if verify:
            if self.graph_runner.can_replay_verify(batch):
                return "cuda_graph"
        elif self.graph_runner.can_use_cuda_graph(batch) and not (all_rows and batch.is_prefill):
            return "cuda_graph"
        if self.graph_runner.can_run_compiled(batch):
            return "compiled"
        return "eager"

    def _forward(
        self,
        batch: Batch,
        own_output: bool = False,
        rows: torch.Tensor | None = None,
        verify: bool = False,
        mode: ForwardMode | None = None,
    ) -> torch.Tensor:
        """Logits of the batch: of each request's last token, or of the token `rows` given (a prefill
        with prompt log probabilities). A CUDA graph writes them into its static output, which the next
        replay overwrites: `own_output` returns a copy (sampling reads them at once and needs none)."""
        self._check_batch(batch)
        if mode is None:
            mode = self.forward_mode(batch, all_rows=rows is not None, verify=verify)
        with self.ctx.forward_batch(batch):
            if mode == "cuda_graph" and verify:
                logits = self.graph_runner.replay_verify(batch)
            elif mode == "cuda_graph":
                logits = self.graph_runner.replay(batch)  # plans attention for the padded batch itself
                if own_output:
                    logits = logits.clone()
            else:
                if batch.attn_metadata is None:
                    self.attn_backend.prepare_metadata(batch)
                if rows is not None:
                    batch.attn_metadata.last_indices = rows
                if mode == "compiled":
                    logits = self.graph_runner.run_compiled(batch)
                else:
                    # each row's LoRA slot (a graph replay or the compiled forward builds its own)
                    lora = None if self.lora is None else self.lora.batch(batch)
                    last_indices = batch.attn_metadata.last_indices
                    # a vision-language prefill's image embeddings (only then: text models take no images)
                    images = {} if batch.images is None else {"images": batch.images}
                    logits = self.model(batch.input_ids, batch.positions, last_indices, lora, **images)
        for req in batch.reqs:
            req.complete_one()
        return logits

    def _check_batch(self, batch: Batch) -> None:
        if self._closed:
            raise FatalEngineError("the engine is shut down; create a new Engine")
        if not batch.reqs:
            raise ValueError("batch has no requests")
        if len(batch.reqs) > self.config.max_running_req:
            raise ValueError(
                f"batch has {len(batch.reqs)} requests, more than max_running_req={self.config.max_running_req}"
            )
        for name in ("input_ids", "positions", "out_loc"):
            if not hasattr(batch, name):
                raise ValueError(
                    f"batch.{name} is not set: the scheduler side prepares input_ids, positions and out_loc "
                    "(see minisgl.scheduler.BatchPreparer)"
                )
        for req in batch.reqs:
            if req.extend_len < 1 or (batch.is_decode and req.extend_len != 1):
                raise ValueError(
                    f"request {req.uid} computes {req.extend_len} tokens in a {batch.phase} batch "
                    "(prefill: at least 1, decode: exactly 1)"
                )
            if req.device_len > self.max_seq_len:
                raise ValueError(
                    f"request {req.uid} reaches {req.device_len} tokens, more than max_seq_len={self.max_seq_len}"
                )

    def shutdown(self, abort: bool = False) -> None:
        """Destroys CUDA graphs, leaves the process group and releases device memory. Idempotent.
        Under tensor parallelism every rank shuts down together (NCCL's teardown is collective);
        `abort=True` when a peer is gone: the communicators are aborted instead of finalized."""
        if self._closed:
            return
        self._closed = True
        self.graph_runner.destroy()
        self.sampler.destroy_graphs()
        close_one_shot_all_reduce()
        if self._owns_process_group:
            destroy_process_group(abort=abort)
        set_tp_info(DistributedInfo())
        self.model = self.kv_cache = self.page_table = self.last_tokens = self.lora = None  # type: ignore[assignment]
        self.ctx.kv_cache = self.ctx.page_table = None  # type: ignore[assignment]
        self.attn_backend = self.ctx.attn_backend = None  # type: ignore[assignment]
        self.moe_backend = self.ctx.moe_backend = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def check_tensor_parallel(config: EngineConfig) -> HeadShard:
    """This rank's attention heads; raises before any process group (and before a launcher starts the
    other ranks) when the model cannot be split over ``config.tp_info.size`` ranks."""
    model_config, tp_info = config.model_config, config.tp_info
    local_heads = shard_heads(model_config.num_heads, model_config.num_kv_heads, tp_info)
    divide(model_config.intermediate_size, tp_info.size, "intermediate_size")
    if model_config.num_experts:
        divide(model_config.moe_intermediate_size, tp_info.size, "moe_intermediate_size")
    check_tensor_parallel_fp8(model_config, tp_info)  # each rank's FP8 scales must cover whole blocks
    if model_config.is_multimodal and tp_info.size > 1:
        raise ValueError(
            f"{model_config.architecture} does not run under tensor parallelism yet: use tp_size=1"
        )
    return local_heads


def _check_fits(num_bytes: int, available: int, what: str) -> None:
    """Raises a MemoryError naming `what` before an allocation larger than the memory available."""
    if num_bytes > available:
        raise MemoryError(
            f"{what} needs {num_bytes / GIB:.2f} GiB, but only {max(available, 0) / GIB:.2f} GiB are "
            "available; lower it"
        )


def _available_memory(device: torch.device) -> int:
    """Bytes free on the device: GPU memory, or the RAM the OS reports available."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
