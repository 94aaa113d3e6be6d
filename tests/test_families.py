"""Gemma 2, Gemma 3 (also the text of Gemma3ForConditionalGeneration) and Phi-3: tiny random models built
by transformers (conftest's TINY_FAMILIES: head_dim apart from hidden / heads, GQA, windows of 6 and 7
on some layers, soft caps, per-layer-type RoPE, partial rotary, LongRoPE) against transformers'
`generate` on the CPU in float32, greedy and token-exact: prompts longer than the windows, batched,
prefilled whole and in chunks, under the radix prefix cache, preempted by a small pool, with n-gram
speculation; Phi-3's LongRoPE on each side of `original_max_position_embeddings`; the published
config.json forms; images to Gemma 3's text model. The GPU backends: tests/gpu/test_gpu_families.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from conftest import TINY_COMMON, check_clean

from minisgl.core import SamplingParams
from minisgl.engine import Engine, EngineConfig
from minisgl.layers.rope import build_rope_cache
from minisgl.models import ModelConfig
from minisgl.multimodal.inputs import check_images
from minisgl.scheduler import Scheduler, SchedulerConfig, generate

ARCHS = ("gemma2", "gemma3", "phi3")
VOCAB = TINY_COMMON["vocab_size"]
MAX_TOKENS = 10


def _prompts(lens: list[int], seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lens]


def _engine(folder: Path, **kw: Any) -> Engine:
    return Engine(EngineConfig(model_path=str(folder), dtype=torch.float32, device="cpu", page_size=4, **kw))


_reference: dict[tuple[str, tuple[int, ...], int], list[int]] = {}


def _hf_generate(folder: Path, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    """transformers' greedy `generate`, one prompt at a time (its KV cache, its LongRoPE switch)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = []
    for prompt in prompts:
        key = (str(folder), tuple(prompt), max_tokens)
        if key not in _reference:
            ids = torch.tensor([prompt])
            new = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                do_sample=False, pad_token_id=0,
            )  # fmt: skip
            _reference[key] = new[0, len(prompt) :].tolist()
        out.append(_reference[key])
    return out


@pytest.fixture(scope="module")
def folders(tiny_model) -> dict[str, Path]:
    return {arch: tiny_model(arch) for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_match_transformers_batched_and_chunked(folders, arch: str) -> None:
    """Three prompts (3, 20 and 33 tokens: past the windows, Phi-3's longest past 20) in one batch,
    prefilled whole, then again in chunks of 5: transformers' tokens both times."""
    folder = folders[arch]
    config = ModelConfig.from_path(folder)
    assert config.family == arch
    prompts = _prompts([3, 20, 33])
    want = _hf_generate(folder, prompts)
    engine = _engine(folder)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    assert generate(engine, prompts, params) == want
    assert generate(engine, prompts, params, chunk_size=5) == want
    engine.shutdown()


@pytest.mark.parametrize("arch", ARCHS)
def test_radix_cache_preemption_and_speculation(tiny_model, folders, arch: str) -> None:
    """Requests over a shared prefix of 24 tokens (past the windows) through the scheduler with the
    radix cache, prefill chunks of 8, a pool of 24 pages of 4 that cannot hold them all (preemption)
    and n-gram speculation (repetitive prompts): every request's tokens are transformers'. Phi-3's
    LongRoPE switch stays past these lengths here (a prompt prefilled in chunks across it is not
    transformers' whole-prompt switch: docs/usage.md, "Models")."""
    folder = folders[arch] if arch != "phi3" else tiny_model("phi3", original_max_position_embeddings=100)
    base = _prompts([24], seed=5)[0]
    prompts = [base + tail for tail in _prompts([1, 9, 14, 4], seed=6)] + [base[:13] * 2]
    want = _hf_generate(folder, prompts, 16)
    engine = _engine(folder, num_page_override=24, max_running_req=4)
    sched = Scheduler(
        engine,
        SchedulerConfig(
            max_prefill_tokens=8, cache_type="radix", speculative_method="ngram", speculative_num_tokens=3
        ),
        eos_token_ids=[2],
    )
    first = sched.add_request(prompts[0], SamplingParams(max_tokens=16, ignore_eos=True))
    while sched.has_work():  # the prefix is cached before the others arrive
        sched.step()
    states = [first] + [
        sched.add_request(p, SamplingParams(max_tokens=16, ignore_eos=True)) for p in prompts[1:]
    ]
    while sched.has_work():
        sched.step()
    assert [s.output_ids for s in states] == want
    assert max(s.prefix_found for s in states[1:4]) >= 20
    assert sched.preemptions > 0
    check_clean(sched)
    engine.shutdown()


def test_longrope_on_each_side_of_the_original_length(folders) -> None:
    """Phi-3's LongRoPE (original_max_position_embeddings 20): a prompt of 12 tokens decoding past 20
    (short factors, then long ones from the step whose length passes 20, as transformers switches), and
    one of 26 (long factors from its prefill): transformers' `generate` tokens."""
    folder = folders["phi3"]
    config = ModelConfig.from_path(folder)
    assert config.rope.rope_type == "longrope" and config.rope.original_max_position_embeddings == 20
    assert config.rotary_dim == 8 and config.rope.attention_factor > 1
    prompts = _prompts([12, 26], seed=7)
    want = _hf_generate(folder, prompts, 14)
    engine = _engine(folder)
    assert generate(engine, prompts, SamplingParams(max_tokens=14, ignore_eos=True)) == want
    engine.shutdown()
    table = build_rope_cache(8, 64, config.rope)  # the short factors' rows, then the long ones'

    assert not torch.allclose(table[:64], table[64:])


def test_gemma3_conditional_generation_text_and_images(tmp_path: Path) -> None:
    """A Gemma3ForConditionalGeneration folder (a tiny SigLIP tower included, as transformers 5 saves
    it): its text model's greedy tokens are transformers'; the vision tensors are skipped, and images are
    refused with a message that names the missing vision tower."""
    text = dict(TINY_COMMON, head_dim=16, query_pre_attn_scalar=16, sliding_window=5, num_hidden_layers=2)
    text.update(layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=True)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    vision.update(image_size=28, patch_size=14)
    cfg = transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=VOCAB - 1,
        boi_token_index=VOCAB - 3, eoi_token_index=VOCAB - 2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and "language_model" in name:
                param.normal_(0.0, 0.3)
    model.save_pretrained(tmp_path, safe_serialization=True)
    config = ModelConfig.from_path(tmp_path)
    assert (config.architecture, config.family, config.num_layers) == (
        "Gemma3ForConditionalGeneration",
        "gemma3",
        2,
    )
    prompts = _prompts([4, 17])
    with torch.no_grad():
        want = []
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
            want.append(out[0, len(prompt) :].tolist())
    engine = _engine(tmp_path)
    assert generate(engine, prompts, SamplingParams(max_tokens=8, ignore_eos=True)) == want
    engine.shutdown()
    with pytest.raises(ValueError, match="vision tower.*not implemented yet: send text only"):
        check_images(config, prompts[0], images=object())


# -- config.json ---------------------------------------------------------------------------------

GEMMA2_2B: dict[str, Any] = {  # google/gemma-2-2b-it, less unread keys
    "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_size": 2304,
    "intermediate_size": 9216, "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
    "head_dim": 256, "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
    "vocab_size": 256000, "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "max_position_embeddings": 8192,
    "query_pre_attn_scalar": 256, "sliding_window": 4096, "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0, "eos_token_id": [1, 107], "bos_token_id": 2,
}  # fmt: skip
GEMMA3_1B: dict[str, Any] = {  # google/gemma-3-1b-it
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 1152,
    "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1,
    "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "vocab_size": 262144, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000, "rope_local_base_freq": 10000, "rope_scaling": None, "sliding_window": 512,
    "sliding_window_pattern": 6, "query_pre_attn_scalar": 256, "max_position_embeddings": 32768,
    "attn_logit_softcapping": None, "final_logit_softcapping": None, "eos_token_id": [1, 106],
}  # fmt: skip
GEMMA3_4B: dict[str, Any] = {  # google/gemma-3-4b-it: most text keys left to transformers' defaults
    "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "eos_token_id": [1, 106],
    "image_token_index": 262144, "mm_tokens_per_image": 256,
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                    "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152},
}  # fmt: skip
PHI35_MINI: dict[str, Any] = {  # microsoft/Phi-3.5-mini-instruct (factors cut to their first values)
    "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_size": 3072, "intermediate_size": 8192,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32, "hidden_act": "silu",
    "vocab_size": 32064, "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "max_position_embeddings": 131072,
    "original_max_position_embeddings": 4096, "sliding_window": 262144, "tie_word_embeddings": False,
    "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [1.08] * 48},
    "eos_token_id": 32000, "bos_token_id": 1,
}  # fmt: skip
PHI4_MINI: dict[str, Any] = {  # microsoft/Phi-4-mini-instruct: partial rotary, tied embeddings
    **PHI35_MINI, "hidden_size": 3072, "num_attention_heads": 24, "num_key_value_heads": 8,
    "partial_rotary_factor": 0.75, "vocab_size": 200064, "tie_word_embeddings": True,
    "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [2.0] * 48},
    "eos_token_id": 199999, "bos_token_id": 199999,
}  # fmt: skip


def test_published_configs() -> None:
    """The hub's config.json forms give the fields transformers derives from them."""
    g2 = ModelConfig.from_dict(GEMMA2_2B)
    assert (g2.attn_softcap, g2.final_softcap, g2.attn_scale) == (50.0, 30.0, 256**-0.5)
    assert g2.layer_types[:3] == ("sliding_attention", "full_attention", "sliding_attention")
    assert (g2.sliding_window, g2.tie_word_embeddings, g2.hidden_act, g2.norm_offset) == (
        4096,
        True,
        "gelu_tanh",
        1.0,
    )
    g3 = ModelConfig.from_dict(GEMMA3_1B)
    assert g3.qk_norm and g3.attn_softcap is None and g3.sliding_window == 512
    assert [i for i, t in enumerate(g3.layer_types) if t == "full_attention"] == [5, 11, 17, 23]
    assert (g3.rope.theta, g3.local_rope.theta) == (1000000.0, 10000.0)
    g4 = ModelConfig.from_dict(GEMMA3_4B)
    assert (g4.hidden_size, g4.num_heads, g4.num_kv_heads, g4.head_dim, g4.vocab_size) == (
        2560,
        8,
        4,
        256,
        262208,
    )
    assert (g4.rope.rope_type, g4.rope.factor, g4.rope.theta, g4.local_rope.rope_type) == (
        "linear",
        8.0,
        1e6,
        "default",
    )
    assert g4.eos_token_ids == (1, 106) and not g4.is_multimodal and "vision tower" in g4.why_no_images
    phi = ModelConfig.from_dict(PHI35_MINI)
    assert (phi.rotary_dim, phi.rope.original_max_position_embeddings, phi.sliding_window) == (
        96,
        4096,
        262144,
    )
    assert phi.rope.attention_factor == pytest.approx(
        (1 + torch.log(torch.tensor(32.0)).item() / 8.317766) ** 0.5
    )
    phi4 = ModelConfig.from_dict(PHI4_MINI)
    assert (phi4.head_dim, phi4.rotary_dim, phi4.tie_word_embeddings) == (128, 96, True)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({**GEMMA2_2B, "hidden_activation": "relu"}, 'hidden_activation="relu" is not supported'),
        ({**GEMMA3_1B, "layer_types": ["full_attention"]}, "layer_types=.* must be a list of 26"),
        ({**PHI35_MINI, "rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}},
         r"rope_scaling.short_factor=\[1.0\] must be a list of 48 positive numbers"),
        ({**PHI4_MINI, "partial_rotary_factor": 1.5}, r"partial_rotary_factor=1.5 must be a number in \(0, 1\]"),
    ],
)  # fmt: skip
def test_bad_family_configs_name_the_key(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(raw, source="x/config.json")
