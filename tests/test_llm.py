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
