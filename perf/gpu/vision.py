"""The vision encoder on the GPU: Qwen2.5-VL-7B's (or Qwen3-VL-8B's) with dummy bf16 weights on one
1280x720 image (or `--images` of them in one call), per attention method, eager and compiled.

    python -m perf.gpu.vision [--model qwen2.5-vl-7b | qwen3-vl-8b] [--model-config PATH]
                              [--image 1280x720] [--images 1] [--iters 20] [--peak-tflops 989]
    python -m perf.gpu.vision --shape cpu      # a tiny encoder on the CPU: the dry run of the script

Rows: each attention method the machine has (`minisgl.models.vision.SegmentPlan`: `loop`, the old one
SDPA launch per segment; `sdpa`, the segments padded into one batched SDPA; `torch_varlen`, torch's
varlen attention; `flashinfer`, FlashInfer's ragged prefill), eager, then the block stack compiled
(inductor, one graph) with the fused methods. Columns: `ms` the median device time of one encoder call
(CUDA events around the call: its host planning included where the GPU waits for it), `ms/image`,
`GEMM TFLOP/s` the linear layers' FLOPs (counted from the shapes: patch embedding, qkv, proj, MLP,
mergers) over that time, `% peak` of `--peak-tflops` (dense bf16; 989 on H100 / H200 SXM), and the
attention's FLOPs (4 x sum of segment lengths squared x hidden, per layer) over the same time. Below the
table, the GEMMs alone: each distinct linear shape timed by itself (F.linear on random activations)
times its count, their sum and its TFLOP/s: what the encoder's GEMMs reach without anything between
them. `--model-config` reads the vision_config of a config.json (or of a model folder's) instead of the
built-in one. A plain script, not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from minisgl.models.qwen_vl import ENCODERS
from minisgl.models.vision import ATTENTION_METHODS, VisionConfig, resolve_attention_method
from minisgl.multimodal.qwen_vl import smart_resize
from perf.gpu.timing import median_ms

# vision_config of the checkpoints' config.json (the keys the encoders read)
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2.5-vl-7b": ("qwen2_5_vl", dict(
        depth=32, hidden_size=1280, num_heads=16, intermediate_size=3420, out_hidden_size=3584,
        hidden_act="silu", patch_size=14, temporal_patch_size=2, spatial_merge_size=2, in_chans=3,
        window_size=112, fullatt_block_indexes=[7, 15, 23, 31],
    )),
    "qwen3-vl-8b": ("qwen3_vl", dict(
        depth=27, hidden_size=1152, num_heads=16, intermediate_size=4304, out_hidden_size=4096,
        hidden_act="gelu_pytorch_tanh", patch_size=16, temporal_patch_size=2, spatial_merge_size=2,
        in_channels=3, num_position_embeddings=2304, deepstack_visual_indexes=[8, 16, 24],
    )),
}  # fmt: skip
CPU_SHAPE = dict(
    depth=2, hidden_size=64, num_heads=4, intermediate_size=96, out_hidden_size=48, hidden_act="silu",
    patch_size=14, window_size=56, fullatt_block_indexes=[1],
)  # fmt: skip
MAX_PIXELS = 12845056  # Qwen2.5-VL's preprocessor_config.json
MIN_PIXELS = 3136


def image_grid(width: int, height: int, cfg: VisionConfig) -> tuple[int, int, int]:
    """(t, h, w) in patches of a `width` x `height` image after the preprocessing's resize."""
    factor = cfg.patch_size * cfg.spatial_merge_size
    h, w = smart_resize(height, width, factor, MIN_PIXELS, MAX_PIXELS)
    return 1, h // cfg.patch_size, w // cfg.patch_size


def gemm_shapes(cfg: VisionConfig, family: str, patches: int) -> Counter[tuple[int, int, int]]:
    """Every linear layer of one call as (rows, in, out) -> count."""
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    merged, tokens = hidden * cfg.spatial_merge_size**2, patches // cfg.spatial_merge_size**2
    mlp_in = 2 if family == "qwen2_5_vl" else 1  # SwiGLU's gate and up, or fc1
    shapes: Counter[tuple[int, int, int]] = Counter()
    shapes[(patches, cfg.patch_dim, hidden)] += 1
    shapes[(patches, hidden, 3 * hidden)] += cfg.depth
    shapes[(patches, hidden, hidden)] += cfg.depth
    shapes[(patches, hidden, inter)] += mlp_in * cfg.depth
    shapes[(patches, inter, hidden)] += cfg.depth
    mergers = 1 + len(cfg.deepstack_visual_indexes)
    shapes[(tokens, merged, merged)] += mergers
    shapes[(tokens, merged, cfg.out_hidden_size)] += mergers
    return shapes


def gemm_flops(shapes: Counter[tuple[int, int, int]]) -> float:
    return float(sum(2 * m * k * n * count for (m, k, n), count in shapes.items()))


def attention_flops(cfg: VisionConfig, family: str, grids: list[tuple[int, int, int]]) -> float:
    """4 x sum(len^2) x hidden per layer (QK^T and PV), windows for Qwen2.5-VL's windowed layers."""
    from minisgl.models.qwen2_5_vl_vision import window_order

    grid = torch.tensor(grids)
    frames = [h * w for t, h, w in grids for _ in range(t)]
    full = sum(n * n for n in frames)
    windowed_layers = 0
    windows = full
    if family == "qwen2_5_vl":
        window = cfg.window_size // cfg.spatial_merge_size // cfg.patch_size
        lengths = window_order(grid, cfg.spatial_merge_size, window)[1].diff().tolist()
        windows = sum(n * n for n in lengths)
        windowed_layers = cfg.depth - len(cfg.fullatt_block_indexes)
    return 4.0 * cfg.hidden_size * (full * (cfg.depth - windowed_layers) + windows * windowed_layers)


def time_ms(fn: Callable[[], Any], iters: int, device: torch.device) -> float:
    """Median milliseconds of `fn()`: CUDA events around each call on a GPU, the wall clock on a CPU."""
    if device.type == "cuda":
        return median_ms(fn, iters, warmup=2)
    fn()
    times = []
    for _ in range(iters):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def gemm_alone_ms(shapes: Counter[tuple[int, int, int]], dtype, device, iters: int) -> float:
    """The GEMMs alone: each shape timed by itself, times its count."""
    total = 0.0
    for (m, k, n), count in shapes.items():
        x = torch.randn(m, k, dtype=dtype, device=device)
        w = torch.randn(n, k, dtype=dtype, device=device)
        total += count * time_ms(lambda x=x, w=w: F.linear(x, w), iters, device)
    return total


def load_config(args: argparse.Namespace) -> tuple[str, VisionConfig]:
    if args.shape == "cpu":
        return "qwen2_5_vl", VisionConfig.from_dict(CPU_SHAPE)
    family, raw = MODELS[args.model]
    if args.model_config:
        path = Path(args.model_config)
        path = path / "config.json" if path.is_dir() else path
        config = json.loads(path.read_text(encoding="utf-8"))
        raw = config.get("vision_config", config)
        family = "qwen3_vl" if "num_position_embeddings" in raw else "qwen2_5_vl"
    return family, VisionConfig.from_dict(raw)


def dummy_encoder(
    family: str, cfg: VisionConfig, dtype: torch.dtype, device: torch.device
) -> torch.nn.Module:
    model = ENCODERS[family](cfg).to(device=device, dtype=dtype)
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator, device=device) * 0.02)
    return model.eval()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=list(MODELS), default="qwen2.5-vl-7b")
    parser.add_argument(
        "--model-config", help="a config.json (or a folder with one) whose vision_config to use"
    )
    parser.add_argument(
        "--image", help="WIDTHxHEIGHT before the preprocessing's resize (1280x720; --shape cpu: 224x168)"
    )
    parser.add_argument("--images", type=int, default=1, help="images of that size in one encoder call")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="the card's dense bf16 peak")
    parser.add_argument("--shape", choices=["gpu", "cpu"], default="gpu", help="cpu: a tiny dry run")
    parser.add_argument(
        "--methods", nargs="+", choices=ATTENTION_METHODS[1:], default=list(ATTENTION_METHODS[1:])
    )
    parser.add_argument("--no-compile", action="store_true", help="eager rows only")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    cpu = args.shape == "cpu"
    device = torch.device("cpu" if cpu else "cuda")
    dtype = torch.float32 if cpu else torch.bfloat16
    backend = "aot_eager" if cpu else "inductor"  # inductor's C++ build is slow on a small CPU
    iters = 2 if cpu else args.iters
    family, cfg = load_config(args)
    width, height = map(int, (args.image or ("224x168" if cpu else "1280x720")).lower().split("x"))
    grids = [image_grid(width, height, cfg)] * args.images
    grid_thw = torch.tensor(grids)  # on the host, as the preprocessing gives it
    patches = int(grid_thw.prod(-1).sum())
    pixel_values = torch.randn(patches, cfg.patch_dim, dtype=dtype, device=device)
    shapes = gemm_shapes(cfg, family, patches)
    flops, attn_flops = gemm_flops(shapes), attention_flops(cfg, family, grids)
    print(
        f"{family} encoder (depth {cfg.depth}, hidden {cfg.hidden_size}, head_dim {cfg.head_dim}), {args.images} "
        f"image(s) of {width}x{height} -> grid {grids[0]}: {patches} patches; {flops / 1e9:.1f} GFLOP of GEMMs, "
        f"{attn_flops / 1e9:.1f} GFLOP of attention; {device}, {dtype}"
    )
    encoder = dummy_encoder(family, cfg, dtype, device)
    runs = []
    for method in args.methods:
        try:
            resolve_attention_method(method, device, dtype)
        except ValueError as e:
            print(f"  {method}: skipped ({e})")
            continue
        runs.append((method, False))
    if not args.no_compile:
        runs += [(method, True) for method, _ in runs if method not in ("loop", "sdpa") or cpu]
    rows = []
    print(
        f"\n{'attention':>13} {'mode':>8} {'ms':>8} {'ms/image':>9} {'GEMM TFLOP/s':>13} {'% peak':>7} {'attn TFLOP/s':>13}"
    )
    with torch.inference_mode():
        for method, compiled in runs:
            encoder.configure(attention=method, compile=compiled, backend=backend)
            ms = time_ms(lambda: encoder(pixel_values, grid_thw), iters, device)
            tflops = flops / ms / 1e9
            row = dict(attention=method, compiled=compiled, ms=ms, ms_per_image=ms / args.images,
                       gemm_tflops=tflops, peak_fraction=tflops / args.peak_tflops, attn_tflops=attn_flops / ms / 1e9)  # fmt: skip
            rows.append(row)
            print(
                f"{method:>13} {'compiled' if compiled else 'eager':>8} {ms:8.2f} {ms / args.images:9.2f} "
                f"{tflops:13.1f} {100 * row['peak_fraction']:6.1f}% {row['attn_tflops']:13.1f}"
            )
        encoder.configure(compile=False)
        alone = gemm_alone_ms(shapes, dtype, device, iters)
    print(
        f"\nthe GEMMs alone ({sum(shapes.values())} calls of {len(shapes)} shapes): {alone:.2f} ms, "
        f"{flops / alone / 1e9:.1f} TFLOP/s ({100 * flops / alone / 1e9 / args.peak_tflops:.1f}% of "
        f"{args.peak_tflops:.0f})"
    )
    for (m, k, n), count in sorted(shapes.items()):
        print(f"  {m:>6} x {k:>5} -> {n:>5}  x{count}")
    return rows


if __name__ == "__main__":
    main()
