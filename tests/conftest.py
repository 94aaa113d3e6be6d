import logging
from pathlib import Path

import pytest
import torch

logging.basicConfig(level=logging.INFO)

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The embedded default model (SmolLM2-135M-Instruct) as a safetensors folder."""
    from minisgl.models.default import default_model_path

    return default_model_path()


def make_tiny_model(tmp_path: Path, arch: str, seed: int = 0, **overrides) -> Path:
    """Builds a tiny random model with transformers (the reference), saves it as safetensors."""
    import transformers

    common = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=False,
    )
    if arch == "llama":
        cfg = transformers.LlamaConfig(
            **common,
            head_dim=16,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(**common, rope_theta=10000.0)
    elif arch == "qwen3":
        cfg = transformers.Qwen3Config(**common, head_dim=32, rope_theta=1000000.0)
    else:
        raise ValueError(arch)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # random biases and norm weights, so that a skipped one shows
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.normal_(1.0 if "norm" in name else 0.0, 0.2)
    folder = tmp_path / f"tiny-{arch}"
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()
