"""The FP8 KV cache against bf16 KV on the GPU (its goals and figures: docs/quantization.md): pages and
throughput on a workload whose bf16 pool runs out, and what the FA2 prefill (FA3 cannot read FP8 KV)
costs. A plain script, not a test.

    python -m perf.gpu.fp8_kv [workload] [prefill] [--rounds N] [--num-seqs N] [--quantization fp8]

`workload` (the goals): 256 requests of 4,096 prompt and 512 output tokens on Qwen3-8B dummy weights
(`configs/models/qwen3-8b`, the H200 presets' settings), kv_cache_dtype auto then fp8_e4m3, alternating
for `--rounds` rounds, a fresh engine per pass after a small warm-up pass; per pass the KV pages and
GiB, preemptions, seconds and tokens/s, then the FP8 / bf16 ratios of pages and output throughput
(goals: >= 1.95 and >= 1.15). `prefill`: 64 prompts of 4,096 tokens, one output token each, with FA3
prefill and bf16 KV, FA2 and bf16 KV, and FA2 with FP8 KV: prefill tokens/s of each.
"""

from __future__ import annotations

import argparse
import gc
from pathlib import Path
from typing import Any

import torch

from minisgl.bench.offline import WorkloadShape, make_workload, run_pass
from minisgl.llm import LLM

GIB = 1 << 30
MODEL = Path(__file__).resolve().parents[2] / "configs" / "models" / "qwen3-8b"
SETTINGS: dict[str, Any] = dict(
    model=str(MODEL),
    use_dummy_weight=True,
    device="cuda",
    dtype="bfloat16",
    page_size=256,
    max_running_req=256,
    attention_backend="auto",
    memory_ratio=0.9,
    cuda_graph_max_bs=256,
)


def _pass(settings: dict[str, Any], shape: WorkloadShape, warmup: WorkloadShape) -> dict[str, Any]:
    llm = LLM(**settings)
    try:
        vocab = llm.engine.config.model_config.vocab_size
        run_pass(llm, *make_workload(warmup, vocab), warmup.temperature)
        preempted = llm.scheduler.preemptions
        result = run_pass(llm, *make_workload(shape, vocab), shape.temperature)
        return dict(
            pages=llm.engine.num_pages,
            page_size=llm.engine.config.page_size,
            kv_gib=llm.engine.kv_cache.size_bytes / GIB,
            backend=",".join(llm.engine.attn_backend.names)
            if hasattr(llm.engine.attn_backend, "names")
            else "torch",
            preemptions=llm.scheduler.preemptions - preempted,
            seconds=result.seconds,
            output_tps=result.output_tokens / result.seconds,
            total_tps=(result.output_tokens + result.input_tokens) / result.seconds,
        )
    finally:
        llm.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()


def _row(name: str, r: dict[str, Any]) -> str:
    return (
        f"{name:>22} {r['backend']:>7} {r['pages']:>7} x {r['page_size']:<4} {r['kv_gib']:>7.1f} "
        f"{r['preemptions']:>6} {r['seconds']:>8.1f} {r['output_tps']:>10.0f} {r['total_tps']:>10.0f}"
    )


HEADER = (
    f"{'variant':>22} {'attn':>7} {'pages':>14} {'KV GiB':>7} {'preempt':>6} {'seconds':>8} "
    f"{'out tok/s':>10} {'all tok/s':>10}"
)


def workload(rounds: int, num_seqs: int, extra: dict[str, Any]) -> None:
    shape = WorkloadShape(num_seqs=num_seqs, min_input=4096, max_input=4096, min_output=512, max_output=512)
    warmup = WorkloadShape(num_seqs=8, min_input=512, max_input=4096, min_output=8, max_output=64, seed=1)
    results: dict[str, list[dict[str, Any]]] = {"auto": [], "fp8_e4m3": []}
    print(HEADER, flush=True)
    for i in range(rounds):
        for kv in ("auto", "fp8_e4m3"):
            r = _pass({**SETTINGS, **extra, "kv_cache_dtype": kv}, shape, warmup)
            results[kv].append(r)
            print(_row(f"kv {kv} (round {i + 1})", r), flush=True)
    best = {kv: max(rs, key=lambda r: r["output_tps"]) for kv, rs in results.items()}
    pages = best["fp8_e4m3"]["pages"] / best["auto"]["pages"]
    speed = best["fp8_e4m3"]["output_tps"] / best["auto"]["output_tps"]
    print(f"FP8 / bf16 KV: pages x{pages:.3f} (goal >= 1.95), output throughput x{speed:.3f} (goal >= 1.15)")


def prefill(extra: dict[str, Any]) -> None:
    shape = WorkloadShape(num_seqs=64, min_input=4096, max_input=4096, min_output=1, max_output=1)
    warmup = WorkloadShape(num_seqs=4, min_input=512, max_input=4096, min_output=1, max_output=1, seed=1)
    variants = [
        ("fa,fi bf16 KV (FA3)", dict(attention_backend="fa,fi")),
        ("fi bf16 KV (FA2)", dict(attention_backend="fi")),
        ("auto FP8 KV (FA2)", dict(kv_cache_dtype="fp8_e4m3")),
    ]
    print(HEADER, flush=True)
    for name, settings in variants:
        r = _pass({**SETTINGS, **extra, **settings}, shape, warmup)
        print(_row(name, r) + f"  prefill {r['total_tps']:.0f} tok/s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("parts", nargs="*", help="workload (default) and/or prefill")
    parser.add_argument("--rounds", type=int, default=1, help="auto / fp8_e4m3 pairs of passes")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--quantization", default=None, help="fp8: FP8 weights too (the other goal's path)")
    args = parser.parse_args()
    parts = args.parts or ["workload"]
    if set(parts) - {"workload", "prefill"}:
        parser.error(f"parts={parts}: name workload and/or prefill")
    extra = {} if args.quantization is None else {"quantization": args.quantization}
    if "workload" in parts:
        workload(args.rounds, args.num_seqs, extra)
    if "prefill" in parts:
        prefill(extra)


if __name__ == "__main__":
    main()
