"""Ablations on the offline workload (H200 preset), one engine: the compiled sampler against the same
function eager, compiled against eager prefill. Then seeded sampling alone against
inside a batch on a tiny random Qwen3, with the one-row GEMV kernel on and off and prefill compiled or
eager. A plain script, not a test.

    python perf/gpu_ablation.py
"""

from __future__ import annotations

import sys
import tempfile

import torch
import transformers

sys.path.insert(0, "perf")
from gpu_profile import timed_pass  # noqa: E402

from minisgl.bench import WorkloadShape, make_workload, run_pass  # noqa: E402
from minisgl.core import SamplingParams  # noqa: E402
from minisgl.engine import Engine, EngineConfig, generate, sample  # noqa: E402
from minisgl.engine.graph import GraphRunner  # noqa: E402
from minisgl.kernels import gemv  # noqa: E402
from minisgl.llm import LLM  # noqa: E402


def workload() -> None:
    llm = LLM(config="configs/h200-qwen3-0.6b.yaml")
    shape = WorkloadShape()
    prompts, max_tokens = make_workload(shape, llm.engine.config.model_config.vocab_size)
    run_pass(llm, prompts, max_tokens, shape.temperature)  # warm-up
    runner = llm.engine.graph_runner
    for name, compiled_sampler, compiled in [
        ("default", True, True),
        ("eager sampler", False, True),
        ("eager prefill", True, False),
        ("default again", True, True),
    ]:
        sample.COMPILE = compiled_sampler
        runner.can_run_compiled = (
            (lambda b, r=runner: GraphRunner.can_run_compiled(r, b)) if compiled else (lambda b: False)
        )
        p, table = timed_pass(llm, prompts, max_tokens, shape.temperature)
        print(f"{name}: {p.tokens_per_s:.0f} tok/s ({p.seconds:.2f} s)\n{table}", flush=True)
    sample.COMPILE = True
    llm.shutdown()


def seeded() -> None:
    cfg = transformers.Qwen3Config(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=3,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    folder = tempfile.mkdtemp()
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(folder)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (7, 33, 1, 150, 64)]
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=12) for i in range(5)]
    for use_gemv in (True, False):
        gemv.ENABLED = use_gemv
        config = EngineConfig(
            model_path=folder,
            dtype=torch.bfloat16,
            device="cuda",
            attention_backend="fi",
            page_size=16,
            max_running_req=64,
            num_page_override=2048,
        )
        engine = Engine(config)
        for compiled in (True, False):
            if not compiled:
                engine.graph_runner.can_run_compiled = lambda b: False
            together = generate(engine, prompts, params)
            alone = [generate(engine, [p], [sp])[0] for p, sp in zip(prompts, params)]
            same = [t == a for t, a in zip(together, alone)]
            print(
                f"seeded: gemv={use_gemv} compiled_prefill={compiled}: alone == together {same}", flush=True
            )
        engine.shutdown()
    gemv.ENABLED = True


if __name__ == "__main__":
    parts = sys.argv[1:] or ["seeded", "workload"]
    if "seeded" in parts:
        seeded()
    if "workload" in parts:
        workload()
