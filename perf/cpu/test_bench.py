"""`minisgl-run bench` scaled down for a CPU, side by side with transformers on the same prompts.

Workload: 32 requests, input and output lengths 16..128 (seed 0), temperature 0.6, ignore_eos.
minisgl runs it through the LLM API (the warm second pass counts). transformers runs batched
`generate` in batches of 8 with left padding and `max_new_tokens` = the largest request of the batch;
both sides count only the tokens each request asked for. Run with `nox -s perf`; the figures are printed
and stored in the benchmark's extra_info.
"""

import time

import pytest
import torch
import transformers

from minisgl.bench.offline import CPU_SHAPE, make_workload, run_bench
from minisgl.llm import LLM
from minisgl.models import default_model_path

HF_BATCH = 8
RESULTS: dict[str, float] = {}


@pytest.fixture(scope="module")
def workload():
    return make_workload(CPU_SHAPE, vocab_size=49152)


def test_minisgl_bench_cpu(benchmark, workload):
    llm = LLM(device="cpu", dtype="float32")
    try:
        report = benchmark.pedantic(lambda: run_bench(llm, CPU_SHAPE, passes=2), rounds=1, iterations=1)
    finally:
        llm.shutdown()
    warm = report["passes"][-1]
    RESULTS["minisgl"] = warm["tokens_per_s"]
    benchmark.extra_info.update(report)
    print(
        f"\nminisgl: {warm['output_tokens']} tokens in {warm['seconds']:.2f} s = {warm['tokens_per_s']:.1f} tokens/s"
    )


def test_transformers_batched_generate_cpu(benchmark, workload):
    prompts, max_tokens = workload
    model = transformers.AutoModelForCausalLM.from_pretrained(
        default_model_path(), dtype=torch.float32
    ).eval()
    pad = 2

    def run() -> float:
        started = time.perf_counter()
        for i in range(0, len(prompts), HF_BATCH):
            batch, wanted = prompts[i : i + HF_BATCH], max_tokens[i : i + HF_BATCH]
            width = max(map(len, batch))
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            with torch.no_grad():
                model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    max_new_tokens=max(wanted),
                    min_new_tokens=max(wanted),
                    do_sample=True,
                    temperature=CPU_SHAPE.temperature,
                    top_k=0,
                    top_p=1.0,
                    pad_token_id=pad,
                )
        return time.perf_counter() - started

    seconds = benchmark.pedantic(run, rounds=1, iterations=1)
    RESULTS["transformers"] = sum(max_tokens) / seconds
    benchmark.extra_info["tokens_per_s"] = RESULTS["transformers"]
    print(
        f"\ntransformers: {sum(max_tokens)} tokens in {seconds:.2f} s = {RESULTS['transformers']:.1f} tokens/s"
    )
    if "minisgl" in RESULTS:
        ratio = RESULTS["minisgl"] / RESULTS["transformers"]
        benchmark.extra_info["minisgl_over_transformers"] = ratio
        print(f"minisgl / transformers: {ratio:.2f}x (goal: 3x)")
