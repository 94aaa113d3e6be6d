"""One MoE layer forward at Qwen3-30B-A3B's shapes (128 experts, top-8, hidden 2048, expert intermediate
768, bf16) on the GPU: the `fused` backend as it dispatches (the few-token kernels of
`minisgl.kernels.moe_gemv`, then the Triton grouped GEMMs of `minisgl.kernels.moe_gemm`), each of
those alone, and `torch._grouped_mm` (the CPU path), all replayed from a CUDA graph of 8 layers (each with its own weights, so none finds its experts in L2; the time of one
layer is reported), against the eager `torch` backend, for several token counts. Plain script, not a test:

    python -m perf.gpu.moe [--tokens 1 2 4 8 16 32 64 256 1024 4096] [--iters 20] [--skew 0]

Each figure is the median of `--iters` runs timed with CUDA events after warm-up; `floor` is the time
to read the touched experts' weights once at the H200's 4.8 TB/s. `--skew` > 0 biases the router
towards some experts (a normal offset per expert's logit), as real routing is never uniform.
"""

from __future__ import annotations

import argparse
import functools
import sys

import torch

from minisgl.kernels.linear import gemv_rows
from minisgl.kernels.moe_gemm import moe_gemm
from minisgl.kernels.moe_gemv import moe_gemv
from minisgl.moe import fused_moe, grouped_moe, select_experts, torch_moe
from perf.gpu.timing import capture, median_ms

EXPERTS, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768
HBM_BYTES_PER_S = 4.8e12  # H200
LAYERS = 8


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 256, 1024, 4096])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--skew", type=float, default=0.0, help="router bias towards some experts (0: none)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("perf.gpu.moe needs a CUDA GPU")

    torch.manual_seed(0)
    device = torch.device("cuda")
    # LAYERS layers of weights, run one after another as a model does, so that no layer finds its
    # experts in L2 left there by the run before
    w13s = [
        (torch.randn(EXPERTS, 2 * INTER, HIDDEN, device=device) / HIDDEN**0.5).bfloat16()
        for _ in range(LAYERS)
    ]
    w2s = [
        (torch.randn(EXPERTS, HIDDEN, INTER, device=device) / INTER**0.5).bfloat16() for _ in range(LAYERS)
    ]
    w13, w2 = w13s[0], w2s[0]
    bias = torch.randn(EXPERTS, device=device) * args.skew

    def layers(fn, x, router_logits):
        for w13, w2 in zip(w13s, w2s, strict=True):
            fn(x, router_logits, w13, w2, TOP_K, True)

    expert_bytes = (w13[0].numel() + w2[0].numel()) * w13.element_size()
    print(
        f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}: one MoE layer, E={EXPERTS}, "
        f"top_k={TOP_K}, H={HIDDEN}, I={INTER}, bf16, skew {args.skew}, median of {args.iters} (us); "
        f"fused = the backend as dispatched (few-token kernels up to {gemv_rows(w13)} tokens), "
        "grouped = its grouped GEMMs; GB/s counts each touched expert's weights once"
    )
    header = (
        f"{'T':>6} {'experts':>7} {'torch':>9} {'_grouped_mm':>11} {'gemv':>7} {'gemm':>7} {'fused':>7} "
        f"{'floor':>7} {'TFLOP/s':>8} {'GB/s':>7} {'rel err':>8}"
    )
    print(header)
    print("-" * len(header))
    for tokens in args.tokens:
        x = torch.randn(tokens, HIDDEN, device=device).bfloat16()
        router_logits = (torch.randn(tokens, EXPERTS, device=device) + bias).bfloat16()
        moe_args = (x, router_logits, w13, w2, TOP_K, True)
        touched = torch.topk(router_logits.float(), TOP_K, dim=-1).indices.unique().numel()
        ref = torch_moe(*moe_args).float()
        err = ((fused_moe(*moe_args).float() - ref).norm() / ref.norm()).item()
        t_ref = median_ms(functools.partial(torch_moe, *moe_args), args.iters) * 1e3

        def per_layer(fn, x=x, router_logits=router_logits) -> float:
            """One layer's microseconds, from a CUDA graph of LAYERS layers."""
            graph, _ = capture(functools.partial(layers, fn, x, router_logits))
            return median_ms(graph.replay, args.iters) * 1e3 / LAYERS

        t_grouped = per_layer(grouped_moe)
        t_gemv = per_layer(moe_gemv) if tokens <= 64 else float("nan")
        t_gemm = per_layer(routed_gemm)
        t_fused = per_layer(fused_moe)
        weight_bytes = touched * expert_bytes
        floor = weight_bytes / HBM_BYTES_PER_S * 1e6
        flops = 6 * tokens * TOP_K * HIDDEN * INTER  # gate/up (2 * H * 2I) + down (2 * I * H) per pair
        print(
            f"{tokens:>6} {touched:>7} {t_ref:>9.1f} {t_grouped:>11.1f} {t_gemv:>7.1f} {t_gemm:>7.1f} "
            f"{t_fused:>7.1f} {floor:>7.1f} {flops / t_fused / 1e6:>8.1f} {weight_bytes / t_fused / 1e3:>7.0f} "
            f"{err:>8.1e}"
        )


def routed_gemm(x, router_logits, w13, w2, top_k, renormalize):
    """The grouped Triton kernels after the reference's routing, at any token count."""
    weights, ids = select_experts(router_logits, top_k, renormalize, x.dtype)
    return moe_gemm(x, weights, ids, w13, w2)


if __name__ == "__main__":
    main()
