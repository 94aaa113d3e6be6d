"""4- and 8-bit weight checkpoints (docs/quantization.md, "4- and 8-bit weights"): AWQ, GPTQ and
compressed-tensors pack-quantized, on the CPU.

The checkpoints are written here, by a packer of the test's own from the formats' published definitions
(AWQ: 8 int4 per int32 along the output dim in the order [0, 2, 4, 6, 1, 3, 5, 7], qweight (K, N/8),
qzeros (K/g, N/8), scales (K/g, N); GPTQ: qweight (K/P, N) sequential values along the input dim,
qzeros (K/g, N/P) storing zero - 1 in the v1 format and the zero in v2, scales (K/g, N), g_idx (K);
compressed-tensors: weight_packed (N, K/P) sequential values, signed values offset by 2^(b-1),
weight_scale (N, K/g), weight_zero_point (N/P, K/g) packed along the output dim, weight_shape), checked
against compressed-tensors' own packer where it is installed. The reference: transformers in float32 on
the weights the quantizer's integers and scales give.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import rel_err, teacher_forced_logits
from safetensors.torch import load_file, save_file

from minisgl.core import SamplingParams
from minisgl.distributed import DistributedInfo
from minisgl.engine import Engine, EngineConfig
from minisgl.kernels.packed import dequantize, pack_words
from minisgl.layers.packed import PackedLinear
from minisgl.models import packed as packed_models
from minisgl.scheduler.batching import generate

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
PROMPT_LENS = [5, 17, 1]
STEPS = 4


# -- the test's own quantizer and packers ------------------------------------------------------------


def quantize(w: torch.Tensor, bits: int, group: int | None, sym: bool, scale_dtype=torch.float16):
    """Integers q (N, K) in [0, 2^bits), zero points (N, G) and scales (N, G) of w, group by group along K;
    zero points in [1, 2^bits - 1] (GPTQ v1 stores zero - 1)."""
    n, k = w.shape
    g = group or k
    wg = w.float().reshape(n, k // g, g)
    top = 2**bits - 1
    if sym:
        scale = (wg.abs().amax(-1) / (2 ** (bits - 1) - 1)).to(scale_dtype)
        zero = torch.full_like(scale, 2 ** (bits - 1), dtype=torch.int64)
    else:
        lo, hi = wg.amin(-1), wg.amax(-1)
        scale = ((hi - lo) / top).to(scale_dtype)
        zero = (-lo / scale.float()).round().clamp(1, top).long()
    q = (wg / scale.float()[..., None]).round() + zero[..., None]
    return q.clamp(0, top).long().reshape(n, k), zero, scale


def dequant(q, zero, scale, col_group=None) -> torch.Tensor:
    col_group = torch.arange(q.shape[1]) // (q.shape[1] // zero.shape[1]) if col_group is None else col_group
    return (q - zero[:, col_group]).float() * scale[:, col_group].float()


def pack_rows(values: torch.Tensor, bits: int, order=None) -> torch.Tensor:
    """(R, C) values -> (R, C * bits / 32) int32: each word's values from its lowest bits up, the word's
    columns taken in `order` (AWQ) or in sequence."""
    per = 32 // bits
    v = values.numpy().astype(np.uint64).reshape(values.shape[0], -1, per)
    if order is not None:
        v = v[:, :, order]
    words = sum(v[:, :, i] << np.uint64(bits * i) for i in range(per))
    return torch.from_numpy(words.astype(np.uint32).view(np.int32))


def write_awq(w, group):
    q, z, s = quantize(w, 4, group, sym=False)
    tensors = {
        "qweight": pack_rows(q.T.contiguous(), 4, AWQ_ORDER),
        "qzeros": pack_rows(z.T.contiguous(), 4, AWQ_ORDER),
        "scales": s.T.contiguous(),
    }
    return tensors, dequant(q, z, s)


def write_gptq(w, bits, group, sym, v2, perm=None):
    """`perm` (act order): the groups are runs of `group` columns of w[:, perm]."""
    k = w.shape[1]
    perm = torch.arange(k) if perm is None else perm
    q_p, z, s = quantize(w[:, perm], bits, group, sym)
    q = torch.empty_like(q_p)
    q[:, perm] = q_p
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[perm] = (torch.arange(k) // (group or k)).int()
    tensors = {
        "qweight": pack_rows(q, bits).T.contiguous(),
        "qzeros": pack_rows(z.T.contiguous() - (0 if v2 else 1), bits),
        "scales": s.T.contiguous(),
        "g_idx": g_idx,
    }
    return tensors, dequant(q, z, s, g_idx.long())


def write_ct(w, bits, group, sym):
    q, z, s = quantize(w, bits, group, sym, torch.bfloat16)
    tensors = {"weight_packed": pack_rows(q, bits), "weight_scale": s, "weight_shape": torch.tensor(w.shape)}
    if not sym:
        tensors["weight_zero_point"] = pack_rows(z.T.contiguous(), bits).T.contiguous()
    return tensors, dequant(q, z, s)


def ct_config(bits: int, strategy: str, sym: bool, **extra: Any) -> dict[str, Any]:
    weights = {"num_bits": bits, "type": "int", "symmetric": sym, "strategy": strategy}
    if strategy == "group":
        weights["group_size"] = 32
    group = {"targets": ["Linear"], "weights": weights, "input_activations": None}
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"group_0": group},
        "ignore": ["lm_head"],
        **extra,
    }


# name -> (quantization_config, writer of one weight)
FORMATS: dict[str, tuple[dict[str, Any], Any]] = {
    "awq-g32": (
        {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"},
        lambda w, name: write_awq(w, 32),
    ),
    "gptq-4bit-g32-sym-v1": (
        {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False},
        lambda w, name: write_gptq(w, 4, 32, True, v2=False),
    ),
    "gptq-4bit-g32-actorder-asym-v1": (
        {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": False, "desc_act": True},
        # one act order per input (q/k/v and gate/up share theirs, as GPTQ's Hessian order does)
        lambda w, name: write_gptq(w, 4, 32, False, v2=False, perm=act_order(w.shape[1])),
    ),
    "gptq-8bit-channel-asym-v2": (
        {"quant_method": "gptq", "bits": 8, "group_size": -1, "sym": False, "checkpoint_format": "gptq_v2"},
        lambda w, name: write_gptq(w, 8, None, False, v2=True),
    ),
}
FORMATS["ct-4bit-g32-sym"] = (ct_config(4, "group", True), lambda w, name: write_ct(w, 4, 32, True))
FORMATS["ct-4bit-g32-asym"] = (ct_config(4, "group", False), lambda w, name: write_ct(w, 4, 32, False))
FORMATS["ct-8bit-channel-asym"] = (
    ct_config(8, "channel", False),
    lambda w, name: write_ct(w, 8, None, False),
)


def act_order(k: int) -> torch.Tensor:
    return torch.randperm(k, generator=torch.Generator().manual_seed(k))


def write_checkpoint(original: Path, folder: Path, fmt: str, dense: Path | None = None) -> Path:
    """`original` in format `fmt` in `folder` (and, with `dense`, its dequantized weights as a float32
    checkpoint there: the reference's weights)."""
    quant, writer = FORMATS[fmt]
    folder.mkdir(parents=True)
    tensors, plain = {}, {}
    for name, tensor in load_file(original / "model.safetensors").items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in PROJECTIONS:
            packed, w = writer(tensor, module)
            tensors.update({f"{module}.{role}": t for role, t in packed.items()})
            plain[name] = w
        else:
            tensors[name] = plain[name] = tensor
    save_file(tensors, folder / "model.safetensors")
    config = json.loads((original / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    if dense is not None:
        dense.mkdir(parents=True)
        save_file(plain, dense / "model.safetensors")
        (dense / "config.json").write_text(json.dumps(config))
    return folder


def sequences(vocab: int = 320) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (n + STEPS,), generator=gen).tolist() for n in PROMPT_LENS]


def engine(folder: Path, **settings: Any) -> Engine:
    return Engine(EngineConfig(model_path=str(folder), dtype=torch.float32, device="cpu", **settings))


def greedy_reference(dense: Path, prompts: list[list[int]], steps: int) -> list[list[int]]:
    from test_mistral import _hf_greedy

    return _hf_greedy(dense, prompts, steps)


# -- the formats ---------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_format_matches_transformers_on_the_dequantized_weights(tmp_path, tiny_model, fmt, monkeypatch):
    """Greedy tokens equal transformers' in float32 on the dequantized weights; the packed layout (as on a
    GPU, here with its reference product) gives the dequantized path's logits bit for bit."""
    original = tiny_model("qwen3" if "ct" in fmt else "llama")
    folder = write_checkpoint(original, tmp_path / "q", fmt, dense=tmp_path / "dense")
    prompts = [s[:n] for s, n in zip(sequences(), PROMPT_LENS)]
    eng = engine(folder)
    assert not any(isinstance(m, PackedLinear) for m in eng.model.modules())  # CPU: dequantized at load
    got = generate(eng, prompts, SamplingParams(max_tokens=8))
    logits = teacher_forced_logits(eng, sequences(), PROMPT_LENS, STEPS)
    eng.shutdown()
    assert got == greedy_reference(tmp_path / "dense", prompts, 8)
    monkeypatch.setattr(packed_models, "KEEP_PACKED", True)
    eng = engine(folder)
    layers = [m for m in eng.model.modules() if isinstance(m, PackedLinear)]
    assert len(layers) == 4 * 3
    assert (layers[0].perm is not None) == ("actorder" in fmt)
    assert torch.equal(teacher_forced_logits(eng, sequences(), PROMPT_LENS, STEPS), logits)
    eng.shutdown()


def test_packer_matches_compressed_tensors():
    """The test's packer against compressed-tensors' own (skipped where it is not installed)."""
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    for bits in (4, 8):
        q, z, _ = quantize(w, bits, 32, sym=False)
        offset = 2 ** (bits - 1)
        assert torch.equal(pack_rows(q, bits), helpers.pack_to_int32((q - offset).to(torch.int8), bits))
        zp = helpers.pack_to_int32((z - offset).to(torch.int8), bits, packed_dim=0)
        assert torch.equal(pack_rows(z.T.contiguous(), bits).T.contiguous(), zp)


def test_layout_roundtrip():
    """pack_words is the layout's packing (the test's packer's bytes) and `dequantize` undoes `perm`."""
    g = torch.Generator().manual_seed(0)
    for bits in (4, 8):
        values = torch.randint(0, 2**bits, (8, 64), generator=g)
        assert torch.equal(pack_words(values, bits), pack_rows(values, bits))
    values = torch.randint(0, 16, (8, 64), generator=g)
    scales, zeros = torch.rand(8, 2, generator=g).half(), torch.randint(0, 16, (8, 2), generator=g)
    perm = torch.randperm(64, generator=g)
    want = torch.empty(8, 64)
    want[:, perm] = dequant(values, zeros, scales)
    assert torch.equal(dequantize(pack_words(values, 4), scales, zeros.to(torch.uint8), 4, perm), want)


@pytest.mark.parametrize("fmt", ["gptq-4bit-g32-sym-v1", "gptq-4bit-g32-actorder-asym-v1"])
def test_qwen3_moe_experts_packed_or_dequantized(tmp_path, tiny_model, monkeypatch, fmt):
    """Qwen3-MoE in GPTQ with the weights kept packed: the experts stay packed too (the MoE backends take
    `PackedWeights`; on the CPU they dequantize them per call), except with act order, where they are
    dequantized at load; greedy tokens as transformers' on the dequantized weights either way."""
    original = tiny_model("qwen3_moe")
    folder = write_checkpoint(original, tmp_path / "q", fmt, dense=tmp_path / "dense")
    prompts = [s[:n] for s, n in zip(sequences(), PROMPT_LENS)]
    want = greedy_reference(tmp_path / "dense", prompts, 6)
    monkeypatch.setattr(packed_models, "KEEP_PACKED", True)
    eng = engine(folder)
    packed = [m for m in eng.model.modules() if isinstance(m, PackedLinear) and m.qweight.numel()]
    experts = [m for m in packed if m.experts]
    assert len(packed) - len(experts) == 2 * 3 + 2  # attention in 3 layers, the MLP of the dense one
    assert len(experts) == (0 if "actorder" in fmt else 2 * 2)  # w13 and w2 of the 2 sparse layers
    assert generate(eng, prompts, SamplingParams(max_tokens=6)) == want
    if experts:  # under torch.compile the packed experts go through their own opaque op: one graph
        from test_moe import compiled_prefill_error

        assert compiled_prefill_error(eng, prompts) < 1e-5
    eng.shutdown()


def test_tp2_matches_tp1(tmp_path, tiny_model, ranks):
    """GPTQ with act order over 2 ranks: rows and columns split on group boundaries, each rank's g_idx."""
    from test_tp import assert_tp_matches_single

    folder = write_checkpoint(tiny_model("llama"), tmp_path / "q", "gptq-4bit-g32-actorder-asym-v1")
    assert_tp_matches_single(ranks, folder, 2, max_tokens=4)


def test_lora_over_a_packed_base(tmp_path, tiny_model, monkeypatch):
    """A LoRA adapter over the packed 4-bit base gives the tokens of the same adapter over the
    dequantized float32 model (and other tokens than the base alone)."""
    from conftest import make_peft_adapter

    from minisgl.llm import LLM

    folder = write_checkpoint(tiny_model("llama"), tmp_path / "q", "awq-g32", dense=tmp_path / "dense")
    targets = ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]
    adapter = make_peft_adapter(
        tmp_path / "dense", tmp_path / "lora", 0, r=4, lora_alpha=8, target_modules=targets
    )
    prompts = [s[:n] for s, n in zip(sequences(), PROMPT_LENS)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    got = {}
    for name, path, packed in (("packed", folder, True), ("dense", tmp_path / "dense", False)):
        monkeypatch.setattr(packed_models, "KEEP_PACKED", packed)
        settings = dict(device="cpu", dtype="float32", lora_modules={"a": adapter}, max_lora_rank=4)
        with LLM(str(path), cpu_kv_budget_gib=0.05, **settings) as llm:
            assert packed == any(isinstance(m, PackedLinear) for m in llm.engine.model.modules())
            got[name] = [o.token_ids for o in llm.generate(prompts, params, lora="a")]
            got[name + "-base"] = [o.token_ids for o in llm.generate(prompts, params)]
    assert got["packed"] == got["dense"] and got["packed-base"] == got["dense-base"]
    assert got["packed"] != got["packed-base"]


def test_dummy_packed_weights(tiny_model, tmp_path, monkeypatch):
    """A 4-bit config.json without weights and dummy weights: packed layers, finite logits."""
    folder = tmp_path / "m"
    folder.mkdir()
    config = json.loads((tiny_model("qwen3") / "config.json").read_text())
    config["quantization_config"] = FORMATS["awq-g32"][0]
    (folder / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr(packed_models, "KEEP_PACKED", True)
    eng = engine(folder, use_dummy_weight=True)
    layer = next(m for m in eng.model.modules() if isinstance(m, PackedLinear))
    assert dequantize(layer.qweight, layer.scales, layer.zeros, 4).std() > 0.01
    logits = teacher_forced_logits(eng, sequences(), PROMPT_LENS, 1)
    assert torch.isfinite(logits).all() and logits.std() > 0
    eng.shutdown()


# -- what minisgl refuses ----------------------------------------------------------------------------

AWQ = FORMATS["awq-g32"][0]
GPTQ = FORMATS["gptq-4bit-g32-sym-v1"][0]
CT = ct_config(4, "group", True)
CT_WEIGHTS = CT["config_groups"]["group_0"]["weights"]
GROUP_0 = "quantization_config.config_groups.group_0"


def ct_with(group: dict[str, Any] | None = None, weights: dict[str, Any] | None = None, **top: Any):
    scheme = {**CT["config_groups"]["group_0"], **(group or {})}
    scheme["weights"] = {**CT_WEIGHTS, **(weights or {})}
    return {**CT, "config_groups": {"group_0": scheme}, **top}


REFUSED = [
    ({**AWQ, "version": "gemv"}, 'quantization_config.version="gemv" is not supported'),
    ({**AWQ, "version": "exllama"}, 'quantization_config.version="exllama" is not supported'),
    ({**AWQ, "bits": 3}, "quantization_config.bits=3 is not supported"),
    ({**AWQ, "zero_point": False}, "quantization_config.zero_point=false is not supported"),
    (
        {**AWQ, "modules_to_not_convert": ["mlp.down_proj"]},
        'quantization_config.modules_to_not_convert=["mlp',
    ),
    ({**GPTQ, "bits": 3}, "quantization_config.bits=3 is not supported: minisgl reads 4- and 8-bit"),
    ({**GPTQ, "checkpoint_format": "marlin"}, 'quantization_config.checkpoint_format="marlin" is not'),
    ({**GPTQ, "group_size": 12}, "quantization_config.group_size=12 is not supported"),
    ({**GPTQ, "dynamic": {"-:.*": {}}}, "quantization_config.dynamic="),
    ({"quant_method": "exl2", "bits": 4}, 'quantization_config.quant_method="exl2" is not supported'),
    (ct_with(format="naive-quantized"), 'quantization_config.format="naive-quantized" is not supported'),
    (
        ct_with({"input_activations": {"num_bits": 8, "type": "int"}}),
        f'{GROUP_0}.input_activations={{"num_bits": 8',
    ),
    (ct_with(weights={"num_bits": 3}), f"{GROUP_0}.weights.num_bits=3 is not supported"),
    (ct_with(weights={"strategy": "tensor"}), f'{GROUP_0}.weights.strategy="tensor" is not supported'),
    (ct_with(weights={"type": "float"}), f'{GROUP_0}.weights.type="float" is not supported'),
    (ct_with(weights={"actorder": "group"}), f'{GROUP_0}.weights.actorder="group" is not supported'),
    (ct_with(ignore=[]), "quantization_config.ignore=[] is not supported: minisgl keeps the LM head"),
    (
        ct_with(ignore=["lm_head", "re:.*down_proj"]),
        'quantization_config.ignore=["lm_head", "re:.*down_proj"]',
    ),
    (ct_with(kv_cache_scheme={"num_bits": 8}), "quantization_config.kv_cache_scheme="),
]


@pytest.mark.parametrize(("quant", "message"), REFUSED, ids=[m.split(" ")[0][20:60] for _, m in REFUSED])
def test_refused_at_start_naming_the_field(tiny_model, quant, message):
    """When config.json is read (before any weight), naming the field and its value."""
    from minisgl.models import ModelConfig

    config = json.loads((tiny_model("llama") / "config.json").read_text())
    with pytest.raises(ValueError) as error:
        ModelConfig.from_dict({**config, "quantization_config": quant}, source="config.json")
    assert str(error.value).startswith(f"config.json: {message}"), str(error.value)


def test_tp_size_that_splits_a_group_is_refused(tmp_path, tiny_model):
    folder = tmp_path / "model"
    folder.mkdir()
    config = json.loads((tiny_model("llama") / "config.json").read_text())
    (folder / "config.json").write_text(
        json.dumps({**config, "quantization_config": {**AWQ, "group_size": 64}})
    )
    with pytest.raises(ValueError, match=r"tensor-parallel size 2 splits the packed weights of self_attn.o_proj: "
                       r"each rank would hold 32 of its 64 columns, not a multiple of the group size 64"):  # fmt: skip
        engine(folder, tp_info=DistributedInfo(0, 2))


def test_damaged_tensors_are_refused_naming_them(tmp_path, tiny_model):
    folder = write_checkpoint(tiny_model("llama"), tmp_path / "q", "gptq-4bit-g32-actorder-asym-v1")
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.mlp.down_proj.g_idx"][0] = 7
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"down_proj.g_idx names groups outside \[0, 3\)"):
        engine(folder)
    tensors["model.layers.0.mlp.down_proj.scales"] = tensors["model.layers.0.mlp.down_proj.scales"][:2]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(
        ValueError, match=r"down_proj.scales' in model.safetensors has shape \(2, 64\), expected \(3, 64\)"
    ):
        engine(folder)


# -- the GPU kernels under Triton's interpreter (tests/gpu/test_gpu_quant4.py runs them on CUDA) ---------


def test_kernels_under_the_interpreter(monkeypatch):
    """The GEMV (3 rows), the tensor-core GEMM (20 and 70 rows: two blocks of x's rows; unpacked in
    the columns' order, and value by value) and dequantize-then-cuBLAS (20 rows), 4-bit with act-order
    columns and a bias and 8-bit per channel, against dequantize-then-multiply, float32."""
    import os

    from minisgl.kernels import packed_gemm

    if os.environ.get("TRITON_INTERPRET") != "1" or packed_gemm.triton is None:
        pytest.skip("needs Triton's interpreter (CPU)")
    g = torch.Generator().manual_seed(0)
    mma = packed_gemm.packed_mma
    cases = [(packed_gemm.packed_gemv, 3, None), (mma, 20, True), (mma, 70, True), (mma, 20, False)]
    cases.append((packed_gemm.packed_gemm, 20, None))
    default = packed_gemm.mma_config
    for kernel, rows, reshape in cases:
        if reshape is not None:  # the GEMM's two ways of pairing values with x's columns
            monkeypatch.setattr(packed_gemm, "mma_config", lambda m, r=reshape: (*default(m)[:5], r))
        for bits, groups, perm in ((4, 2, torch.randperm(64, generator=g)), (8, 1, None)):
            qweight = pack_words(torch.randint(0, 2**bits, (80, 64), generator=g), bits)
            scales = torch.rand(80, groups, generator=g).half() / 2**bits
            zeros = torch.randint(0, 2**bits, (80, groups), generator=g).to(torch.uint8)
            x, bias = torch.randn(rows, 64, generator=g), torch.randn(80, generator=g)
            args = (x, qweight, scales, zeros, perm, bias, bits)
            assert rel_err(kernel(*args), packed_gemm.packed_reference(*args)) < 1e-6, (rows, reshape, bits)


def test_the_gemm_buffer_is_reserved_once_and_grows_only():
    """`reserve_workspace` gives the bytes it adds (a model's load counts them as weights) and the GEMM
    path writes into that buffer rather than allocating one each call."""
    from minisgl.kernels import packed_gemm

    dtype = torch.float64  # a key no other test uses
    try:
        assert packed_gemm.reserve_workspace(100, dtype, torch.device("cpu")) == 800
        assert packed_gemm.reserve_workspace(60, dtype, "cpu") == 0
        assert packed_gemm.reserve_workspace(150, dtype, torch.device("cpu")) == 400
        assert packed_gemm._WORKSPACE[(torch.device("cpu"), dtype)].numel() == 150
    finally:
        packed_gemm._WORKSPACE.pop((torch.device("cpu"), dtype), None)
