"""The prefix-cache workloads under one engine configuration, one process: hit rate and throughput.

    python -m perf.gpu.prefix --cache-type radix --page-size 256 [--workloads shared-prefix multi-turn random]
        [--passes 2] [--config configs/h200-qwen3-0.6b.yaml]

Starts one `LLM` with the preset, `cache_type` and `page_size` given (one start for several workloads:
each engine start costs tens of seconds on the GPU), runs each workload of `minisgl.bench.offline`
(`run_bench`: a warm-up, then `passes` passes, the prefix cache emptied before each), prints one JSON
line per workload and a table last. Run it once per cache type and page size in the same call and
compare the last passes (docs/performance.md#prefix-cache).
"""

from __future__ import annotations

import argparse
import json
import time

from minisgl.bench.offline import WORKLOADS, default_shape, run_bench
from minisgl.llm import LLM


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default="configs/h200-qwen3-0.6b.yaml")
    parser.add_argument("--cache-type", default="radix", choices=("radix", "naive"))
    parser.add_argument("--page-size", type=int, default=256)
    parser.add_argument(
        "--workloads", nargs="+", default=["shared-prefix", "multi-turn", "random"], choices=WORKLOADS
    )
    parser.add_argument("--passes", type=int, default=2)
    args = parser.parse_args()
    started = time.perf_counter()
    llm = LLM(config=args.config, cache_type=args.cache_type, page_size=args.page_size)
    startup = time.perf_counter() - started
    rows = []
    try:
        for workload in args.workloads:
            report = run_bench(llm, default_shape(workload, llm.engine.device.type), passes=args.passes)
            last = report["passes"][-1]
            row = {
                "workload": workload,
                "cache_type": args.cache_type,
                "page_size": args.page_size,
                "startup_s": round(startup, 1),
                "tok_s": [round(p["tokens_per_s"], 1) for p in report["passes"]],
                "ttft_p50_s": round(last["ttft_p50"], 4),
                "hit_rate": last.get("hit_rate"),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        llm.shutdown()
    print(
        f"{'workload':>14} {'cache':>6} {'page':>5} {'tok/s (passes)':>22} {'TTFT p50 s':>10} {'hit rate':>8}"
    )
    for r in rows:
        hit = "-" if r["hit_rate"] is None else f"{r['hit_rate']:.3f}"
        tok = " ".join(f"{t:.0f}" for t in r["tok_s"])
        print(
            f"{r['workload']:>14} {r['cache_type']:>6} {r['page_size']:>5} {tok:>22} {r['ttft_p50_s']:>10.4f} {hit:>8}"
        )


if __name__ == "__main__":
    main()
