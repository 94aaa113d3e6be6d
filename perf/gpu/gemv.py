"""Linear layers of a decode step on the GPU: cuBLAS (F.linear) against the Triton GEMV kernel of
`minisgl.kernels.gemv`, at Qwen3-0.6B's shapes.

    python -m perf.gpu.gemv [--sweep] [--rows 1 2 4 8 16] [--model 0.6b|8b|30b]

Each figure is device time per call, measured inside a CUDA graph of 28 calls on 28 distinct weight
copies (as in a decode step: the weights come from HBM, not from L2). `--sweep` also times every kernel
configuration (rows per program, K block, warps) per shape. The last table: the 112 layer GEMMs and
the LM head of one decode step, chained as in the model. `--rows`: instead, each projection at each
row count as the ops of `minisgl.kernels.linear` run it past the GEMV's row limit (the row kernel for
the add + RMSNorm before QKV and gate/up or the SiLU-and-multiply before down, then cuBLAS) against the
GEMV kernel with the prologue fused, and the LM head (plain); with `--sweep`, the kernel's fastest
configurations at each row count. Its wins set `GEMV_ROWS_BY_SHAPE`. `--model` (with `--rows`): the
projections of Qwen3-8B or Qwen3-30B-A3B (its attention and the MoE router, whose GEMV carries the
norm) instead of 0.6B's; the sweep's one-row winners set `GEMV_CONFIGS`. A plain script, not a test.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

from minisgl.kernels import gemv as G
from minisgl.kernels import linear as L
from perf.gpu.timing import graph_us

LAYERS = 28
# (name, N, K): Qwen3-0.6B's projections (QKV, O, gate/up, down) and the tied LM head
SHAPES = [("qkv", 4096, 1024), ("o", 1024, 2048), ("gate_up", 6144, 1024), ("down", 1024, 3072)]
LM_HEAD = ("lm_head", 151936, 1024)
# `--model`: (projections, LM head) of the larger presets
MODELS = {
    "0.6b": (SHAPES, LM_HEAD),
    "8b": ([("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 24576, 4096), ("down", 4096, 12288)], None),
    "30b": ([("qkv", 5120, 2048), ("o", 2048, 4096), ("router", 128, 2048)], None),
    # the one-row configuration rule's survey (with --sweep): projections of other sizes, "kind:model"
    "survey": (
        [
            ("down:0.6b", 1024, 3072), ("down:1.7b", 2048, 6144), ("down:4b", 2560, 9728),
            ("down:8b", 4096, 12288), ("down:14b", 5120, 13824), ("qkv:4b", 6144, 2560),
            ("gate_up:4b", 19456, 2560), ("qkv:14b", 7168, 5120), ("gate_up:1.7b", 12288, 2048),
            ("o:4b", 2560, 4096), ("o:14b", 5120, 5120), ("o:1.7b", 2048, 2048),
        ],
        None,
    ),
}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument(
        "--rows", type=int, nargs="+", help="time these row counts (fused ops against cuBLAS)"
    )
    parser.add_argument("--model", choices=sorted(MODELS), default="0.6b", help="the shapes (with --rows)")
    args = parser.parse_args()
    if args.rows:
        shapes, lm_head = MODELS[args.model]
        rows_table(args.rows, sweep=args.sweep, shapes=[*shapes, *([lm_head] if lm_head else [])])
        return
    if args.model != "0.6b":
        parser.error("--model needs --rows")
    torch.manual_seed(0)
    dev, dt = torch.device("cuda"), torch.bfloat16
    x_by_k = {k: torch.randn(1, k, dtype=dt, device=dev) for k in (1024, 2048, 3072)}
    weights = {
        name: [torch.randn(n, k, dtype=dt, device=dev) * 0.02 for _ in range(LAYERS)] for name, n, k in SHAPES
    }
    weights["lm_head"] = [torch.randn(LM_HEAD[1], LM_HEAD[2], dtype=dt, device=dev) * 0.02]
    print(
        f"{'shape':>8} {'N':>7} {'K':>5} {'MB':>6} {'cuBLAS us':>10} {'GB/s':>6} {'gemv us':>8} {'GB/s':>6} "
        f"{'max rel err':>11}"
    )
    for name, n, k in [*SHAPES, LM_HEAD]:
        ws, x = weights[name], x_by_k[k]
        mb = n * k * 2 / 1e6
        t_ref = graph_us(lambda x=x, ws=ws: [F.linear(x, w) for w in ws]) / len(ws)
        t_gemv = graph_us(lambda x=x, ws=ws: [G.gemv(x, w) for w in ws]) / len(ws)
        ref = F.linear(x.float(), ws[0].float())
        err = ((G.gemv(x, ws[0]).float() - ref).norm() / ref.norm()).item()
        print(
            f"{name:>8} {n:>7} {k:>5} {mb:>6.1f} {t_ref:>10.2f} {mb * 1e3 / t_ref:>6.0f} {t_gemv:>8.2f} "
            f"{mb * 1e3 / t_gemv:>6.0f} {err:>11.2e}",
            flush=True,
        )
    if args.sweep:
        print("\nsweep: us per call (block_n, block_k, warps)")
        for name, n, k in [*SHAPES, LM_HEAD]:
            ws, x = weights[name], x_by_k[k]
            out = torch.empty(1, n, dtype=dt, device=dev)
            results = []
            for bn, bk, nw in itertools.product((1, 2, 4, 8, 16), (256, 512, 1024), (4, 8)):
                if bk > triton_next_pow2(k):
                    continue
                try:
                    t = graph_us(
                        lambda x=x, ws=ws, out=out, cfg=(bn, bk, nw): [
                            G.gemv_launch(x, w, None, out, *cfg) for w in ws
                        ],
                        reps=10,
                    )
                except Exception as e:  # a configuration Triton rejects
                    print(f"  {name} {bn},{bk},{nw}: {type(e).__name__}")
                    continue
                results.append((t / len(ws), bn, bk, nw))
            results.sort()
            best = ", ".join(f"{t:.2f} ({bn},{bk},{nw})" for t, bn, bk, nw in results[:6])
            print(f"{name:>8}: {best}", flush=True)
    # a decode step's GEMMs in model order
    x1 = x_by_k[1024]

    def chain(fn):
        def run():
            h = x1
            for i in range(LAYERS):
                fn(h, weights["qkv"][i])
                a = fn(x_by_k[2048], weights["o"][i])
                g = fn(a, weights["gate_up"][i])
                fn(x_by_k[3072], weights["down"][i])
                h = g[:, :1024].contiguous()
            return fn(h, weights["lm_head"][0])

        return run

    t_ref = graph_us(chain(F.linear))
    t_gemv = graph_us(chain(G.gemv))
    print(f"\nstep GEMMs (112 + LM head): cuBLAS {t_ref:.1f} us, gemv {t_gemv:.1f} us")

    # the same GEMVs, each reading the one before's output (no copies between), with and without
    # programmatic dependent launch (minisgl.kernels.pdl)
    outs = {name: torch.empty(1, n, dtype=dt, device=dev) for name, n, _ in [*SHAPES, LM_HEAD]}

    def dependent_chain(pdl: bool):
        def launch(x, name, i):
            w = weights[name][i]
            G.gemv_launch(
                x,
                w,
                None,
                outs[name],
                G._block_n(w.shape[0]),
                min(1024, triton_next_pow2(w.shape[1])),
                4,
                pdl=pdl,
            )
            return outs[name]

        def run():
            h = x1
            for i in range(LAYERS):
                qkv = launch(h, "qkv", i)
                a = launch(qkv[:, :2048], "o", i)
                g = launch(a, "gate_up", i)
                h = launch(g[:, :3072], "down", i)
            return launch(h, "lm_head", 0)

        return run

    plain, pdl = graph_us(dependent_chain(False)), graph_us(dependent_chain(True))
    print(f"dependent GEMV chain (112 + LM head): plain launches {plain:.1f} us, PDL {pdl:.1f} us")


# the prologue each projection runs in a decode step: QKV and gate/up after the add + RMSNorm, down after
# the SiLU-and-multiply (its input is [gate | up], 2 K wide), O and the LM head plain
PROLOGUES = {
    "qkv": G.ADD_RMS_NORM,
    "o": G.PLAIN,
    "gate_up": G.ADD_RMS_NORM,
    "down": G.SILU_MUL,
    "lm_head": G.PLAIN,
    "router": G.ADD_RMS_NORM,
}


def _row_ops(prologue: int, x, residual, norm_w):
    """(the ops' path past the GEMV's row limit: the row kernel, then cuBLAS; the fused GEMV), each w -> y."""
    if prologue == G.ADD_RMS_NORM:
        return (
            lambda w: F.linear(L.add_rms_norm_rows(x, residual, norm_w, 1e-6)[0], w),
            lambda w: G.add_rms_norm_gemv(x, residual, norm_w, w, None, 1e-6)[0],
        )
    if prologue == G.SILU_MUL:
        return lambda w: F.linear(L.silu_mul_rows(x), w), lambda w: G.silu_mul_gemv(x, w)
    return lambda w: F.linear(x, w), lambda w: G.gemv(x, w)


def rows_table(row_counts: list[int], sweep: bool = False, shapes: list | None = None) -> None:
    """Per projection (`shapes`, 0.6B's by default) and row count: the row kernel + cuBLAS against the
    fused GEMV kernel as the ops configure it (time per call over 28 weight copies, one for the LM head;
    GB/s of the GEMV; rel diff between their outputs). `sweep`: also the kernel's fastest configurations
    (block_n, block_k, warps) at each row count."""
    torch.manual_seed(0)
    dev, dt = torch.device("cuda"), torch.bfloat16
    print(
        f"{'shape':>8} {'rows':>4} {'cuBLAS us':>10} {'GEMV us':>8} {'GB/s':>6} {'ratio':>6} {'rel diff':>9}"
    )
    for name, n, k in shapes or [*SHAPES, LM_HEAD]:
        ws = [
            torch.randn(n, k, dtype=dt, device=dev) * 0.02 for _ in range(1 if name == "lm_head" else LAYERS)
        ]
        for m in row_counts:
            prologue = PROLOGUES[name.split(":")[0]]
            x = torch.randn(m, 2 * k if prologue == G.SILU_MUL else k, dtype=dt, device=dev)
            residual, norm_w = (
                torch.randn(m, k, dtype=dt, device=dev),
                torch.rand(k, dtype=dt, device=dev) + 0.5,
            )
            ops = _row_ops(prologue, x, residual, norm_w)
            t_ref, t_gemv = (graph_us(lambda op=op, ws=ws: [op(w) for w in ws]) / len(ws) for op in ops)
            ref = ops[0](ws[0]).float()
            diff = ((ops[1](ws[0]).float() - ref).norm() / ref.norm()).item()
            gbs = n * k * 2 / t_gemv / 1e3
            print(
                f"{name:>8} {m:>4} {t_ref:>10.2f} {t_gemv:>8.2f} {gbs:>6.0f} {t_gemv / t_ref:>6.2f} {diff:>9.1e}",
                flush=True,
            )
            if sweep:
                print(f"{'':>8} best: {_sweep_rows(prologue, x, residual, norm_w, ws)}", flush=True)


def _sweep_rows(prologue: int, x, residual, norm_w, ws) -> str:
    """The kernel's six fastest configurations (us per call (block_n, block_k, warps)) on rows x."""
    n, k = ws[0].shape
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    args = {}
    if prologue == G.ADD_RMS_NORM:
        residual_out = torch.empty(x.shape[0], k, dtype=x.dtype, device=x.device)
        args = dict(residual=residual, norm_weight=norm_w, residual_out=residual_out, eps=1e-6)
    results = []
    wide = (8, 16) if x.shape[0] == 1 else ()  # (more rows: too many registers)
    for bn, bk, nw in itertools.product((1, 2, 4, *wide), (128, 256, 512, 1024), (4, 8)):
        if bk > triton_next_pow2(k) or k > 32 * bk or bn * bk > 8192:  # (32+ blocks compile slowly)
            continue
        launch = lambda w, cfg=(bn, bk, nw): G.gemv_launch(x, w, None, out, *cfg, prologue=prologue, **args)  # noqa: E731
        try:
            t = graph_us(lambda launch=launch: [launch(w) for w in ws], reps=10)
        except Exception as e:  # a configuration Triton rejects (too many registers, say)
            results.append((float("inf"), f"{bn},{bk},{nw} {type(e).__name__}"))
            continue
        results.append((t / len(ws), f"{bn},{bk},{nw}"))
    results.sort()
    return ", ".join(f"{t:.2f} ({cfg})" for t, cfg in results[:6])


def triton_next_pow2(k: int) -> int:
    return 1 << (k - 1).bit_length()


if __name__ == "__main__":
    main()
