"""Qwen3-MoE: tiny random models against transformers, and the MoE backends (torch, fused) on their own."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from conftest import make_tiny_model, reference_logits, rel_err, teacher_forced_logits
from safetensors import safe_open

from minisgl.core import SamplingParams
from minisgl.engine import BatchPreparer, Engine, EngineConfig, generate
from minisgl.models import ModelConfig
from minisgl.moe import FusedMoeBackend, TorchMoeBackend, create_moe_backend, fused_moe
from minisgl.settings import EngineSettings

PROMPT_LENS = [5, 17, 1, 40]
DECODE_STEPS = 8
VOCAB = 320  # make_tiny_model's
BACKENDS = {"torch": TorchMoeBackend, "fused": FusedMoeBackend}
QWEN3_30B_A3B = Path(__file__).resolve().parents[1] / "configs" / "models" / "qwen3-30b-a3b"


def _reference(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def test_checkpoint_layout_and_config(tmp_path):
    """transformers 5 keeps experts fused in memory but saves them per expert; its config says
    `num_local_experts`. Both are what minisgl reads."""
    folder = make_tiny_model(tmp_path, "qwen3_moe")
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


def test_h200_qwen3_30b_a3b_preset():
    preset = QWEN3_30B_A3B.parents[1] / "h200-qwen3-30b-a3b.yaml"
    settings = EngineSettings.load(preset, device="cpu")  # the preset says cuda; CI has none
    config = settings.to_engine_config()
    assert Path(config.model_path) == QWEN3_30B_A3B.resolve()
    assert config.model_config.num_experts == 128 and config.model_config.num_layers == 48
    assert config.use_dummy_weight is True and config.dtype == torch.bfloat16
    assert config.moe_backend == "auto" and settings.sources()["moe_backend"] == f"yaml {preset}"
    assert (config.page_size, config.max_running_req, config.cuda_graph_max_bs) == (256, 256, 256)


@pytest.mark.parametrize("backend", ["torch", "fused"])
@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_logits_match_transformers(tmp_path, norm_topk_prob, backend):
    """Prefill, then teacher-forced decode steps, for prompts of different lengths."""
    folder = make_tiny_model(tmp_path, "qwen3_moe", norm_topk_prob=norm_topk_prob)
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, VOCAB, (n + DECODE_STEPS,), generator=gen).tolist() for n in PROMPT_LENS]
    want = reference_logits(folder, seqs, PROMPT_LENS, DECODE_STEPS)

    config = EngineConfig(
        model_path=str(folder), dtype=torch.float32, device="cpu", page_size=4, moe_backend=backend
    )
    engine = Engine(config)
    assert isinstance(engine.moe_backend, BACKENDS[backend]) and engine.ctx.moe_backend is engine.moe_backend
    err = rel_err(teacher_forced_logits(engine, seqs, PROMPT_LENS, DECODE_STEPS), want)
    print(f"qwen3_moe norm_topk_prob={norm_topk_prob} moe_backend={backend}: relative error {err:.2e}")
    assert err < 1e-4, f"relative error {err:.2e}"
    engine.shutdown()


def test_greedy_tokens_match_transformers(tmp_path):
    """transformers' greedy tokens, with either MoE backend."""
    folder = make_tiny_model(tmp_path, "qwen3_moe")
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
    for backend in ("torch", "fused"):
        config = EngineConfig(model_path=str(folder), dtype=torch.float32, device="cpu", moe_backend=backend)
        engine = Engine(config)
        assert isinstance(engine.moe_backend, BACKENDS[backend])
        got = generate(engine, prompts, SamplingParams(max_tokens=new, ignore_eos=True))
        assert got == expected, backend
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


@pytest.mark.parametrize("backend", ["torch", "fused"])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backend_against_per_token_reference(renormalize, dtype, backend):
    gen = torch.Generator().manual_seed(0)
    tokens, hidden, inter, experts, top_k = 37, 48, 24, 16, 4
    x = torch.randn(tokens, hidden, generator=gen)
    router_logits = torch.randn(tokens, experts, generator=gen) * 2
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    want = _per_token_reference(x, router_logits, w13, w2, top_k, renormalize)
    got = BACKENDS[backend]().forward(
        x.to(dtype), router_logits.to(dtype), w13.to(dtype), w2.to(dtype), top_k, renormalize
    )
    assert got.dtype == dtype and got.shape == x.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert rel_err(got, want) < tol


def _random_moe(tokens, experts, hidden=64, inter=32, dtype=torch.float32, seed=0, unused=()):
    """Random MoE inputs; the experts in `unused` never win the routing (their logits are very low)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    router_logits = torch.randn(tokens, experts, generator=gen) * 2
    router_logits[:, list(unused)] = -30.0
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    return tuple(t.to(dtype) for t in (x, router_logits, w13, w2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("experts", [4, 8])
@pytest.mark.parametrize("tokens", [0, 1, 7, 64])
def test_fused_backend_matches_torch_backend(tokens, experts, top_k, renormalize, dtype):
    """Experts 1 and E-1 receive no token (and with few tokens more experts receive none)."""
    unused = (1, experts - 1)
    x, router_logits, w13, w2 = _random_moe(tokens, experts, dtype=dtype, seed=tokens, unused=unused)
    args = (x, router_logits, w13, w2, top_k, renormalize)
    got, want = FusedMoeBackend().forward(*args), TorchMoeBackend().forward(*args)
    assert got.shape == x.shape and got.dtype == dtype
    if tokens == 0:
        return
    _, ids = torch.topk(router_logits.float(), top_k, dim=-1)
    assert not torch.isin(ids, torch.tensor(unused)).any()  # the empty groups do happen
    assert rel_err(got, want) < (1e-5 if dtype == torch.float32 else 2e-2)


def test_fused_backend_with_many_experts_per_token():
    """top_k 8 of 128 experts with few tokens (most groups empty), against the float64 reference."""
    x, router_logits, w13, w2 = _random_moe(9, 128, hidden=32, inter=16, seed=5)
    want = _per_token_reference(x, router_logits, w13, w2, 8, True)
    assert rel_err(FusedMoeBackend().forward(x, router_logits, w13, w2, 8, True), want) < 1e-5


def test_fused_backend_is_deterministic():
    args = (*_random_moe(200, 8, dtype=torch.bfloat16, seed=3), 2, True)
    assert torch.equal(fused_moe(*args), fused_moe(*args))


def test_fused_backend_compiles_fullgraph_without_host_sync():
    """torch.compile(fullgraph=True) fails on anything that reads device values on the host (.item(),
    .tolist(), data-dependent shapes): the fused backend traces as one graph, the torch one does not.
    In bfloat16: the fake (meta) implementation of torch._grouped_mm accepts only that, as its CUDA kernel."""
    args = (*_random_moe(13, 8, dtype=torch.bfloat16, seed=4, unused=(2,)), 2, True)
    compiled = torch.compile(fused_moe, fullgraph=True, dynamic=False)
    assert rel_err(compiled(*args), TorchMoeBackend().forward(*args)) < 2e-2
    with pytest.raises(Exception, match="(?i)graph break|data.dependent|item|tolist"):
        torch.compile(TorchMoeBackend().forward, fullgraph=True, backend="eager")(*args)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(hidden=66), "hidden_size=66 is not a multiple of 4"),
        (dict(inter=30), r"moe_intermediate_size \(per rank\)=30 is not a multiple of 4"),
        (dict(w2_dtype=torch.bfloat16), "must share one dtype"),
        (dict(top_k=9), "top_k=9"),
        (dict(w13_layout=True), "w13 must be contiguous in its last two dims"),
    ],
)
def test_fused_backend_refuses_unsupported_shapes(change, message):
    hidden, inter = change.get("hidden", 64), change.get("inter", 32)
    x, router_logits, w13, w2 = _random_moe(5, 8, hidden=hidden, inter=inter)
    w2 = w2.to(change.get("w2_dtype", w2.dtype))
    if change.get("w13_layout"):
        w13 = w13.transpose(1, 2).contiguous().transpose(1, 2)  # same values, column-major
    with pytest.raises(ValueError, match=message):
        FusedMoeBackend().forward(x, router_logits, w13, w2, change.get("top_k", 2), True)


def test_moe_backend_choice(monkeypatch):
    cpu = torch.device("cpu")
    assert isinstance(create_moe_backend("auto", cpu), TorchMoeBackend)
    assert isinstance(create_moe_backend("torch", cpu), TorchMoeBackend)
    assert isinstance(create_moe_backend("fused", cpu), FusedMoeBackend)
    assert FusedMoeBackend.graph_capturable and not getattr(TorchMoeBackend, "graph_capturable", False)
    with pytest.raises(ValueError, match="not valid"):
        create_moe_backend("triton", cpu)
    # on CUDA (the device is only looked up, never used): 'fused' where torch._grouped_mm has its kernel
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert isinstance(create_moe_backend("auto", cuda), FusedMoeBackend)
    assert isinstance(create_moe_backend("auto", cuda, torch.bfloat16), FusedMoeBackend)
    assert isinstance(create_moe_backend("auto", cuda, torch.float16), TorchMoeBackend)
    with pytest.raises(ValueError, match="moe_backend='fused' cannot run here.*float16"):
        create_moe_backend("fused", cuda, torch.float16)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert isinstance(create_moe_backend("auto", cuda), TorchMoeBackend)
    with pytest.raises(ValueError, match="moe_backend='fused' cannot run here.*sm_80"):
        create_moe_backend("fused", cuda)


def test_forward_compiles_fullgraph(tmp_path):
    """The MoE goes through an opaque custom op under torch.compile, as attention does: one graph."""
    engine = Engine(
        EngineConfig(
            model_path=str(make_tiny_model(tmp_path, "qwen3_moe")), dtype=torch.float32, device="cpu"
        )
    )
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
