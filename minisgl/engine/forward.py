"""The model's forward over a prepared batch: one path for every forward the engine runs (a step, a
verify step, logits alone, a batch with embedding requests), and its output on the host.

`ForwardPath.run` chooses how the batch runs (a CUDA graph replay, the compiled forward without a graph,
or the eager model), runs it inside the engine's context and marks the computed tokens cached. It gives
the logits of each request's last token or of the rows asked, and for embedding requests the pooled
hidden states too (the graphs and the compiled forward give every row's hidden state beside the
logits). The graphs and the compiled forward are `minisgl.engine.graph`'s.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch

from minisgl.core import Batch, Context, FatalEngineError, Req
from minisgl.engine.graph import GraphRunner
from minisgl.engine.lora import EngineLora, has_adapter_rows

# how a forward runs: a CUDA graph replay, the compiled forward without a graph, or the eager model
ForwardMode = Literal["cuda_graph", "compiled", "eager"]


class ForwardOutput(NamedTuple):
    next_tokens_gpu: torch.Tensor  # (B,) int32 on the engine's device
    next_tokens_cpu: torch.Tensor  # (B,) int32 on the host, valid once copy_done_event has completed
    copy_done_event: torch.cuda.Event | CompletedEvent
    # with log probabilities asked (`BatchSamplingArgs.logprobs`), `Sampler.logprobs`' three tensors on
    # the host, valid with the tokens
    logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    mode: ForwardMode = "eager"  # how the forward ran (`Engine.forward_mode`)
    # embedding requests (`SamplingParams.pooling`) whose prefill ended in this forward: their pooled
    # vectors (E, hidden) float32 on the host in batch order, valid with the tokens
    pooled: torch.Tensor | None = None


class CompletedEvent:
    """Stands in for the CUDA event on CPU, where the tokens are on the host as soon as they exist."""

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


class Forwarded(NamedTuple):
    """What `ForwardPath.run` gives: the float32 logits, how the forward ran, and the pooled vectors of
    the embedding requests whose prefill ended in it (None when none did)."""

    logits: torch.Tensor
    mode: ForwardMode
    pooled: torch.Tensor | None = None


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without blocking (from pinned memory on CUDA; itself elsewhere)."""
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A pinned host copy of a device tensor, made without blocking (valid once the stream reaches it)."""
    out = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return out.copy_(tensor, non_blocking=True)


def host_output(
    next_tokens: torch.Tensor,
    logprobs: tuple[torch.Tensor, ...] | None,
    mode: ForwardMode,
    pooled: torch.Tensor | None = None,
) -> ForwardOutput:
    """The forward's output, its tokens (log probabilities, pooled vectors) copied to the host without
    blocking."""
    if next_tokens.device.type != "cuda":
        return ForwardOutput(next_tokens, next_tokens, CompletedEvent(), logprobs, mode, pooled)
    next_tokens_cpu = _to_host(next_tokens)
    if logprobs is not None:
        logprobs = tuple(map(_to_host, logprobs))
    if pooled is not None:
        pooled = _to_host(pooled)
    copy_done_event = torch.cuda.Event()
    copy_done_event.record()
    return ForwardOutput(next_tokens, next_tokens_cpu, copy_done_event, logprobs, mode, pooled)


class ForwardPath:
    """The engine's forward (see the module docstring) over its model, context (the attention backend
    plans a batch outside the graphs), graph runner and LoRA part (None: no adapters); a batch beyond
    the engine's `max_running_req` or `max_seq_len` is refused."""

    def __init__(
        self,
        model: torch.nn.Module,
        ctx: Context,
        graph_runner: GraphRunner,
        lora: EngineLora | None,
        max_running_req: int,
        max_seq_len: int,
    ) -> None:
        self.model, self.ctx, self.graph_runner, self.lora = model, ctx, graph_runner, lora
        self.max_running_req, self.max_seq_len = max_running_req, max_seq_len
        self.closed = False

    def close(self) -> None:
        """Refuses every later forward and lets go of the model (`Engine.shutdown`)."""
        self.closed = True
        self.model = self.lora = None  # type: ignore[assignment]

    def mode(self, batch: Batch, all_rows: bool = False, verify: bool = False) -> ForwardMode:
        """How this prepared batch runs: a CUDA graph replay, the compiled forward without a graph, or the
        eager model. `all_rows`: logits of more rows than the requests' last tokens are asked for (prompt
        log probabilities), which a prefill graph does not give. `verify`: a verify step's batch
        (`Engine.forward_verify`), which replays a verify graph where one fits."""
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

    def run(
        self,
        batch: Batch,
        rows: torch.Tensor | None = None,
        verify: bool = False,
        own_output: bool = False,
        pool: list[bool] | None = None,
    ) -> Forwarded:
        """The logits of the batch: of each request's last token, or of the token `rows` given (a prefill
        with prompt log probabilities, a verify step's every row). A CUDA graph writes them into its
        static output, which the next replay overwrites: `own_output` returns a copy (sampling reads them
        at once and needs none). `pool`, which requests are embedding requests: their pooled vectors come
        from the hidden states of the same forward (a prefill graph's, the compiled forward's or the eager
        model's). Marks the computed tokens cached."""
        self._check(batch)
        mode = self.mode(batch, all_rows=rows is not None, verify=verify)
        # embedding inputs are prefill only; a batch that is not pools eagerly (the eager path pools any)
        if pool is not None and not batch.is_prefill:
            mode = "eager"
        pooled = None
        with self.ctx.forward_batch(batch):
            if mode == "cuda_graph" and verify:
                logits = self.graph_runner.replay_verify(batch)
            elif mode == "cuda_graph":
                if pool is None:
                    logits = self.graph_runner.replay(batch)  # plans attention for the padded batch itself
                else:
                    logits, hidden, place = self.graph_runner.replay_prefill(batch, hidden=True)
                    pooled = self._pool(batch, pool, hidden, place)
                if own_output:
                    logits = logits.clone()
            else:
                if batch.attn_metadata is None:
                    self.ctx.attn_backend.prepare_metadata(batch)
                if rows is not None:
                    batch.attn_metadata.last_indices = rows
                if mode == "compiled" and pool is not None:
                    logits, hidden = self.graph_runner.run_compiled_hidden(batch)
                    pooled = self._pool(batch, pool, hidden)
                elif mode == "compiled":
                    logits = self.graph_runner.run_compiled(batch)
                else:
                    logits, pooled = self._eager(batch, pool)
        for req in batch.reqs:
            req.complete_one()
        return Forwarded(logits, mode, pooled)

    def _check(self, batch: Batch) -> None:
        """Raises on a batch the engine cannot run, before any of it runs."""
        if self.closed:
            raise FatalEngineError("the engine is shut down; create a new Engine")
        if not batch.reqs:
            raise ValueError("batch has no requests")
        if len(batch.reqs) > self.max_running_req:
            raise ValueError(
                f"batch has {len(batch.reqs)} requests, more than max_running_req={self.max_running_req}"
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

    def _eager(self, batch: Batch, pool: list[bool] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The eager model's logits of the planned rows, and with `pool` the pooled vectors (`run`)."""
        # each row's LoRA slot (a graph replay or the compiled forward builds its own); a batch of base
        # rows only runs the base model, no adapter work
        lora = None if self.lora is None or not has_adapter_rows(batch) else self.lora.batch(batch)
        last_indices = batch.attn_metadata.last_indices
        # a vision-language prefill's image embeddings (only then: text models take no images)
        images = {} if batch.images is None else {"images": batch.images}
        args = (batch.input_ids, batch.positions, last_indices, lora)
        if pool is None:
            return self.model(*args, **images), None
        logits, hidden = self.model(*args, return_hidden=True, **images)
        return logits, self._pool(batch, pool, hidden)

    def _pool(
        self, batch: Batch, pool: list[bool], hidden: torch.Tensor, place: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """The pooled vectors (E, hidden) float32 of the embedding requests whose prefill ends in this
        forward, in batch order (docs/embeddings.md): the rows they need normed in one gather and summed
        per request in one `index_add_`, on the device. `place`: each computed token's row of `hidden`
        (a prefill graph's layout; None: the tokens' own rows). A chunked mean or CLS input carries its
        sum or first row over in `req.pooled` (mean and CLS compute every position: they never start
        from a cached prefix)."""
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
        device = hidden.device
        ints = to_device(torch.tensor([*take, *segment, *final], dtype=torch.int64), device)
        n, width = len(take), hidden.shape[-1]
        sums = torch.zeros(len(pooled), width, dtype=torch.float32, device=device)
        if n:
            rows = ints[:n] if place is None else place[ints[:n]]
            sums.index_add_(0, ints[n : 2 * n], self.model.final_norm(hidden[rows]).float())
        for i, req in enumerate(pooled):
            if req.pooled is not None:  # an earlier chunk's
                sums[i] += req.pooled
            req.pooled = sums[i] if req.is_partial else None
        if not final:
            return None
        factors = to_device(torch.tensor(scale, dtype=torch.float32), device)
        return sums[ints[2 * n :]] * factors[:, None]
