"""gpt-oss on the GPU: a tiny model in bf16 (the `torch` attention backend, which 'auto' picks for its
sinks; the `fused` MoE backend with the experts' biases and clamped SwiGLU) against transformers'
float32 logits, prefill and teacher-forced decode past the window; the biased grouped GEMMs against
the reference at gpt-oss-20b's expert shapes. Skips without CUDA.

Run: `python -m pytest tests/gpu/test_gpu_gpt_oss.py`.
"""

import pytest
import torch
from conftest import (
    GPU_PROMPT_LENS,
    GPU_SHAPE,
    GPU_STEPS,
    gpu_seqs,
    make_tiny_model,
    reference_logits,
    rel_err,
    teacher_forced_logits,
)

from minisgl.attention import TorchAttnBackend
from minisgl.engine import Engine, EngineConfig
from minisgl.moe import fused_moe, torch_moe

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
BF16_TOL = 3e-2


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] not in (9, 10),
    reason="torch._grouped_mm's kernel needs sm90/sm100",
)
def test_biased_grouped_moe_matches_the_reference_at_20b_shapes() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    experts, hidden, inter, tokens = 32, 2880, 2880, 33
    w13 = (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=g) / hidden**0.5).bfloat16()
    w2 = (torch.randn(experts, hidden, inter, device="cuda", generator=g) / inter**0.5).bfloat16()
    biased = dict(
        b13=torch.randn(experts, 2 * inter, device="cuda", generator=g).bfloat16(),
        b2=torch.randn(experts, hidden, device="cuda", generator=g).bfloat16(),
        limit=7.0,
        alpha=1.702,
    )
    x = torch.randn(tokens, hidden, device="cuda", generator=g).bfloat16()
    logits = torch.randn(tokens, experts, device="cuda", generator=g).bfloat16()
    want = torch_moe(x.float(), logits.float(), w13.float(), w2.float(), 4, True, **{
        k: v.float() if torch.is_tensor(v) else v for k, v in biased.items()
    })  # fmt: skip
    assert rel_err(fused_moe(x, logits, w13, w2, 4, True, **biased), want) < BF16_TOL


def test_bf16_logits_match_transformers(tmp_path) -> None:
    shape = {**GPU_SHAPE, "intermediate_size": 256, "head_dim": 64}
    folder = make_tiny_model(
        tmp_path, "gpt_oss", sliding_window=32, num_local_experts=8, num_experts_per_tok=4, **shape
    )
    seqs = gpu_seqs()
    engine = Engine(EngineConfig(model_path=str(folder), dtype=torch.bfloat16, device="cuda", page_size=16))
    assert isinstance(engine.attn_backend, TorchAttnBackend) and engine.attn_backend.options.sinks
    assert engine.attn_backend.options.window_layers == (True, False, True)
    got = teacher_forced_logits(engine, seqs, GPU_PROMPT_LENS, GPU_STEPS)
    engine.shutdown()
    err = rel_err(got.cpu(), reference_logits(folder, seqs, GPU_PROMPT_LENS, GPU_STEPS))
    assert err < BF16_TOL, f"relative error {err:.2e}"
