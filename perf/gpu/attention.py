"""Decode attention kernels side by side on the GPU: FlashInfer's CUDA-core and tensor-core decode
(`fi`) and FA3 run as a one-token prefill (`fa`), for Qwen3-0.6B's heads (16 query, 8 KV, dim 128).

    python -m perf.gpu.attention

Prints, per batch size and context length, the host time of planning and the device time of one
layer's attention (calls back to back). A plain script, not a test.
"""

from __future__ import annotations

import statistics
import time

import torch

from minisgl.attention.flashinfer_backend import FlashInferAttnBackend
from minisgl.core import Batch, Req
from minisgl.kvcache import MHAKVCachePool

HEADS, KV_HEADS, DIM, PAGE = 16, 8, 128, 256


def main() -> None:
    device = torch.device("cuda")
    max_bs, max_ctx = 256, 1536
    pages_per_req = max_ctx // PAGE
    pool = MHAKVCachePool(1, max_bs * pages_per_req + 1, PAGE, KV_HEADS, DIM, torch.bfloat16, device)
    pool.k_cache(0).normal_()
    pool.v_cache(0).normal_()
    table = torch.arange(max_bs * max_ctx, dtype=torch.int32, device=device).view(max_bs, max_ctx)
    table = torch.cat([table, torch.zeros(1, max_ctx, dtype=torch.int32, device=device)])
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
                reqs = [Req([0] * ctx, i, ctx - 1, 1, i) for i in range(bs)]
                batch = Batch(reqs=reqs, phase="decode")
                plans = []
                for _ in range(20):
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    backend.prepare_metadata(batch)
                    plans.append((time.perf_counter() - t) * 1e3)
                wrapper = batch.attn_metadata.wrapper
                q = torch.randn(bs, HEADS, DIM, dtype=torch.bfloat16, device=device)
                kv = (pool.k_cache(0), pool.v_cache(0))
                for _ in range(3):
                    wrapper.run(q, kv)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(50):
                    wrapper.run(q, kv)
                end.record()
                end.synchronize()
                cells.append(f"{statistics.median(plans):>13.3f}/{start.elapsed_time(end) / 50:<14.4f}")
            print(f"{bs:>4} {ctx:>5} " + " ".join(cells), flush=True)


if __name__ == "__main__":
    main()
