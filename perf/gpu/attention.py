"""Decode attention kernels side by side on the GPU: FlashInfer's CUDA-core and tensor-core decode
(`fi`) and FA3 run as a one-token prefill (`fa`), for Qwen3-0.6B's heads (16 query, 8 KV, dim 128).

    python -m perf.gpu.attention            # eager calls: plan host time and kernel device time
    python -m perf.gpu.attention --graphs   # CUDA graphs: FlashInfer split-KV or not, Triton

Without `--graphs`: per batch size and context length, the host time of planning and the device time
of one layer's attention (calls back to back). With `--graphs`: one layer's decode captured in a CUDA
graph as the engine captures it (a graph wrapper over fixed buffers, planned before each replay), with
FlashInfer's split-KV (chunks and a merge kernel) and without (`disable_split_kv`), the CUDA-core
kernel's graph, and minisgl's Triton split-KV kernel (`minisgl.kernels.decode_attention`) at two block
sizes; device time per replay. `--kv-dtype fp8_e4m3` (with `--graphs`) times the same variants on an
FP8 page pool (scales 1.0); with `--graphs` the pool holds the longest of `--contexts` for every row. A
plain script, not a test.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from minisgl.attention.flashinfer_backend import FlashInferAttnBackend
from minisgl.core import Batch, Req
from minisgl.kvcache import MHAKVCachePool
from perf.gpu.timing import capture, gpu_ms

HEADS, KV_HEADS, DIM, PAGE = 16, 8, 128, 256
MAX_BS, MAX_CTX = 256, 2048


def _pool_and_table(
    device: torch.device, dtype: torch.dtype = torch.bfloat16, max_ctx: int = MAX_CTX
) -> tuple[MHAKVCachePool, torch.Tensor]:
    pages_per_req = -(-max_ctx // PAGE)
    pool = MHAKVCachePool(1, MAX_BS * pages_per_req + 1, PAGE, KV_HEADS, DIM, dtype, device)
    for cache in (pool.k_cache(0), pool.v_cache(0)):
        for page in cache.split(256):  # normal_ has no float8 kernel: draw in bf16, then cast
            page.copy_(torch.randn(page.shape, dtype=torch.bfloat16, device=device))
    ctx = pages_per_req * PAGE
    table = torch.arange(MAX_BS * ctx, dtype=torch.int32, device=device).view(MAX_BS, ctx)
    table = torch.cat([table, torch.zeros(1, ctx, dtype=torch.int32, device=device)])
    return pool, table


def _batch(bs: int, ctx: int) -> Batch:
    return Batch(
        reqs=[
            Req(input_ids=[0] * ctx, table_idx=i, cached_len=ctx - 1, output_len=1, uid=i) for i in range(bs)
        ],
        phase="decode",
    )


def eager(device: torch.device) -> None:
    pool, table = _pool_and_table(device)
    variants = {
        "fi/cuda-core": dict(decode="fi", decode_tensor_cores=False),
        "fi/tensor-core": dict(decode="fi", decode_tensor_cores=True),
        "fa": dict(decode="fa"),
    }
    backends = {
        name: FlashInferAttnBackend(pool, table, device, HEADS, KV_HEADS, DIM, prefill="fi", **kw)
        for name, kw in variants.items()
    }
    print(f"{'bs':>4} {'ctx':>5} " + " ".join(f"{n + ' plan/run ms':>28}" for n in variants))
    for bs in (1, 8, 32, 64, 128, 256):
        for ctx in (256, 600, 1500):
            cells = []
            for backend in backends.values():
                batch = _batch(bs, ctx)
                plans = []
                for _ in range(20):
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    backend.prepare_metadata(batch)
                    plans.append((time.perf_counter() - t) * 1e3)
                wrapper = batch.attn_metadata.wrapper
                q = torch.randn(bs, HEADS, DIM, dtype=torch.bfloat16, device=device)
                kv = (pool.k_cache(0), pool.v_cache(0))
                run_ms = gpu_ms(lambda wrapper=wrapper, q=q, kv=kv: wrapper.run(q, kv))
                cells.append(f"{statistics.median(plans):>13.3f}/{run_ms:<14.4f}")
            print(f"{bs:>4} {ctx:>5} " + " ".join(cells), flush=True)


def graphs(
    device: torch.device,
    sizes: list[int],
    contexts: list[int],
    replays: int = 200,
    dtype: torch.dtype = torch.bfloat16,
) -> None:
    """Per (batch, context): microseconds per replay of a graph of one layer's decode, for each variant;
    the outputs are compared with the first variant's (max abs difference) to show they agree. `dtype`:
    the pages' (bf16, or float8_e4m3fn with scales 1.0)."""
    from minisgl.kernels.decode_attention import decode_attention

    pool, table = _pool_and_table(device, dtype, max(contexts))
    max_pages = table.shape[1] // PAGE
    scales = pool.scales[0] if pool.is_fp8 else None
    kv = (pool.k_cache(0), pool.v_cache(0))
    flat = pool.flat(0)
    # name: (backend settings, Triton block size or None for the backend's own attend)
    variants = {
        "tc split": (dict(decode_tensor_cores=True), None),
        "tc no-split": (dict(decode_tensor_cores=True, split_kv_max_bs=0), None),
        "cuda-core": (dict(decode_tensor_cores=False), None),
        "triton n64": (dict(triton_decode_max_bs=MAX_BS), 64),
        "triton n32": (dict(triton_decode_max_bs=MAX_BS), 32),
    }
    backends = {}
    for name, (kw, _) in variants.items():
        backend = FlashInferAttnBackend(
            pool, table, device, HEADS, KV_HEADS, DIM, prefill="fi", decode="fi", **kw
        )
        backend.init_graph_wrappers(sizes, max_pages)
        backends[name] = backend
    print(f"{'bs':>4} {'ctx':>5} " + " ".join(f"{n + ' us':>14}" for n in variants) + f" {'max |diff|':>11}")
    for bs in sizes:
        q = torch.randn(bs, HEADS, DIM, dtype=torch.bfloat16, device=device)
        captured = {}
        for name, backend in backends.items():
            batch = _batch(bs, 1)
            backend.prepare_metadata(batch, graph_bs=bs)  # capture on one-token requests
            meta, block_n = batch.attn_metadata, variants[name][1]

            def run(meta=meta, block_n=block_n, q=q):
                if block_n is None:
                    return meta.wrapper.run(q, kv)
                return decode_attention(
                    q, *flat, table, meta.rows, meta.lens, block_n=block_n, kv_scales=scales
                )

            captured[name] = capture(run)
        for ctx in contexts:
            cells, outs = [], []
            for name, backend in backends.items():
                graph, out = captured[name]
                backend.prepare_metadata(_batch(bs, ctx), graph_bs=bs)
                cells.append(f"{gpu_ms(graph.replay, replays) * 1e3:>14.2f}")
                outs.append(out.float().clone())
            diff = max((o - outs[0]).abs().max().item() for o in outs[1:])
            print(f"{bs:>4} {ctx:>5} " + " ".join(cells) + f" {diff:>11.2e}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--graphs", action="store_true", help="CUDA graphs: split-KV against not")
    parser.add_argument("--sizes", default="1,2,4,8,16,24,32,48,64,96,128,192,256")
    parser.add_argument("--contexts", default="160,640,1152,2048")
    parser.add_argument("--kv-dtype", default="auto", choices=("auto", "fp8_e4m3"), help="with --graphs")
    args = parser.parse_args()
    device = torch.device("cuda")
    dtype = torch.float8_e4m3fn if args.kv_dtype == "fp8_e4m3" else torch.bfloat16
    if args.graphs:
        sizes, contexts = [int(s) for s in args.sizes.split(",")], [int(c) for c in args.contexts.split(",")]
        graphs(device, sizes, contexts, dtype=dtype)
    elif dtype != torch.bfloat16:
        parser.error("--kv-dtype fp8_e4m3 needs --graphs")
    else:
        eager(device)


if __name__ == "__main__":
    main()
