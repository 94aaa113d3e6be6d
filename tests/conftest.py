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


def teacher_forced_logits(engine, seqs: list[list[int]], prompt_lens: list[int], steps: int) -> torch.Tensor:
    """Prefills each seq[:n] as one batch, then decodes `steps` steps fed from the sequences (teacher
    forcing). Returns the float32 logits, (requests, steps + 1, vocab): step 0 predicts position n."""
    from minisgl.core import SamplingParams
    from minisgl.engine import BatchPreparer

    prep = BatchPreparer(engine)
    reqs = [prep.add_request(s[:n], SamplingParams(max_tokens=steps + 1)) for s, n in zip(seqs, prompt_lens)]
    out = [engine.forward_logits(prep.prefill(reqs))]
    for step in range(steps):
        for req, s, n in zip(reqs, seqs, prompt_lens):
            req.input_ids.append(s[n + step])
        out.append(engine.forward_logits(prep.decode(reqs)))
    prep.release(reqs)
    assert prep.pages.num_used == 0
    return torch.stack(out, dim=1).float()


def reference_logits(folder: Path, seqs: list[list[int]], prompt_lens: list[int], steps: int) -> torch.Tensor:
    """transformers' logits at the same positions as `teacher_forced_logits`, each sequence alone."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        full = [model(torch.tensor([s])).logits[0] for s in seqs]
    return torch.stack([f[n - 1 : n + steps] for f, n in zip(full, prompt_lens)])
