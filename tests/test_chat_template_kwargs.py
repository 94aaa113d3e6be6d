"""`chat_template_kwargs` (issue 29, part 4): the template's own variables, through `LLM.chat` and the
server, on a copy of the default model whose template reads `enable_thinking` as Qwen3's does (an
empty think block written into the prompt when thinking is off)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import openai
import pytest
import transformers
from test_server import Server

from minisgl.core import SamplingParams
from minisgl.llm import LLM
from minisgl.templates import check_template_kwargs

THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def thinking_model(smollm2_path, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("thinking") / "smollm2-thinking"
    folder.mkdir()
    for entry in Path(smollm2_path).iterdir():
        if entry.name not in ("tokenizer_config.json", "chat_template.jinja"):
            os.symlink(entry, folder / entry.name)
    config = json.loads((Path(smollm2_path) / "tokenizer_config.json").read_text())
    config["chat_template"] = THINKING_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def _expected(folder: Path, thinking_off: bool) -> list[int]:
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    text = f"<|im_start|>user\n{MESSAGES[0]['content']}<|im_end|>\n<|im_start|>assistant\n"
    text += "<think>\n\n</think>\n\n" if thinking_off else ""
    return tok(text, add_special_tokens=False)["input_ids"]


def test_the_template_variables_change_the_prompt_as_the_template_says(thinking_model) -> None:
    llm = LLM(str(thinking_model), device="cpu", dtype="float32")
    try:
        plain = llm.chat_prompt(MESSAGES)
        off = llm.chat_prompt(MESSAGES, {"enable_thinking": False})
        assert (
            plain == llm.chat_prompt(MESSAGES, {"enable_thinking": True}) == _expected(thinking_model, False)
        )
        assert off == _expected(thinking_model, True) and off != plain
        params = SamplingParams(max_tokens=8)
        reply = llm.chat(MESSAGES, params, chat_template_kwargs={"enable_thinking": False})
        assert reply.token_ids == llm.generate([off], params)[0].token_ids
        with pytest.raises(ValueError, match="may not set 'tokenize'"):
            llm.chat(MESSAGES, params, chat_template_kwargs={"tokenize": True})
    finally:
        llm.shutdown()


def test_chat_template_kwargs_over_http(thinking_model) -> None:
    srv = Server("--model", str(thinking_model), "--device", "cpu", "--dtype", "float32")
    try:
        client = openai.OpenAI(base_url=srv.url, api_key="x", timeout=120, max_retries=0)
        name = thinking_model.name

        def usage(**extra) -> int:
            reply = client.chat.completions.create(
                model=name, messages=MESSAGES, max_tokens=2, temperature=0, extra_body=extra or None
            )
            return reply.usage.prompt_tokens

        assert usage() == len(_expected(thinking_model, False))
        assert usage(chat_template_kwargs={"enable_thinking": False}) == len(_expected(thinking_model, True))
        for bad, words in (([1], "must be an object"), ({"add_generation_prompt": False}, "may not set")):
            with pytest.raises(openai.BadRequestError, match=words):
                usage(chat_template_kwargs=bad)
    finally:
        assert srv.stop() == 0


def test_check_template_kwargs() -> None:
    assert check_template_kwargs({"enable_thinking": False, "x": [1]}) == {"enable_thinking": False, "x": [1]}
    for bad in ([("a", 1)], {1: 2}, "x", {"messages": []}, {"chat_template": "{{ 1 }}"}):
        with pytest.raises(ValueError, match="chat_template_kwargs"):
            check_template_kwargs(bad)
