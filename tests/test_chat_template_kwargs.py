"""`chat_template_kwargs` and `separate_reasoning`: the template's own variables,
through `LLM.chat` and the server, on a copy of the default model whose template reads
`enable_thinking` (off: an empty think block written into the prompt, as Qwen3's does; on: the prompt
ends inside an opened <think>, as templates that force thinking do); the reply split into its
reasoning and its content, streamed and not."""

from __future__ import annotations

import json
import os
from pathlib import Path

import openai
import pytest
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st
from test_server import Server

from minisgl.core import SamplingParams
from minisgl.llm import LLM
from minisgl.templates import (
    THINK_CLOSE,
    THINK_OPEN,
    ReasoningSplitter,
    check_template_kwargs,
    split_reasoning,
)

THINKING_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('the system message must come first') }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined %}{% if enable_thinking %}<think>\n{% else %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}{% endif %}"
)
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
SUFFIX = {None: "", True: "<think>\n", False: "<think>\n\n</think>\n\n"}  # by enable_thinking


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


@pytest.fixture(scope="module")
def server(thinking_model) -> Server:
    srv = Server("--model", str(thinking_model), "--device", "cpu", "--dtype", "float32")
    yield srv
    assert srv.stop() == 0


def _expected(folder: Path, enable_thinking: bool | None) -> list[int]:
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    text = f"<|im_start|>user\n{MESSAGES[0]['content']}<|im_end|>\n<|im_start|>assistant\n"
    return tok(text + SUFFIX[enable_thinking], add_special_tokens=False)["input_ids"]


def test_the_template_variables_change_the_prompt_as_the_template_says(thinking_model) -> None:
    llm = LLM(str(thinking_model), device="cpu", dtype="float32")
    try:
        for thinking in (None, True, False):
            kwargs = None if thinking is None else {"enable_thinking": thinking}
            assert llm.chat_prompt(MESSAGES, kwargs) == _expected(thinking_model, thinking)
        off = llm.chat_prompt(MESSAGES, {"enable_thinking": False})
        params = SamplingParams(max_tokens=8)
        reply = llm.chat(MESSAGES, params, chat_template_kwargs={"enable_thinking": False})
        assert reply.token_ids == llm.generate([off], params)[0].token_ids
        with pytest.raises(ValueError, match="may not set 'tokenize'"):
            llm.chat(MESSAGES, params, chat_template_kwargs={"tokenize": True})
    finally:
        llm.shutdown()


def test_chat_template_kwargs_over_http(server, thinking_model) -> None:
    client = openai.OpenAI(base_url=server.url, api_key="x", timeout=120, max_retries=0)

    def prompt_tokens(**extra) -> int:
        reply = client.chat.completions.create(
            model=thinking_model.name,
            messages=MESSAGES,
            max_tokens=2,
            temperature=0,
            extra_body=extra or None,
        )
        return reply.usage.prompt_tokens

    for thinking in (None, True, False):
        extra = {} if thinking is None else {"chat_template_kwargs": {"enable_thinking": thinking}}
        assert prompt_tokens(**extra) == len(_expected(thinking_model, thinking))
    for bad, words in (([1], "must be an object"), ({"add_generation_prompt": False}, "may not set")):
        with pytest.raises(openai.BadRequestError, match=words):
            prompt_tokens(chat_template_kwargs=bad)
    # the template's own refusal, and a variable that breaks it: 400s, not 500s
    late_system = [*MESSAGES, {"role": "system", "content": "Be brief."}]
    for extra in ({}, {"chat_template_kwargs": {"raise_exception": 1}}):
        with pytest.raises(openai.BadRequestError, match="chat template could not render"):
            client.chat.completions.create(
                model=thinking_model.name, messages=late_system, max_tokens=2, extra_body=extra or None
            )


def test_separate_reasoning_over_http(server, thinking_model) -> None:
    """The model (SmolLM2) never closes a think block: a prompt that opened one makes the whole reply
    reasoning, one that closed it the whole reply content; streamed as not."""
    client = openai.OpenAI(base_url=server.url, api_key="x", timeout=120, max_retries=0)
    request = dict(model=thinking_model.name, messages=MESSAGES, max_tokens=12, temperature=0)
    for thinking in (True, False):
        extra = {"chat_template_kwargs": {"enable_thinking": thinking}}
        text = client.chat.completions.create(**request, extra_body=extra).choices[0].message.content
        assert text
        extra["separate_reasoning"] = True
        message = client.chat.completions.create(**request, extra_body=extra).choices[0].message
        reasoning = (message.model_extra or {}).get("reasoning_content")
        assert (reasoning, message.content) == ((text, "") if thinking else (None, text))
        streamed = {"reasoning": "", "content": ""}
        for chunk in client.chat.completions.create(**request, extra_body=extra, stream=True):
            if chunk.choices:
                delta = chunk.choices[0].delta
                streamed["content"] += delta.content or ""
                streamed["reasoning"] += (delta.model_extra or {}).get("reasoning_content") or ""
        assert streamed == (
            {"reasoning": text, "content": ""} if thinking else {"reasoning": "", "content": text}
        )


@settings(max_examples=300, deadline=None)
@given(
    reasoning=st.text("ab<>/think \n", max_size=30).filter(lambda t: THINK_CLOSE not in t),
    content=st.text("ab<>/think \n", max_size=30),
    opened=st.booleans(),
    cuts=st.lists(st.integers(0, 80), max_size=8),
)
def test_the_split_does_not_depend_on_the_pieces(reasoning, content, opened, cuts) -> None:
    text = ("" if opened else THINK_OPEN) + reasoning + THINK_CLOSE + "\n\n" + content
    whole = split_reasoning(text, opened)
    assert whole == (reasoning, content.lstrip())
    splitter, got = ReasoningSplitter(opened), ("", "")
    bounds = sorted({0, len(text), *(min(c, len(text)) for c in cuts)})
    for start, end in zip(bounds, bounds[1:]):
        r, c = splitter.feed(text[start:end])
        got = (got[0] + r, got[1] + c)
    r, c = splitter.feed("", final=True)
    assert (got[0] + r, got[1] + c) == whole


def test_replies_without_a_think_block_are_content() -> None:
    assert split_reasoning("Paris.") == ("", "Paris.")
    assert split_reasoning("<thi") == ("", "<thi")  # a tag begun, never finished
    assert split_reasoning("  <think>x</think>y") == ("x", "y")
    assert split_reasoning("x</think>y", in_reasoning=True) == ("x", "y")


def test_check_template_kwargs() -> None:
    assert check_template_kwargs({"enable_thinking": False, "x": [1]}) == {"enable_thinking": False, "x": [1]}
    for bad in ([("a", 1)], {1: 2}, "x", {"messages": []}, {"chat_template": "{{ 1 }}"}):
        with pytest.raises(ValueError, match="chat_template_kwargs"):
            check_template_kwargs(bad)
