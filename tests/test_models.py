"""Tiny random Llama (llama3 RoPE scaling), Mistral (a sliding window shorter than the sequences), Qwen2
and Qwen3 models: logits against transformers; the checks of config.json (ModelConfig)."""

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from conftest import GPU_SHAPE, make_tiny_model, reference_logits, rel_err, teacher_forced_logits

from minisgl.core import SamplingParams
from minisgl.engine import Engine, EngineConfig
from minisgl.models import ModelConfig
from minisgl.scheduler import BatchPreparer

PROMPT_LENS = [5, 17, 1, 40]
DECODE_STEPS = 12


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_logits_match_transformers(tiny_model, arch, page_size):
    """Prefill of prompts of different lengths in one batch, then teacher-forced decode steps."""
    folder = tiny_model(arch)
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


# -- config.json checks --------------------------------------------------------------------------

LLAMA_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 96,
    "vocab_size": 320,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
}
MOE_CONFIG: dict[str, Any] = {
    **LLAMA_CONFIG,
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "rope_scaling": None,
    "num_local_experts": 8,  # transformers 5's name; the hub's files say num_experts
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [1],
}
DELETE = object()  # an override that removes the key


def write_config(folder: Path, raw: Any, **overrides: Any) -> Path:
    """`folder`/config.json holding `raw` (a dict: with `overrides`, DELETE removing a key); the file."""
    folder.mkdir(parents=True, exist_ok=True)
    if isinstance(raw, dict):
        raw = {k: v for k, v in {**raw, **overrides}.items() if v is not DELETE}
    path = folder / "config.json"
    path.write_text(raw if isinstance(raw, str) else json.dumps(raw))
    return path


def test_config_dicts_of_these_tests_load(tmp_path: Path) -> None:
    dense = ModelConfig.from_path(write_config(tmp_path / "dense", LLAMA_CONFIG).parent)
    assert (dense.num_heads, dense.num_kv_heads, dense.head_dim, dense.rope.rope_type) == (4, 2, 16, "llama3")
    moe = ModelConfig.from_path(write_config(tmp_path / "moe", MOE_CONFIG).parent)
    assert (moe.num_experts, moe.num_experts_per_tok, moe.mlp_only_layers) == (8, 2, (1,))


# (base config, overrides, the message after "<path>: ")
IMPOSSIBLE_CONFIGS: list[tuple[dict[str, Any], dict[str, Any], str]] = [
    (LLAMA_CONFIG, {"num_attention_heads": 0}, "num_attention_heads=0 must be an integer in [1, 65536]"),
    (LLAMA_CONFIG, {"num_hidden_layers": -1}, "num_hidden_layers=-1 must be an integer in [1, 65536]"),
    (LLAMA_CONFIG, {"num_hidden_layers": 10**9}, "num_hidden_layers=1000000000 must be an integer in [1,"),
    (LLAMA_CONFIG, {"hidden_size": "64"}, 'hidden_size="64" must be an integer in [1, 1048576]'),
    (LLAMA_CONFIG, {"hidden_size": True}, "hidden_size=true must be an integer"),
    (LLAMA_CONFIG, {"hidden_size": 64.5}, "hidden_size=64.5 must be an integer"),
    (LLAMA_CONFIG, {"hidden_size": 64.0}, "hidden_size=64.0 must be an integer"),
    (LLAMA_CONFIG, {"hidden_size": None}, "hidden_size=null must be an integer"),
    (LLAMA_CONFIG, {"hidden_size": 2**40}, "hidden_size=1099511627776 must be an integer in [1, 1048576]"),
    (LLAMA_CONFIG, {"intermediate_size": 0}, "intermediate_size=0 must be an integer"),
    (LLAMA_CONFIG, {"vocab_size": 0}, "vocab_size=0 must be an integer in [1, 16777216]"),
    (LLAMA_CONFIG, {"vocab_size": 2**40}, "vocab_size=1099511627776 must be an integer in [1, 16777216]"),
    (LLAMA_CONFIG, {"max_position_embeddings": 0}, "max_position_embeddings=0 must be an integer"),
    (
        LLAMA_CONFIG,
        {"max_position_embeddings": 2**31},
        "max_position_embeddings=2147483648 must be an integer in [1, 2147483647]",
    ),
    (LLAMA_CONFIG, {"num_key_value_heads": 0}, "num_key_value_heads=0 must be an integer"),
    (
        LLAMA_CONFIG,
        {"num_key_value_heads": 3},
        "num_attention_heads=4 must be a multiple of num_key_value_heads=3",
    ),
    (
        LLAMA_CONFIG,
        {"num_key_value_heads": 8},
        "num_attention_heads=4 must be a multiple of num_key_value_heads=8",
    ),
    (LLAMA_CONFIG, {"head_dim": 0}, "head_dim=0 must be an integer"),
    (LLAMA_CONFIG, {"head_dim": 15}, "head_dim=15 must be even"),
    (LLAMA_CONFIG, {"head_dim": "16"}, 'head_dim="16" must be an integer'),
    (
        LLAMA_CONFIG,
        {"head_dim": DELETE, "num_attention_heads": 3, "num_key_value_heads": 1},
        "hidden_size=64 must be a multiple of num_attention_heads=3",
    ),
    (LLAMA_CONFIG, {"rms_norm_eps": 0}, "rms_norm_eps=0 must be a finite number > 0"),
    (LLAMA_CONFIG, {"rms_norm_eps": -1e-6}, "rms_norm_eps=-1e-06 must be a finite number > 0"),
    (LLAMA_CONFIG, {"rms_norm_eps": float("nan")}, "rms_norm_eps=NaN must be a finite number > 0"),
    (LLAMA_CONFIG, {"rms_norm_eps": float("inf")}, "rms_norm_eps=Infinity must be a finite number > 0"),
    (LLAMA_CONFIG, {"rms_norm_eps": "1e-6"}, 'rms_norm_eps="1e-6" must be a finite number > 0'),
    (LLAMA_CONFIG, {"rms_norm_eps": False}, "rms_norm_eps=false must be a finite number > 0"),
    (LLAMA_CONFIG, {"rope_theta": 0}, "rope_theta=0 must be a finite number > 0"),
    (
        LLAMA_CONFIG,
        {"rope_scaling": None, "rope_parameters": {"rope_theta": -1.0}},
        "rope_parameters.rope_theta=-1.0 must be",
    ),
    (
        LLAMA_CONFIG,
        {"rope_scaling": {**LLAMA_CONFIG["rope_scaling"], "factor": 0}},
        "rope_scaling.factor=0 must be a finite number > 0",
    ),
    (
        LLAMA_CONFIG,
        {"rope_scaling": {**LLAMA_CONFIG["rope_scaling"], "original_max_position_embeddings": 0.5}},
        "rope_scaling.original_max_position_embeddings=0.5 must be an integer",
    ),
    (
        LLAMA_CONFIG,
        {"rope_scaling": {**LLAMA_CONFIG["rope_scaling"], "high_freq_factor": 1.0}},
        "rope_scaling.high_freq_factor=1.0 must be > low_freq_factor=1",
    ),
    (LLAMA_CONFIG, {"rope_scaling": [8.0]}, "rope_scaling=[8.0] must be a JSON object or null"),
    (LLAMA_CONFIG, {"eos_token_id": 320}, "eos_token_id=320 must be a token id in [0, 319]"),
    (LLAMA_CONFIG, {"eos_token_id": [2, -1]}, "eos_token_id=[2, -1] must be a token id in [0, 319]"),
    (LLAMA_CONFIG, {"eos_token_id": "2"}, 'eos_token_id="2" must be a token id'),
    (LLAMA_CONFIG, {"eos_token_id": True}, "eos_token_id=true must be a token id"),
    (LLAMA_CONFIG, {"bos_token_id": 320}, "bos_token_id=320 must be an integer in [0, 319] (vocab_size=320)"),
    (LLAMA_CONFIG, {"bos_token_id": 1.0}, "bos_token_id=1.0 must be an integer in [0, 319]"),
    (LLAMA_CONFIG, {"tie_word_embeddings": 1}, "tie_word_embeddings=1 must be true or false"),
    (LLAMA_CONFIG, {"attention_bias": "false"}, 'attention_bias="false" must be true or false'),
    (LLAMA_CONFIG, {"torch_dtype": 16}, "torch_dtype=16 must be a string"),
    (LLAMA_CONFIG, {"architectures": "LlamaForCausalLM"}, 'architectures="LlamaForCausalLM" must be a list'),
    (MOE_CONFIG, {"num_local_experts": 0}, "num_local_experts=0 must be an integer in [1, 65536]"),
    (
        MOE_CONFIG,
        {"num_experts": 0},
        "num_experts=0 must be an integer in [1, 65536]",
    ),  # wins over num_local_experts
    (MOE_CONFIG, {"num_experts_per_tok": 0}, "num_experts_per_tok=0 must be an integer in [1, 8]"),
    (
        MOE_CONFIG,
        {"num_experts_per_tok": 9},
        "num_experts_per_tok=9 must be an integer in [1, 8] (num_local_experts=8)",
    ),
    (MOE_CONFIG, {"moe_intermediate_size": 0}, "moe_intermediate_size=0 must be an integer"),
    (MOE_CONFIG, {"moe_intermediate_size": 32.0}, "moe_intermediate_size=32.0 must be an integer"),
    (MOE_CONFIG, {"decoder_sparse_step": 0}, "decoder_sparse_step=0 must be an integer in [1,"),
    (MOE_CONFIG, {"mlp_only_layers": [3]}, "mlp_only_layers=[3] must be a list of layer indices in [0, 2]"),
    (MOE_CONFIG, {"mlp_only_layers": [-1]}, "mlp_only_layers=[-1] must be a list of layer indices in [0, 2]"),
    (MOE_CONFIG, {"mlp_only_layers": 1}, "mlp_only_layers=1 must be a list of layer indices"),
    (MOE_CONFIG, {"norm_topk_prob": "yes"}, 'norm_topk_prob="yes" must be true or false'),
    # the errors of what minisgl does not support
    (LLAMA_CONFIG, {"hidden_act": "gelu"}, 'hidden_act="gelu" is not supported; minisgl supports "silu"'),
    (LLAMA_CONFIG, {"mlp_bias": True}, "mlp_bias=true is not supported"),
    (LLAMA_CONFIG, {"use_sliding_window": True}, "use_sliding_window=true is not supported"),
    (
        LLAMA_CONFIG,
        {"rope_scaling": {"rope_type": "dynamic"}},
        'rope_scaling.rope_type="dynamic" is not supported',
    ),
    (
        LLAMA_CONFIG,
        {"rope_scaling": None, "rope_parameters": {"type": "dynamic"}},
        'rope_parameters.type="dynamic" is not',
    ),
    (LLAMA_CONFIG, {"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture ['GPT2LMHeadModel']"),
    (LLAMA_CONFIG, {"vocab_size": DELETE}, "missing required key 'vocab_size' for LlamaForCausalLM"),
    (MOE_CONFIG, {"num_local_experts": DELETE}, "missing required key 'num_experts' for Qwen3MoeForCausalLM"),
]


@pytest.mark.parametrize(
    ("base", "overrides", "message"), IMPOSSIBLE_CONFIGS, ids=[c[2].split(" ")[0] for c in IMPOSSIBLE_CONFIGS]
)
def test_impossible_config_values_name_the_key_and_the_file(
    tmp_path: Path, base: dict[str, Any], overrides: dict[str, Any], message: str
) -> None:
    path = write_config(tmp_path / "model", base, **overrides)
    with pytest.raises(ValueError) as error:
        ModelConfig.from_path(path.parent)
    assert str(error.value).startswith(f"{path}: {message}"), str(error.value)


def test_null_optional_keys_take_their_defaults(tmp_path: Path) -> None:
    """transformers writes null for an unset key: head_dim null is hidden_size / num_attention_heads."""
    nulls = dict.fromkeys(
        [
            "head_dim",
            "num_key_value_heads",
            "rms_norm_eps",
            "rope_theta",
            "rope_scaling",
            "bos_token_id",
            "eos_token_id",
        ]
    )
    config = ModelConfig.from_path(write_config(tmp_path / "m", LLAMA_CONFIG, **nulls).parent)
    assert (config.head_dim, config.num_kv_heads, config.rms_norm_eps) == (16, 4, 1e-6)
    assert (config.rope.theta, config.rope.rope_type, config.bos_token_id, config.eos_token_ids) == (
        10000.0,
        "default",
        None,
        (),
    )
    moe_nulls = dict.fromkeys(["num_experts", "decoder_sparse_step", "mlp_only_layers", "norm_topk_prob"])
    moe = ModelConfig.from_path(write_config(tmp_path / "moe", MOE_CONFIG, **moe_nulls).parent)
    assert (moe.num_experts, moe.decoder_sparse_step, moe.mlp_only_layers, moe.norm_topk_prob) == (
        8,
        1,
        (),
        False,
    )
    assert (
        ModelConfig.from_path(
            write_config(tmp_path / "int", LLAMA_CONFIG, rms_norm_eps=1).parent
        ).rms_norm_eps
        == 1.0
    )


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{", "not a valid JSON file"),
        ("", "not a valid JSON file"),
        ('{"hidden_size": 64,}', "not a valid JSON file"),
        ("[1, 2]", "must hold a JSON object at its top level, got a list"),
        ('"LlamaForCausalLM"', "must hold a JSON object at its top level, got a string"),
        ("null", "must hold a JSON object at its top level, got a null"),
    ],
)
def test_config_json_that_is_no_json_object_names_the_file(
    tmp_path: Path, content: str, message: str
) -> None:
    path = write_config(tmp_path / "model", content)
    with pytest.raises(ValueError) as error:
        ModelConfig.from_path(path.parent)
    assert str(error.value).startswith(f"{path}: {message}"), str(error.value)


def test_config_json_that_is_no_text_names_the_file(tmp_path: Path) -> None:
    path = write_config(tmp_path / "model", "")
    path.write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(ValueError, match=f"^{re.escape(str(path))}: not a valid JSON file"):
        ModelConfig.from_path(path.parent)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3_moe"])
def test_tiny_models_configs_load(tiny_model, arch: str) -> None:
    for folder in (tiny_model(arch), tiny_model(arch, **GPU_SHAPE)):
        config = ModelConfig.from_path(folder)
        hf = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
        assert (config.family, config.num_layers, config.hidden_size) == (
            arch,
            hf.num_hidden_layers,
            hf.hidden_size,
        )
        assert (config.num_heads, config.num_kv_heads) == (hf.num_attention_heads, hf.num_key_value_heads)
        assert (config.vocab_size, config.bos_token_id, config.eos_token_ids) == (hf.vocab_size, 1, (2,))


def test_default_model_config_loads(smollm2_path: Path) -> None:
    config = ModelConfig.from_path(smollm2_path)
    assert (config.architecture, config.num_layers, config.hidden_size) == ("LlamaForCausalLM", 30, 576)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (9, 3, 64)
    assert (config.vocab_size, config.tie_word_embeddings, config.eos_token_ids) == (49152, True, (2,))


def test_llm_with_an_impossible_config_names_the_key_and_the_file(tmp_path: Path) -> None:
    """The check comes first: a folder with nothing but the bad config.json (no weights, no tokenizer)."""
    from minisgl.llm import LLM

    path = write_config(tmp_path / "model", LLAMA_CONFIG, num_attention_heads=0)
    with pytest.raises(ValueError) as error:
        LLM(str(path.parent), device="cpu")
    assert str(error.value).startswith(f"{path}: num_attention_heads=0 must be an integer"), str(error.value)
