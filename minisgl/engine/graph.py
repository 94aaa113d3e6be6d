"""CUDA graphs of the compiled forward: one per decode batch size, and one per prefill token-count bucket.

The forward is compiled once for every token count (the token dimension is unbacked); decode batches
are padded with the dummy request to the next captured size, small prefills are laid out in blocks of
`ALIGN` tokens and replay a bucket's graph, and the rest run compiled without a graph. Why and when:
docs/gpu.md#compiled-forward-and-cuda-graphs and docs/gpu.md#prefill-graphs.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging

import torch
from tqdm import tqdm

from minisgl.compile import mark_unbacked, raise_recompile_limit
from minisgl.core import Batch, Context, Req
from minisgl.engine.lora import EngineLora, StaticLoraBatch, batch_rows, has_adapter_rows
from minisgl.kernels.prefill_attention import ALIGN
from minisgl.layers.lora import NO_ADAPTER, LoraBatch

logger = logging.getLogger(__name__)


def _normal_tensor(t: torch.Tensor) -> torch.Tensor:
    """t, or a copy of it outside inference mode when t is an inference tensor."""
    if not t.is_inference():
        return t
    with torch.inference_mode(False):
        return t.clone()


def default_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, then every 8 up to max_bs."""
    return sorted({bs for bs in [1, 2, 4, *range(8, max_bs + 1, 8)] if bs <= max_bs})


def prefill_buckets(max_tokens: int) -> list[int]:
    """The token counts prefill graphs are captured for: ALIGN, doubling, up to `max_tokens` (which is
    the last when it is not a power of two: rounded up to ALIGN)."""
    if max_tokens < ALIGN:
        return []
    buckets = [ALIGN << i for i in range(max_tokens.bit_length()) if ALIGN << i < max_tokens]
    return [*buckets, -(-max_tokens // ALIGN) * ALIGN]


def prefill_layout(batch: Batch) -> tuple[list[int], int]:
    """Where each request's tokens start in a prefill graph's layout (blocks of ALIGN), and the tokens
    the layout spans (its blocks)."""
    starts, at = [], 0
    for req in batch.reqs:
        starts.append(at)
        at += -(-req.extend_len // ALIGN) * ALIGN
    return starts, at


def default_max_bs(device: torch.device) -> int:
    """256 on a card of 80 GB or more, 160 below."""
    return 256 if torch.cuda.get_device_properties(device).total_memory >= 80e9 else 160


class GraphRunner:
    """CUDA graphs of the decode forward and the compiled forward they share (docs/gpu.md).

    ``compile_prefill``: prefill and batches above the largest graph run the compiled forward (False:
    eagerly, for ablation; the ``compile_prefill`` setting). A batch-invariant engine runs them eagerly
    whatever it says. ``lora``: the engine's LoRA part (None: no adapters); with it every graph
    captures a `StaticLoraBatch` of its rows, rewritten before each replay, so one graph serves any mix
    of adapters, and the compiled forward takes the batch's `LoraBatch`. A decode batch whose rows are
    all the base model's replays a second graph of its size, captured without LoRA (no adapter kernel
    launched), which writes its logits into the first one's output (the sampler's graphs read those).
    """

    lora: EngineLora | None = None
    max_loras = 0  # the LoRA pool's slots (0: no pool)

    def __init__(
        self,
        model: torch.nn.Module,
        ctx: Context,
        device: torch.device,
        max_running_req: int,
        max_seq_len: int,
        cuda_graph_bs: tuple[int, ...] | None,
        cuda_graph_max_bs: int | None,
        compile_prefill: bool = True,
        prefill_graph_max_tokens: int = 0,
        prefill_graph_max_context: int = 0,
        lora: EngineLora | None = None,
    ) -> None:
        self.lora, self.max_loras = lora, 0 if lora is None else lora.pool.max_loras
        # with a LoRA pool: each graph's static LoraBatch, by ("decode", batch size) or ("prefill", tokens)
        # (a verify graph shares its token count's prefill layout, and its batch)
        self.lora_batches: dict[tuple[str, int], StaticLoraBatch] = {}
        self.batch_sizes: list[int] = []
        self.prefill_sizes: list[int] = []  # token counts of the prefill graphs
        self.prefill_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # each prefill graph's every row's hidden state (the pooled vectors of embedding inputs read them)
        self.prefill_hidden: dict[int, torch.Tensor] = {}
        # speculative decoding's verify graphs (`capture_verify`), by token count, and the rows each
        # request's block gives logits of
        self.verify_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # a verify batch of few rows replays the decode graph of its rows (`as_decode_rows`; off: ablation)
        self.verify_as_decode = True
        self.verify_rows = 0
        self.prefill_graph_max_context = prefill_graph_max_context
        # the compiled graph's kernels depend on the token count, so batch invariance rules it out
        self.compile_prefill = compile_prefill and not ctx.batch_invariant
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # with a LoRA pool: the decode graphs of base-only batches, by batch size (the same outputs)
        self.base_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if device.type != "cuda" or cuda_graph_max_bs == 0:
            logger.info(
                "CUDA graphs: disabled (%s)",
                "no CUDA device" if device.type != "cuda" else "cuda_graph_max_bs=0",
            )
            return
        backend = ctx.attn_backend
        if not hasattr(backend, "init_graph_wrappers"):
            logger.info(
                "CUDA graphs: disabled (the %s attention backend has no graph support)",
                type(backend).__name__,
            )
            return
        if ctx.moe_backend is not None and not getattr(ctx.moe_backend, "graph_capturable", False):
            logger.info(
                "CUDA graphs: disabled (the %s MoE backend cannot be captured)",
                type(ctx.moe_backend).__name__,
            )
            return
        max_bs = min(cuda_graph_max_bs or default_max_bs(device), max_running_req)
        sizes = sorted({bs for bs in (cuda_graph_bs or default_batch_sizes(max_bs)) if bs <= max_bs})
        if not sizes:
            logger.info("CUDA graphs: disabled (no batch size <= %d)", max_bs)
            return
        self.model, self.ctx, self.device = model, ctx, device
        self.max_running_req = max_running_req
        page_size = ctx.page_size
        self.dummy_loc = ctx.kv_cache.dummy_page * page_size
        prefill_sizes = self._prefill_sizes(prefill_graph_max_tokens, ctx)
        # one row longer than the largest graph: every graph's inputs are then strict views of these, so
        # dynamo does not equate a view's size with its base's at the first (largest) size, a guard that
        # recompiled the forward at the second size
        top = max(sizes[-1], *prefill_sizes, 0) + 1
        self.input_ids = torch.zeros(top, dtype=torch.int32, device=device)
        self.positions = torch.zeros(top, dtype=torch.int64, device=device)
        self.out_loc = torch.full((top,), self.dummy_loc, dtype=torch.int64, device=device)
        # every row's index: a decode batch's `last_indices` (a graph's slice, or a batch above the graphs)
        self.rows = torch.arange(max(top, max_running_req + 1), dtype=torch.int64, device=device)
        backend.init_graph_wrappers(sizes, -(-max_seq_len // page_size))
        # one engine compiles the forward once; further engines in the process add their own entries
        raise_recompile_limit()
        self.forward = torch.compile(model.forward, fullgraph=True, dynamic=False)
        self._pool = torch.cuda.graph_pool_handle()
        if self.max_loras:  # made here, outside inference mode: the compiled forward would copy them
            slots = self.max_loras
            for bs in sizes:  # one base-only request more than the graph's rows: the padding
                self.lora_batches["decode", bs] = StaticLoraBatch(bs, bs + 1, slots, device)
            for tokens in prefill_sizes:  # a request and its block's padding per block, then the rest
                self.lora_batches["prefill", tokens] = StaticLoraBatch(
                    tokens, 2 * (tokens // ALIGN) + 1, slots, device
                )
        self._capture(sizes)
        if self.max_loras:
            self._capture(sizes, base=True)
        self.batch_sizes = sizes
        if prefill_sizes:
            # each request's last row, then padding rows: the rows whose logits a prefill graph computes
            self.prefill_last = torch.zeros(prefill_sizes[-1] // ALIGN + 1, dtype=torch.int64, device=device)
            backend.init_prefill_graphs(prefill_sizes[-1])
            self._capture_prefill(prefill_sizes)
            self.prefill_sizes = prefill_sizes

    def _prefill_sizes(self, max_tokens: int, ctx: Context) -> list[int]:
        """The prefill graphs' token counts, or none where they cannot run (docs/gpu.md#prefill-graphs)."""
        why = None
        if not self.compile_prefill:
            why = "compile_prefill is off or the engine is batch-invariant"
        elif not hasattr(ctx.attn_backend, "prepare_prefill_graph"):
            why = f"the {type(ctx.attn_backend).__name__} attention backend has no prefill graph plan"
        elif ctx.moe_backend is not None:
            why = "a MoE model"
        elif not prefill_buckets(max_tokens):
            why = f"prefill_graph_max_tokens={max_tokens}"
        if why is not None:
            logger.info("prefill CUDA graphs: none (%s)", why)
            return []
        return prefill_buckets(max_tokens)

    def _dummy_batch(self, bs: int) -> Batch:
        reqs = [
            Req(input_ids=[0], table_idx=self.max_running_req, cached_len=0, output_len=1, uid=-1)
            for _ in range(bs)
        ]
        batch = Batch(reqs=reqs, phase="decode")
        batch.input_ids, batch.positions, batch.out_loc = (
            self.input_ids[:bs],
            self.positions[:bs],
            self.out_loc[:bs],
        )
        return batch

    def _static_lora(self, kind: str, size: int) -> LoraBatch | None:
        static = self.lora_batches.get((kind, size))
        return None if static is None else static.batch

    def _capture_one(
        self,
        batch: Batch,
        last_indices: torch.Tensor | None,
        lora: LoraBatch | None = None,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]:
        """Captures the compiled forward of a planned dummy batch (compiled, for the first size only,
        and warmed up off the capture), with the graph's static LoraBatch where there is a pool. `out`:
        the graph copies its logits there (the output of another graph of the same rows). Returns the
        graph and its static logits and hidden states."""
        stream = torch.cuda.Stream(self.device)
        with self.ctx.forward_batch(batch):
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self.compiled_both(batch.input_ids, batch.positions, last_indices, lora)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, stream=stream):
                logits, hidden = self.compiled_both(batch.input_ids, batch.positions, last_indices, lora)
                if out is not None:
                    logits = out.copy_(logits)
        return graph, logits, hidden

    @torch.inference_mode()
    def _capture(self, sizes: list[int], base: bool = False) -> None:
        """The decode graphs, largest first; `base`: the base-only set (no LoRA), each writing into the
        output of the graph of its size."""
        what = "base-only CUDA graphs" if base else "CUDA graphs"
        bar = tqdm(sorted(sizes, reverse=True), desc=f"capturing {what}", unit="graph")
        for bs in bar:
            batch = self._dummy_batch(bs)
            self.ctx.attn_backend.prepare_metadata(batch, graph_bs=bs)
            if base:
                self.base_graphs[bs] = self._capture_one(batch, None, None, out=self.graphs[bs][1])[:2]
            else:
                self.graphs[bs] = self._capture_one(batch, None, self._static_lora("decode", bs))[:2]
            free = torch.cuda.mem_get_info(self.device)[0] / 2**30
            bar.set_postfix_str(f"bs {bs}, {free:.1f} GiB free")
        bar.close()
        logger.info("%s: captured %d batch sizes (%d..%d)", what, len(sizes), sizes[0], sizes[-1])

    @torch.inference_mode()
    def _capture_prefill(self, sizes: list[int]) -> None:
        """One graph per prefill bucket, largest first, planned as all padding (the dummy row)."""
        for tokens in sorted(sizes, reverse=True):
            batch = self._prefill_dummy(tokens)
            lora = self._static_lora("prefill", tokens)
            graph, logits, hidden = self._capture_one(batch, self.prefill_last[: tokens // ALIGN], lora)
            self.prefill_graphs[tokens], self.prefill_hidden[tokens] = (graph, logits), hidden
        logger.info("prefill CUDA graphs: captured %d token counts (%d..%d)", len(sizes), sizes[0], sizes[-1])

    @torch.inference_mode()
    def capture_verify(self, rows: int, max_reqs: int) -> None:
        """Verify graphs for speculative decoding: for each prefill bucket up to the one that holds
        `max_reqs` blocks, a graph laid out as a prefill graph (a block per request) whose logits are of
        the first `rows` rows of every block (a request's newest token and its drafts; then padding).
        Nothing without prefill graphs or when `rows` exceeds a block."""
        if not self.batch_sizes:  # no CUDA graphs at all (the CPU): said at start already
            return
        if not self.prefill_sizes or rows > ALIGN:
            logger.info(
                "verify CUDA graphs: none (%s)", "no prefill graphs" if rows <= ALIGN else "rows > block"
            )
            return
        fits = [t for t in self.prefill_sizes if t >= max_reqs * ALIGN]
        sizes = [t for t in self.prefill_sizes if t <= (fits[0] if fits else self.prefill_sizes[-1])]
        self.verify_last = torch.zeros(sizes[-1] // ALIGN * rows, dtype=torch.int64, device=self.device)
        for tokens in sorted(sizes, reverse=True):
            blocks = tokens // ALIGN
            batch = self._prefill_dummy(tokens)
            lora = self._static_lora("prefill", tokens)
            self.verify_graphs[tokens] = self._capture_one(batch, self.verify_last[: blocks * rows], lora)[:2]
        self.verify_rows = rows
        logger.info("verify CUDA graphs: captured %d token counts (%d..%d)", len(sizes), sizes[0], sizes[-1])

    def can_replay_verify(self, batch: Batch) -> bool:
        """A verify batch whose rows fit a decode graph that attends with the Triton kernel
        (`as_decode_rows`), or whose requests each compute at most `verify_rows` tokens, in as many blocks
        as the largest verify graph has, reaching at most `prefill_graph_max_context` tokens."""
        if self.fits_decode_rows(batch):
            return True
        return (
            bool(self.verify_graphs)
            and batch.size * ALIGN <= max(self.verify_graphs)
            and all(req.extend_len <= self.verify_rows for req in batch.reqs)
            and max(req.device_len for req in batch.reqs) <= self.prefill_graph_max_context
        )

    def fits_decode_rows(self, batch: Batch) -> bool:
        """Whether a verify batch's rows fit a decode graph that attends with the Triton decode kernel
        (its rows and lengths are read on the device), with `verify_as_decode` on (`as_decode_rows`)."""
        num = batch.num_tokens
        if not (self.verify_as_decode and self.batch_sizes and num <= self.batch_sizes[-1]):
            return False
        graph_bs = self.batch_sizes[bisect.bisect_left(self.batch_sizes, num)]
        return graph_bs <= getattr(self.ctx.attn_backend, "triton_decode_max_bs", 0)

    def as_decode_rows(self, batch: Batch) -> Batch | None:
        """A verify batch as a decode batch of its rows, where they fit (`fits_decode_rows`): each row
        a request of one token on its request's page-table row, of length its position + 1. A verify
        step of one request (k + 1 rows) then replays the decode graph of k + 1, not a 16-row prefill
        block: the projections and the LM head run on its rows only, and each row's attention is split
        over the KV as a decode step's is. None where they do not fit."""
        if not self.fits_decode_rows(batch):
            return None
        rows = [req.row_at(pos) for req in batch.reqs for pos in range(req.cached_len, req.device_len)]
        decode = Batch(reqs=rows, phase="decode")
        decode.input_ids, decode.positions, decode.out_loc = batch.input_ids, batch.positions, batch.out_loc
        decode.shift = batch.shift
        return decode

    def replay_verify(self, batch: Batch) -> torch.Tensor:
        """Replays the smallest verify graph that holds the batch (a block per request): the logits of
        every computed token, in batch order. A batch of few rows replays the decode graph of its rows
        instead (`as_decode_rows`)."""
        decode = self.as_decode_rows(batch)
        if decode is not None:
            return self.replay(decode)
        tokens = min(t for t in self.verify_graphs if t >= batch.size * ALIGN)
        rows, picks = self.verify_rows, []
        last = torch.zeros(tokens // ALIGN * rows, dtype=torch.int64)
        for i, req in enumerate(batch.reqs):
            last[i * rows : i * rows + req.extend_len] = torch.arange(i * ALIGN, i * ALIGN + req.extend_len)
            picks.append(torch.arange(i * rows, i * rows + req.extend_len))
        starts = [i * ALIGN for i in range(batch.size)]
        last, _, pick = self._lay_out(batch, starts, tokens, last, picks)
        self._refresh_lora_layout(batch, starts, tokens)
        self.verify_last[: len(last)].copy_(last, non_blocking=True)
        graph, logits = self.verify_graphs[tokens]
        graph.replay()
        return logits[pick]

    def _prefill_dummy(self, tokens: int) -> Batch:
        """A prefill graph's batch of `tokens` tokens, all padding, its attention planned."""
        batch = Batch(reqs=self._dummy_batch(1).reqs, phase="prefill")
        batch.input_ids, batch.positions = self.input_ids[:tokens], self.positions[:tokens]
        batch.out_loc = self.out_loc[:tokens]
        blocks = tokens // ALIGN
        plan = torch.tensor([self.max_running_req] * blocks + [1] * tokens, dtype=torch.int32)
        self.ctx.attn_backend.prepare_prefill_graph(batch, plan.to(self.device), tokens)
        return batch

    def compiled_forward(self, input_ids, positions, last_indices=None, lora=None) -> torch.Tensor:
        """The logits of `compiled_both`."""
        return self.compiled_both(input_ids, positions, last_indices, lora)[0]

    def compiled_both(
        self, input_ids, positions, last_indices=None, lora=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's forward (its arguments), compiled, as (logits, every row's hidden state): one
        compiled graph serves generation and the pooled vectors of embedding inputs. Logits of every row
        when `last_indices` is None (it is then the slice of `rows`, so the compiled graph always gets a
        tensor). Marks the token dimension (and the sizes of a LoraBatch's tensors) unbacked and copies
        an inference-mode input to a normal tensor, so one graph serves every call and engine
        (docs/gpu.md#compiled-forward-and-cuda-graphs).
        An engine with a LoRA pool passes `lora` to every call but its base-only decode graphs' captures
        (the model's forward with and without one: two compiled graphs)."""
        if last_indices is None:
            if input_ids.shape[0] > self.rows.shape[0]:
                raise ValueError(
                    f"{input_ids.shape[0]} tokens without last_indices: every row's logits are given for at "
                    f"most {self.rows.shape[0]} tokens; pass last_indices"
                )
            last_indices = self.rows[: input_ids.shape[0]]
        inputs = [_normal_tensor(t) for t in (input_ids, positions, last_indices)]
        for tensor in inputs:
            mark_unbacked(tensor, 0)
        if lora is None:
            return self.forward(*inputs, return_hidden=True)
        fields = {f.name: _normal_tensor(getattr(lora, f.name)) for f in dataclasses.fields(lora)}
        for tensor in fields.values():
            mark_unbacked(tensor, 0)
        return self.forward(*inputs, LoraBatch(**fields), return_hidden=True)

    def warm_up_prefill(self) -> None:
        """Runs a prefill through the compiled forward at start (two dummy requests of 3 and 2 tokens on
        the dummy page), so the first real prefill finds its kernels ready: the attention backend's
        prefill kernels (the FA3 module's JIT build, begun in a thread when the backend was made, is
        joined here) and the compiled graph's. The inputs are made as the batch preparer makes a real
        prefill's. Nothing to do without graphs or with `compile_prefill` off."""
        if not (self.batch_sizes and self.compile_prefill):
            return
        lens = (3, 2)
        reqs = [
            Req(input_ids=[0] * n, table_idx=self.max_running_req, cached_len=0, output_len=1, uid=-1)
            for n in lens
        ]
        batch = Batch(reqs=reqs, phase="prefill")
        positions = torch.cat([torch.arange(n) for n in lens])
        batch.input_ids = torch.zeros(len(positions), dtype=torch.int32, device=self.device)
        batch.positions = positions.to(self.device)
        batch.out_loc = (self.dummy_loc + positions % self.ctx.page_size).to(self.device)
        self.ctx.attn_backend.prepare_metadata(batch)
        with torch.inference_mode(), self.ctx.forward_batch(batch):
            self.run_compiled(batch)

    def can_run_compiled(self, batch: Batch) -> bool:
        """Prefill and decode batches above the largest graph run the compiled forward, when
        `compile_prefill` (off in a batch-invariant engine: the compiled graph's kernels depend on the
        token count, see docs/performance.md and `python -m perf.gpu.ablation`)."""
        return bool(self.batch_sizes) and self.compile_prefill

    def run_compiled(self, batch: Batch) -> torch.Tensor:
        """The compiled forward without a graph (attention planned; with LoRA, its rows' slots built)."""
        return self.run_compiled_hidden(batch)[0]

    def run_compiled_hidden(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """`run_compiled`'s logits and every row's hidden state."""
        lora = None if self.lora is None else self.lora.batch(batch)
        return self.compiled_both(batch.input_ids, batch.positions, batch.attn_metadata.last_indices, lora)

    @property
    def enabled(self) -> bool:
        return bool(self.batch_sizes)

    def can_use_cuda_graph(self, batch: Batch) -> bool:
        """A decode batch up to the largest decode graph; a prefill batch whose layout fits the largest
        prefill graph and whose sequences reach at most `prefill_graph_max_context` tokens."""
        if batch.is_decode:
            return bool(self.batch_sizes) and batch.size <= self.batch_sizes[-1]
        return (
            bool(self.prefill_sizes)
            and prefill_layout(batch)[1] <= self.prefill_sizes[-1]
            and max(req.device_len for req in batch.reqs) <= self.prefill_graph_max_context
        )

    def graph_size(self, batch: Batch) -> int:
        """The size of the decode graph a decode batch replays (0 for a prefill batch)."""
        if batch.is_prefill:
            return 0
        return self.batch_sizes[bisect.bisect_left(self.batch_sizes, batch.size)]

    def decode_logits(self) -> dict[int, torch.Tensor]:
        """Each decode graph's static logits (bs, V), by batch size."""
        return {bs: logits for bs, (_, logits) in self.graphs.items()}

    def replay(self, batch: Batch) -> torch.Tensor:
        """Pads the decode batch to the next captured size, plans attention for it, replays (a prefill
        batch: `replay_prefill`)."""
        if batch.is_prefill:
            return self.replay_prefill(batch)
        bs, graph_bs = batch.size, self.graph_size(batch)
        self.input_ids[:bs].copy_(batch.input_ids, non_blocking=True)
        self.positions[:bs].copy_(batch.positions, non_blocking=True)
        self.out_loc[:bs].copy_(batch.out_loc, non_blocking=True)
        self.out_loc[bs:graph_bs].fill_(self.dummy_loc)  # padding writes its KV to the dummy page
        base = bool(self.base_graphs) and not has_adapter_rows(batch)  # no adapter work to launch
        if self.max_loras and not base:
            self.lora_batches["decode", graph_bs].refresh(*batch_rows(batch))
        self.ctx.attn_backend.prepare_metadata(batch, graph_bs=graph_bs)
        graph, logits = (self.base_graphs if base else self.graphs)[graph_bs]
        graph.replay()
        return logits[:bs]

    def replay_prefill(
        self, batch: Batch, hidden: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Lays the prefill batch out in the smallest bucket that holds it (docs/gpu.md#prefill-graphs),
        plans its attention on the device, replays; the logits of each request's last token, and with
        `hidden` (logits, the graph's static hidden states of every row of the layout, each computed
        token's row in them in batch order): pooling reads the rows it needs, nothing is copied."""
        starts, span = prefill_layout(batch)
        tokens = self.prefill_sizes[bisect.bisect_left(self.prefill_sizes, span)]
        # each request's last row in the layout (padding rows: 0)
        last = torch.zeros(tokens // ALIGN, dtype=torch.int64)
        for i, (req, start) in enumerate(zip(batch.reqs, starts)):
            last[i] = start + req.extend_len - 1
        last, place, _ = self._lay_out(batch, starts, tokens, last, [])
        self._refresh_lora_layout(batch, starts, tokens)
        self.prefill_last[: len(last)].copy_(last, non_blocking=True)
        graph, logits = self.prefill_graphs[tokens]
        graph.replay()
        if hidden:
            return logits[: batch.size], self.prefill_hidden[tokens], place
        return logits[: batch.size]

    def _lay_out(
        self, batch: Batch, starts: list[int], tokens: int, last: torch.Tensor, picks: list[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Puts a prefill batch's inputs in the graph buffers at `starts` (a layout of `tokens` tokens
        in blocks) and plans its attention on the device; `last` (the logits rows) and `picks` (host
        index tensors) go to the device in the same copy, returned as (last, each computed token's row
        in the layout, the picks concatenated)."""
        blocks = tokens // ALIGN
        # on the host: each block's page-table row, each token's length (position + 1; padding 1), and
        # each computed token's place in the layout
        block_rows = torch.full((blocks,), self.max_running_req, dtype=torch.int64)
        lens = torch.ones(tokens, dtype=torch.int64)
        places = []
        for req, start in zip(batch.reqs, starts):
            n = req.extend_len
            block_rows[start // ALIGN : (start + n + ALIGN - 1) // ALIGN] = req.table_idx
            lens[start : start + n] = torch.arange(req.cached_len + 1, req.device_len + 1)
            places.append(torch.arange(start, start + n))
        host = torch.cat([block_rows, lens, last, *places, *picks]).pin_memory()
        packed = host.to(self.device, non_blocking=True)
        at = blocks + tokens
        plan, last = packed[:at], packed[at : at + len(last)]
        place = packed[at + len(last) : at + len(last) + batch.num_tokens]
        if batch.shift is not None:  # a pending verify batch: each token's length moves with it
            plan[blocks:].index_add_(0, place, batch.shift[1])
        self.out_loc[:tokens].fill_(self.dummy_loc)  # padding writes its KV to the dummy page
        self.input_ids.index_copy_(0, place, batch.input_ids)
        self.positions.index_copy_(0, place, batch.positions)
        self.out_loc.index_copy_(0, place, batch.out_loc)
        self.ctx.attn_backend.prepare_prefill_graph(batch, plan, tokens)
        return last, place, packed[at + len(last) + batch.num_tokens :]

    def _refresh_lora_layout(self, batch: Batch, starts: list[int], tokens: int) -> None:
        """With a LoRA pool, the static LoraBatch of a prefill or verify graph of `tokens` tokens made the
        batch's: each request's rows at its start in the layout, the padding between them base-only."""
        if not self.max_loras:
            return
        rows, slots = [], []
        for i, req in enumerate(batch.reqs):
            if i:
                rows.append(starts[i] - starts[i - 1] - batch.reqs[i - 1].extend_len)
                slots.append(NO_ADAPTER)
            rows.append(req.extend_len)
            slots.append(req.lora_slot)
        self.lora_batches["prefill", tokens].refresh(rows, slots)

    def destroy(self) -> None:
        """Drops the graphs (their outputs and hidden states, in the graph pool, with them) and what the
        runner holds of its engine (`Engine.shutdown`): the model, and its compiled forward, torch.compile's
        wrapper of the bound method `model.forward`, which holds the model too; the LoRA part and the
        graphs' static LoraBatches. The engine's weights then go even while the engine is referenced:
        dynamo's cache of the model class's forward keeps none (they are inputs of the compiled graph),
        and other engines keep their compiled code."""
        self.graphs.clear()
        self.base_graphs.clear()
        self.prefill_graphs, self.prefill_hidden, self.verify_graphs, self.lora_batches = {}, {}, {}, {}
        self.batch_sizes = []
        self.prefill_sizes = []
        self.model = self.forward = self.lora = None  # type: ignore[assignment]
        self.max_loras = 0
