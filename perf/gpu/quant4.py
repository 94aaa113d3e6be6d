"""4- and 8-bit projections on the GPU (`minisgl.kernels.packed_gemm`) against bf16 cuBLAS, and one
request of a 4-bit model against bf16 (dummy weights).

    python -m perf.gpu.quant4 kernels [--rows 1 2 4 ...] [--shapes qkv o ...] [--bits 4] [--group 128] [--sweep]
    python -m perf.gpu.quant4 request [--model configs/models/qwen3-8b] [--new-tokens 512] [--reps 3]
    python -m perf.gpu.quant4 offline [--model configs/models/qwen3-8b] [--passes 3] [--batch 32]
    python -m perf.gpu.quant4 moe [--tokens 1 2 4 ...] [--bits 4] [--group 128] [--sweep [--write]]

`kernels`: device time per call in microseconds, inside a CUDA graph of calls on distinct weight copies
(at least 256 MB of bf16 weights per shape, so both read from HBM, not L2), at Qwen3-8B's projections
and Qwen3-30B-A3B's (attention, and one expert's w13 / w2: the experts themselves are dequantized at
load); columns: `bf16` (F.linear), `op` (what `torch.ops.minisgl.packed_linear` runs at that row
count: the GEMV to 4 rows, the tensor-core GEMM to MMA_MAX_ROWS, dequantize-then-cuBLAS beyond), `deq`
(dequantize-then-cuBLAS at every row count), bf16 / op (above 1: the packed weights are faster), and
the op's relative error against dequantize-then-matmul. `--sweep`: the op's kernel under each of its
block configurations, the fastest printed.

`request`: one engine per variant in one process, bf16 then AWQ 4-bit (the model's config.json with an
AWQ `quantization_config`, group 128, in a temporary folder), dummy weights, CUDA graphs to batch 1;
`--reps` requests of 128 random prompt tokens and `--new-tokens` greedy ones each
(`minisgl.bench.offline.run_single`) after one such request as a warm-up (its prefill's shape compiles
once), tokens/s and their median.

`offline`: the same two variants, each in a process of its own, with CUDA graphs to the engine's
default batch sizes: the offline workload (`minisgl.bench.offline.run_bench`, 256 requests, `--passes`
passes after a warm-up) and the decode step at `--batch` requests of 512 tokens of context
(`perf.gpu.lora.decode_steps`: median wall and device ms over 50 steps); the 4-bit figures over bf16's.
`moe`: one MoE layer of Qwen3-30B-A3B's shapes (128 experts, top 8, hidden 2048, intermediate 768) on
the fused backend, bf16 experts against packed ones (`PackedWeights`), per token count (`moe` below);
`--sweep`: at a few tokens, the gate/up kernel's configurations on packed experts, then the down
kernel's (with its SPLIT), the six fastest of each printed; `--write` puts the fastest pair into the
packed table (`gemv_q4` / `gemv_q8`) of `minisgl/kernels/moe_gemv_configs.json`.
A plain script, not a test.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from perf.gpu.timing import graph_us

# (name, N, K)
SHAPES = [
    ("qkv", 6144, 4096),  # Qwen3-8B
    ("o", 4096, 4096),
    ("gate_up", 24576, 4096),
    ("down", 4096, 12288),
    ("a3b_qkv", 5120, 2048),  # Qwen3-30B-A3B: attention, one expert
    ("a3b_o", 2048, 4096),
    ("a3b_w13", 1536, 2048),
    ("a3b_w2", 2048, 768),
]
ROWS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
MIN_BYTES = 256 * 2**20
MOE_LAYERS = 8  # `moe`: layers of distinct weights in one graph
# `moe --sweep`: the few-token kernels' configurations tried on packed experts, the gate/up kernel's
# [block_n, block_k, warps] first (the down kernel at its default), then the down kernel's with its SPLIT
MOE_GATE_UP_SWEEP = [
    (n, k, w) for n in (8, 16, 32) for k in (256, 512, 1024, 2048) for w in (4, 8) if n * k <= 16384
]
MOE_DOWN_SWEEP = [(n, k, 4, split) for n in (8, 16, 32) for k in (128, 256, 1024) for split in (1, 2, 4, 8)]
# the engines of `request` and `offline` (dummy weights), and `offline`'s workload (WorkloadShape's fields)
ENGINE: dict = dict(use_dummy_weight=True, device="cuda", dtype="bfloat16", page_size=256)
WORKLOAD: dict = {}
# the GEMV's (BLOCK_N, BLOCK_W, warps) tried by `kernels --sweep`
GEMV_SWEEP = [(n, w, warps) for n in (8, 16, 32) for w in (32, 64, 128, 256) for warps in (4, 8)]
# the tensor-core GEMM's (BLOCK_N, BLOCK_W, warps, stages, RESHAPE) tried by `kernels --sweep`
MMA_SWEEP = [
    (n, w, warps, 3, reshape)
    for reshape, ws in ((True, (16, 32)), (False, (32, 64)))
    for n in (32, 64, 128)
    for w in ws
    for warps in (4, 8)
]


def time_rows(x, dense, qs, scales, zeros, bits, sweep: bool = False) -> tuple[float, float, float, float]:
    """(bf16 us, op us, dequantize-then-cuBLAS us, the op's relative error against dequantize-then-matmul)
    at x's row count; with `sweep` the op's time is its kernel's (the GEMV's to GEMV_MAX_ROWS rows, the
    tensor-core GEMM's beyond) under its fastest configuration of GEMV_SWEEP / MMA_SWEEP (printed)."""
    from minisgl.kernels import packed_gemm as P
    from minisgl.kernels.packed_gemm import packed_linear_op, packed_reference

    copies, m = len(qs), x.shape[0]
    bf16 = graph_us(lambda: [F.linear(x, w) for w in dense], reps=10) / copies
    op = graph_us(lambda: [packed_linear_op(x, q, scales, zeros, None, None, bits) for q in qs], 10) / copies
    deq = graph_us(lambda: [P.packed_gemm(x, q, scales, zeros, None, None, bits) for q in qs], 10) / copies
    if sweep and m <= P.MMA_MAX_ROWS:
        gemv = m <= P.GEMV_MAX_ROWS
        name, kernel = ("gemv_config", P.packed_gemv) if gemv else ("mma_config", P.packed_mma)
        default, times = getattr(P, name), {}
        if gemv:
            configs = [c for c in GEMV_SWEEP if c[0] * c[1] <= 4096]  # registers
        else:
            configs = [(default(m)[0], *c) for c in MMA_SWEEP]
        for config in configs:
            setattr(P, name, lambda _m, config=config: config)
            try:
                times[config] = graph_us(
                    lambda: [kernel(x, q, scales, zeros, None, None, bits) for q in qs], 10
                )
            except Exception as e:  # a configuration the compiler refuses (shared memory, registers)
                print(f"  {config}: {type(e).__name__}")
        setattr(P, name, default)
        best = min(times, key=times.get)
        op = times[best] / copies
        print(f"  fastest {name} at {m} rows: {best}, default {default(m)}", flush=True)
    call = (x, qs[0], scales, zeros, None, None, bits)
    want = packed_reference(*call).float()
    return bf16, op, deq, ((packed_linear_op(*call).float() - want).norm() / want.norm()).item()


def kernels(args: argparse.Namespace) -> None:
    from minisgl.kernels.packed import pack_words

    bits, group, top = args.bits, args.group, 1 << args.bits
    total = {m: [0.0, 0.0] for m in args.rows}
    print(f"{'shape':>10} {'M':>4} {'bf16 us':>9} {'op us':>9} {'deq us':>9} {'bf16/op':>8} {'err':>9}")
    for name, n, k in [s for s in SHAPES if s[0] in args.shapes]:
        copies = max(2, -(-MIN_BYTES // (2 * n * k)))
        g = torch.Generator(device="cuda").manual_seed(0)
        qs = [
            pack_words(torch.randint(0, top, (n, k), generator=g, device="cuda"), bits) for _ in range(copies)
        ]
        scales = (torch.rand(n, k // group, generator=g, device="cuda") * 0.04 / top).half()
        zeros = torch.full((n, k // group), top // 2, dtype=torch.uint8, device="cuda")
        dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            bf16, op, deq, err = time_rows(x, dense, qs, scales, zeros, bits, args.sweep)
            total[m][0] += bf16
            total[m][1] += op
            print(
                f"{name:>10} {m:>4} {bf16:9.1f} {op:9.1f} {deq:9.1f} {bf16 / op:8.2f} {err:9.2e}", flush=True
            )
        qs.clear()
        dense.clear()
        torch.cuda.empty_cache()
    print("all shapes named: M, bf16 us, op us, bf16/op")
    for m, (bf16, op) in total.items():
        print(f"{m:>4} {bf16:9.1f} {op:9.1f} {bf16 / op:8.2f}")


def moe(args: argparse.Namespace) -> None:
    """One MoE layer of Qwen3-30B-A3B's shapes on the fused backend, bf16 experts against packed ones,
    per token count: device us per layer in a CUDA graph of `LAYERS` layers (none finds its experts in
    L2), and the packed layer's relative error against the bf16 layer on its dequantized weights."""
    from minisgl.kernels.linear import MOE_GEMV_TOKENS
    from minisgl.kernels.packed import PackedWeights, pack_words
    from minisgl.moe import fused_moe

    experts, hidden, inter, top_k, top = 128, 2048, 768, 8, 1 << args.bits
    g = torch.Generator(device="cuda").manual_seed(0)

    def packed(rows: int, cols: int) -> PackedWeights:
        values = torch.randint(0, top, (experts, rows, cols), generator=g, device="cuda", dtype=torch.int32)
        scales = (
            torch.rand(experts, rows, cols // args.group, generator=g, device="cuda") * 0.04 / top
        ).half()
        zeros = torch.full(scales.shape, top // 2, dtype=torch.uint8, device="cuda")
        return PackedWeights(pack_words(values, args.bits), scales, zeros, args.bits)

    layers = [(packed(2 * inter, hidden), packed(hidden, inter)) for _ in range(MOE_LAYERS)]
    dense = [(w13.dequantize(torch.bfloat16), w2.dequantize(torch.bfloat16)) for w13, w2 in layers[:2]]
    dense += [(torch.randn_like(dense[0][0]), torch.randn_like(dense[0][1])) for _ in range(MOE_LAYERS - 2)]
    tuned: dict[str, dict] = {}
    print(f"{'tokens':>6} {'bf16 us':>9} {'packed us':>9} {'bf16/packed':>11} {'err':>9}")
    for t in args.tokens:
        x = torch.randn(t, hidden, device="cuda", dtype=torch.bfloat16)
        logits = torch.randn(t, experts, device="cuda", dtype=torch.bfloat16)
        bf16, q = (
            graph_us(
                lambda ws=ws, x=x, logits=logits: [fused_moe(x, logits, a, b, top_k, True) for a, b in ws], 10
            )
            / MOE_LAYERS
            for ws in (dense, layers)
        )
        want = fused_moe(x, logits, *dense[0], top_k, True).float()
        err = ((fused_moe(x, logits, *layers[0], top_k, True).float() - want).norm() / want.norm()).item()
        print(f"{t:>6} {bf16:9.1f} {q:9.1f} {bf16 / q:11.2f} {err:9.2e}", flush=True)
        if args.sweep and t <= MOE_GEMV_TOKENS:  # the few-token kernels' configurations on packed experts
            best = sweep_moe_gemv(layers, x, logits, top_k)
            if args.write:
                tuned.setdefault(f"gemv_q{args.bits}", {})[f"{experts},{2 * inter},{hidden},{t}"] = best
    if args.write and tuned:
        from minisgl.kernels import moe_gemv as K

        configs = json.loads(K.CONFIG_FILE.read_text()) if K.CONFIG_FILE.exists() else {}
        for table, entries in tuned.items():
            configs.setdefault(table, {}).update(entries)
        K.CONFIG_FILE.write_text(json.dumps(configs, indent=1, sort_keys=True) + "\n")
        print(f"wrote {K.CONFIG_FILE}")


def sweep_moe_gemv(layers, x, logits, top_k: int) -> dict:
    """The fastest gate/up configuration (the down kernel at its default), then the fastest down
    configuration with it; prints the six fastest of each. Returns the table entry."""
    from minisgl.kernels.moe_gemv import moe_gemv, moe_gemv_config

    w13 = layers[0][0]
    default = moe_gemv_config(w13.shape[0], w13.shape[1] // 2, w13.shape[2], x.shape[0], w13.bits)

    def time(config: dict) -> float:
        fn = lambda: [moe_gemv(x, logits, a, b, top_k, True, config=config) for a, b in layers]  # noqa: E731
        return graph_us(fn, 10) / MOE_LAYERS

    best = dict(default)
    for part, candidates in (("gate_up", MOE_GATE_UP_SWEEP), ("down", MOE_DOWN_SWEEP)):
        times = {c: time({**best, part: list(c)}) for c in candidates}
        fastest = sorted(times, key=times.get)
        best[part] = list(fastest[0])
        print(
            f"  packed {part}, fastest at {x.shape[0]} tokens: "
            + ", ".join(f"{list(c)} {times[c]:.1f}" for c in fastest[:6])
            + f" us (default {default[part]})",
            flush=True,
        )
    best["us"] = round(time(best), 2)
    print(f"  packed, both fastest: {best}", flush=True)
    return best


VARIANTS = ("bf16", "awq-4bit")


def variants(model: str) -> tuple[tuple[str, str], tuple[str, str]]:
    """(("bf16", `model`), ("awq-4bit", a folder of its config.json with an AWQ quantization_config,
    group 128)): the two engines' models (dummy weights)."""
    config = json.loads((Path(model) / "config.json").read_text())
    awq = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
    folder = Path(tempfile.mkdtemp()) / "awq"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": awq}))
    return (VARIANTS[0], model), (VARIANTS[1], str(folder))


def offline_one(args: argparse.Namespace) -> dict:
    """`offline` for the one variant `args.only`, in this process: its figures, and the device memory
    (GiB) at three points: free after the engine started, allocated and reserved by torch after it
    closed (what a closed engine leaves behind)."""
    from minisgl.bench.offline import WorkloadShape, run_bench
    from minisgl.llm import LLM
    from perf.gpu.lora import decode_steps

    model = dict(variants(args.model))[args.only]
    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("minisgl.engine").setLevel(logging.INFO)  # the KV budget and the start phases
    with LLM(model, **ENGINE, detokenize=False) as llm:
        free_started = torch.cuda.mem_get_info()[0] / 2**30
        report = run_bench(llm, WorkloadShape(**WORKLOAD), passes=args.passes)
        rates = [p["tokens_per_s"] for p in report["passes"]]
        step, _ = decode_steps(llm, args.batch, 512, 50, [None])
    torch.cuda.empty_cache()
    return dict(
        rates=rates, wall_ms=step["wall_ms"], device_ms=step["device_ms"] or float("nan"),
        free_started=free_started, allocated_closed=torch.cuda.memory_allocated() / 2**30,
        reserved_closed=torch.cuda.memory_reserved() / 2**30,
    )  # fmt: skip


def offline(args: argparse.Namespace) -> None:
    """Each variant in a process of its own (one engine's leftovers never shrink the next one's room);
    `--only` runs one here and prints its figures as the last line, JSON."""
    if args.only:
        print(json.dumps(offline_one(args)), flush=True)
        return
    results = {}
    for variant in VARIANTS:
        argv = [sys.executable, "-m", "perf.gpu.quant4", "offline", "--only", variant, "--model", args.model,
                "--passes", str(args.passes), "--batch", str(args.batch)]  # fmt: skip
        run = subprocess.run(argv, stdout=subprocess.PIPE, text=True)  # its log goes to stderr
        if run.returncode != 0:
            sys.exit(f"{variant}: exit {run.returncode}\n{run.stdout[-4000:]}")
        r = results[variant] = json.loads(run.stdout.strip().splitlines()[-1])
        print(
            f"{variant}: offline " + ", ".join(f"{x:,.0f}" for x in r["rates"]) + " output tokens/s; decode "
            f"step at batch {args.batch}: {r['wall_ms']:.3f} ms ({r['device_ms']:.3f} device); GiB free "
            f"after start {r['free_started']:.2f}, allocated / reserved after close "
            f"{r['allocated_closed']:.2f} / {r['reserved_closed']:.2f}",
            flush=True,
        )
    b, q = (results[v] for v in VARIANTS)
    rate, rate4 = statistics.median(b["rates"]), statistics.median(q["rates"])
    print(f"4-bit / bf16: offline {rate4 / rate:.2f}x (goal >= 0.9x), decode step at batch {args.batch} "
          f"{q['wall_ms'] / b['wall_ms']:.2f}x wall, {q['device_ms'] / b['device_ms']:.2f}x device "
          "(goal <= 0.6x)", flush=True)  # fmt: skip


def request(args: argparse.Namespace) -> None:
    from minisgl.bench.offline import run_single
    from minisgl.core import SamplingParams
    from minisgl.llm import LLM

    results = {}
    for variant, model in variants(args.model):
        with LLM(model, **ENGINE, cuda_graph_max_bs=1, max_running_req=8) as llm:
            llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=8, ignore_eos=True))
            run_single(llm, new_tokens=16)  # warm-up: the timed requests' prefill shape compiled once
            rates = [run_single(llm, new_tokens=args.new_tokens)["tokens_per_s"] for _ in range(args.reps)]
        results[variant] = statistics.median(rates)
        print(f"{variant}: " + ", ".join(f"{r:.1f}" for r in rates) + " tokens/s", flush=True)
        torch.cuda.empty_cache()
    print(f"one request: 4-bit / bf16 = {results['awq-4bit'] / results['bf16']:.2f}x", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    k = sub.add_parser("kernels")
    k.add_argument("--rows", type=int, nargs="+", default=ROWS)
    k.add_argument("--shapes", nargs="+", default=[s[0] for s in SHAPES])
    k.add_argument("--bits", type=int, default=4, choices=(4, 8))
    k.add_argument("--group", type=int, default=128)
    k.add_argument("--sweep", action="store_true", help="the GEMV's rows at its fastest block sizes")
    r = sub.add_parser("request")
    r.add_argument("--model", default="configs/models/qwen3-8b")
    r.add_argument("--new-tokens", type=int, default=512)
    r.add_argument("--reps", type=int, default=3)
    o = sub.add_parser("offline")
    o.add_argument("--model", default="configs/models/qwen3-8b")
    o.add_argument("--passes", type=int, default=3)
    o.add_argument("--batch", type=int, default=32)
    o.add_argument("--only", choices=VARIANTS, help="one variant, in this process")
    e = sub.add_parser("moe")
    e.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 256, 1024])
    e.add_argument("--bits", type=int, default=4, choices=(4, 8))
    e.add_argument("--group", type=int, default=128)
    e.add_argument("--sweep", action="store_true", help="the few-token kernels' configurations (packed)")
    e.add_argument("--write", action="store_true", help="with --sweep: the fastest into the packed table")
    args = parser.parse_args()
    {"kernels": kernels, "request": request, "offline": offline, "moe": moe}[args.what](args)


if __name__ == "__main__":
    main()
