"""Qwen3-MoE: tiny random models against transformers, and the torch MoE backend on its own."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from conftest import reference_logits, rel_err, teacher_forced_logits
from safetensors import safe_open

from minisgl.core import SamplingParams
from minisgl.engine import BatchPreparer, Engine, EngineConfig, generate
from minisgl.models import ModelConfig
from minisgl.moe import TorchMoeBackend, create_moe_backend

PROMPT_LENS = [5, 17, 1, 40]
DECODE_STEPS = 8
VOCAB = 320
QWEN3_30B_A3B = Path(__file__).resolve().parents[1] / "configs" / "models" / "qwen3-30b-a3b"


def make_tiny_moe(tmp_path, norm_topk_prob=True, seed=0):
    """3 layers, layer 1 dense (mlp_only_layers), 8 experts, top-2; random router and norm weights."""
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=norm_topk_prob,
        mlp_only_layers=[1],
        max_position_embeddings=512,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # the router starts at zeros (uniform routing): make it, and the norms, random
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.2)
            elif name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.5)
    folder = tmp_path / f"tiny-qwen3-moe-{norm_topk_prob}"
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def _reference(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def test_checkpoint_layout_and_config(tmp_path):
    """transformers 5 keeps experts fused in memory but saves them per expert; its config says
    `num_local_experts`. Both are what minisgl reads."""
    folder = make_tiny_moe(tmp_path)
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.mlp.gate.weight" in keys
    assert {f"model.layers.2.mlp.experts.7.{p}_proj.weight" for p in ("gate", "up", "down")} <= keys
    assert "model.layers.1.mlp.gate_proj.weight" in keys and "model.layers.1.mlp.gate.weight" not in keys
    assert not any(k.endswith(("experts.gate_up_proj", "experts.down_proj")) for k in keys)
    cfg = ModelConfig.from_path(folder)
    assert cfg.family == "qwen3_moe" and cfg.num_experts == 8 and cfg.num_experts_per_tok == 2
    assert cfg.moe_intermediate_size == 32 and cfg.norm_topk_prob
    assert [cfg.is_sparse_layer(i) for i in range(3)] == [True, False, True]
    raw = json.loads((folder / "config.json").read_text())
    assert ModelConfig.from_dict({**raw, "decoder_sparse_step": 2, "mlp_only_layers": []}).is_sparse_layer(1)
    assert not ModelConfig.from_dict({**raw, "decoder_sparse_step": 2}).is_sparse_layer(0)
    dense = ModelConfig.from_dict({**raw, "architectures": ["Qwen3ForCausalLM"]})
    assert dense.num_experts == 0 and not dense.is_sparse_layer(0)


def test_qwen3_30b_a3b_config():
    cfg = ModelConfig.from_path(QWEN3_30B_A3B)
    assert cfg.num_experts == 128 and cfg.num_experts_per_tok == 8 and cfg.moe_intermediate_size == 768
    assert cfg.norm_topk_prob and cfg.head_dim == 128 and cfg.num_kv_heads == 4
    assert all(cfg.is_sparse_layer(i) for i in range(cfg.num_layers)) and cfg.qk_norm
    hf = transformers.AutoConfig.from_pretrained(QWEN3_30B_A3B, local_files_only=True)
    assert type(hf).__name__ == "Qwen3MoeConfig" and hf.num_experts == 128 and hf.head_dim == 128


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_logits_match_transformers(tmp_path, norm_topk_prob):
    """Prefill, then teacher-forced decode steps, for prompts of different lengths."""
    folder = make_tiny_moe(tmp_path, norm_topk_prob)
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, VOCAB, (n + DECODE_STEPS,), generator=gen).tolist() for n in PROMPT_LENS]
    want = reference_logits(folder, seqs, PROMPT_LENS, DECODE_STEPS)

    engine = Engine(EngineConfig(model_path=str(folder), dtype=torch.float32, device="cpu", page_size=4))
    assert isinstance(engine.moe_backend, TorchMoeBackend) and engine.ctx.moe_backend is engine.moe_backend
    err = rel_err(teacher_forced_logits(engine, seqs, PROMPT_LENS, DECODE_STEPS), want)
    print(f"qwen3_moe norm_topk_prob={norm_topk_prob}: relative error {err:.2e}")
    assert err < 1e-4, f"relative error {err:.2e}"
    engine.shutdown()


def test_greedy_tokens_match_transformers(tmp_path):
    folder = make_tiny_moe(tmp_path)
    prompts = [[5, 9, 77, 31, 200], [12], list(range(3, 30))]
    new = 10
    ref = _reference(folder)
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            out = ref.generate(
                torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new, do_sample=False
            )
            expected.append(out[0, len(prompt) :].tolist())
    engine = Engine(EngineConfig(model_path=str(folder), dtype=torch.float32, device="cpu"))
    got = generate(engine, prompts, SamplingParams(max_tokens=new, ignore_eos=True))
    assert got == expected
    engine.shutdown()


def _per_token_reference(x, router_logits, w13, w2, top_k, renormalize):
    """The MoE written token by token, in float64."""
    inter = w2.shape[-1]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        probs = F.softmax(router_logits[t].double(), dim=-1)
        weights, ids = torch.topk(probs, top_k)
        if renormalize:
            weights = weights / weights.sum()
        for w, e in zip(weights, ids):
            h = w13[e].double() @ x[t].double()
            out[t] += w * (w2[e].double() @ (F.silu(h[:inter]) * h[inter:]))
    return out


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_backend_against_per_token_reference(renormalize, dtype):
    gen = torch.Generator().manual_seed(0)
    tokens, hidden, inter, experts, top_k = 37, 48, 24, 16, 4
    x = torch.randn(tokens, hidden, generator=gen)
    router_logits = torch.randn(tokens, experts, generator=gen) * 2
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    want = _per_token_reference(x, router_logits, w13, w2, top_k, renormalize)
    got = TorchMoeBackend().forward(
        x.to(dtype), router_logits.to(dtype), w13.to(dtype), w2.to(dtype), top_k, renormalize
    )
    assert got.dtype == dtype and got.shape == x.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert rel_err(got, want) < tol


def test_fused_backend_on_cpu_is_a_clear_error(tmp_path):
    folder = make_tiny_moe(tmp_path, True)
    with pytest.raises(ValueError, match="moe_backend='fused' needs a CUDA GPU"):
        Engine(EngineConfig(model_path=str(folder), device="cpu", moe_backend="fused"))


def test_moe_backend_choice():
    assert isinstance(create_moe_backend("auto", torch.device("cpu")), TorchMoeBackend)
    assert isinstance(create_moe_backend("torch", torch.device("cpu")), TorchMoeBackend)
    with pytest.raises(ValueError, match="fused.*needs a CUDA GPU"):
        create_moe_backend("fused", torch.device("cpu"))
    with pytest.raises(ValueError, match="not valid"):
        create_moe_backend("triton", torch.device("cpu"))


def test_forward_compiles_fullgraph(tmp_path):
    """The MoE goes through an opaque custom op under torch.compile, as attention does: one graph."""
    engine = Engine(EngineConfig(model_path=str(make_tiny_moe(tmp_path)), dtype=torch.float32, device="cpu"))
    prep = BatchPreparer(engine)
    batch = prep.prefill(
        [prep.add_request(list(range(3, 3 + n)), SamplingParams(max_tokens=1)) for n in (5, 9)]
    )
    compiled = torch.compile(engine.model.forward, fullgraph=True, dynamic=True)
    with torch.inference_mode(), engine.ctx.forward_batch(batch):
        engine.attn_backend.prepare_metadata(batch)
        args = (batch.input_ids, batch.positions, batch.attn_metadata.last_indices)
        assert rel_err(compiled(*args), engine.model(*args)) < 1e-5
    engine.shutdown()
