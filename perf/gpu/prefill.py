"""Prefill on the GPU, eager against torch.compile (the engine's compiled forward, one graph for every
token count, `GraphRunner.compiled_forward`), on the H200 preset (Qwen3-0.6B dummy weights).

    python -m perf.gpu.prefill [--config configs/h200-qwen3-0.6b.yaml]

Prints the device time of one prefill forward (model only, attention planned once) per batch shape,
and the relative difference of the logits. A plain script, not a test.
"""

from __future__ import annotations

import argparse

import torch

from minisgl.core import SamplingParams
from minisgl.engine import Engine
from minisgl.scheduler import BatchPreparer
from minisgl.settings import EngineSettings
from perf.gpu.timing import gpu_ms

# (requests, prompt tokens each): the scheduler's 8,192-token chunks and smaller prefills
SHAPES = [(1, 8192), (16, 512), (8, 1024), (4, 256), (1, 128)]


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="configs/h200-qwen3-0.6b.yaml")
    args = parser.parse_args()
    settings = EngineSettings.load(args.config, cuda_graph_bs=[1], cuda_graph_max_bs=1)
    engine = Engine(settings.to_engine_config())
    runner = engine.graph_runner
    compiled = (
        runner.compiled_forward
        if runner.enabled
        else torch.compile(engine.model.forward, fullgraph=True, dynamic=True)
    )
    vocab = engine.config.model_config.vocab_size
    prep = BatchPreparer(engine)
    print(f"{'requests':>8} {'tokens':>7} {'eager ms':>9} {'compiled ms':>12} {'speedup':>8} {'rel diff':>9}")
    for n, length in SHAPES:
        reqs = [
            prep.add_request([(13 * i + 7 * j) % vocab for j in range(length)], SamplingParams(max_tokens=1))
            for i in range(n)
        ]
        batch = prep.prefill(reqs)
        engine.attn_backend.prepare_metadata(batch)
        inputs = (batch.input_ids, batch.positions, batch.attn_metadata.last_indices)
        with engine.ctx.forward_batch(batch):
            eager = engine.model(*inputs)
            comp = compiled(*inputs)
            t_eager = gpu_ms(lambda inputs=inputs: engine.model(*inputs), iters=10)
            t_comp = gpu_ms(lambda inputs=inputs: compiled(*inputs), iters=10)
        diff = ((comp.float() - eager.float()).norm() / eager.float().norm()).item()
        print(
            f"{n:>8} {n * length:>7} {t_eager:>9.2f} {t_comp:>12.2f} {t_eager / t_comp:>8.2f} {diff:>9.1e}",
            flush=True,
        )
        prep.release(reqs)
    engine.shutdown()


if __name__ == "__main__":
    main()
