"""Ablations through the engine's settings. On the offline workload (H200 preset): the compiled sampler
against the same function eager (`compile_sampler`), compiled against eager prefill (`compile_prefill`),
one fresh engine per variant. Then seeded sampling alone against inside a batch on a tiny Qwen3 with
dummy weights (`perf/gpu/tiny-qwen3`), with the one-row GEMV kernel on and off (`use_gemv_kernel`) and
prefill compiled or eager. A plain script, not a test.

    python -m perf.gpu.ablation [seeded] [workload]
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from minisgl.bench.offline import WorkloadShape, make_workload, run_pass
from minisgl.core import SamplingParams
from minisgl.engine import Engine, EngineConfig
from minisgl.llm import LLM
from minisgl.scheduler import generate
from perf.gpu.timing import timed_pass

TINY_QWEN3 = Path(__file__).resolve().parent / "tiny-qwen3"
# (name, settings): the workload variants, each on its own engine; "default again" shows the drift
WORKLOAD_VARIANTS: list[tuple[str, dict[str, Any]]] = [
    ("default", {}),
    ("eager sampler", {"compile_sampler": False}),
    ("eager prefill", {"compile_prefill": False}),
    ("default again", {}),
]


def workload(config: str = "configs/h200-qwen3-0.6b.yaml") -> None:
    shape = WorkloadShape()
    for name, settings in WORKLOAD_VARIANTS:
        llm = LLM(config=config, **settings)
        prompts, max_tokens = make_workload(shape, llm.engine.config.model_config.vocab_size)
        run_pass(llm, prompts, max_tokens, shape.temperature)  # warm-up
        p, table = timed_pass(llm, prompts, max_tokens, shape.temperature)
        print(f"{name}: {p.tokens_per_s:.0f} tok/s ({p.seconds:.2f} s)\n{table}", flush=True)
        llm.shutdown()


def seeded() -> None:
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (7, 33, 1, 150, 64)]
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=12) for i in range(5)]
    for use_gemv in (True, False):
        for compiled in (True, False):
            config = EngineConfig(
                model_path=str(TINY_QWEN3),
                use_dummy_weight=True,
                dtype=torch.bfloat16,
                device="cuda",
                attention_backend="fi",
                page_size=16,
                max_running_req=64,
                num_page_override=2048,
                use_gemv_kernel=use_gemv,
                compile_prefill=compiled,
            )
            engine = Engine(config)
            together = generate(engine, prompts, params)
            alone = [generate(engine, [p], [sp])[0] for p, sp in zip(prompts, params)]
            same = [t == a for t, a in zip(together, alone)]
            print(
                f"seeded: gemv={use_gemv} compiled_prefill={compiled}: alone == together {same}", flush=True
            )
            engine.shutdown()


if __name__ == "__main__":
    parts = sys.argv[1:] or ["seeded", "workload"]
    if "seeded" in parts:
        seeded()
    if "workload" in parts:
        workload()
