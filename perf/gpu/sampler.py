"""Device time of the sampler's draw at Qwen3's vocabulary (151,936), one CUDA graph replay per call, by
batch size: greedy (argmax), temperature only and with top-p 0.95 / top-k 50, each on the Triton kernels
(`minisgl.kernels.draw`, what a CUDA sampler runs) and on the compiled `sample_rows` (before them).
Each batch's draws must give the same tokens on both (else it stops with an error). `--blocks` also
times the unfiltered Triton draw at other block sizes (`minisgl.kernels.draw.BLOCK`).

    python -m perf.gpu.sampler [--batches 1 2 4 8 64] [--blocks 1024 4096]
"""

from __future__ import annotations

import argparse
import random

import torch

from minisgl.core import Req, SamplingParams
from minisgl.engine.sample import Sampler
from minisgl.engine.sampling_args import BatchSamplingArgs
from minisgl.kernels import draw as draw_kernels
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
    parser.add_argument("--blocks", type=int, nargs="*", default=[], help="other Triton block sizes")
    args = parser.parse_args()
    with torch.inference_mode():
        sampler = Sampler(CUDA, VOCAB)
        sampler.warm_up()
        others = "".join(f" {'T ' + str(b):>9}" for b in args.blocks)
        print(
            f"{'batch':>5} {'greedy':>8} {'T triton':>9} {'T compiled':>11} {'T+p/k triton':>13} "
            f"{'T+p/k compiled':>15}{others}  us/draw"
        )
        default_block = draw_kernels.BLOCK
        for batch in args.batches:
            logits = torch.randn(batch, VOCAB, device=CUDA, dtype=torch.bfloat16) * 3
            greedy, plain = _args(batch, temperature=0.0), _args(batch, temperature=0.6)
            filtered = _args(batch, temperature=0.6, top_p=0.95, top_k=50)
            runs = [
                (False, greedy, default_block),
                (True, plain, default_block),
                (False, plain, default_block),
            ]
            runs += [(True, filtered, default_block), (False, filtered, default_block)]
            runs += [(True, plain, b) for b in args.blocks]
            times, tokens = [], {id(plain): [], id(filtered): []}
            for fused, sampling, block in runs:
                sampler.fused_draw, draw_kernels.BLOCK = fused, block
                times.append(graph_us(lambda x=logits, s=sampling: sampler.sample(x, s)))
                if sampling is not greedy:
                    tokens[id(sampling)].append(sampler.sample(logits, sampling))
            draw_kernels.BLOCK = default_block
            for name, drawn in zip(("unfiltered", "filtered"), tokens.values()):
                if not all(torch.equal(drawn[0], t) for t in drawn):
                    raise AssertionError(f"batch {batch}: the {name} draws differ")
            widths = (8, 9, 11, 13, 15, *[9] * 8)
            print(f"{batch:>5} " + " ".join(f"{t:>{w}.1f}" for t, w in zip(times, widths)))


if __name__ == "__main__":
    main()
