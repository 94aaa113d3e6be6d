"""CUDA graphs of the compiled decode forward, one per batch size.

The model's forward is compiled once with torch.compile (fullgraph, dynamic batch dimension; attention
is an opaque custom op), then captured into one CUDA graph per batch size in `batch_sizes`, all in one
memory pool, from the largest down. A decode batch is padded with the dummy request (page-table row
`max_running_req`, one token on the dummy page) up to the next captured size and replayed; larger
batches and prefill run the same compiled forward without a graph (`run_compiled`; faster than eager
prefill, see docs/performance.md and `python -m perf.gpu.prefill`), as the documentation allows, unless
`compile_prefill` is off (ablation) or the engine is batch-invariant.
"""

from __future__ import annotations

import bisect
import logging

import torch
from tqdm import tqdm

from minisgl.compile import raise_recompile_limit
from minisgl.core import Batch, Context, Req

logger = logging.getLogger(__name__)


def default_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, then every 8 up to max_bs."""
    return sorted({bs for bs in [1, 2, 4, *range(8, max_bs + 1, 8)] if bs <= max_bs})


def default_max_bs(device: torch.device) -> int:
    """256 on a card of 80 GB or more, 160 below."""
    return 256 if torch.cuda.get_device_properties(device).total_memory >= 80e9 else 160


class GraphRunner:
    """CUDA graphs of the decode forward and the compiled forward they share (see the module docstring).

    ``compile_prefill``: prefill and batches above the largest graph run the compiled forward (False:
    eagerly, for ablation; the ``compile_prefill`` setting). A batch-invariant engine runs them eagerly
    whatever it says.
    """

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
    ) -> None:
        self.batch_sizes: list[int] = []
        # the compiled graph's kernels depend on the token count, so batch invariance rules it out
        self.compile_prefill = compile_prefill and not ctx.batch_invariant
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
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
        # one row longer than the largest graph: every graph's inputs are then strict views of these, so
        # dynamo does not equate a view's size with its base's at the first (largest) size, a guard that
        # recompiled the forward at the second size
        top = sizes[-1] + 1
        self.input_ids = torch.zeros(top, dtype=torch.int32, device=device)
        self.positions = torch.zeros(top, dtype=torch.int64, device=device)
        self.out_loc = torch.full((top,), self.dummy_loc, dtype=torch.int64, device=device)
        backend.init_graph_wrappers(sizes, -(-max_seq_len // page_size))
        # one engine compiles the forward twice (a batch of 1 is specialized, every other size shares one
        # dynamic graph); further engines in the process add their own entries
        raise_recompile_limit()
        self.forward = torch.compile(model.forward, fullgraph=True, dynamic=True)
        self._capture(sizes)
        self.batch_sizes = sizes
        if self.compile_prefill:
            self._warm_up_compiled()

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

    @torch.inference_mode()
    def _capture(self, sizes: list[int]) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        bar = tqdm(sorted(sizes, reverse=True), desc="capturing CUDA graphs", unit="graph")
        for bs in bar:
            batch = self._dummy_batch(bs)
            self.ctx.attn_backend.prepare_metadata(batch, graph_bs=bs)
            with self.ctx.forward_batch(batch):
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    for _ in range(2):  # compile (first size only) and warm up off the capture
                        self.forward(batch.input_ids, batch.positions, None)
                torch.cuda.current_stream(self.device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    logits = self.forward(batch.input_ids, batch.positions, None)
            self.graphs[bs] = (graph, logits)
            free = torch.cuda.mem_get_info(self.device)[0] / 2**30
            bar.set_postfix_str(f"bs {bs}, {free:.1f} GiB free")
        bar.close()
        logger.info("CUDA graphs: captured %d batch sizes (%d..%d)", len(sizes), sizes[0], sizes[-1])

    def _warm_up_compiled(self) -> None:
        """Compiles the prefill path at start (two dummy requests of 3 and 2 tokens on the dummy page),
        so the first real prefill does not pay for it. The inputs are made outside inference mode, as the
        batch preparer makes a real prefill's: an inference tensor has other dispatch keys, and dynamo's
        guard on them would compile the forward again at the first real prefill."""
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
        """Prefill and decode batches above the largest graph of two or more tokens (a single token
        would make dynamo specialize a graph on size 1) run the compiled forward, when `compile_prefill`
        (off in a batch-invariant engine: the compiled graph's kernels depend on the token count, see
        docs/performance.md and `python -m perf.gpu.ablation`)."""
        return bool(self.batch_sizes) and batch.input_ids.shape[0] >= 2 and self.compile_prefill

    def run_compiled(self, batch: Batch) -> torch.Tensor:
        """The compiled forward without a graph (attention planned). A prefill's `last_indices` gets
        its last row repeated, so it never has one row (same reason), and the extra logits row is cut."""
        last = batch.attn_metadata.last_indices
        if last is None:
            return self.forward(batch.input_ids, batch.positions, None)
        return self.forward(batch.input_ids, batch.positions, torch.cat([last, last[-1:]]))[:-1]

    @property
    def enabled(self) -> bool:
        return bool(self.batch_sizes)

    def can_use_cuda_graph(self, batch: Batch) -> bool:
        return bool(self.batch_sizes) and batch.is_decode and batch.size <= self.batch_sizes[-1]

    def replay(self, batch: Batch) -> torch.Tensor:
        """Pads the decode batch to the next captured size, plans attention for it, replays."""
        bs = batch.size
        graph_bs = self.batch_sizes[bisect.bisect_left(self.batch_sizes, bs)]
        self.input_ids[:bs].copy_(batch.input_ids, non_blocking=True)
        self.positions[:bs].copy_(batch.positions, non_blocking=True)
        self.out_loc[:bs].copy_(batch.out_loc, non_blocking=True)
        self.out_loc[bs:graph_bs].fill_(self.dummy_loc)  # padding writes its KV to the dummy page
        self.ctx.attn_backend.prepare_metadata(batch, graph_bs=graph_bs)
        graph, logits = self.graphs[graph_bs]
        graph.replay()
        return logits[:bs]

    def destroy(self) -> None:
        self.graphs.clear()
        self.batch_sizes = []
