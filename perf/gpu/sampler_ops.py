"""How much host work one sampled step costs: top-level aten ops of the eager sampler (each a kernel launch
when run eagerly; on CUDA the sampler is compiled into a few fused kernels) and host
time of `BatchSamplingArgs.from_reqs` (prepare) and `Sampler.sample`, on CPU with a tiny vocabulary so
that the ops' own compute does not count.

    python -m perf.gpu.sampler_ops
"""

from __future__ import annotations

import time
from functools import partial

import torch
from torch.profiler import ProfilerActivity, profile

from minisgl.core import Req, SamplingParams
from minisgl.engine.sample import Sampler
from minisgl.engine.sampling_args import BatchSamplingArgs

CPU = torch.device("cpu")


def _top_level_ops(fn) -> int:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if e.cpu_parent is None and e.name.startswith("aten::"))


def main() -> None:
    torch.set_num_threads(1)
    sampler = Sampler(CPU, 64)
    print(f"{'batch':>5} {'prepare ops':>11} {'sample ops':>10} {'prepare+sample ms':>17}")
    for bs in (1, 64, 256):
        reqs = [
            Req(
                input_ids=[1] * 9,
                table_idx=i,
                cached_len=0,
                output_len=4,
                uid=i,
                sampling_params=SamplingParams(temperature=0.6, seed=i),
            )
            for i in range(bs)
        ]
        logits = torch.randn(bs, 64)
        args = BatchSamplingArgs.from_reqs(reqs, CPU)
        prepare_ops = _top_level_ops(partial(BatchSamplingArgs.from_reqs, reqs, CPU))
        sample_ops = _top_level_ops(partial(sampler.sample, logits, args))
        for _ in range(20):
            sampler.sample(logits, BatchSamplingArgs.from_reqs(reqs, CPU))
        started, n = time.perf_counter(), 200
        for _ in range(n):
            sampler.sample(logits, BatchSamplingArgs.from_reqs(reqs, CPU))
        ms = (time.perf_counter() - started) / n * 1e3
        print(f"{bs:>5} {prepare_ops:>11} {sample_ops:>10} {ms:>17.3f}")


if __name__ == "__main__":
    main()
