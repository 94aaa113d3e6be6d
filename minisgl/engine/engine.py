"""The Engine: one per tensor-parallel rank, a coordinator. Its constructor reads top to bottom as the
start phases (built by `minisgl.engine.start`); its forwards run the batch through the one forward path
(`minisgl.engine.forward`, which checks it first) and sample."""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence

import torch

from minisgl.attention.torch_backend import TorchAttnBackend
from minisgl.core import Batch, Req
from minisgl.distributed import DistributedInfo, close_one_shot_all_reduce, destroy_process_group, set_tp_info
from minisgl.engine import start
from minisgl.engine.config import EngineConfig
from minisgl.engine.forward import ForwardMode, ForwardOutput, ForwardPath, host_output, to_device
from minisgl.engine.lora import EngineLora
from minisgl.engine.sample import Sampler
from minisgl.engine.sampling_args import BatchSamplingArgs
from minisgl.kernels import verify as verify_kernels
from minisgl.lora import LoraAdapter, LoraPool
from minisgl.multimodal.inputs import pixel_rows


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
        self._encoder_timers: list[_Timer] = []  # vision encoder runs not yet read (`take_encoder_seconds`)
        self.config = config
        self.device, self.dtype = config.torch_device, config.torch_dtype
        self._closed = False
        started = time.perf_counter()
        # seconds of each start phase, in order (each also logged as it ends)
        self.start_phases: dict[str, float] = {}
        phase = functools.partial(start.timed, self.start_phases)
        # this rank's attention heads; sizes the ranks cannot split fail here, before any process group
        self.local_heads = start.check_tensor_parallel(config)
        start.set_host_threads(config)
        start.set_cache_dir(config.cache_dir)
        self._owns_process_group, available_before = phase("communication", lambda: start.join_group(config))
        self.model, model_bytes = phase("model", lambda: start.load_model(config))
        self.lora: EngineLora | None = None
        if config.enable_lora:
            self.lora = phase("lora pool", lambda: start.make_lora(config, self.model))
        phase("kv cache", lambda: self._init_kv_cache(available_before, model_bytes))
        phase("page table", lambda: self._init_page_table(page_table))
        self.ctx = phase(
            "backends",
            lambda: start.make_context(
                config, self.kv_cache, self.page_table, self.local_heads, self.attention_window
            ),
        )
        self.attn_backend, self.moe_backend = self.ctx.attn_backend, self.ctx.moe_backend
        self.sampler = Sampler(
            self.device,
            config.model_config.vocab_size,
            compile=config.compile_sampler,
            slots=config.max_running_req + 1,
        )
        self.graph_runner = phase(
            "cuda graphs",
            lambda: start.make_graph_runner(config, self.model, self.ctx, self.max_seq_len, self.lora),
        )
        self.forward_path = ForwardPath(
            self.model, self.ctx, self.graph_runner, self.lora, config.max_running_req, self.max_seq_len
        )
        phase("sampler", self.sampler.warm_up)  # compiles the sampler on CUDA
        phase("sampler graphs", lambda: self.sampler.capture_graphs(self.graph_runner.decode_logits()))
        if config.model_config.is_multimodal and config.compile_vision and self.device.type == "cuda":
            phase("vision encoder", lambda: start.compile_vision(config, self.model))
        # last: it waits for the attention backend's prefill kernels, built in a thread meanwhile
        phase("prefill warm-up", self.graph_runner.warm_up_prefill)
        start.log_ready(
            config, time.perf_counter() - started, model_bytes, self.kv_cache, self.max_seq_len, companion,
            page_table is not None, self.lora,
        )  # fmt: skip

    def _init_kv_cache(self, available_before: int, model_bytes: int) -> None:
        """Sizes and allocates the KV pool; `max_seq_len` becomes the configured limit capped by the pool."""
        cfg, kv_heads = self.config, self.local_heads.num_kv_heads
        self.num_pages = start.num_pages(cfg, kv_heads, available_before, model_bytes, self.companion)
        self.kv_cache = start.make_kv_cache(cfg, self.num_pages, kv_heads, self.model.kv_scales)
        self.max_seq_len = min(cfg.configured_max_seq_len, self.num_pages * cfg.page_size)

    def _init_page_table(self, shared: torch.Tensor | None) -> None:
        """The page table (`shared`: the target's, for a draft model), and beside it each table_idx's
        last token and verify shift."""
        self.page_table = start.make_page_table(
            self.config, self.max_seq_len, self.kv_cache.dummy_page, shared
        )
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

    @property
    def lora_pool(self) -> LoraPool | None:
        """The device slots of LoRA adapters (`enable_lora`), or None."""
        return None if self.lora is None else self.lora.pool

    def _lora_part(self) -> EngineLora:
        """The LoRA part, for the adapter calls; without a pool they are refused."""
        if self.lora is None:
            raise ValueError("this engine has no LoRA pool (enable_lora is off)")
        return self.lora

    def read_lora(self, name: str, path: str) -> LoraAdapter:
        """The PEFT adapter at `path` read (on the host) for this engine's model, dtype, `max_lora_rank`
        and tensor-parallel rank; raises `minisgl.lora.LoraError`."""
        return self._lora_part().read(name, path)

    def load_lora(self, slot: int, adapter: LoraAdapter) -> None:
        """Puts `adapter` in device slot `slot` (requests with `lora_slot` = slot then use it). Ordered
        on the device after the forwards already queued and before any later one; no sync."""
        self._lora_part().load(slot, adapter)

    def clear_lora(self, slot: int) -> None:
        """Empties device slot `slot` (ordered as `load_lora`)."""
        self._lora_part().clear(slot)

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
        # embedding requests need the hidden states: the eager model gives them
        logits, mode, pooled = self.forward_path.run(batch, rows=rows, pool=pool if any(pool) else None)
        if scoring is not None and scoring.last is not None:  # more rows than the requests' last ones
            next_tokens = self.sampler.sample(logits[scoring.last], args)
        else:
            graph_bs = self.graph_runner.graph_size(batch) if mode == "cuda_graph" else 0
            next_tokens = self.sampler.sample(logits, args, graph_bs=graph_bs)
        if self.config.tp_broadcast_tokens and self.config.tp_info.size > 1:
            torch.distributed.broadcast(next_tokens, src=0)  # rank 0's tokens, on the device
        logprobs = None if scoring is None else self.sampler.logprobs(logits, next_tokens, scoring)
        self.last_tokens[self._table_idx(batch)] = next_tokens
        return host_output(next_tokens, logprobs, mode, pooled)

    @torch.inference_mode()
    def encode_images(self, reqs: Sequence[Req]) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
        """The images of vision-language requests through the model's vision encoder in one call: per
        request, its placeholder tokens' embeddings and DeepStack features, on the device. Called once
        per prefill batch for the requests whose first chunk with an image token it holds
        (`minisgl.multimodal.inputs.chunk_images`). `grid_thw` stays on the host, where the encoder
        plans its attention (no device read)."""
        if not self.config.model_config.is_multimodal:
            raise ValueError(
                f"{self.config.model_config.architecture} is a text-only model: it takes no images"
            )
        images = [req.images for req in reqs]
        timer = _Timer(self.device)
        # the 8-bit patches go to the device, which makes the float rows of them
        patches = to_device(torch.cat([i.pixels for i in images]), self.device)
        scale = images[0].scale
        numbers = None if scale.mean is None else to_device(scale.numbers(), self.device)
        pixel_values = pixel_rows(patches, scale, numbers)
        embeds, deepstack = self.model.encode_images(pixel_values, torch.cat([i.grid_thw for i in images]))
        self._encoder_timers.append(timer.stop())
        sizes = [len(i.token_positions) for i in images]
        per_layer = [d.split(sizes) for d in deepstack]
        return [(e, [layer[r] for layer in per_layer]) for r, e in enumerate(embeds.split(sizes))]

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
        packed = to_device(host, self.device)
        ext_d, starts = packed[: len(ext)], packed[len(ext) :]
        table_idx = self._table_idx(batch)
        if pending:
            self.move_pending(batch, args, table_idx, ext_d, starts, max(ext))
        rows = torch.arange(sum(ext), device=self.device)
        logits, mode, _ = self.forward_path.run(batch, rows=rows, verify=True)
        tokens = self.sampler.sample(logits, args)
        logprobs = None if args.logprobs is None else self.sampler.logprobs(logits, tokens, args.logprobs)
        verify_kernels.accept(
            tokens, batch.input_ids, ext_d, starts, table_idx, self.last_tokens, self.verify_shift, max(ext)
        )
        return host_output(tokens, logprobs, mode)

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

    @torch.inference_mode()
    def forward_logits(self, batch: Batch) -> torch.Tensor:
        """The model part of `forward_batch`: float32 logits (B, vocab) of each request's last computed
        token. Marks the computed tokens cached, as `forward_batch` does."""
        return self.forward_path.run(batch, own_output=True).logits

    def forward_mode(self, batch: Batch, all_rows: bool = False, verify: bool = False) -> ForwardMode:
        """How `forward_batch` runs this prepared batch (`ForwardPath.mode`): a CUDA graph replay, the
        compiled forward without a graph, or the eager model."""
        return self.forward_path.mode(batch, all_rows, verify)

    def _table_idx(self, batch: Batch) -> torch.Tensor:
        """The batch's table_idxs on the device (prepared with the batch, or copied here)."""
        if batch.table_idx is not None:
            return batch.table_idx
        return torch.tensor([req.table_idx for req in batch.reqs]).to(self.device, non_blocking=True)

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
        self.forward_path.close()
        self.model = self.kv_cache = self.page_table = self.last_tokens = self.lora = None  # type: ignore[assignment]
        self.ctx.kv_cache = self.ctx.page_table = None  # type: ignore[assignment]
        self.attn_backend = self.ctx.attn_backend = None  # type: ignore[assignment]
        self.moe_backend = self.ctx.moe_backend = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
