"""FP8 projections on the GPU (`minisgl.kernels.fp8_gemm`) against bf16 cuBLAS, at Qwen3-8B's shapes.

    python -m perf.gpu.fp8_gemm [--rows 1 2 4 ...] [--shapes qkv o ...] [--sweep] [--no-numerics]

Each figure is device time per call in microseconds, measured inside a CUDA graph of calls on distinct
weight copies (at least 256 MB of FP8 weights per shape, so that they come from HBM, not from the
60 MB L2, as in a decode step). Columns, per shape and row count M:

- `bf16`: F.linear on the bf16 weight (cuBLAS);
- `gemv`: the FP8 GEMV (M <= 16; it quantizes the activations itself);
- `tri:BMxBN`: the Triton block-scaled GEMM in each configuration of `GEMM_CONFIGS`, `quantize_rows`
  included;
- `smm`: `torch._scaled_mm` with 1x128 / 128x128 scales, `quantize_rows` included (`n/a` where this
  torch or GPU refuses it: then the op runs the Triton GEMM);
- `quant`: `quantize_rows` alone;
- `op`: what `torch.ops.minisgl.fp8_linear` picks at this M with the module's settings;
- `best`: the fastest FP8 path and bf16's time over its time (above 1: FP8 is faster).

With numerics on (the default), `err` columns: the largest |y - emulation| over max |emulation| of each
FP8 path (the emulation `minisgl.kernels.fp8.fp8_linear` in float32 on the same quantized weight; bf16
outputs). `--sweep` also times the GEMV's configurations (output rows per program, warps) per shape.
The summary prints, per M, the fastest FP8 path over the four shapes together and its ratio to bf16,
and the settings (`GEMV_MAX_ROWS`, `GEMM_CONFIGS`, `GEMM_BACKEND`) those figures suggest. A plain script,
not a test; about a minute and a half on an H200, most of it compiling the GEMV (one kernel per K and
power-of-two M).
"""

from __future__ import annotations

import argparse
import itertools
import time

import torch
import torch.nn.functional as F

from minisgl.kernels import fp8_gemm as G
from minisgl.kernels.fp8 import fp8_linear, quantize_blocks
from perf.gpu.timing import graph_us

# (name, N, K): Qwen3-8B's projections (QKV, O, gate/up, down)
SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 24576, 4096), ("down", 4096, 12288)]
ROWS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
MIN_BYTES = 256 * 2**20  # of FP8 weights per shape: the copies overflow L2 several times
BLOCK = (128, 128)


def copies_for(n: int, k: int) -> int:
    return max(2, -(-MIN_BYTES // (n * k)))


def timed(fn, copies: int) -> float:
    """us per call of fn(i) over `copies` distinct weights, in one CUDA graph."""
    return graph_us(lambda: [fn(i) for i in range(copies)], reps=10) / copies


def bench_rows(name, m, x, bf16, qs, ss, copies, fp8_names, numerics) -> dict[str, float]:
    """Times every path at x's row count m; prints the table's line; returns the FP8 paths' times and
    bf16's."""
    configs = {f"tri:{c[0]}x{c[1]}": c for c in G.GEMM_CONFIGS}
    runs = {"bf16": lambda i: F.linear(x, bf16[i])}
    if m <= G.GEMV_ROWS_LIMIT:
        runs["gemv"] = lambda i: G.fp8_gemv(x, qs[i], ss[i], BLOCK)
    for label, config in configs.items():
        runs[label] = lambda i, c=config: G.fp8_gemm_triton(x, qs[i], ss[i], BLOCK, config=c)
    xq, xs = G.quantize_rows(x)
    if G.scaled_mm_layout(xq, xs, qs[0], ss[0], None, x.dtype) is not None:
        runs["smm"] = lambda i: G.fp8_gemm_scaled_mm(x, qs[i], ss[i])
    runs["quant"] = lambda i: G.quantize_rows(x)
    runs["op"] = lambda i: torch.ops.minisgl.fp8_linear(x, qs[i], ss[i], None, *BLOCK, 128)
    us = {label: timed(fn, copies) for label, fn in runs.items()}
    fp8 = {label: us[label] for label in fp8_names if label in us}
    fastest = min(fp8, key=fp8.get)
    line = f"{name:>8} {m:>4} {us['bf16']:>7.1f} "
    line += " ".join(f"{us[label]:>11.1f}" if label in us else f"{'n/a':>11}" for label in fp8_names)
    best = f"{fastest} {us['bf16'] / fp8[fastest]:.2f}x"
    line += f" {us['quant']:>6.1f} {us['op']:>11.1f} {best:>18}"
    if numerics:
        want = fp8_linear(x.float(), qs[0], ss[0], BLOCK, 128)
        scale = want.abs().max()
        errs = []
        for label in fp8_names:
            if label in runs:
                got = runs[label](0).float()
                errs.append(f"{((got - want).abs().max() / scale).item():>13.2e}")
            else:
                errs.append(f"{'n/a':>13}")
        line += " " + " ".join(errs)
    print(line, flush=True)
    return {**fp8, "bf16": us["bf16"]}


def sweep_gemv(name, m, x, qs, ss, copies) -> None:
    """Times the GEMV's configurations (output rows per program, warps, columns a step) at x's row count
    m, on activations quantized once (as the fused quantizers hand them over)."""
    out = torch.empty(m, qs[0].shape[0], dtype=torch.bfloat16, device=x.device)
    quantized = G.quantize_rows(x)
    results = []
    for rows_per_program, warps, block_k in itertools.product((1, 2, 4, 8), (4, 8), (256, 512, 1024)):
        try:
            t = timed(
                lambda i, c=(rows_per_program, warps), b=block_k: G.gemv_launch(
                    x, qs[i], ss[i], BLOCK, None, out, *c, quantized=quantized, block_k=b
                ),
                copies,
            )
        except Exception as e:  # a configuration Triton rejects (resources)
            print(f"  {name} M={m} {rows_per_program},{warps},{block_k}: {type(e).__name__}")
            continue
        results.append((t, rows_per_program, warps, block_k))
    results.sort()
    default = G.gemv_config(m, qs[0].shape[0])
    gb = qs[0].numel() / 1e3
    best = ", ".join(f"{t:.1f} {gb / t:.0f} GB/s ({r},{w},{b})" for t, r, w, b in results[:5])
    print(
        f"  gemv sweep {name} M={m} (us, rows per program, warps, block_k; now {default}): {best}", flush=True
    )


def bench_shape(name, n, k, args, fp8_names, totals, dev: str = "cuda") -> None:
    copies = copies_for(n, k)
    qs, ss, bf16 = [], [], []
    for _ in range(copies):
        w = torch.randn(n, k, device=dev) * 0.02
        q, s = quantize_blocks(w, BLOCK)
        qs.append(q)
        ss.append(s)
        bf16.append(w.to(torch.bfloat16))
    for m in args.rows:
        x = torch.randn(m, k, device=dev).to(torch.bfloat16)
        for label, t in bench_rows(name, m, x, bf16, qs, ss, copies, fp8_names, not args.no_numerics).items():
            totals[m][label] = totals[m].get(label, 0.0) + t
    if args.sweep:
        for m in [r for r in args.rows if r <= G.GEMV_ROWS_LIMIT]:
            sweep_gemv(name, m, torch.randn(m, k, device=dev).to(torch.bfloat16), qs, ss, copies)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=ROWS)
    parser.add_argument("--shapes", nargs="+", default=[s[0] for s in SHAPES])
    parser.add_argument("--sweep", action="store_true", help="time the GEMV's configurations too")
    parser.add_argument("--no-numerics", action="store_true")
    args = parser.parse_args()
    start = time.time()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}; GEMV_MAX_ROWS {G.GEMV_MAX_ROWS}, ")
    print(f"GEMM_BACKEND {G.GEMM_BACKEND}, GEMM_CONFIGS {G.GEMM_CONFIGS}")
    fp8_names = ["gemv", *(f"tri:{c[0]}x{c[1]}" for c in G.GEMM_CONFIGS), "smm"]
    header = f"{'shape':>8} {'M':>4} {'bf16':>7} " + " ".join(f"{n:>11}" for n in fp8_names)
    header += f" {'quant':>6} {'op':>11} {'best':>18}"
    if not args.no_numerics:
        header += " " + " ".join(f"{'err ' + n:>13}" for n in fp8_names)
    print(header)
    totals: dict[int, dict[str, float]] = {m: {} for m in args.rows}
    for name, n, k in SHAPES:
        if name in args.shapes:
            bench_shape(name, n, k, args, fp8_names, totals)
            torch.cuda.empty_cache()
    print("\nsum over the shapes, per M: the fastest FP8 path and bf16 / FP8 (a path missing at a shape")
    print("is left out of the sums: compare paths timed at every shape)")
    for m, sums in totals.items():
        fp8 = {label: t for label, t in sums.items() if label != "bf16"}
        if not fp8:
            continue
        fastest = min(fp8, key=fp8.get)
        ranked = ", ".join(f"{label} {t:.1f}" for label, t in sorted(fp8.items(), key=lambda kv: kv[1]))
        print(
            f"M={m:>4}: bf16 {sums['bf16']:.1f} us, best {fastest} {sums['bf16'] / fp8[fastest]:.2f}x ({ranked})"
        )
    print(f"\n{time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
