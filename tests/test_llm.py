"""The LLM API on models without a tokenizer (dummy-weight presets) and with hub ids offline."""

import pytest
import torch
from conftest import make_tiny_model

from minisgl.core import SamplingParams
from minisgl.engine import Engine, EngineConfig
from minisgl.llm import LLM, resolve_model
from minisgl.scheduler import generate


def test_token_ids_without_tokenizer_and_dummy_weights(tmp_path):
    folder = make_tiny_model(tmp_path, "qwen3")
    llm = LLM(str(folder), device="cpu", dtype="float32", max_running_req=4)
    assert llm.tokenizer is None
    prompts = [[5, 6, 7], list(range(10, 30))]
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [6, 6] and all(o.text == "" for o in outs)
    engine = Engine(EngineConfig(model_path=str(folder), dtype=torch.float32, device="cpu"))
    assert [o.token_ids for o in outs] == generate(engine, prompts, SamplingParams(max_tokens=6))
    with pytest.raises(ValueError, match="has no tokenizer: give token ids"):
        llm.generate("hello")
    with pytest.raises(ValueError, match="no chat template"):
        llm.chat("hello")
    llm.shutdown()
    for file in folder.glob("*.safetensors"):
        file.unlink()
    dummy = LLM(str(folder), device="cpu", use_dummy_weight=True)
    assert len(dummy.generate([[5, 6]], SamplingParams(max_tokens=3, ignore_eos=True))[0].token_ids) == 3
    dummy.shutdown()


def test_hub_id_offline_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="could not download 'nobody-here/no-such-model'"):
        resolve_model("nobody-here/no-such-model")
    with pytest.raises(FileNotFoundError, match="neither a local folder nor a hub id"):
        resolve_model("./missing/folder/x")


def test_the_eos_id_read_from_the_files_is_the_tokenizers(tmp_path, smollm2_path):
    """`eos_token_id_from_files` (the server's scheduler process starts without loading the tokenizer)
    gives the tokenizer's eos_token_id, or None where the files cannot tell; an LLM with detokenize=False
    loads its tokenizer at the first use, with the same EOS ids."""
    import json
    import shutil

    from conftest import make_tiny_model_with_tokenizer

    from minisgl.templates import eos_token_id_from_files, load_tokenizer

    assert eos_token_id_from_files(smollm2_path) == load_tokenizer(smollm2_path).eos_token_id
    folder = tmp_path / "tok"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_path / name, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    for eos in (
        {"__type": "AddedToken", "content": "<|im_start|>", "special": True},
        "<|endoftext|>",
        "Hello",
    ):
        (folder / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": eos}))
        assert eos_token_id_from_files(folder) == load_tokenizer(folder).eos_token_id
    for eos in (None, "no such token"):
        (folder / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": eos}))
        assert eos_token_id_from_files(folder) is None
    (folder / "special_tokens_map.json").write_text("{}")
    assert eos_token_id_from_files(folder) is None
    assert eos_token_id_from_files(tmp_path / "missing") is None

    model = make_tiny_model_with_tokenizer(tmp_path)
    eager = LLM(str(model), device="cpu", dtype="float32", max_running_req=2)
    lazy = LLM(str(model), device="cpu", dtype="float32", max_running_req=2, detokenize=False)
    try:
        assert lazy._tokenizer is None and eager._tokenizer is not None
        assert lazy.scheduler.output.eos_token_ids == eager.scheduler.output.eos_token_ids
        assert lazy.tokenizer.eos_token_id == eager.tokenizer.eos_token_id  # loaded now
    finally:
        eager.shutdown()
        lazy.shutdown()
