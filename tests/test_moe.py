"""Qwen3-MoE: tiny random models against transformers, and the MoE backends (torch, fused) on their own."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from conftest import reference_logits, rel_err, teacher_forced_logits
from safetensors import safe_open

from minisgl.core import SamplingParams
from minisgl.engine import Engine, EngineConfig
from minisgl.kernels import linear as linear_ops
from minisgl.kernels import moe_gemm as moe_gemm_kernels
from minisgl.kernels import moe_gemv as moe_gemv_kernels
from minisgl.kernels.moe_gemv import moe_gemv
from minisgl.kernels.packed import PackedWeights, pack_words
from minisgl.models import ModelConfig
from minisgl.moe import FusedMoeBackend, TorchMoeBackend, create_moe_backend, fused_moe, select_experts
from minisgl.scheduler import BatchPreparer, generate
from minisgl.settings import EngineSettings

PROMPT_LENS = [5, 17, 1, 40]
DECODE_STEPS = 8
VOCAB = 320  # make_tiny_model's
BACKENDS = {"torch": TorchMoeBackend, "fused": FusedMoeBackend}
QWEN3_30B_A3B = Path(__file__).resolve().parents[1] / "configs" / "models" / "qwen3-30b-a3b"


def _reference(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def test_checkpoint_layout_and_config(tiny_model):
    """transformers 5 keeps experts fused in memory but saves them per expert; its config says
    `num_local_experts`. Both are what minisgl reads."""
    folder = tiny_model("qwen3_moe")
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
def test_logits_match_transformers(tiny_model, norm_topk_prob, backend):
    """Prefill, then teacher-forced decode steps, for prompts of different lengths."""
    folder = tiny_model("qwen3_moe", norm_topk_prob=norm_topk_prob)
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


def test_greedy_tokens_match_transformers(tiny_model):
    """transformers' greedy tokens, with either MoE backend."""
    folder = tiny_model("qwen3_moe")
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


def test_forward_compiles_fullgraph(tiny_model):
    """The MoE goes through an opaque custom op under torch.compile, as attention does: one graph."""
    engine = Engine(EngineConfig(model_path=str(tiny_model("qwen3_moe")), dtype=torch.float32, device="cpu"))
    assert compiled_prefill_error(engine, [list(range(3, 3 + n)) for n in (5, 9)]) < 1e-5
    engine.shutdown()


def compiled_prefill_error(engine: Engine, prompts: list[list[int]]) -> float:
    """The relative error of the engine's model forward compiled with fullgraph=True (torch.compile
    raises unless it is one graph) against the eager forward, on one prefill of `prompts`."""
    prep = BatchPreparer(engine)
    batch = prep.prefill([prep.add_request(p, SamplingParams(max_tokens=1)) for p in prompts])
    compiled = torch.compile(engine.model.forward, fullgraph=True, dynamic=True)
    with torch.inference_mode(), engine.ctx.forward_batch(batch):
        engine.attn_backend.prepare_metadata(batch)
        args = (batch.input_ids, batch.positions, batch.attn_metadata.last_indices)
        return rel_err(compiled(*args), engine.model(*args))


# -- the few-token kernels (minisgl.kernels.moe_gemv), under Triton's interpreter --------------------

needs_triton = pytest.mark.skipif(moe_gemv_kernels.triton is None, reason="needs triton (its interpreter)")
# launch configurations whose row blocks do not divide the rows or the width (masked tails, several
# blocks along the row): [rows a program, row block, warps]; the down kernel's pairs shared among
# programs (a fourth entry: 3 divides top_k 3 only, elsewhere one program takes them all)
SMALL_BLOCKS = {"gate_up": [4, 32, 4], "down": [8, 16, 2]}
SPLIT_DOWN = {"gate_up": [8, 64, 4], "down": [16, 32, 4, 3]}


@needs_triton
@pytest.mark.parametrize("config", [None, SMALL_BLOCKS, SPLIT_DOWN], ids=["default", "small-blocks", "split"])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("tokens, experts, top_k", [(1, 8, 2), (3, 12, 3), (2, 128, 8)])
def test_moe_gemv_matches_reference(tokens, experts, top_k, renormalize, config):
    """Routing (top-k of E logits, E not a power of two too, softmax or renormalised weights), gate/up,
    SiLU, down and the weighted sum of the slots, against the float64 per-token reference: float32 to
    1e-5 (so no expert or weight is wrong), with hidden 72 and intermediate 40, neither a power of two."""
    x, router_logits, w13, w2 = _random_moe(tokens, experts, hidden=72, inter=40, seed=tokens, unused=(1,))
    got = moe_gemv(x, router_logits, w13, w2, top_k, renormalize, config=config)
    assert got.shape == x.shape and got.dtype == torch.float32
    assert rel_err(got, _per_token_reference(x, router_logits, w13, w2, top_k, renormalize)) < 1e-5


@needs_triton
@pytest.mark.parametrize("renormalize", [True, False])
def test_moe_gemv_breaks_ties_to_the_lower_expert(renormalize):
    """Tied router logits (and experts that never win, at -inf): of a tie the kernels choose the lowest
    expert ids. The reference gets the same choice from logits nudged down by 1e-9 per id (weights move
    by ~1e-9)."""
    x, _, w13, w2 = _random_moe(3, 10, hidden=72, inter=40, seed=4)
    logits = torch.tensor(
        [
            [1.0, 3.0, 3.0, 0.0, 3.0, 2.0, 2.0, 1.0, float("-inf"), 2.0],
            [0.5] * 10,  # all tied: experts 0..k-1
            [-1.0, float("-inf"), 2.0, 2.0, -1.0, -1.0, 2.0, float("-inf"), -1.0, -1.0],
        ]
    )
    nudged = logits.double() - 1e-9 * torch.arange(10, dtype=torch.float64)
    for top_k in (1, 3, 4, 6):
        got = moe_gemv(x, logits, w13, w2, top_k, renormalize)
        assert rel_err(got, _per_token_reference(x, nudged, w13, w2, top_k, renormalize)) < 1e-5


@needs_triton
def test_moe_gemv_in_bfloat16():
    """bf16 in and out: within 2x of the torch backend's own error against float64. (Triton's interpreter
    truncates float32 to bf16 where a GPU rounds to nearest, which doubles a rounding's error; the GPU
    tests hold the kernels to the torch backend directly.)"""
    x, router_logits, w13, w2 = _random_moe(3, 16, hidden=64, inter=48, dtype=torch.bfloat16, seed=9)
    args = (x, router_logits, w13, w2, 4, True)
    want = _per_token_reference(*args)
    got = moe_gemv(*args)
    assert got.dtype == torch.bfloat16
    assert rel_err(got, want) < max(2 * rel_err(TorchMoeBackend().forward(*args), want), 1e-3)


@needs_triton
def test_moe_gemv_empty_batch():
    x, router_logits, w13, w2 = _random_moe(0, 8)
    assert moe_gemv(x, router_logits, w13, w2, 2, True).shape == (0, 64)


def test_moe_gemv_configuration_lookup(monkeypatch):
    """The tuned configuration of the nearest token count at or above the batch's, else the largest
    tuned, else the defaults; the file in the repository holds well-formed entries."""
    tuned = {
        "8,64,32,1": {"gate_up": [1, 32, 2], "down": [2, 32, 2]},
        "8,64,32,4": {"gate_up": [4, 32, 4], "down": [4, 32, 4]},
        "16,64,32,1": {"gate_up": [8, 32, 8], "down": [8, 32, 8]},
    }
    monkeypatch.setattr(moe_gemv_kernels, "MOE_GEMV_CONFIGS", {"gemv": tuned})
    assert moe_gemv_kernels.moe_gemv_config(8, 32, 32, 1) == tuned["8,64,32,1"]
    assert moe_gemv_kernels.moe_gemv_config(8, 32, 32, 3) == tuned["8,64,32,4"]
    assert moe_gemv_kernels.moe_gemv_config(8, 32, 32, 16) == tuned["8,64,32,4"]
    default = moe_gemv_kernels.moe_gemv_config(8, 16, 32, 2)
    assert set(default) == {"gate_up", "down"} and all(len(v) == 3 for v in default.values())
    # packed experts read their own table, and none of the plain one
    packed = {"8,64,32,1": {"gate_up": [8, 32, 4], "down": [16, 32, 4, 2]}}
    monkeypatch.setattr(moe_gemv_kernels, "MOE_GEMV_CONFIGS", {"gemv": tuned, "gemv_q4": packed})
    assert moe_gemv_kernels.moe_gemv_config(8, 32, 32, 1, bits=4) == packed["8,64,32,1"]
    untuned = moe_gemv_kernels.moe_gemv_config(8, 32, 32, 1, bits=8)
    assert len(untuned["gate_up"]) == 3 and len(untuned["down"]) == 4
    # [block_n, block_k, warps] for the few-token kernels (the down kernel's SPLIT may follow),
    # [block_m, block_n, block_k, warps, stages] for the grouped ones
    tables = json.loads(moe_gemv_kernels.CONFIG_FILE.read_text())
    assert set(tables) <= {"gemv", "gemv_q4", "gemv_q8", "grouped"}
    for name, table in tables.items():
        for key, value in table.items():
            assert len(key.split(",")) == 4 and all(part.isdigit() for part in key.split(","))
            for part in ("gate_up", "down"):
                config = value[part]
                few = name.startswith("gemv")
                warps = config[2] if few else config[3]
                sizes = ((3, 4) if part == "down" else (3,)) if few else (5,)
                assert len(config) in sizes and min(config) >= 1, (name, key)
                assert warps in (1, 2, 4, 8, 16), (name, key)


def test_moe_dispatch_table(monkeypatch):
    """One table says how many tokens go to the few-row kernels, by weight shape: a projection (N, K) to
    the GEMV, an expert tensor (E, 2I, H) to the MoE kernels; other shapes take each kind's default."""
    monkeypatch.setattr(linear_ops, "GEMV_ROWS_BY_SHAPE", {(4, 64, 32): 12, (64, 32): 3})
    assert linear_ops.gemv_rows(torch.empty(4, 64, 32)) == 12
    assert linear_ops.gemv_rows(torch.empty(8, 64, 32)) == linear_ops.MOE_GEMV_TOKENS
    assert linear_ops.gemv_rows(torch.empty(64, 32)) == 3
    assert linear_ops.gemv_rows(torch.empty(32, 64)) == linear_ops.LINEAR_GEMV_ROWS


# -- the grouped Triton GEMMs (minisgl.kernels.moe_gemm), under Triton's interpreter -----------------

GEMM_BLOCKS = {"gate_up": [16, 16, 32, 4, 2], "down": [32, 16, 16, 4, 2]}


@needs_triton
@pytest.mark.parametrize("tokens, experts, top_k", [(5, 8, 2), (37, 16, 4), (1, 4, 1)])
def test_align_pairs_groups_every_pair_once(tokens, experts, top_k):
    """Each block of rows holds pairs of one expert (or padding), every pair appears exactly once, and
    the grid has room for any routing; blocks past the last expert's are marked `experts`."""
    _, router_logits, _, _ = _random_moe(tokens, experts, seed=tokens, unused=(1,))
    ids = torch.topk(router_logits, top_k, dim=-1).indices
    block_m = 4
    pairs, block_expert = moe_gemm_kernels.align_pairs(ids, experts, block_m)
    num_pairs = tokens * top_k
    assert pairs.numel() == block_expert.numel() * block_m
    assert block_expert.numel() == -(-num_pairs // block_m) + min(experts, num_pairs)
    real = pairs[pairs < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))
    flat = ids.flatten()
    for block, expert in enumerate(block_expert.tolist()):
        rows = pairs[block * block_m : (block + 1) * block_m]
        rows = rows[rows < num_pairs]
        if expert == experts:
            assert rows.numel() == 0
        else:
            assert rows.numel() > 0 and bool((flat[rows.long()] == expert).all())


@needs_triton
@pytest.mark.parametrize("config", [None, GEMM_BLOCKS], ids=["default", "small-blocks"])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("tokens, experts, top_k", [(5, 8, 2), (37, 16, 4)])
def test_moe_gemm_matches_reference(tokens, experts, top_k, renormalize, config):
    """The grouped kernels after the reference's routing, float32, against the float64 per-token
    reference: hidden 72 and intermediate 40 (masked tails), an expert that gets no token."""
    x, router_logits, w13, w2 = _random_moe(tokens, experts, hidden=72, inter=40, seed=tokens, unused=(1,))
    weights, ids = select_experts(router_logits, top_k, renormalize, x.dtype)
    got = moe_gemm_kernels.moe_gemm(x, weights, ids, w13, w2, config=config)
    assert got.shape == x.shape and got.dtype == torch.float32
    assert rel_err(got, _per_token_reference(x, router_logits, w13, w2, top_k, renormalize)) < 1e-5


# -- packed (4- and 8-bit) experts: the same kernels, the weights dequantized in registers ------------


def _packed_experts(experts, rows, cols, bits, group, seed):
    """Random experts in minisgl's packed layout (`PackedWeights`, groups of `group` columns, None: one
    per channel) and their weights in float32, dequantized here from the values, not the words."""
    gen = torch.Generator().manual_seed(seed)
    group = group or cols
    u = torch.randint(0, 2**bits, (experts, rows, cols), generator=gen)
    shape = (experts, rows, cols // group)
    scales = ((torch.rand(shape, generator=gen) + 0.5) * 3.5 / 2**bits / cols**0.5).half()
    zeros = torch.randint(0, 2**bits, shape, generator=gen)
    w = (u - zeros.repeat_interleave(group, -1)) * scales.float().repeat_interleave(group, -1)
    return PackedWeights(pack_words(u, bits), scales, zeros.to(torch.uint8), bits), w


@needs_triton
@pytest.mark.parametrize("bits, group, hidden, inter", [(4, 32, 96, 64), (8, None, 96, 48)])
@pytest.mark.parametrize("tokens", [1, 3, 9])
def test_packed_experts_match_reference(bits, group, hidden, inter, tokens):
    """4-bit experts in groups of 32 and 8-bit per channel (the GEMM's steps of 32 and 16 columns: one
    group each), through the few-token kernels, the grouped GEMMs and the fused backend's CPU path (the
    experts dequantized for the call), float32, against the float64 per-token reference on the
    dequantized weights; expert 1 gets no token."""
    experts, top_k = 8, 2
    gen = torch.Generator().manual_seed(tokens)
    x, router_logits = torch.randn(tokens, hidden, generator=gen), torch.randn(tokens, experts, generator=gen)
    router_logits[:, 1] = -30.0
    w13, plain13 = _packed_experts(experts, 2 * inter, hidden, bits, group, seed=1)
    w2, plain2 = _packed_experts(experts, hidden, inter, bits, group, seed=2)
    want = _per_token_reference(x, router_logits, plain13, plain2, top_k, True)
    assert rel_err(moe_gemv(x, router_logits, w13, w2, top_k, True), want) < 1e-5
    split = {"gate_up": [8, 64, 4], "down": [8, 64, 4, top_k]}  # one pair a program in the down kernel
    assert rel_err(moe_gemv(x, router_logits, w13, w2, top_k, True, config=split), want) < 1e-5
    weights, ids = select_experts(router_logits, top_k, True, x.dtype)
    assert rel_err(moe_gemm_kernels.moe_gemm(x, weights, ids, w13, w2), want) < 1e-5
    assert rel_err(FusedMoeBackend().forward(x, router_logits, w13, w2, top_k, True), want) < 1e-5
    assert rel_err(TorchMoeBackend().forward(x, router_logits, w13, w2, top_k, True), want) < 1e-5
