"""Linear layers of 8 to 256 rows on the GPU: cuBLAS (F.linear), a tiled Triton matmul swept over its
configurations, and what torch.compile's max-autotune picks, at Qwen3-0.6B's shapes.

    python -m perf.gpu.gemm [--rows 8 16 32 64 128 256] [--out FILE.json] [--no-autotune | --autotune-rows M ...]

At these row counts a GEMM should cost about one read of its weights. Each figure is device time per
call in microseconds, measured inside a CUDA graph of 28 calls on 28 distinct weight copies (as in a
decode step: the weights come from HBM, not from L2; the LM head has one copy and one call). Columns:
`floor` one read of the weights at 4.8 TB/s (H200 HBM3e peak; the activations and the output are not
counted); `cublas` F.linear; `triton` the best of about 15 to 32 configurations of the kernel below
(`config` BLOCK_MxBLOCK_NxBLOCK_K, warps, stages; its result is checked against F.linear);
`autotune` torch.compile(F.linear, mode="max-autotune-no-cudagraphs") compiled for that shape
(`choice` the kernel inductor chose, read from its generated code: cublas, triton with its tiles,
decompose_k, or ?); `best` the fastest, its weight bandwidth (GB/s) and its time over the floor.
The summary gives each shape's winner against cuBLAS, and one decode step's GEMMs (28 layers x 4
projections + the LM head) per candidate. `--no-autotune` skips the (slow) compiles; `--autotune-rows`
runs them at those row counts only. A plain script, not a test.

`check_triton` checks the kernel alone; on a CPU it runs under Triton's interpreter:
    TRITON_INTERPRET=1 python -c "from perf.gpu.gemm import check_triton; check_triton(5, 70, 130, device='cpu')"
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
from typing import NamedTuple

import torch
import torch.nn.functional as F

from perf.gpu.gemv import LAYERS, LM_HEAD, SHAPES
from perf.gpu.timing import graph_us

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the script needs CUDA and Triton to run
    triton = None

HBM_BYTES_PER_S = 4.8e12  # H200 HBM3e peak
SMEM_BYTES = 227 * 1024  # shared memory one H100/H200 block may use
MAX_REL_ERR = 2e-2
CANDIDATES = ("cublas", "triton", "autotune")


class Config(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3

    def __str__(self) -> str:
        return f"{self.block_m}x{self.block_n}x{self.block_k} w{self.num_warps} s{self.num_stages}"


if triton is not None:

    @triton.jit
    def _matmul_kernel(
        x_ptr,
        w_ptr,
        y_ptr,
        M,
        N,
        K,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """y (M, N) = x (M, K) @ w (N, K)^T, all row-major; one (BLOCK_M, BLOCK_N) tile per program."""
        pid = tl.program_id(0)
        num_m = tl.cdiv(M, BLOCK_M)
        # the row blocks of one weight tile run next to each other, so its reads past the first hit L2
        pid_m = pid % num_m
        pid_n = pid // num_m
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + rows[:, None].to(tl.int64) * K + ks[None, :]
        w_ptrs = w_ptr + cols[:, None].to(tl.int64) * K + ks[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = (k0 + ks) < K
            x = tl.load(x_ptrs, mask=(rows[:, None] < M) & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=(cols[:, None] < N) & k_mask[None, :], other=0.0)
            acc = tl.dot(x, tl.trans(w), acc)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        y_ptrs = y_ptr + rows[:, None].to(tl.int64) * N + cols[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


def triton_linear(x: torch.Tensor, w: torch.Tensor, cfg: Config) -> torch.Tensor:
    """x (M, K) @ w (N, K)^T on the Triton kernel with configuration `cfg`."""
    assert x.is_contiguous() and w.is_contiguous() and x.shape[1] == w.shape[1]
    (m, k), n = x.shape, w.shape[0]
    y = x.new_empty(m, n)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _matmul_kernel[grid](
        x,
        w,
        y,
        m,
        n,
        k,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return y


def triton_configs(m: int) -> list[Config]:
    """The configurations swept for `m` rows: the two largest BLOCK_M that `m` fills (tl.dot needs 16),
    BLOCK_K paired with a few stage counts, 8 warps only on the largest tiles, and nothing whose
    pipelined tiles overflow shared memory (about 15 to 32 configurations)."""
    block_ms = [bm for bm in (16, 32, 64) if bm <= max(16, m)][-2:]
    k_stages = ((64, 4), (64, 5), (128, 3), (128, 4), (256, 3))
    configs = []
    for bm, bn, (bk, stages) in itertools.product(block_ms, (32, 64, 128), k_stages):
        if stages * (bm + bn) * bk * 2 > SMEM_BYTES:
            continue
        for warps in (4, 8) if bm * bn >= 64 * 128 else (4,):
            configs.append(Config(bm, bn, bk, warps, stages))
    return configs


def check_triton(
    m: int,
    n: int,
    k: int,
    cfg: Config | tuple = (16, 32, 64),
    device="cuda",
    dtype=torch.float32,
    verbose: bool = True,
) -> float:
    """Runs the kernel on random (m, k) and (n, k) inputs, compares it with F.linear in float32 and
    raises if the largest difference exceeds 2e-2 of the output's largest magnitude. Returns that
    relative difference. On a CPU, run under TRITON_INTERPRET=1 in float32 or float16 (the interpreter's
    tl.dot multiplies bfloat16's raw bits, so bfloat16 fails there but not on the GPU)."""
    cfg = Config(*cfg)
    gen = torch.Generator(device=device).manual_seed(m * 1_000_003 + n * 1009 + k)
    x = torch.randn(m, k, generator=gen, device=device).to(dtype)
    w = (torch.randn(n, k, generator=gen, device=device) * 0.02).to(dtype)
    ref = F.linear(x.float(), w.float())
    err = ((triton_linear(x, w, cfg).float() - ref).abs().max() / ref.abs().max()).item()
    if verbose:
        print(f"check_triton M={m} N={n} K={k} {cfg} {dtype}: max rel err {err:.2e}")
    if not err < MAX_REL_ERR:
        raise RuntimeError(f"Triton matmul is wrong for M={m} N={n} K={k} {cfg}: max rel err {err:.2e}")
    return err


def inductor_choice(code: str) -> str:
    """The kernel inductor's generated code runs for the matmul, read off its text."""
    if "bmm" in code:  # the decompose-K choice: a batched matmul over K slices and a sum
        return "decompose_k"
    if "triton_tem_" in code:
        meta = {
            key: re.search(pattern, code)
            for key, pattern in (
                ("m", r"BLOCK_M\s*:\s*tl\.constexpr\s*=\s*(\d+)"),
                ("n", r"BLOCK_N\s*:\s*tl\.constexpr\s*=\s*(\d+)"),
                ("k", r"BLOCK_K\s*:\s*tl\.constexpr\s*=\s*(\d+)"),
                ("w", r"num_warps=(\d+)"),
                ("s", r"num_stages=(\d+)"),
            )
        }
        g = {key: found.group(1) if found else "?" for key, found in meta.items()}
        tma = " tma" if "tensor_descriptor" in code else ""
        return f"triton{tma} {g['m']}x{g['n']}x{g['k']} w{g['w']} s{g['s']}"
    if re.search(r"extern_kernels\.(mm|addmm)\(", code):
        return "cublas"
    return "?"


def compile_autotuned(x: torch.Tensor, w: torch.Tensor):
    """F.linear compiled by max-autotune for x's and w's shapes (compiled and run once here), and the
    kernel it chose."""
    torch._dynamo.reset()  # a fresh compile per shape; no recompile limit to run into
    fn = torch.compile(lambda x, w: F.linear(x, w), mode="max-autotune-no-cudagraphs", dynamic=False)
    try:
        from torch._inductor.utils import run_and_get_code
    except ImportError:
        fn(x, w)
        return fn, "?"
    _, codes = run_and_get_code(fn, x, w)
    return fn, inductor_choice("\n".join(codes))


def measure(name: str, n: int, k: int, m: int, ws: list[torch.Tensor], no_autotune: bool) -> dict:
    x = torch.randn(m, k, dtype=ws[0].dtype, device=ws[0].device)
    per_call = len(ws)
    row = dict(
        shape=name, N=n, K=k, M=m, weight_mb=n * k * 2 / 1e6, floor_us=n * k * 2 / HBM_BYTES_PER_S * 1e6
    )
    times = {"cublas": graph_us(lambda: [F.linear(x, w) for w in ws]) / per_call}
    sweep = []
    for cfg in triton_configs(m):
        try:
            triton_linear(x, ws[0], cfg)  # compiles; a configuration Triton rejects fails here
            sweep.append(
                (graph_us(lambda cfg=cfg: [triton_linear(x, w, cfg) for w in ws], reps=10) / per_call, cfg)
            )
        except Exception as e:
            print(f"  triton {cfg}: {type(e).__name__}")
    sweep.sort()
    best_cfg = sweep[0][1]
    row["triton_err"] = check_triton(m, n, k, best_cfg, device=x.device, dtype=x.dtype, verbose=False)
    times["triton"] = graph_us(lambda: [triton_linear(x, w, best_cfg) for w in ws]) / per_call
    row["triton_config"] = str(best_cfg)
    row["triton_sweep"] = [[str(cfg), t] for t, cfg in sweep]
    row["autotune_choice"] = "skipped"
    if not no_autotune:
        try:
            fn, row["autotune_choice"] = compile_autotuned(x, ws[0])
            times["autotune"] = graph_us(lambda: [fn(x, w) for w in ws]) / per_call
        except Exception as e:
            print(f"  autotune failed: {type(e).__name__}: {str(e)[:200]}")
            row["autotune_choice"] = "failed"
    for c in CANDIDATES:
        row[f"{c}_us"] = times.get(c)
    row["best"] = min(times, key=times.get)
    row["best_us"] = times[row["best"]]
    row["best_gbps"] = n * k * 2 / row["best_us"] / 1e3
    row["best_over_floor"] = row["best_us"] / row["floor_us"]
    return row


def fmt(t: float | None, width: int = 9) -> str:
    return f"{t:>{width}.2f}" if t is not None else f"{'-':>{width}}"


def step_totals(rows: list[dict], ms: list[int]) -> list[dict]:
    """One decode step's GEMMs at each row count: 28 x (the 4 layer shapes) + the LM head."""
    totals = []
    for m in ms:
        at_m = {r["shape"]: r for r in rows if r["M"] == m}
        count = {name: LAYERS for name, _, _ in SHAPES} | {LM_HEAD[0]: 1}
        total = {"M": m}
        for col in ("floor", *CANDIDATES, "best"):
            ts = [at_m[s][f"{col}_us"] for s in count]
            total[f"{col}_us"] = None if None in ts else sum(c * t for c, t in zip(count.values(), ts))
        totals.append(total)
    return totals


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256])
    parser.add_argument("--out", help="write every figure to this JSON file")
    parser.add_argument("--no-autotune", action="store_true", help="skip torch.compile max-autotune")
    parser.add_argument("--autotune-rows", type=int, nargs="+", help="max-autotune at these row counts only")
    args = parser.parse_args()
    if triton is None or not torch.cuda.is_available():
        raise SystemExit("perf.gpu.gemm needs a CUDA GPU and Triton")
    torch.manual_seed(0)
    dev, dt = torch.device("cuda"), torch.bfloat16
    rows = []
    for name, n, k in [*SHAPES, LM_HEAD]:
        copies = 1 if name == LM_HEAD[0] else LAYERS
        ws = [torch.randn(n, k, dtype=dt, device=dev) * 0.02 for _ in range(copies)]
        print(f"\n{name}: N={n} K={k}, {n * k * 2 / 1e6:.1f} MB of weights, {copies} copies")
        print(
            f"{'M':>4} {'floor':>7} {'cublas':>9} {'triton':>9} {'config':<20} {'autotune':>9} "
            f"{'choice':<24} {'best':>8} {'GB/s':>6} {'x floor':>7}"
        )
        for m in args.rows:
            skip = args.no_autotune or (args.autotune_rows is not None and m not in args.autotune_rows)
            r = measure(name, n, k, m, ws, skip)
            rows.append(r)
            print(
                f"{m:>4} {r['floor_us']:>7.2f} {fmt(r['cublas_us'])} {fmt(r['triton_us'])} "
                f"{r['triton_config']:<20} {fmt(r['autotune_us'])} {r['autotune_choice']:<24} "
                f"{r['best']:>8} {r['best_gbps']:>6.0f} {r['best_over_floor']:>7.2f}",
                flush=True,
            )
        del ws
        torch.cuda.empty_cache()

    print("\nwinner per shape and row count (cublas/best: cuBLAS's time over the winner's)")
    print(f"{'shape':>8} {'M':>4} {'winner':>8} {'us':>9} {'cublas':>9} {'cublas/best':>11}")
    for r in rows:
        print(
            f"{r['shape']:>8} {r['M']:>4} {r['best']:>8} {r['best_us']:>9.2f} {r['cublas_us']:>9.2f} "
            f"{r['cublas_us'] / r['best_us']:>11.2f}"
        )
    totals = step_totals(rows, args.rows)
    print("\none decode step's GEMMs (28 x 4 layer GEMMs + LM head), us; best: the fastest per shape")
    print(f"{'M':>4} {'floor':>9} {'cublas':>9} {'triton':>9} {'autotune':>9} {'best':>9}")
    for t in totals:
        print(f"{t['M']:>4} " + " ".join(fmt(t[f"{c}_us"]) for c in ("floor", *CANDIDATES, "best")))
    if args.out:
        meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, rows=rows, step_totals=totals), f, indent=1)
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
