"""Device time of the sampler's draw at Qwen3's vocabulary (151,936), one CUDA graph replay per call, by
batch size: greedy (argmax), temperature only on the Triton kernels (`minisgl.kernels.draw`, what a
CUDA sampler runs) and on the compiled `sample_rows` (before them), and with top-k / top-p (compiled).
Each batch's two unfiltered draws are checked to give the same tokens.

    python -m perf.gpu.sampler [--batches 1 2 4 8 64]
"""

from __future__ import annotations

import argparse
import random

import torch

from minisgl.core import Req, SamplingParams
from minisgl.engine.sample import Sampler
from minisgl.engine.sampling_args import BatchSamplingArgs
from perf.gpu.timing import graph_us

VOCAB = 151_936
CUDA = torch.device("cuda")


def _args(batch: int, **params) -> BatchSamplingArgs:
    rng = random.Random(batch)
    reqs = []
    for i in range(batch):
        req = Req(input_ids=[1], table_idx=i, cached_len=0, output_len=1, uid=i,
                  sampling_params=SamplingParams(seed=rng.randrange(2**62), **params))  # fmt: skip
        req.device_len = rng.randrange(1, 10**5)
        reqs.append(req)
    return BatchSamplingArgs.from_reqs(reqs, CUDA)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64, 256])
    args = parser.parse_args()
    with torch.inference_mode():
        sampler = Sampler(CUDA, VOCAB)
        sampler.warm_up()
        print(
            f"{'batch':>5} {'greedy':>8} {'T triton':>9} {'T compiled':>11} {'T+top_p/k':>10}  us/draw, same tokens"
        )
        for batch in args.batches:
            logits = torch.randn(batch, VOCAB, device=CUDA, dtype=torch.bfloat16) * 3
            greedy, plain = _args(batch, temperature=0.0), _args(batch, temperature=0.6)
            filtered = _args(batch, temperature=0.6, top_p=0.95, top_k=50)
            times, tokens = [], []
            for fused, sampling in [(False, greedy), (True, plain), (False, plain), (False, filtered)]:
                sampler.fused_draw = fused
                times.append(graph_us(lambda x=logits, s=sampling: sampler.sample(x, s)))
                if sampling is plain:
                    tokens.append(sampler.sample(logits, plain))
            same = bool(torch.equal(*tokens))
            print(
                f"{batch:>5} " + " ".join(f"{t:>{w}.1f}" for t, w in zip(times, (8, 9, 11, 10))) + f"  {same}"
            )


if __name__ == "__main__":
    main()
