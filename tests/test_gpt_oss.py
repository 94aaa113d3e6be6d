"""gpt-oss (`GptOssForCausalLM`): a tiny random model built by transformers (3 layers: sliding under a
window of 8, full, sliding; learned sinks; YaRN; 8 experts top-2 with biases and a clamp that bites)
against transformers' greedy `generate` on the CPU: prompts past the window, batched, prefilled in
chunks, preempted and under the radix prefix cache; its experts as MXFP4 (`*_blocks`, `*_scales`)
dequantized at load; the MXFP4 format against its definition; config.json as published and as
transformers 5 saves it. The harmony chat format: tests/test_harmony.py; the GPU: tests/gpu/test_gpu_gpt_oss.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from conftest import hf_model
from safetensors.torch import load_file, save_file

from minisgl.attention import AttnOptions, TorchAttnBackend, create_attention_backend
from minisgl.core import SamplingParams
from minisgl.engine import Engine, EngineConfig
from minisgl.engine.start import attention_options
from minisgl.kvcache import MHAKVCachePool
from minisgl.models import ModelConfig
from minisgl.models.mxfp4 import dequantize_mxfp4
from minisgl.scheduler import Scheduler, SchedulerConfig, generate

PROMPT_LENS = [3, 13, 21]
MAX_TOKENS = 8


def _prompts(lens: list[int] = PROMPT_LENS, seed: int = 5) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 320, (n,), generator=gen).tolist() for n in lens]


def _hf_greedy(folder: Path, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    model = hf_model(folder)
    out = []
    for prompt in prompts:
        ids = model.generate(
            torch.tensor([prompt]), max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long), pad_token_id=0,
        )  # fmt: skip
        out.append(ids[0, len(prompt) :].tolist())
    return out


def e2m1(code: int) -> float:
    """An FP4 e2m1 code by the format's definition: sign bit, 2 exponent bits (bias 1), 1 mantissa bit."""
    sign, exp, man = code >> 3, (code >> 1) & 3, code & 1
    value = man * 0.5 if exp == 0 else 2.0 ** (exp - 1) * (1 + man / 2)
    return -value if sign else value


def test_mxfp4_dequantizes_to_the_formats_definition() -> None:
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (2, 3, 2, 16), generator=gen, dtype=torch.uint8)
    scales = torch.tensor(
        [[[127, 128], [120, 130], [0, 150]], [[1, 127], [126, 140], [100, 127]]], dtype=torch.uint8
    )
    got = dequantize_mxfp4(blocks, scales, torch.float32)
    assert got.shape == (2, 3, 64)
    assert sorted({e2m1(c) for c in range(16)}) == [
        -6,
        -4,
        -3,
        -2,
        -1.5,
        -1,
        -0.5,
        0,
        0.5,
        1,
        1.5,
        2,
        3,
        4,
        6,
    ]
    for e in range(2):
        for r in range(3):
            for i in range(64):
                byte = int(blocks[e, r, i // 32, (i % 32) // 2])
                code = byte & 0xF if i % 2 == 0 else byte >> 4  # the low nibble first
                want = e2m1(code) * 2.0 ** (int(scales[e, r, i // 32]) - 127)
                assert got[e, r, i].item() == want, (e, r, i)
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.bfloat16).float(), got)  # exact in bf16


def _to_mxfp4(folder: Path, out: Path) -> None:
    """`folder`'s checkpoint with every expert weight rounded to MXFP4 (written back there, for the
    reference) and stored as `*_blocks` / `*_scales` in `out` (quantization_config mxfp4)."""
    tensors = load_file(folder / "model.safetensors")
    packed = dict(tensors)
    table = torch.tensor([e2m1(c) for c in range(16)])
    for name in [n for n in tensors if n.endswith(("gate_up_proj", "down_proj"))]:
        weight = tensors[name].transpose(1, 2).contiguous()  # (E, out, in), the checkpoint's rows
        groups = weight.view(*weight.shape[:2], -1, 32)
        exp = torch.floor(torch.log2(groups.abs().amax(-1).clamp(min=1e-30))) - 2  # 6 = 1.5 * 2^2
        scales = (exp + 127).clamp(0, 254)
        scaled = groups / torch.exp2(scales - 127).unsqueeze(-1)
        codes = (scaled.unsqueeze(-1) - table).abs().argmin(-1).to(torch.uint8)
        blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
        scales = scales.to(torch.uint8)
        del packed[name]
        packed[f"{name}_blocks"], packed[f"{name}_scales"] = blocks.contiguous(), scales.contiguous()
        tensors[name] = dequantize_mxfp4(blocks, scales, torch.float32).transpose(1, 2).contiguous()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    out.mkdir()
    save_file(packed, out / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((folder / "config.json").read_text())
    raw["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn"],
    }
    (out / "config.json").write_text(json.dumps(raw))


@pytest.fixture(scope="module")
def tiny_gpt_oss(tmp_path_factory) -> tuple[Path, Path]:
    """(the float32 checkpoint whose experts are MXFP4 values, the same as an MXFP4 checkpoint)."""
    from conftest import make_tiny_model

    def spread(model: torch.nn.Module) -> None:  # at transformers' init the biases decide every token
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 1.0 if "embed" in name else 0.15)

    root = tmp_path_factory.mktemp("gpt-oss")
    folder = make_tiny_model(root, "gpt_oss", adjust=spread)
    _to_mxfp4(folder, root / "mxfp4")
    return folder, root / "mxfp4"


@pytest.fixture(scope="module")
def reference(tiny_gpt_oss) -> list[list[int]]:
    return _hf_greedy(tiny_gpt_oss[0], _prompts())


def _engine(folder: Path, **kw) -> Engine:
    return Engine(EngineConfig(model_path=str(folder), dtype=torch.float32, device="cpu", page_size=4, **kw))


@pytest.mark.parametrize("which", ["bf16 layout", "mxfp4"])
def test_greedy_tokens_match_transformers(tiny_gpt_oss, reference, which) -> None:
    """Both checkpoints, three prompts (3 to 21 tokens, past the window of 8) in one batch, prefilled
    whole and in chunks of 5: transformers' greedy tokens."""
    folder = tiny_gpt_oss[which == "mxfp4"]
    config = ModelConfig.from_path(folder)
    full = [i for i in range(config.num_layers) if config.layer_window(i) is None]
    assert (config.family, full, config.sliding_window) == ("gpt_oss", [1], 8)
    assert config.mxfp4_experts == (which == "mxfp4")
    engine = _engine(folder)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    assert generate(engine, _prompts(), params) == reference
    assert len({t for out in reference for t in out}) > 12  # tokens that tell the model apart
    if which == "mxfp4":
        assert generate(engine, _prompts(), params, chunk_size=5) == reference
    engine.shutdown()


def test_radix_cache_chunks_and_preemption(tiny_gpt_oss) -> None:
    """Through the scheduler: requests over a shared prefix of 14 tokens (past the window), the radix
    cache, prefill chunks of 6, and a KV pool small enough that requests are preempted: each request's
    greedy tokens are transformers'."""
    folder = tiny_gpt_oss[0]
    base = _prompts([14], seed=7)[0]
    prompts = [base + tail for tail in _prompts([2, 9, 5], seed=8)]
    engine = _engine(folder, num_page_override=14, max_running_req=3)
    sched = Scheduler(engine, SchedulerConfig(max_prefill_tokens=6, cache_type="radix"), eos_token_ids=[2])
    first = sched.add_request(prompts[0], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    while sched.has_work():
        sched.step()
    states = [first] + [
        sched.add_request(p, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)) for p in prompts[1:]
    ]
    while sched.has_work():
        sched.step()
    assert [s.output_ids for s in states] == _hf_greedy(folder, prompts)
    assert states[1].prefix_found >= 12
    engine.shutdown()


def test_logprobs_equal_transformers_log_softmax(tiny_gpt_oss) -> None:
    """Sampled (temperature 0.9, seeded) with logprobs and prompt_logprobs, a prompt past the window:
    each token's log probability and its top 3 equal `torch.log_softmax` of transformers' logits on the
    same sequence (float32, within 1e-4; top ids the same, the random model has no ties)."""
    folder = tiny_gpt_oss[0]
    prompt = _prompts([13], seed=9)[0]
    engine = _engine(folder)
    sched = Scheduler(engine, SchedulerConfig(), eos_token_ids=[2])
    params = SamplingParams(
        max_tokens=6, temperature=0.9, seed=4, ignore_eos=True, logprobs=3, prompt_logprobs=3
    )
    state = sched.add_request(prompt, params)
    while sched.has_work():
        sched.step()
    engine.shutdown()
    ids = prompt + state.output_ids
    model = hf_model(folder)
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)
    scored = [*list(state.prompt_logprobs)[1:], *state.logprobs]  # tokens 1 .. len(ids) - 1
    assert len(scored) == len(ids) - 1 and list(state.prompt_logprobs)[0] is None
    for p, entry in enumerate(scored):
        assert entry.token_id == ids[p + 1]
        assert abs(entry.logprob - ref[p, ids[p + 1]].item()) < 1e-4, p
        top = ref[p].topk(3)
        assert [t for t, _ in entry.top] == top.indices.tolist(), p
        assert torch.allclose(
            torch.tensor([v for _, v in entry.top], dtype=torch.float64), top.values, atol=1e-4
        )


GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"],
    "attention_bias": True,
    "eos_token_id": 200002,
    "experts_per_token": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072,
    "model_type": "gpt_oss",
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 24,
    "num_key_value_heads": 8,
    "num_local_experts": 32,
    "pad_token_id": 199999,
    "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]},
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
        "rope_type": "yarn", "truncate": False,
    },
    "rope_theta": 150000,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "vocab_size": 201088,
}  # fmt: skip


def test_config_as_published_and_as_transformers_saves_it() -> None:
    published = ModelConfig.from_dict(GPT_OSS_20B)
    assert published.mxfp4_experts and published.sliding_window == 128 and published.attention_sinks
    assert published.layer_types == ("sliding_attention", "full_attention") * 12
    assert (published.num_experts, published.num_experts_per_tok, published.moe_intermediate_size) == (
        32,
        4,
        2880,
    )
    assert (published.rope.rope_type, published.rope.factor, published.rope.truncate) == ("yarn", 32.0, False)
    assert published.qkv_bias and published.o_bias and published.swiglu_limit == 7.0
    saved = transformers.GptOssConfig(**{k: v for k, v in GPT_OSS_20B.items() if k != "quantization_config"})
    resaved = ModelConfig.from_dict({**saved.to_dict(), "architectures": ["GptOssForCausalLM"]})
    assert resaved.rope == published.rope and resaved.layer_types == published.layer_types
    assert not resaved.mxfp4_experts
    with pytest.raises(ValueError, match="quant_method"):
        ModelConfig.from_dict({**GPT_OSS_20B, "quantization_config": {"quant_method": "awq"}})
    with pytest.raises(ValueError, match="layer_types"):
        ModelConfig.from_dict({**GPT_OSS_20B, "layer_types": ["sliding_attention"]})


def test_attention_options_sinks_and_windowed_layers() -> None:
    """gpt-oss's attention, as the engine gives it to the backend (`AttnOptions`): the sliding layers
    (every other one) and sinks; the torch backend only (FlashInfer names refused), no soft cap."""
    options = attention_options(ModelConfig.from_dict(GPT_OSS_20B))
    assert options.sinks and options.window_layers == (True, False) * 12 and options.soft_cap is None
    pool = MHAKVCachePool(2, 4, 2, 1, 8, torch.float32, torch.device("cpu"))
    table = torch.zeros(2, 8, dtype=torch.int32)
    two = AttnOptions(window_layers=(True, False), sinks=True)
    backend = create_attention_backend(
        "auto", pool, table, torch.device("cpu"), 2, 1, 8, sliding_window=4, options=two
    )
    assert isinstance(backend, TorchAttnBackend) and (backend.window(0), backend.window(1)) == (4, None)
    for name in ("fi", "fa,fi"):
        with pytest.raises(ValueError, match="attention sinks .* 'torch' backend only"):
            create_attention_backend(name, pool, table, torch.device("cpu"), 2, 1, 8, options=two)
    with pytest.raises(ValueError, match="sinks with a soft cap"):
        AttnOptions(sinks=True, soft_cap=30.0)


def test_fused_moe_backend_takes_the_biases_and_the_clamp() -> None:
    """The grouped GEMMs (`fused`, the GPU's backend) with gpt-oss's expert biases and clamped SwiGLU
    give the reference's output."""
    from minisgl.moe import fused_moe, torch_moe

    gen = torch.Generator().manual_seed(2)
    x, logits = torch.randn(9, 32, generator=gen), torch.randn(9, 4, generator=gen)
    w13, w2 = torch.randn(4, 16, 32, generator=gen) * 0.3, torch.randn(4, 32, 8, generator=gen) * 0.3
    biased = dict(
        b13=torch.randn(4, 16, generator=gen), b2=torch.randn(4, 32, generator=gen), limit=0.5, alpha=1.702
    )
    want = torch_moe(x, logits, w13, w2, 2, True, **biased)
    torch.testing.assert_close(fused_moe(x, logits, w13, w2, 2, True, **biased), want)
    assert not torch.allclose(torch_moe(x, logits, w13, w2, 2, True, **{**biased, "limit": None}), want)
