"""FP8 (docs/quantization.md): FP8 checkpoints, the setting `quantization: fp8`, FP8 KV cache, and the
quantization configs minisgl refuses.

The references are written here, apart from minisgl's code: a block quantizer that walks the blocks one
by one (it also writes the FP8 checkpoints the tests load), and transformers in float32 on the
dequantized weights, with every projection's input quantized per token group by a forward hook and, for
the FP8 KV cache, K and V rounded through e4m3 by a registered attention function.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from conftest import make_tiny_model, rel_err, teacher_forced_logits
from safetensors.torch import load_file, save_file

from minisgl.core import SamplingParams
from minisgl.distributed import DistributedInfo, set_tp_info
from minisgl.engine import Engine, EngineConfig
from minisgl.kernels.fp8 import fp8_linear, quantize_blocks
from minisgl.kvcache import MHAKVCachePool
from minisgl.layers import Fp8Linear
from minisgl.models import ModelConfig, build_model
from minisgl.scheduler import BatchPreparer
from minisgl.settings import EngineSettings, SettingsError

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
# a scale is amax times float32(1 / 448), one multiplication on every device (minisgl.kernels.fp8)
E4M3_INV = 1.0 / E4M3_MAX
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPT_LENS = [5, 17, 1, 40]
DECODE_STEPS = 6


# -- the references ------------------------------------------------------------------------------


def ref_quantize(w: torch.Tensor, block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 values and float32 scales of w, block by block (block None: one scale for the tensor)."""
    w = w.float()
    if block is None:
        scale = w.abs().max() * E4M3_INV
        return (w / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale
    bn, bk = block
    rows, cols = w.shape
    q = torch.empty(rows, cols, dtype=E4M3)
    scales = torch.empty((rows + bn - 1) // bn, (cols + bk - 1) // bk)
    for i in range(0, rows, bn):
        for j in range(0, cols, bk):
            part = w[i : i + bn, j : j + bk]
            scale = part.abs().max() * E4M3_INV
            q[i : i + bn, j : j + bk] = (part / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
            scales[i // bn, j // bk] = scale
    return q, scales


def ref_dequantize(q: torch.Tensor, scales: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    if block is None:
        return q.float() * scales
    bn, bk = block
    out = q.float()
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            out[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] *= scales[i, j]
    return out


def ref_round_activations(x: torch.Tensor, group: int) -> torch.Tensor:
    """x with each token's groups of `group` columns rounded through e4m3 at scale amax x float32(1 / 448)."""
    out = torch.empty_like(x)
    for j in range(0, x.shape[-1], group):
        part = x[..., j : j + group].float()
        scale = part.abs().amax(dim=-1, keepdim=True) * E4M3_INV
        out[..., j : j + group] = (part / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).float() * scale
    return out


def activation_group(block: tuple[int, int] | None) -> int:
    """128 columns per activation scale, or the weight blocks' width where narrower."""
    return 128 if block is None else min(128, block[1])


def write_fp8_checkpoint(
    original: Path, folder: Path, block: tuple[int, int] | None, extra: dict[str, Any] | None = None
) -> Path:
    """`original` (any dtype) as an FP8 checkpoint in `folder`: each projection weight in e4m3 with
    `weight_scale_inv` per block (or `weight_scale` per tensor), everything else as it was;
    config.json gains the quantization_config (and `extra` keys in it)."""
    folder.mkdir(parents=True)
    tensors: dict[str, torch.Tensor] = {}
    for file in original.glob("*.safetensors"):
        for name, tensor in load_file(file).items():
            module = name.removesuffix(".weight")
            if name.endswith(".weight") and module.rsplit(".", 1)[-1] in PROJECTIONS:
                q, scale = ref_quantize(tensor, block)
                tensors[name] = q
                tensors[f"{module}.weight_scale_inv" if block else f"{module}.weight_scale"] = scale
            else:
                tensors[name] = tensor
    save_file(tensors, folder / "model.safetensors")
    config = json.loads((original / "config.json").read_text())
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    if block is not None:
        quant["weight_block_size"] = list(block)
    config["quantization_config"] = {**quant, **(extra or {})}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def as_bf16(original: Path, folder: Path) -> Path:
    """`original` with every tensor in bf16 (a model's unquantized release)."""
    folder.mkdir(parents=True)
    tensors = load_file(next(original.glob("*.safetensors")))
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, folder / "model.safetensors")
    shutil.copy(original / "config.json", folder / "config.json")
    return folder


def emulated_transformers(
    fp8_folder: Path, original: Path, block: tuple[int, int] | None, attn: str | None = None
) -> torch.nn.Module:
    """transformers in float32 on the FP8 checkpoint's dequantized weights, each projection's input
    rounded per token group through e4m3 (the config of the unquantized `original`)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        original, dtype=torch.float32, **({"attn_implementation": attn} if attn else {})
    ).eval()
    tensors = load_file(fp8_folder / "model.safetensors")
    group = activation_group(block)
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] not in PROJECTIONS:
            continue
        scale = tensors[f"{name}.weight_scale_inv" if block else f"{name}.weight_scale"]
        with torch.no_grad():
            module.weight.copy_(ref_dequantize(tensors[f"{name}.weight"], scale, block))
        module.register_forward_pre_hook(lambda _, args: (ref_round_activations(args[0], group),))
    return model


def positions_logits(model: torch.nn.Module, seqs: list[list[int]], steps: int) -> torch.Tensor:
    """The model's logits at the positions `teacher_forced_logits` computes, each sequence alone."""
    with torch.no_grad():
        full = [model(torch.tensor([s])).logits[0] for s in seqs]
    return torch.stack([f[n - 1 : n + steps] for f, n in zip(full, PROMPT_LENS)])


def sequences(vocab: int = 320) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (n + DECODE_STEPS,), generator=gen).tolist() for n in PROMPT_LENS]


def engine(folder: Path, **settings: Any) -> Engine:
    return Engine(EngineConfig(model_path=str(folder), dtype=torch.float32, device="cpu", **settings))


def fp8_layers(model: torch.nn.Module) -> list[tuple[str, Fp8Linear]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, Fp8Linear)]


# -- the numerics --------------------------------------------------------------------------------


def test_quantizer_and_fp8_linear_match_the_reference():
    """Partial blocks on both sides: minisgl's quantizer gives the reference's bits, and `fp8_linear`
    the reference's float32 emulation."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(100, 72, generator=gen) * torch.rand(100, 1, generator=gen) * 3
    x = torch.randn(7, 72, generator=gen) * 5
    for block in [(32, 32), (128, 128), (1, 72), (48, 16)]:
        q, scale = quantize_blocks(w, block)
        ref_q, ref_scale = ref_quantize(w, block)
        assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(scale, ref_scale)
        group = activation_group(block)
        bias = torch.randn(100, generator=gen)
        got = fp8_linear(x, q, scale, block, group, bias)
        want = ref_round_activations(x, group) @ ref_dequantize(ref_q, ref_scale, block).T + bias
        assert rel_err(got, want) < 1e-6, block
        assert rel_err(got, x @ w.T + bias) > 1e-3  # the emulation does round


# (family, checkpoint weight blocks): partial blocks everywhere (hidden 64, intermediate 96, q 64 rows,
# k and v 32); [48, 32] leaves the merged Q/K/V with segments of partial blocks, [16, 64] fills whole
# blocks in every segment; None: one scale per tensor
CHECKPOINTS = [("llama", (128, 128)), ("qwen3", (48, 32)), ("qwen2", (16, 64)), ("llama", None)]


@pytest.mark.parametrize(("arch", "block"), CHECKPOINTS, ids=[f"{a}-{b}" for a, b in CHECKPOINTS])
def test_fp8_checkpoint_matches_the_float32_emulation(tmp_path, tiny_model, arch, block):
    """Prefill of prompts of different lengths in one batch, then teacher-forced decode steps, against
    transformers on the dequantized weights with the activations rounded per token group."""
    original = tiny_model(arch)
    folder = write_fp8_checkpoint(original, tmp_path / "fp8", block)
    seqs = sequences()
    eng = engine(folder)
    layers = fp8_layers(eng.model)
    assert len(layers) == 4 * 3 and all(m.weight.dtype == E4M3 for _, m in layers)
    # embeddings, norms, biases and the LM head stay in the model's dtype
    others = {n: p.dtype for n, p in eng.model.named_parameters() if p.dtype != E4M3 and ".scale" not in n}
    assert set(others.values()) == {torch.float32} and "lm_head" in others
    got = teacher_forced_logits(eng, seqs, PROMPT_LENS, DECODE_STEPS)
    eng.shutdown()
    want = positions_logits(emulated_transformers(folder, original, block), seqs, DECODE_STEPS)
    err = rel_err(got, want)
    print(f"{arch} {block}: relative error {err:.2e} against the float32 emulation")
    assert err < 1e-4
    unquantized = positions_logits(
        transformers.AutoModelForCausalLM.from_pretrained(original, dtype=torch.float32), seqs, DECODE_STEPS
    )
    assert rel_err(got, unquantized) > 10 * err  # FP8 shows: the comparison above tells something


def test_quantization_setting_equals_the_fp8_checkpoint(tmp_path):
    """`quantization: fp8` on a bf16 model gives the bits of its 128x128 FP8 checkpoint: the same e4m3
    weights, scales and logits. Head dim 48 and intermediate 320: Q (192 rows), K, V and gate/up end in
    partial blocks."""
    original = as_bf16(
        make_tiny_model(tmp_path, "llama", hidden_size=192, head_dim=48, intermediate_size=320),
        tmp_path / "bf16",
    )
    folder = write_fp8_checkpoint(original, tmp_path / "fp8", (128, 128))
    from_checkpoint, at_load = engine(folder), engine(original, quantization="fp8")
    assert at_load.config.model_config.quantization.in_checkpoint is False
    pairs = list(zip(fp8_layers(from_checkpoint.model), fp8_layers(at_load.model)))
    assert len(pairs) == 12
    for (name, a), (_, b) in pairs:
        assert torch.equal(a.weight.view(torch.uint8), b.weight.view(torch.uint8)), name
        assert torch.equal(a.scale, b.scale), name
    seqs = sequences()
    got = [teacher_forced_logits(e, seqs, PROMPT_LENS, DECODE_STEPS) for e in (from_checkpoint, at_load)]
    assert torch.equal(got[0], got[1])
    for e in (from_checkpoint, at_load):
        e.shutdown()


def test_static_activation_scales_are_not_used(tmp_path, tiny_model, caplog):
    """A per-tensor checkpoint with activation_scheme "static" and `input_scale` tensors loads (they are
    known and skipped without a warning) and computes as the dynamic one: per token group."""
    original = tiny_model("llama")
    dynamic = write_fp8_checkpoint(original, tmp_path / "dynamic", None)
    static = write_fp8_checkpoint(original, tmp_path / "static", None, {"activation_scheme": "static"})
    tensors = load_file(static / "model.safetensors")
    for name in [n for n in tensors if n.endswith(".weight_scale")]:
        tensors[name.replace(".weight_scale", ".input_scale")] = torch.tensor(123.0)
    save_file(tensors, static / "model.safetensors")
    seqs = sequences()
    logits = []
    for folder in (dynamic, static):
        eng = engine(folder)
        logits.append(teacher_forced_logits(eng, seqs, PROMPT_LENS, DECODE_STEPS))
        eng.shutdown()
    assert torch.equal(logits[0], logits[1])
    assert "checkpoint tensor(s) the model does not use" not in caplog.text


def test_dummy_weights_with_fp8(tmp_path):
    """Dummy weights with `quantization: fp8`, and an FP8 config.json with no weights: FP8 projections
    (1 byte a weight), random and finite logits."""
    original = make_tiny_model(tmp_path, "qwen3")
    fp8_config = write_fp8_checkpoint(original, tmp_path / "fp8", (128, 128))
    for folder in (original, fp8_config):
        for file in folder.glob("*.safetensors"):
            file.unlink()
    for folder, settings in ((original, {"quantization": "fp8"}), (fp8_config, {})):
        eng = engine(folder, use_dummy_weight=True, **settings)
        layers = fp8_layers(eng.model)
        assert len(layers) == 12 and all(m.weight.float().std() > 0 for _, m in layers)
        prep = BatchPreparer(eng)
        logits = eng.forward_logits(prep.prefill([prep.add_request([5, 6, 7], SamplingParams(max_tokens=1))]))
        assert torch.isfinite(logits).all() and logits.std() > 0
        eng.shutdown()


# -- tensor parallelism --------------------------------------------------------------------------


def test_tp_ranks_hold_their_blocks(tmp_path, tiny_model):
    """Under TP=2 each rank's FP8 weights and scales are its slices of TP=1's, in whole 16x16 blocks:
    Q/K/V and gate/up rows, o_proj and down columns."""
    folder = write_fp8_checkpoint(tiny_model("llama"), tmp_path / "fp8", (16, 16))
    cfg = ModelConfig.from_path(folder)
    full = build_model(cfg, str(folder), 64, torch.device("cpu"), torch.float32).layers[1]
    for rank in range(2):
        set_tp_info(DistributedInfo(rank, 2))
        try:
            layer = build_model(cfg, str(folder), 64, torch.device("cpu"), torch.float32).layers[1]
        finally:
            set_tp_info(DistributedInfo())
        # (full rows of each segment of the rank, full columns): q 64 rows, k and v 32, gate and up 96
        q, kv, inter = slice(32 * rank, 32 * rank + 32), slice(16 * rank, 16 * rank + 16), 48 * rank
        expect = {
            "qkv_proj": (
                [q, slice(64 + kv.start, 64 + kv.stop), slice(96 + kv.start, 96 + kv.stop)],
                slice(None),
            ),
            "o_proj": ([slice(None)], q),
            "gate_up_proj": ([slice(inter, inter + 48), slice(96 + inter, 144 + inter)], slice(None)),
            "down_proj": ([slice(None)], slice(inter, inter + 48)),
        }
        for attr, (rows, cols) in expect.items():
            mine, whole = getattr(layer, attr), getattr(full, attr)
            want_w = torch.cat([whole.weight.view(torch.uint8)[r, cols] for r in rows])
            assert torch.equal(mine.weight.view(torch.uint8), want_w), (rank, attr)
            block_rows = [slice(r.start // 16, r.stop // 16) if r.stop else r for r in rows]
            block_cols = slice(cols.start // 16, cols.stop // 16) if cols.stop else cols
            want_s = torch.cat([whole.scale[r, block_cols] for r in block_rows])
            assert torch.equal(mine.scale, want_s), (rank, attr)


# per-tensor scales: o_proj's and down's columns split into 128 per rank (whole activation groups)
@pytest.mark.parametrize(
    ("block", "shape"),
    [((16, 16), {}), (None, {"head_dim": 64, "intermediate_size": 256})],
    ids=["blocks", "per-tensor"],
)
def test_tp2_fp8_checkpoint_matches_tp1(tmp_path, tiny_model, block, shape, ranks):
    from test_tp import assert_tp_matches_single

    folder = write_fp8_checkpoint(tiny_model("qwen3", **shape), tmp_path / "fp8", block)
    assert_tp_matches_single(ranks, folder, 2, logits_tol=1e-4)


@pytest.mark.parametrize(
    ("block", "settings", "message"),
    [
        (
            (32, 32),
            {},
            "splits the FP8 weight blocks ([32, 32]) of self_attn.k_proj: each rank would hold 16 of its 32 rows",
        ),
        (
            (64, 64),
            {},
            "splits the FP8 weight blocks ([64, 64]) of self_attn.q_proj: each rank would hold 32 of its 64 rows",
        ),
        (
            (16, 64),
            {},
            "splits the FP8 weight blocks ([16, 64]) of self_attn.o_proj: each rank would hold 32 of its 64 columns",
        ),
        (None, {"quantization": "fp8"}, "splits the FP8 weight blocks ([128, 128]) of self_attn.q_proj"),
        (
            "per-tensor",
            {},
            "splits the FP8 activation groups (128 columns) of self_attn.o_proj: each rank would hold 32 of its "
            "64 columns",
        ),
    ],
)
def test_tp_size_that_splits_a_block_is_refused(tmp_path, tiny_model, block, settings, message):
    """Refused before any process group exists (a single process asks for rank 0 of 2)."""
    original = tiny_model("llama")
    if block is not None:
        original = write_fp8_checkpoint(original, tmp_path / "fp8", None if block == "per-tensor" else block)
    with pytest.raises(ValueError, match=re.escape(message)):
        engine(original, tp_info=DistributedInfo(0, 2), **settings)


# -- FP8 KV cache --------------------------------------------------------------------------------

KV_SCALES = [(0.05, 0.02), (0.08, 0.03), (0.04, 0.05)]  # per layer (k_scale, v_scale) in the checkpoint


def fp8_kv_attention(module, query, key, value, attention_mask, **kwargs):
    """sdpa attention on K and V rounded through e4m3 at the layer's scales, as the FP8 KV cache stores
    them (the test gives each attention module `kv_scales`)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    k_scale, v_scale = module.kv_scales
    key = (key / k_scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).float() * k_scale
    value = (value / v_scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).float() * v_scale
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


@pytest.mark.parametrize("with_scales", [True, False], ids=["checkpoint-scales", "scales-1"])
def test_fp8_kv_cache_matches_the_emulation(tmp_path, with_scales):
    """kv_cache_dtype fp8_e4m3 against transformers with K and V rounded through e4m3 after RoPE and
    the k norm: the checkpoint's per-layer k_scale / v_scale, or 1.0 where it has none."""
    original = make_tiny_model(tmp_path, "qwen3", randomize=("norm", "bias", "lm_head"))
    scales = KV_SCALES if with_scales else [(1.0, 1.0)] * 3
    if with_scales:  # the checkpoint gives each layer's scales, as a scalar and as a 1-element tensor
        tensors = load_file(original / "model.safetensors")
        for i, (k, v) in enumerate(scales):
            tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(k)
            tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor([v])
        save_file(tensors, original / "model.safetensors")
    transformers.AttentionInterface.register("minisgl_test_fp8_kv", fp8_kv_attention)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        original, dtype=torch.float32, attn_implementation="minisgl_test_fp8_kv"
    ).eval()
    for layer, layer_scales in zip(ref.model.layers, scales):
        layer.self_attn.kv_scales = layer_scales
    seqs = sequences()
    eng = engine(original, kv_cache_dtype="fp8_e4m3", page_size=4)
    assert eng.kv_cache.buffer.dtype == E4M3
    assert torch.equal(eng.kv_cache.scales, torch.tensor(scales))
    got = teacher_forced_logits(eng, seqs, PROMPT_LENS, DECODE_STEPS)
    eng.shutdown()
    err = rel_err(got, positions_logits(ref, seqs, DECODE_STEPS))
    print(f"FP8 KV ({'checkpoint scales' if with_scales else 'scales 1'}): relative error {err:.2e}")
    assert err < 1e-4
    plain = engine(original, page_size=4)
    unrounded = teacher_forced_logits(plain, seqs, PROMPT_LENS, DECODE_STEPS)
    plain.shutdown()
    assert rel_err(got, unrounded) > 10 * err  # the e4m3 rounding shows


def test_fp8_pool_stores_and_reads_with_the_layer_scales():
    scales = torch.tensor([[0.5, 2.0], [0.01, 0.03]])
    pool = MHAKVCachePool(2, 3, 4, 2, 8, E4M3, torch.device("cpu"), scales=scales)
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(5, 2, 8, generator=gen) * 4, torch.randn(5, 2, 8, generator=gen)
    k[0, 0, 0] = 1e4  # beyond 448 * scale: stored as 448
    loc = torch.tensor([0, 3, 4, 9, 11])
    pages = torch.tensor([0, 1, 2])
    for layer in range(2):
        pool.store_kv(k, v, loc, layer)
        keys, values = pool.gather(layer, pages, torch.float32)
        k_scale, v_scale = scales[layer]
        for got, x, scale in ((keys, k, k_scale), (values, v, v_scale)):
            want = (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).float() * scale
            assert torch.equal(got.reshape(-1, 2, 8)[loc], want)
            assert got.reshape(-1, 2, 8)[1].abs().sum() == 0  # never written
    assert keys.reshape(-1, 2, 8)[0, 0, 0] == E4M3_MAX * scales[1, 0]


def test_fp8_kv_cache_holds_more_pages(tiny_model):
    """One byte a value: four times float32's pages on the same budget."""
    folder = tiny_model("llama")
    pages = [
        engine(folder, kv_cache_dtype=kv, cpu_kv_budget_gib=0.001, max_running_req=64).num_pages
        for kv in ("auto", "fp8_e4m3")
    ]
    assert 4 * pages[0] <= pages[1] < 4 * (pages[0] + 1)


# -- what minisgl refuses --------------------------------------------------------------------------

REFUSED = [
    (
        {"quant_method": "bitsandbytes", "load_in_4bit": True},
        'quantization_config.quant_method="bitsandbytes" is not supported',
    ),
    ({"quant_method": "hqq"}, 'quantization_config.quant_method="hqq" is not supported'),
    ({"load_in_8bit": True}, "quantization_config has no quant_method"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, 'quantization_config.fmt="e5m2" must be "e4m3"'),
    (
        {"quant_method": "fp8", "weight_block_size": [128]},
        "quantization_config.weight_block_size=[128] must be",
    ),
    (
        {"quant_method": "fp8", "weight_block_size": [0, 128]},
        "quantization_config.weight_block_size=[0, 128] must",
    ),
    (
        {"quant_method": "fp8", "activation_scheme": "none"},
        'quantization_config.activation_scheme="none" must',
    ),
    (
        {"quant_method": "fp8", "modules_to_not_convert": ["lm_head", "layers.1.mlp"]},
        "quantization_config.modules_to_not_convert lists 'layers.1.mlp'",
    ),
    ("fp8", 'quantization_config="fp8" must be a JSON object'),
]


@pytest.mark.parametrize(
    ("quant", "message"),
    REFUSED,
    ids=[m.split(" ")[0].removeprefix("quantization_config")[:40] for _, m in REFUSED],
)
def test_unsupported_quantization_is_refused_at_load(tmp_path, tiny_model, quant, message):
    """At load, naming the key, before any weight is read (the folder has none)."""
    folder = tmp_path / "model"
    folder.mkdir()
    config = json.loads((tiny_model("llama") / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    with pytest.raises(ValueError) as error:
        engine(folder)
    assert str(error.value).startswith(f"{folder / 'config.json'}: {message}"), str(error.value)


def test_fp8_is_refused_for_qwen3_moe(tmp_path, tiny_model):
    folder = tiny_model("qwen3_moe")
    with pytest.raises(ValueError, match="quantization='fp8' is not supported for Qwen3MoeForCausalLM yet"):
        engine(folder, quantization="fp8")
    write_fp8_checkpoint(folder, tmp_path / "fp8", (128, 128))
    with pytest.raises(ValueError, match='quant_method="fp8" is not supported for Qwen3MoeForCausalLM yet'):
        engine(tmp_path / "fp8")


def _damage(folder: Path, name: str, tensor: torch.Tensor | None) -> None:
    tensors = load_file(folder / "model.safetensors")
    if tensor is None:
        del tensors[name]
    else:
        tensors[name] = tensor
    save_file(tensors, folder / "model.safetensors")


K_SCALE = "model.layers.1.self_attn.k_proj.weight_scale_inv"
DAMAGED = [
    (
        K_SCALE,
        torch.ones(2, 1),
        f"{K_SCALE}' in model.safetensors has shape (2, 1), expected (1, 1) for the (32, 64)",
    ),
    (K_SCALE, None, f"is missing tensor(s) '{K_SCALE}'"),
    (
        K_SCALE,
        torch.full((1, 1), float("nan")),
        f"{K_SCALE}' in model.safetensors holds scales that are negative",
    ),
    (
        "model.layers.0.mlp.down_proj.weight",
        torch.ones(64, 96, dtype=torch.bfloat16),
        "down_proj.weight' in model.safetensors holds BF16, expected F8_E4M3",
    ),
    (
        "model.layers.2.self_attn.v_scale",
        torch.tensor(-1.0),
        "v_scale' in model.safetensors is -1.0; a KV-cache scale must be a positive finite number",
    ),
]


@pytest.mark.parametrize(
    ("name", "tensor", "message"), DAMAGED, ids=["shape", "missing", "nan", "dtype", "kv"]
)
def test_bad_fp8_tensors_are_refused_naming_them(tmp_path, tiny_model, name, tensor, message):
    folder = write_fp8_checkpoint(tiny_model("llama"), tmp_path / "fp8", (128, 128))
    _damage(folder, name, tensor)
    with pytest.raises(ValueError, match=re.escape(message)):
        engine(folder)


def test_fp8_settings_are_checked():
    with pytest.raises(SettingsError, match="quantization='int8'.*use one of fp8"):
        EngineSettings.load(quantization="int8")
    with pytest.raises(SettingsError, match="kv_cache_dtype='fp8'.*use one of auto, fp8_e4m3"):
        EngineSettings.load(kv_cache_dtype="fp8")
    settings = EngineSettings.load(quantization="fp8", kv_cache_dtype="fp8_e4m3", device="cpu")
    config = settings.to_engine_config()
    assert config.model_config.quantization.block == (128, 128)
    assert config.kv_torch_dtype == E4M3
