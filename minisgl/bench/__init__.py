"""The offline throughput benchmark (the workload Mini-SGLang and nano-vllm publish).

256 requests: `random.seed(seed)`; for each request in turn an input length `randint(min_input,
max_input)` and that many token ids `randint(0, 10000)`; then for each request `max_tokens =
randint(min_output, max_output)`. Temperature 0.6, ignore_eos, so every request runs to max_tokens.
Throughput = output tokens / wall time of the whole generate call, timed after a short warm-up; the
workload runs twice in one process and both passes are reported.

    python -m minisgl bench --config configs/h200-qwen3-0.6b.yaml   (the same as `minisgl-run bench`)
    python -m minisgl.bench --config configs/h200-qwen3-0.6b.yaml   (the same, through bench/__main__.py)
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass

import torch

from minisgl.core import SamplingParams
from minisgl.llm import LLM

TOKEN_ID_MAX = 10000


@dataclass(frozen=True)
class WorkloadShape:
    num_seqs: int = 256
    min_input: int = 100
    max_input: int = 1024
    min_output: int = 100
    max_output: int = 1024
    temperature: float = 0.6
    seed: int = 0


# the default shape scaled down for a CPU
CPU_SHAPE = WorkloadShape(num_seqs=32, min_input=16, max_input=128, min_output=16, max_output=128)


def make_workload(shape: WorkloadShape, vocab_size: int) -> tuple[list[list[int]], list[int]]:
    """(prompts, max_tokens per request). Token ids above the vocabulary wrap around it."""
    rng = random.Random(shape.seed)
    prompts = [
        [
            rng.randint(0, TOKEN_ID_MAX) % vocab_size
            for _ in range(rng.randint(shape.min_input, shape.max_input))
        ]
        for _ in range(shape.num_seqs)
    ]
    max_tokens = [rng.randint(shape.min_output, shape.max_output) for _ in range(shape.num_seqs)]
    return prompts, max_tokens


@dataclass
class PassResult:
    output_tokens: int
    input_tokens: int
    seconds: float
    tokens_per_s: float
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run_pass(llm: LLM, prompts: list[list[int]], max_tokens: list[int], temperature: float) -> PassResult:
    params = [SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True) for n in max_tokens]
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, progress=True)
    seconds = time.perf_counter() - started
    produced = sum(len(o.token_ids) for o in outputs)
    if produced != sum(max_tokens):
        raise RuntimeError(f"the workload asked for {sum(max_tokens)} tokens, {produced} were generated")
    ttfts = [o.time_to_first_token for o in outputs]
    return PassResult(
        output_tokens=produced,
        input_tokens=sum(map(len, prompts)),
        seconds=seconds,
        tokens_per_s=produced / seconds,
        ttft_p50=_percentile(ttfts, 0.5),
        ttft_p90=_percentile(ttfts, 0.9),
        ttft_p99=_percentile(ttfts, 0.99),
    )


def run_single(llm: LLM, prompt_len: int = 128, new_tokens: int = 1024) -> dict:
    """Decode speed of one request alone: `prompt_len` random tokens, `new_tokens` greedy tokens."""
    vocab = llm.engine.config.model_config.vocab_size
    rng = random.Random(1)
    prompt = [rng.randint(0, TOKEN_ID_MAX) % vocab for _ in range(prompt_len)]
    started = time.perf_counter()
    [out] = llm.generate([prompt], SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    seconds = time.perf_counter() - started
    return {
        "prompt_tokens": prompt_len,
        "new_tokens": len(out.token_ids),
        "seconds": seconds,
        "tokens_per_s": len(out.token_ids) / seconds,
    }


def run_bench(llm: LLM, shape: WorkloadShape, passes: int = 2, single: bool = False) -> dict:
    """Warm-up, then `passes` timed passes of the workload (and, if asked, one request alone);
    returns a JSON-able report."""
    prompts, max_tokens = make_workload(shape, llm.engine.config.model_config.vocab_size)
    llm.generate([prompts[0][:16]], SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
    engine = llm.engine
    if engine.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(engine.device)
    results = [run_pass(llm, prompts, max_tokens, shape.temperature) for _ in range(passes)]
    extra: dict = {"single_request": run_single(llm)} if single else {}
    if engine.device.type == "cuda":
        extra["peak_memory_gib"] = torch.cuda.max_memory_allocated(engine.device) / 2**30
    return {
        **extra,
        "model": llm.model_name,
        "device": str(engine.device),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "attention_backend": engine.config.attention_backend,
        "page_size": engine.config.page_size,
        "shape": asdict(shape),
        "passes": [asdict(r) for r in results],
    }


def format_report(report: dict) -> str:
    shape = report["shape"]
    lines = [
        f"model {report['model']} on {report['device']} ({report['dtype']}, attention {report['attention_backend']}, "
        f"page size {report['page_size']})",
        f"workload: {shape['num_seqs']} requests, input {shape['min_input']}..{shape['max_input']}, output "
        f"{shape['min_output']}..{shape['max_output']}, temperature {shape['temperature']}, seed {shape['seed']}, "
        "ignore_eos",
        f"{'pass':>4} {'output tok':>10} {'input tok':>10} {'time s':>8} {'tok/s':>10} "
        f"{'TTFT p50':>9} {'p90':>8} {'p99':>8}",
    ]
    for i, p in enumerate(report["passes"], 1):
        lines.append(
            f"{i:>4} {p['output_tokens']:>10} {p['input_tokens']:>10} {p['seconds']:>8.2f} {p['tokens_per_s']:>10.1f} "
            f"{p['ttft_p50']:>8.3f}s {p['ttft_p90']:>7.3f}s {p['ttft_p99']:>7.3f}s"
        )
    if "single_request" in report:
        single = report["single_request"]
        lines.append(
            f"single request: {single['prompt_tokens']} prompt + {single['new_tokens']} new tokens (greedy) in "
            f"{single['seconds']:.2f} s = {single['tokens_per_s']:.1f} tokens/s"
        )
    if "startup_seconds" in report:
        lines.append(f"startup: {report['startup_seconds']:.1f} s")
    if "peak_memory_gib" in report:
        lines.append(f"peak memory allocated by torch: {report['peak_memory_gib']:.1f} GiB")
    return "\n".join(lines)


def dumps(report: dict) -> str:
    return json.dumps(report, indent=2)
