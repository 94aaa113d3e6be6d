"""One FP8 request with the fused quantizers off and on (`minisgl.kernels.fp8_gemm.FUSED_QUANTIZE`,
docs/quantization.md "The norm and the SiLU-and-multiply write e4m3").

    python -m perf.gpu.fp8_fused [--config configs/h200-qwen3-8b-fp8.yaml] [--pairs 3] [--tokens 512]

Two engines in this process, the first started with the switch off, the second with it on (each
compiles and captures its CUDA graphs under its own setting; the switch is set again before each of its
requests). One greedy request of 128 random prompt tokens and `--tokens` output tokens, alternating
between the two (off first in even pairs, on first in odd ones), after one warm-up pair; decode tokens
per second after the first token, medians over the pairs, and the ratio. Also how many greedy tokens
the two outputs share (on random weights near-ties make them part early). Bounded: pairs + 1 requests
per engine.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from minisgl.core import SamplingParams
from minisgl.kernels import fp8_gemm
from minisgl.llm import LLM
from perf.common import decode_rate

SETTINGS = (("off", False), ("on", True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/h200-qwen3-8b-fp8.yaml")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--memory-ratio", type=float, default=0.4, help="per engine (two share the GPU)")
    args = parser.parse_args()
    llms = {}
    for name, flag in SETTINGS:
        fp8_gemm.FUSED_QUANTIZE = flag
        started = time.perf_counter()
        llms[name] = LLM(config=args.config, memory_ratio=args.memory_ratio)
        print(f"start {name}: {time.perf_counter() - started:.1f} s", flush=True)
    rng = random.Random(0)
    prompt = [rng.randrange(1000, 30000) for _ in range(128)]
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    rates: dict[str, list[float]] = {name: [] for name, _ in SETTINGS}
    outs: dict[str, list[int]] = {}
    for rep in range(args.pairs + 1):  # pair 0 warms up
        for name, flag in SETTINGS if rep % 2 == 0 else SETTINGS[::-1]:
            fp8_gemm.FUSED_QUANTIZE = flag
            rate, [outs[name]] = decode_rate(llms[name], [prompt], params)
            print(f"pair {rep} {name}: {rate:.1f} tok/s", flush=True)
            if rep:
                rates[name].append(rate)
    for llm in llms.values():
        llm.shutdown()
    off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
    shared = next((i for i, (a, b) in enumerate(zip(outs["off"], outs["on"])) if a != b), len(outs["off"]))
    print(
        f"one request: off {off:.1f} tok/s, on {on:.1f} tok/s ({on / off:.3f}x); greedy outputs share {shared} tokens"
    )


if __name__ == "__main__":
    main()
