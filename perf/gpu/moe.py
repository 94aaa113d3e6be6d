"""One MoE layer forward at Qwen3-30B-A3B's shapes (128 experts, top-8, hidden 2048, expert intermediate
768, bf16) on the GPU: the `fused` backend (eager and replayed from a CUDA graph) against the `torch`
backend, for several token counts. Plain script, not a test:

    python -m perf.gpu.moe [--tokens 1 16 64 256 1024 4096] [--iters 20] [--skew 0]

Each figure is the median of `--iters` runs timed with CUDA events after warm-up. `--skew` > 0 biases
the router towards low expert ids (a log-normal scale per expert), as real routing is never uniform.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from minisgl.moe import FusedMoeBackend, TorchMoeBackend

EXPERTS, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768


def time_ms(fn, iters: int, warmup: int = 3) -> float:
    """Median milliseconds of `fn()` on the current stream, each call between two CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graphed(fn):
    """`fn` captured in a CUDA graph (warmed up on a side stream); returns the replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256, 1024, 4096])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--skew", type=float, default=0.0, help="router bias towards some experts (0: none)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("perf.gpu.moe needs a CUDA GPU")

    torch.manual_seed(0)
    device = torch.device("cuda")
    w13 = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, device=device) / HIDDEN**0.5).bfloat16()
    w2 = (torch.randn(EXPERTS, HIDDEN, INTER, device=device) / INTER**0.5).bfloat16()
    bias = torch.randn(EXPERTS, device=device) * args.skew
    fused, ref = FusedMoeBackend(), TorchMoeBackend()
    print(
        f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}: one MoE layer, E={EXPERTS}, "
        f"top_k={TOP_K}, H={HIDDEN}, I={INTER}, bf16, median of {args.iters} (ms)"
    )
    header = f"{'T':>6} {'torch':>10} {'fused':>10} {'fused+graph':>12} {'speedup':>8} {'TFLOP/s':>8} {'rel err':>9}"
    print(header)
    print("-" * len(header))
    for tokens in args.tokens:
        x = torch.randn(tokens, HIDDEN, device=device).bfloat16()
        router_logits = (torch.randn(tokens, EXPERTS, device=device) + bias).bfloat16()

        def run_fused(x=x, router_logits=router_logits):
            return fused.forward(x, router_logits, w13, w2, TOP_K, True)

        def run_ref(x=x, router_logits=router_logits):
            return ref.forward(x, router_logits, w13, w2, TOP_K, True)

        err = ((run_fused().float() - run_ref().float()).norm() / run_ref().float().norm()).item()
        t_ref = time_ms(run_ref, args.iters)
        t_fused = time_ms(run_fused, args.iters)
        t_graph = time_ms(graphed(run_fused), args.iters)
        best = min(t_fused, t_graph)
        flops = 6 * tokens * TOP_K * HIDDEN * INTER  # gate/up (2 * H * 2I) + down (2 * I * H) per pair
        print(
            f"{tokens:>6} {t_ref:>10.3f} {t_fused:>10.3f} {t_graph:>12.3f} {t_ref / best:>7.1f}x "
            f"{flops / best / 1e9:>8.1f} {err:>9.1e}"
        )


if __name__ == "__main__":
    main()
