"""LoRA's GPU figures: the decode step with and without adapters, and a runtime adapter load, with dummy
weights (docs/lora.md, "Benchmark").

    python -m perf.gpu.lora [--model configs/models/qwen3-8b] [--batch 1 32 128] [--context 512]
                            [--steps 50] [--adapters 8] [--rank 16] [--max-lora-rank N] [--out FILE.json]
    python -m perf.gpu.lora --kernels [--batch 1 32 128]   # the kernels alone, per variant
    python -m perf.gpu.lora --shape cpu      # a tiny Qwen3 on the CPU: the dry run of the script

In one process, one engine after the other (dummy weights, bf16, CUDA graphs to the largest batch):
`no_slots`, an engine without adapter slots; then one engine with `--adapters` slots and as many
rank-`--rank` adapters (random A and B on q/k/v/o/gate/up/down_proj, written as PEFT folders:
adapter_config.json and adapter_model.safetensors, in a temporary folder), on which `slots_base` runs
base-only requests and `mixed` the same requests with row i under adapter i mod `--adapters`. Each
configuration: `batch` requests of `--context` random prompt tokens (greedy, ignore_eos), stepped until
every one has its first token, then `--steps` decode steps; `wall_ms` is the median time between two
step returns (what the host sees, overlap scheduling included), `device_ms` the median device time of
a decode forward (the scheduler's step records; CUDA only). The ratios are `slots_base` and `mixed`
over `no_slots` by wall time, beside the goals: base requests on an adapter engine at least 0.97x the
speed of the engine without (a time ratio of at most 1/0.97), mixed at most 1.10x / 1.20x / 1.25x the
base step at batch 1 / 32 / 128. `rows_changed`: the mixed rows whose tokens differ from the same
rows' base tokens (the adapters ran). Last, `LLM.load_lora` of one more such adapter (read and laid
out on the host; its copy into a slot comes at the first request), `--loads` times, each unloaded
again: the median. `--kernels`: no engine, the LoRA kernels alone at the model's four packed
projections (`run_kernels`), each expand block width of `KERNEL_BLOCKS` with and without the slots'
ranks, against the torch reference (on the CPU under Triton's interpreter, TRITON_INTERPRET=1). A plain
script, not a test (tests/test_perf_lora.py runs the dry runs).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from minisgl.core import SamplingParams
from perf.common import ROOT, goal_note, median
from perf.gpu.latency import _clear, _run_until, _step

MODEL = ROOT / "configs" / "models" / "qwen3-8b"
TINY_QWEN3 = Path(__file__).resolve().parent / "tiny-qwen3"
# PEFT's module names under model.layers.N, and (input, output) sizes from a config.json
MODULES = {
    "self_attn.q_proj": lambda hidden, q, kv, inter: (hidden, q),
    "self_attn.k_proj": lambda hidden, q, kv, inter: (hidden, kv),
    "self_attn.v_proj": lambda hidden, q, kv, inter: (hidden, kv),
    "self_attn.o_proj": lambda hidden, q, kv, inter: (q, hidden),
    "mlp.gate_proj": lambda hidden, q, kv, inter: (hidden, inter),
    "mlp.up_proj": lambda hidden, q, kv, inter: (hidden, inter),
    "mlp.down_proj": lambda hidden, q, kv, inter: (inter, hidden),
}
KERNEL_BLOCKS = (64, 128, 256)  # the expand's column blocks `--kernels` tries (kernels.lora.EXPAND_BLOCK_N)
BASE_GOAL = 1 / 0.97  # slots_base / no_slots, at most
MIXED_GOALS = {1: 1.10, 32: 1.20, 128: 1.25}  # mixed / no_slots at most, by the largest batch <= the row's


@dataclass(frozen=True)
class Shape:
    model: Path
    batches: tuple[int, ...]
    context: int
    steps: int
    adapters: int
    loads: int
    settings: dict[str, Any] = field(default_factory=dict)


GPU = Shape(MODEL, (1, 32, 128), 512, 50, 8, 5, dict(device="cuda", dtype="bfloat16", page_size=256))
CPU = Shape(
    TINY_QWEN3, (1, 2), 16, 4, 2, 2,
    dict(device="cpu", dtype="float32", attention_backend="torch", page_size=16, cpu_kv_budget_gib=0.25),
)  # fmt: skip


def widths(model_config: dict[str, Any]) -> tuple[int, int, int, int]:
    """(hidden, q, kv, intermediate) sizes of a config.json's layers."""
    hidden, heads = model_config["hidden_size"], model_config["num_attention_heads"]
    head_dim = model_config.get("head_dim") or hidden // heads
    kv = model_config.get("num_key_value_heads", heads) * head_dim
    return hidden, heads * head_dim, kv, model_config["intermediate_size"]


def write_adapter(
    folder: Path, model_config: dict[str, Any], rank: int, seed: int, dtype: torch.dtype
) -> str:
    """A PEFT LoRA adapter of rank `rank` on every layer's seven projections, N(0, 0.02) A and B and
    lora_alpha 2 * rank, saved in `folder` as `save_pretrained` writes it; the folder's path."""
    sizes = widths(model_config)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(model_config["num_hidden_layers"]):
        for module, io in MODULES.items():
            n_in, n_out = io(*sizes)
            key = f"base_model.model.model.layers.{layer}.{module}"
            for ab, shape in (("A", (rank, n_in)), ("B", (n_out, rank))):
                weight = torch.empty(shape).normal_(0.0, 0.02, generator=generator)
                tensors[f"{key}.lora_{ab}.weight"] = weight.to(dtype)
    folder.mkdir(parents=True)
    save_file(tensors, folder / "adapter_model.safetensors")
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank}
    config |= {"target_modules": [m.rpartition(".")[2] for m in MODULES], "bias": "none"}
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=1))
    return str(folder)


def decode_steps(
    llm: Any, batch: int, context: int, steps: int, loras: Sequence[str | None]
) -> tuple[dict[str, Any], list[list[int]]]:
    """`batch` requests, row i under `loras[i % len(loras)]` (None: the base), stepped past their
    prefills, then `steps` timed decode steps: the row of figures, and each request's output tokens."""
    sched = llm.scheduler
    params = SamplingParams(max_tokens=steps + 64, ignore_eos=True)
    vocab = llm.engine.config.model_config.vocab_size
    rng = random.Random(batch)
    with llm._lock:
        states = [
            sched.add_request(
                [rng.randrange(vocab) for _ in range(context)], params, lora=loras[i % len(loras)]
            )
            for i in range(batch)
        ]
    kept = sched.record_steps
    try:
        _run_until(llm, lambda: all(s.first_token_time for s in states), "prefill")
        sched.record_steps = steps + 8
        returns = [_step(llm) for _ in range(steps + 1)]
        decodes = [r for r in sched.step_records if r.phase == "decode" and r.batch_size == batch]
    finally:
        sched.record_steps = kept
        _clear(llm, states)
    row = {"wall_ms": 1e3 * statistics.median(b - a for a, b in zip(returns, returns[1:]))}
    row["device_ms"] = median(r.device_ms for r in decodes[-steps:])
    return row, [list(s.output_ids[: steps + 1]) for s in states]


def start(shape: Shape, args: argparse.Namespace, **lora: Any) -> Any:
    from minisgl.llm import LLM

    top = max(args.batch)
    settings = dict(use_dummy_weight=True, detokenize=False, **shape.settings, **lora)
    llm = LLM(args.model, **settings, cuda_graph_max_bs=top, max_running_req=max(top, 8))
    decode_steps(llm, top, args.context, 2, [None])  # warm-up
    return llm


def run_engines(shape: Shape, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    model_config = json.loads((Path(args.model) / "config.json").read_text())
    dtype = getattr(torch, shape.settings["dtype"])
    paths = {
        f"a{i}": write_adapter(folder / f"a{i}", model_config, args.rank, i, dtype)
        for i in range(args.adapters)
    }
    extra = write_adapter(folder / "extra", model_config, args.rank, args.adapters, dtype)
    results: dict[str, Any] = {"batches": {}}
    base_tokens: dict[int, list[list[int]]] = {}
    with start(shape, args) as llm:
        for batch in args.batch:
            row, base_tokens[batch] = decode_steps(llm, batch, args.context, args.steps, [None])
            results["batches"][str(batch)] = {"no_slots": row}
            print(f"bs {batch} no_slots: {row['wall_ms']:.3f} ms", flush=True)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    slots = dict(max_loras=args.adapters, allow_runtime_lora=True, lora_modules=paths)
    if args.max_lora_rank:
        slots["max_lora_rank"] = args.max_lora_rank
    with start(shape, args, **slots) as llm:
        results["max_lora_rank"] = llm.engine.config.max_lora_rank
        for batch in args.batch:
            rows = results["batches"][str(batch)]
            rows["slots_base"], tokens = decode_steps(llm, batch, args.context, args.steps, [None])
            rows["mixed"], mixed = decode_steps(llm, batch, args.context, args.steps, list(paths))
            rows["base_same_tokens"] = tokens == base_tokens[batch]
            rows["rows_changed"] = sum(m != t for m, t in zip(mixed, tokens))
            rows["resident"] = llm.scheduler.lora.resident
            for name in ("slots_base", "mixed"):
                rows[name]["ratio"] = rows[name]["wall_ms"] / rows["no_slots"]["wall_ms"]
                device, base_device = rows[name]["device_ms"], rows["no_slots"]["device_ms"]
                rows[name]["ratio_device"] = device / base_device if device and base_device else None
            print(
                f"bs {batch} slots_base {rows['slots_base']['wall_ms']:.3f} ms, mixed "
                f"{rows['mixed']['wall_ms']:.3f} ms, rows changed {rows['rows_changed']}",
                flush=True,
            )
        loads = []
        for i in range(args.loads):
            started = time.perf_counter()
            llm.load_lora(f"extra{i}", extra)
            loads.append(1e3 * (time.perf_counter() - started))
            llm.unload_lora(f"extra{i}")
        results["load_ms"] = {"median": statistics.median(loads), "runs": loads}
    return results


def run_kernels(shape: Shape, args: argparse.Namespace) -> dict[str, Any]:
    """The kernels alone (`--kernels`) at the model's four packed projections: `--adapters` slots of
    rank `--rank` in a pool of `--max-lora-rank` (64), row i under slot i % adapters, for each batch;
    per variant (the expand's column block `KERNEL_BLOCKS`, the slots' ranks given or not) the us of
    one `lora_add_kernels` (10 calls in a CUDA graph on CUDA; one call eagerly elsewhere, where Triton
    must run its interpreter) and its error against the torch reference."""
    from minisgl.kernels import lora as K
    from minisgl.layers.lora import LoraBatch, lora_add_reference
    from perf.gpu.timing import graph_us

    device, dtype = torch.device(shape.settings["device"]), getattr(torch, shape.settings["dtype"])
    config = json.loads((Path(args.model) / "config.json").read_text())
    hidden, q, kv, inter = widths(config)
    projections = {"qkv_proj": ([q, kv, kv], hidden), "o_proj": ([hidden], q)}
    projections |= {"gate_up_proj": ([inter, inter], hidden), "down_proj": ([hidden], inter)}
    pool_rank, slots = args.max_lora_rank or 64, args.adapters
    generator = torch.Generator(device).manual_seed(0)
    ranks = torch.full((slots,), args.rank, dtype=torch.int32, device=device)
    results: dict[str, Any] = {"layers": config["num_hidden_layers"], "projections": {}}
    kept = K.EXPAND_BLOCK_N
    try:
        for name, (sizes, k) in projections.items():
            a = torch.randn(slots, len(sizes), pool_rank, k, generator=generator, device=device) / k**0.5
            b = torch.randn(slots, sum(sizes), pool_rank, generator=generator, device=device) / args.rank**0.5
            a[:, :, args.rank :], b[:, :, args.rank :] = 0, 0  # the pool's padding past each rank
            a, b = a.flatten(1, 2).to(dtype), b.to(dtype)
            for rows in args.batch:
                batch = LoraBatch.build([1] * rows, [i % slots for i in range(rows)], device, slots)
                x = torch.randn(rows, k, generator=generator, device=device).to(dtype)
                base = torch.randn(rows, sum(sizes), generator=generator, device=device).to(dtype)
                want = lora_add_reference(x, base.clone(), a, b, batch.row_slots, sizes).float()
                row = results["projections"].setdefault(name, {})[str(rows)] = {}
                for block, ranked in [(block, ranked) for block in KERNEL_BLOCKS for ranked in (False, True)]:
                    K.EXPAND_BLOCK_N = block
                    out = base.clone()
                    call = (x, out, a, b, batch.tiles, batch.order, sizes, ranks if ranked else None)
                    K.lora_add_kernels(*call)
                    error = ((out.float() - want).norm() / (want - base.float()).norm()).item()
                    if device.type == "cuda":
                        us = graph_us(lambda call=call: [K.lora_add_kernels(*call) for _ in range(10)]) / 10
                    else:
                        started = time.perf_counter()
                        K.lora_add_kernels(*call)
                        us = 1e6 * (time.perf_counter() - started)
                    row[f"{block}{'r' if ranked else ''}"] = {"us": us, "error": error}
    finally:
        K.EXPAND_BLOCK_N = kept
    return results


def kernels_table(results: dict[str, Any]) -> str:
    """us per `lora_add` by projection and rows for each variant (the expand's block, `r`: the slots'
    ranks given), the largest error, and per rows the four projections' sum times the layers, in ms."""
    projections = results["projections"]
    variants = list(next(iter(next(iter(projections.values())).values())))
    lines = [f"{'projection':>12} {'rows':>5} " + " ".join(f"{v:>8}" for v in variants) + "  max error"]
    totals: dict[str, dict[str, float]] = {}
    for name, by_rows in projections.items():
        for rows, row in by_rows.items():
            us = " ".join(f"{row[v]['us']:8.2f}" for v in variants)
            lines.append(f"{name:>12} {rows:>5} {us}  {max(r['error'] for r in row.values()):.1e}")
            for v in variants:
                totals.setdefault(rows, {}).setdefault(v, 0.0)
                totals[rows][v] += row[v]["us"] * results["layers"] / 1e3
    for rows, by_variant in totals.items():
        lines.append(f"{'all, ms':>12} {rows:>5} " + " ".join(f"{by_variant[v]:8.3f}" for v in variants))
    return "\n".join(lines)


def mixed_goal(batch: int) -> float:
    return MIXED_GOALS[max((b for b in MIXED_GOALS if b <= batch), default=min(MIXED_GOALS))]


def _ms(row: dict[str, Any]) -> str:
    device = "-" if row["device_ms"] is None else f"{row['device_ms']:.3f}"
    return f"{row['wall_ms']:.3f} ({device})"


def table(results: dict[str, Any]) -> str:
    lines = [
        f"decode step, context {results['context']}: median ms per step, wall (device); ratios by wall "
        f"over no_slots; {results['adapters']} adapters of rank {results['rank']}, "
        f"max_lora_rank {results.get('max_lora_rank')}",
        f"{'batch':>5} {'no_slots':>18} {'slots_base':>18} {'mixed':>18} {'rows changed':>12}  ratios",
    ]
    for batch, rows in results.get("batches", {}).items():
        if "mixed" not in rows:
            continue
        base, mixed = rows["slots_base"]["ratio"], rows["mixed"]["ratio"]
        lines.append(
            f"{batch:>5} {_ms(rows['no_slots']):>18} {_ms(rows['slots_base']):>18} {_ms(rows['mixed']):>18} "
            f"{rows['rows_changed']:>8}/{batch:<3}  base {base:.3f}x{goal_note(base, round(BASE_GOAL, 3), True)}, "
            f"mixed {mixed:.3f}x{goal_note(mixed, mixed_goal(int(batch)), True)}"
        )
    if "load_ms" in results:
        runs = ", ".join(f"{v:.1f}" for v in results["load_ms"]["runs"])
        lines.append(
            f"adapter load (LLM.load_lora, rank {results['rank']}): median {results['load_ms']['median']:.1f} ms ({runs})"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", choices=["full", "cpu"], default="full", help="cpu: a small dry run")
    parser.add_argument(
        "--model", default=None, help=f"model folder, run with dummy weights (default {MODEL.name})"
    )
    parser.add_argument("--batch", type=int, nargs="+", default=None, help="decode batch sizes (1 32 128)")
    parser.add_argument("--context", type=int, default=None, help="prompt tokens per request (512)")
    parser.add_argument("--steps", type=int, default=None, help="timed decode steps per configuration (50)")
    parser.add_argument("--adapters", type=int, default=None, help="adapters and slots (8)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--max-lora-rank", type=int, default=None, help="the engine's (default: its default)")
    parser.add_argument("--loads", type=int, default=None, help="timed adapter loads (5)")
    parser.add_argument("--out", default=None, help="write the figures to this JSON file")
    parser.add_argument("--kernels", action="store_true", help="the kernels alone, no engine")
    args = parser.parse_args(argv)
    shape = CPU if args.shape == "cpu" else GPU
    for name in ("model", "batch", "context", "steps", "adapters", "loads"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(shape, name if name != "batch" else "batches"))
    args.model = str(args.model)
    os.environ["TQDM_DISABLE"] = "1"
    results: dict[str, Any] = {"shape": args.shape, "model": args.model, "context": args.context}
    results |= {"steps": args.steps, "adapters": args.adapters, "rank": args.rank}
    if torch.cuda.is_available() and shape.settings["device"] == "cuda":
        results["device"] = torch.cuda.get_device_name()
    if args.kernels:
        results["kernels"] = run_kernels(shape, args)
    else:
        with tempfile.TemporaryDirectory(prefix="minisgl-lora-") as tmp:
            results |= run_engines(shape, args, Path(tmp))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    report = kernels_table(results["kernels"]) if args.kernels else table(results)
    print(f"\n--- LoRA ({args.shape}; {args.model}) ---\n{report}", flush=True)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
