"""`Sampler`: the device work that turns a batch's logits into next tokens, then log probabilities.

The transforms (grammar mask, logit_bias, penalties, suppressed tokens) run eagerly; the draw
(`minisgl.engine.draw.sample_rows`) runs eagerly on CPU and with ``compile_sampler: false``; on CUDA
as Triton kernels (`minisgl.kernels.draw`, the same tokens; ``Sampler.fused_draw = False``: as one
``torch.compile``d function, to compare). Launching it costs the host more than a small batch's
forward, so a plain decode step of up to `GRAPH_MAX_BS` requests replays a CUDA graph of it
(`capture_graphs`).
Details: docs/gpu.md#the-sampler and docs/gpu.md#sampler-graphs.
"""

from __future__ import annotations

import random

import torch

from minisgl.compile import raise_recompile_limit
from minisgl.core import Batch, Req, SamplingParams
from minisgl.engine.draw import TOP_K_ALL, mark_batch_unbacked, sample_rows
from minisgl.engine.sampling_args import BatchSamplingArgs, LogprobArgs, PenaltyArgs
from minisgl.engine.token_mask import apply_token_mask
from minisgl.kernels import draw as draw_kernels

# the largest decode batch whose sampling replays a CUDA graph (the host's launch cost matters where the
# forward is short)
GRAPH_MAX_BS = 64


class Sampler:
    """Turns the last-position logits of a batch into next tokens (see the module docstring).

    ``compile``: on CUDA, run the sampled path as one compiled function (False: the same function
    eagerly, for ablation; the ``compile_sampler`` setting). CPU always runs it eagerly.
    """

    def __init__(self, device: torch.device, vocab_size: int, compile: bool = True, slots: int = 1) -> None:
        self.device = device
        self.vocab_size = vocab_size
        self.slots = slots  # table rows: the per-slot token counts of the penalties have as many
        self._counts: torch.Tensor | None = None  # (slots, V) int32: each generated token's count
        self._seen: torch.Tensor | None = None  # (slots, V) bool: prompt and generated tokens
        self._rng = random.Random()
        # (decode graph size, need_filter) -> (graph, its floats and ints arguments, its tokens)
        self._graphs: dict[
            tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, torch.Tensor]
        ] = {}
        self._compiled = None
        # the draw on CUDA: the Triton kernels (False: the compiled function, to compare)
        self.fused_draw = device.type == "cuda" and compile and draw_kernels.AVAILABLE
        if device.type == "cuda" and compile:
            # one graph per need_filter value (for every batch size: `mark_batch_unbacked`), per vocabulary
            raise_recompile_limit()
            self._compiled = torch.compile(sample_rows, fullgraph=True, dynamic=False)

    @property
    def compiled(self) -> bool:
        """True when the sampled path runs compiled (CUDA, ``compile`` on)."""
        return self._compiled is not None

    def prepare(self, batch: Batch) -> BatchSamplingArgs:
        """The sampling arguments of ``batch``; call it before the forward so the copy overlaps."""
        return BatchSamplingArgs.from_reqs(batch.reqs, self.device, self._rng)

    def sample(self, logits: torch.Tensor, args: BatchSamplingArgs, graph_bs: int = 0) -> torch.Tensor:
        """Next token ids, int32 of shape (B,), on the device of ``logits``, without a host sync.

        ``logits``: (B, V), V >= ``vocab_size`` (columns past it are padding, ignored). ``graph_bs``: the
        logits are the first B rows of that decode graph's static output (its sampler graph, if
        captured, then runs the sampled path). The transforms and draws, in order: docs/gpu.md#the-sampler.
        """
        if logits.dim() != 2 or logits.shape[1] < self.vocab_size:
            raise ValueError(
                f"logits must be (batch, >= vocab_size={self.vocab_size}), got shape {tuple(logits.shape)}"
            )
        logits = logits[:, : self.vocab_size]
        mask = args.token_mask() if callable(args.token_mask) else args.token_mask
        plain = mask is None and args.bias_ids is None and args.penalties is None and args.suppress is None
        graph = self._graphs.get((graph_bs, args.need_filter)) if plain and not args.all_greedy else None
        if graph is not None:
            graph, floats, ints, tokens = graph
            floats[:, : logits.shape[0]].copy_(args.floats, non_blocking=True)
            ints[:, : logits.shape[0]].copy_(args.ints, non_blocking=True)
            graph.replay()
            return tokens[: logits.shape[0]]
        if mask is not None:  # structured output first: what follows sees the masked logits
            logits = apply_token_mask(logits, mask)
        if args.bias_ids is not None:  # then logit_bias; padding (-1) goes to an extra column
            ids = torch.where(args.bias_ids < 0, self.vocab_size, args.bias_ids)
            logits = torch.cat(
                [logits.float(), logits.new_zeros(logits.shape[0], 1, dtype=torch.float32)], dim=1
            )
            logits = logits.scatter_add_(1, ids, args.bias_values)[:, : self.vocab_size]
        if args.penalties is not None:
            logits = self._penalize(logits, args.penalties)
        if args.suppress is not None:  # an extra column takes the padding entries
            logits = torch.cat([logits, logits.new_zeros(logits.shape[0], 1)], dim=1)
            logits = logits.scatter_(1, args.suppress, float("-inf"))[:, : self.vocab_size]
        if args.all_greedy:
            tokens = logits.argmax(dim=-1).to(torch.int32)
        else:
            assert args.floats is not None and args.ints is not None
            if self._compiled is None:
                tokens = sample_rows(logits, args.floats, args.ints, args.need_filter)
            elif self.fused_draw:
                draw = draw_kernels.draw_filtered if args.need_filter else draw_kernels.draw_unfiltered
                tokens = draw(logits, args.floats, args.ints)
            else:
                mark_batch_unbacked(logits, args.floats, args.ints)
                tokens = self._compiled(logits, args.floats, args.ints, args.need_filter)
        if args.penalties is not None:
            self._count(tokens, args.penalties)
        return tokens

    def logprobs(
        self, logits: torch.Tensor, tokens: torch.Tensor, args: LogprobArgs
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(R,) float32 log probabilities of the scored rows' targets and their ``args.top`` most likely
        tokens, (R, top) int64 ids and (R, top) float32 log probabilities, most likely first, under
        ``log_softmax`` of the model's ``logits`` as they are (before bias, penalties and temperature).
        ``tokens``: the batch's sampled tokens (the targets -1 take theirs). Nothing syncs."""
        x = logits[args.lp_rows, : self.vocab_size].float()
        norm = torch.logsumexp(x, dim=-1, keepdim=True)
        sampled = tokens.long()[args.sampled_of.clamp(min=0)]
        targets = torch.where(args.targets < 0, sampled, args.targets)
        chosen = (x.gather(1, targets[:, None]) - norm).squeeze(1)
        if args.top == 0:
            return chosen, targets.new_empty(len(targets), 0), x.new_empty(len(targets), 0)
        values, ids = x.topk(args.top, dim=-1, sorted=True)
        return chosen, ids, values - norm

    def _penalize(self, logits: torch.Tensor, pen: PenaltyArgs) -> torch.Tensor:
        """The penalised rows' logits: a token seen in the prompt or the output divided by the
        repetition penalty when positive (multiplied when negative), then each generated token's
        logit lowered by frequency x its count and presence x (count > 0). The per-slot counts are
        made (zeroed, lazily allocated) for the requests that start in this batch."""
        if self._counts is None:
            self._counts = torch.zeros(self.slots, self.vocab_size, dtype=torch.int32, device=self.device)
            self._seen = torch.zeros(self.slots, self.vocab_size, dtype=torch.bool, device=self.device)
        pin = self.device.type == "cuda"
        for slot, tokens, generated in pen.fresh:
            self._counts[slot].zero_()
            self._seen[slot].zero_()
            seen = torch.tensor(tokens, pin_memory=pin).to(self.device, non_blocking=True)
            self._seen[slot].index_fill_(0, seen, True)
            if generated:
                ids = torch.tensor(generated, pin_memory=pin).to(self.device, non_blocking=True)
                self._counts[slot].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
        counts, seen = self._counts[pen.slots], self._seen[pen.slots]
        if pen.extra is not None:  # a verify step's drafts before each row
            ones = torch.ones_like(pen.extra[0], dtype=torch.int32)
            counts = counts.index_put(pen.extra, ones, accumulate=True)
            seen = seen.index_put(pen.extra, torch.ones_like(pen.extra[0], dtype=torch.bool))
        presence, frequency, repetition = pen.values[:, :, None].unbind(0)
        x = logits[pen.rows]
        x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
        x = x - frequency * counts - presence * (counts > 0)
        return logits.index_copy(0, pen.rows, x)

    @torch.inference_mode()
    def count_tokens(self, slots: list[int], tokens: list[int]) -> None:
        """Adds generated tokens to their slots' penalty counts (a verify step's accepted tokens, known
        on the host once the step is read); nothing before any request used penalties."""
        if self._counts is None or not slots:
            return
        pin = self.device.type == "cuda"
        host = torch.tensor([slots, tokens], dtype=torch.int64, pin_memory=pin)
        flat = host.to(self.device, non_blocking=True)
        flat = flat[0] * self.vocab_size + flat[1]
        self._counts.view(-1).scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        self._seen.view(-1).scatter_(0, flat, torch.ones_like(flat, dtype=torch.bool))

    def _count(self, tokens: torch.Tensor, pen: PenaltyArgs) -> None:
        """Adds each penalised row's new token (if it is an output) to its slot's counts."""
        assert self._counts is not None and self._seen is not None
        # flat scatters: index_put_ with a tensor index blocked the host for ~1.5 ms a call on an H200
        flat = pen.slots.long() * self.vocab_size + tokens[pen.rows].long()
        self._counts.view(-1).scatter_add_(0, flat, pen.emits.to(torch.int32))
        seen = self._seen.view(-1)
        seen.scatter_(0, flat, seen.gather(0, flat) | pen.emits)

    @torch.inference_mode()
    def capture_graphs(self, logits_by_bs: dict[int, torch.Tensor]) -> None:
        """Captures the compiled sampled path, with and without filters, on each decode graph's static
        logits (`logits_by_bs`: (bs, V) by graph size) up to `GRAPH_MAX_BS`, over arguments of greedy-free
        valid defaults (temperature 1, no filter). Nothing to do when the sampler runs eagerly."""
        if self._compiled is None:
            return
        stream = torch.cuda.Stream(self.device)
        pool = torch.cuda.graph_pool_handle()
        for bs, logits in sorted(logits_by_bs.items(), reverse=True):
            if bs > GRAPH_MAX_BS:
                continue
            with torch.inference_mode(False):  # normal tensors, as `BatchSamplingArgs` makes them
                floats = torch.tensor([[1.0] * bs, [1.0] * bs, [0.0] * bs], device=self.device)
                ints = torch.tensor([[TOP_K_ALL] * bs, [0] * bs, [0] * bs], device=self.device)
            for need_filter in (False, True):
                args = BatchSamplingArgs(all_greedy=False, need_filter=need_filter, floats=floats, ints=ints)
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    self.sample(logits, args)  # compiled already: a warm-up off the capture
                torch.cuda.current_stream(self.device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    tokens = self.sample(logits, args)
                self._graphs[(bs, need_filter)] = (graph, floats, ints, tokens)

    def destroy_graphs(self) -> None:
        """Drops the graphs and the penalties' per-slot counts (`Engine.shutdown`; a later penalised
        batch would make the counts again)."""
        self._graphs.clear()
        self._counts = self._seen = None

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Compiles the sampled paths (with and without filters; one graph serves every batch size) at
        start, so the first requests do not pay for it. Nothing to do when the sampler runs eagerly (CPU,
        or ``compile`` off). In inference mode, as `Engine.forward_batch` samples: dynamo guards on the
        grad mode, and a warm-up outside it compiled every path again at the first requests. (The
        arguments' tensors are normal tensors whatever the mode, see `BatchSamplingArgs.from_reqs`.)"""
        if self._compiled is None:
            return
        logits = torch.zeros(2, self.vocab_size, device=self.device)
        reqs = [
            Req(
                input_ids=[0],
                table_idx=0,
                cached_len=0,
                output_len=1,
                uid=-1,
                sampling_params=SamplingParams(temperature=1.0, top_k=top_k, seed=0),
            )
            for top_k in (-1, 5)
        ]
        for need_filter in (False, True):
            args = BatchSamplingArgs.from_reqs(reqs, self.device)
            args.need_filter = need_filter
            self.sample(logits, args)
