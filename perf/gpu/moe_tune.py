"""Tunes the launch configurations of the few-token MoE kernels (`minisgl.kernels.moe_gemv`) on this
GPU and writes them to `minisgl/kernels/moe_gemv_configs.json`, which the kernels read at import.

    python -m perf.gpu.moe_tune [--experts 128] [--inter 768] [--hidden 2048] [--top-k 8]
                                [--tokens 1 2 4 8 16] [--budget-s 300] [--iters 20] [--grouped]

For each token count it sweeps the gate/up kernel's (rows a program, row block, warps) with the down
kernel at its default, then the down kernel's with the best gate/up one, each candidate timed as a CUDA
graph of 8 layers (each with its own weights, so none finds its experts in L2). `--grouped` tunes the
grouped Triton GEMMs of `minisgl.kernels.moe_gemm` instead (block of rows, of columns, of the reduction,
warps, pipeline stages; default token counts 16 to 4,096), into the file's "grouped" table. Resumable: a shape and
token count already in the file is skipped, and the file is written after each one, so a run cut short
by `--budget-s` (checked between candidates) or by the machine's time limit keeps what it finished; run
it again to go on. `--redo` tunes the listed token counts again. Plain script, not a test.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time

import torch

from minisgl.kernels import moe_gemm as G
from minisgl.kernels import moe_gemv as K
from minisgl.moe import select_experts
from perf.gpu.timing import capture, median_ms

LAYERS = 8
# the few-token kernels' sweep: [block_n, block_k, warps]
GEMV = [[n, k, w] for n in (2, 4, 8, 16) for k in (256, 512, 1024) for w in (4, 8)]
# the grouped GEMMs' sweep: [block_m, block_n, block_k, warps, stages]; small blocks of rows for a few
# tokens a expert, large ones for many
GROUPED_FEW = [
    [m, n, k, 4, s] for m in (16, 32) for n in (32, 64, 128) for k in (64, 128, 256) for s in (3, 4)
]
GROUPED_MANY = [
    [m, n, k, w, s] for m in (64, 128) for n in (64, 128) for k in (64, 128) for w in (4, 8) for s in (3, 4)
]


def candidates(width: int, grouped: bool, tokens: int) -> list[list[int]]:
    if grouped:
        return GROUPED_FEW if tokens <= 64 else GROUPED_MANY
    return [c for c in GEMV if c[1] <= max(256, width)]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--inter", type=int, default=768, help="each expert's intermediate size (per rank)")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--tokens", type=int, nargs="+", help="default: 1 2 4 8 16 (--grouped: 16 to 4096)")
    parser.add_argument("--budget-s", type=float, default=300.0)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--redo", action="store_true", help="tune token counts already in the file again")
    parser.add_argument("--grouped", action="store_true", help="tune the grouped GEMMs (moe_gemm)")
    args = parser.parse_args()
    tokens_list = args.tokens or ([16, 32, 64, 256, 1024, 4096] if args.grouped else [1, 2, 4, 8, 16])
    table_name = "grouped" if args.grouped else "gemv"
    if not torch.cuda.is_available():
        sys.exit("perf.gpu.moe_tune needs a CUDA GPU")
    deadline = time.monotonic() + args.budget_s
    configs = json.loads(K.CONFIG_FILE.read_text()) if K.CONFIG_FILE.exists() else {}
    table = configs.setdefault(table_name, {})
    e, inter, hidden, top_k = args.experts, args.inter, args.hidden, args.top_k
    torch.manual_seed(0)
    device = torch.device("cuda")
    w13s = [
        (torch.randn(e, 2 * inter, hidden, device=device) / hidden**0.5).bfloat16() for _ in range(LAYERS)
    ]
    w2s = [(torch.randn(e, hidden, inter, device=device) / inter**0.5).bfloat16() for _ in range(LAYERS)]

    def run(x, logits, config):
        if args.grouped:
            weights, ids = select_experts(logits, top_k, True, x.dtype)
        for w13, w2 in zip(w13s, w2s, strict=True):
            if args.grouped:
                G.moe_gemm(x, weights, ids, w13, w2, config=config)
            else:
                K.moe_gemv(x, logits, w13, w2, top_k, True, config=config)

    def us(x, logits, config) -> float:
        try:
            graph, _ = capture(functools.partial(run, x, logits, config))
            return median_ms(graph.replay, args.iters) * 1e3 / LAYERS
        except Exception as exc:  # a configuration the compiler refuses (e.g. out of shared memory)
            print(f"  {config}: {type(exc).__name__}")
            return float("inf")

    for tokens in tokens_list:
        key = f"{e},{2 * inter},{hidden},{tokens}"
        if key in table and not args.redo:
            print(f"{table_name} {key}: done before, {table[key]}")
            continue
        x = torch.randn(tokens, hidden, device=device).bfloat16()
        logits = torch.randn(tokens, e, device=device).bfloat16()
        config_of = G.moe_gemm_config if args.grouped else K.moe_gemv_config
        best = {part: config_of(e, inter, hidden, tokens)[part] for part in ("gate_up", "down")}
        start = us(x, logits, best)
        timed = start
        for part, width in (("gate_up", hidden), ("down", inter)):
            for candidate in candidates(width, args.grouped, tokens):
                if time.monotonic() > deadline:
                    sys.exit(f"budget spent during {key}: {K.CONFIG_FILE} keeps what was finished; run again")
                t = us(x, logits, {**best, part: candidate})
                if t < timed:
                    timed, best = t, {**best, part: candidate}
        table[key] = {**best, "us": round(timed, 2)}
        K.CONFIG_FILE.write_text(json.dumps(configs, indent=1, sort_keys=True) + "\n")
        print(f"{table_name} {key}: {start:.1f} -> {timed:.1f} us a layer, {best}")


if __name__ == "__main__":
    main()
