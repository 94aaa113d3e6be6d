"""Tiny random Llama (llama3 RoPE scaling), Qwen2 and Qwen3 models: logits against transformers."""

import pytest
import torch
import transformers
from conftest import make_tiny_model, reference_logits, rel_err, teacher_forced_logits

from minisgl.core import SamplingParams
from minisgl.engine import BatchPreparer, Engine, EngineConfig

PROMPT_LENS = [5, 17, 1, 40]
DECODE_STEPS = 12


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_logits_match_transformers(tmp_path, arch, page_size):
    """Prefill of prompts of different lengths in one batch, then teacher-forced decode steps."""
    folder = make_tiny_model(tmp_path, arch)
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, 320, (n + DECODE_STEPS,), generator=gen).tolist() for n in PROMPT_LENS]
    engine = Engine(
        EngineConfig(model_path=str(folder), dtype=torch.float32, device="cpu", page_size=page_size)
    )
    got = teacher_forced_logits(engine, seqs, PROMPT_LENS, DECODE_STEPS)
    err = rel_err(got, reference_logits(folder, seqs, PROMPT_LENS, DECODE_STEPS))
    print(f"{arch} page_size={page_size}: relative error {err:.2e}")
    assert err < 1e-4, f"{arch}: relative error {err:.2e}"
    engine.shutdown()


def test_sharded_checkpoint_and_tied_embeddings(tmp_path):
    """A checkpoint split into shards with model.safetensors.index.json, and tied embeddings."""
    single = make_tiny_model(tmp_path, "qwen2", tie_word_embeddings=True)
    ref = transformers.AutoModelForCausalLM.from_pretrained(single, dtype=torch.float32)
    sharded = tmp_path / "sharded"
    ref.save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 3
    seq = list(range(3, 40))
    with torch.no_grad():
        expected = ref(torch.tensor([seq])).logits[0, -1:]
    engine = Engine(EngineConfig(model_path=str(sharded), dtype=torch.float32, device="cpu"))
    assert engine.config.model_config.tie_word_embeddings and engine.model.lm_head is None
    prep = BatchPreparer(engine)
    got = engine.forward_logits(prep.prefill([prep.add_request(seq, SamplingParams(max_tokens=1))]))
    assert rel_err(got, expected) < 1e-4


def test_dummy_weights_need_only_config(tmp_path):
    folder = make_tiny_model(tmp_path, "qwen3")
    for file in folder.glob("*.safetensors"):
        file.unlink()
    engine = Engine(EngineConfig(model_path=str(folder), device="cpu", use_dummy_weight=True))
    assert engine.dtype == torch.float32  # dtype auto on CPU
    prep = BatchPreparer(engine)
    logits = engine.forward_logits(prep.prefill([prep.add_request([5, 6, 7], SamplingParams(max_tokens=1))]))
    assert logits.shape == (1, 320) and torch.isfinite(logits).all() and logits.std() > 0
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        Engine(EngineConfig(model_path=str(folder), device="cpu"))
