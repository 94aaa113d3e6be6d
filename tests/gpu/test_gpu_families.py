"""Gemma 2, Gemma 3 and Phi-3 on the GPU in bf16: tiny models of the GPU tests' attention shape
(tests/conftest.py GPU_SHAPE: head_dim 128, 16 query / 8 KV heads) with a window of 64 tokens on every
other layer (Gemma), Gemma 2's soft caps, Gemma 3's q/k norms and per-layer-type RoPE, Phi-3's partial
rotary. The GPU prompts (1 to 150 tokens, 6 decode steps) run through the torch backend on the GPU,
checked against transformers in float32, and then through FlashInfer's FA2 prefill with tensor-core and
CUDA-core decode, FA3, the Triton decode kernel, and CUDA graphs with the Triton prefill kernel of the
prefill graphs: the same logits. The same Gemma 2 without its caps gives other logits (so a path that
dropped the cap or the per-layer window would fail). Skips without CUDA or flashinfer:

    python -m pytest tests/gpu/test_gpu_families.py
"""

import pytest
import torch
from conftest import GPU_PROMPT_LENS as PROMPT_LENS
from conftest import GPU_SHAPE, gpu_seqs, hf_model, make_tiny_model, rel_err, teacher_forced_logits
from conftest import GPU_STEPS as STEPS

# the same marks (CUDA, flashinfer), tolerance, window and engine settings as Mistral's GPU tests
from test_gpu_mistral import BF16_TOL, WINDOW, _engine, pytestmark  # noqa: F401

LAYERS = ["sliding_attention", "full_attention", "sliding_attention"]
SHAPES = {
    "gemma2": dict(sliding_window=WINDOW, query_pre_attn_scalar=96, attn_logit_softcapping=20.0,
                   final_logit_softcapping=10.0),
    "gemma3": dict(sliding_window=WINDOW, query_pre_attn_scalar=96, layer_types=LAYERS,
                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
    # LongRoPE's switch is on the CPU tests (tests/test_families.py): past these prompts here
    "phi3": dict(hidden_size=2048, partial_rotary_factor=0.5, original_max_position_embeddings=1024,
                 rope_scaling={"rope_type": "longrope", "short_factor": [1.0 + i / 32 for i in range(32)],
                               "long_factor": [2.0] * 32}),  # a factor per rotated pair (64 of 128 dims);
    # transformers' Phi-3 takes head_dim as hidden_size / heads, so 16 heads of 128 need 2,048
}  # fmt: skip


@pytest.fixture(scope="module", params=sorted(SHAPES))
def family(request, tmp_path_factory):
    """(the folder, the torch backend's logits, the tolerance of two bf16 paths), the logits within bf16
    of transformers in float32."""
    arch = request.param
    folder = make_tiny_model(tmp_path_factory.mktemp(arch), arch, **{**GPU_SHAPE, **SHAPES[arch]})
    engine = _engine(folder, attention_backend="torch", page_size=16)
    ref = teacher_forced_logits(engine, gpu_seqs(512), PROMPT_LENS, STEPS)
    engine.shutdown()

    def logits(dtype: torch.dtype) -> torch.Tensor:
        model = hf_model(folder, dtype)
        with torch.no_grad():
            full = [model(torch.tensor([s])).logits[0].float() for s in gpu_seqs(512)]
        return torch.stack([f[n - 1 : n + STEPS] for f, n in zip(full, PROMPT_LENS)])

    want = logits(torch.float32)
    # this Gemma 3's logits move 5% in bf16 in transformers itself (its q/k norms at this shape): the
    # bound is bf16's tolerance or 1.5x transformers' own bf16 error, whichever is larger
    own = rel_err(logits(torch.bfloat16), want)
    assert rel_err(ref.cpu(), want) < max(BF16_TOL, 1.5 * own), arch
    # two bf16 paths (a backend and the torch one) differ by no more than bf16 differs from float32
    return folder, ref, max(BF16_TOL, own)


@pytest.mark.parametrize("backend", ["fi", "fi/cc", "fa,fi", "fa", "fi+triton"])
def test_every_backend_matches_the_reference(family, backend):
    folder, reference, tol = family
    extra = {"decode_triton_max_bs": 0}
    if backend == "fi/cc":
        backend, extra["tensor_core_min_group"] = "fi", 1000
    if backend.endswith("+triton"):
        backend, extra["decode_triton_max_bs"] = backend.removesuffix("+triton"), 8
    engine = _engine(folder, attention_backend=backend, page_size=16, cuda_graph_max_bs=0, **extra)
    got = teacher_forced_logits(engine, gpu_seqs(512), PROMPT_LENS, STEPS)
    assert rel_err(got, reference) < tol
    engine.shutdown()


def test_graphs_and_the_triton_prefill_kernel(family):
    """Decode graphs (Triton up to 4, FlashInfer at 8) and prefill graphs (the Triton prefill kernel)."""
    folder, reference, tol = family
    engine = _engine(
        folder, attention_backend="fi", page_size=16, cuda_graph_bs=(1, 2, 4, 8), decode_triton_max_bs=4,
        prefill_graph_max_tokens=256, prefill_graph_max_context=512,
    )  # fmt: skip
    assert rel_err(teacher_forced_logits(engine, gpu_seqs(512), PROMPT_LENS, STEPS), reference) < tol
    for i in range(len(PROMPT_LENS)):
        one = teacher_forced_logits(engine, gpu_seqs(512)[i : i + 1], PROMPT_LENS[i : i + 1], STEPS)
        assert rel_err(one, reference[i : i + 1]) < tol, i
    engine.shutdown()


def test_the_caps_and_the_per_layer_window_matter(family, tmp_path):
    """Gemma 2 with its caps and window off gives logits far from the reference (so the paths above
    that matched applied them)."""
    folder, reference, _ = family
    if "gemma2" not in folder.name:
        pytest.skip("Gemma 2 only")
    shape = {**GPU_SHAPE, **SHAPES["gemma2"], "attn_logit_softcapping": None, "sliding_window": 4096}
    plain = make_tiny_model(tmp_path, "gemma2", **shape)
    engine = _engine(plain, attention_backend="fi", page_size=16, cuda_graph_max_bs=0)
    assert rel_err(teacher_forced_logits(engine, gpu_seqs(512), PROMPT_LENS, STEPS), reference) > 5 * BF16_TOL
    engine.shutdown()
