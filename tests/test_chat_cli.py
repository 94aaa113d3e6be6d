"""`minisgl-run chat` through click's CliRunner, in-process on one shared LLM (the embedded SmolLM2,
CPU): the CLI's own `_make_llm` runs, only `LLM(...)` is replaced by a proxy to the shared engine whose
shutdown is a no-op, and every ChatSession the command makes is kept for inspection."""

from __future__ import annotations

from typing import Any

import pytest
from click.testing import CliRunner

import minisgl.chat
import minisgl.llm
from minisgl.chat import ChatSession, NoChatTemplate
from minisgl.cli import main
from minisgl.core import SamplingParams

MAX_TOKENS = 5
FIRST, SECOND = "What is 2+2?", "And 3+3?"


class _SharedLLM:
    def __init__(self, llm: minisgl.llm.LLM, tokenizer: Any = "same") -> None:
        self._llm = llm
        self.tokenizer = llm.tokenizer if tokenizer == "same" else tokenizer
        self.shutdowns = 0
        self.prompts: list[list[int]] = []  # the token ids of each streamed request

    def stream(self, prompt: Any, params: Any = None) -> Any:
        self.prompts.append(list(prompt))
        return self._llm.stream(prompt, params)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._llm, name)

    def shutdown(self) -> None:
        self.shutdowns += 1


@pytest.fixture
def chat_cli(shared_llm, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Runs `chat` on the shared LLM; returns a record of the LLM proxies and ChatSessions made."""
    record: dict[str, Any] = {"llms": [], "sessions": [], "tokenizer": "same"}

    def fake_llm(model: str | None = None, **kwargs: Any) -> _SharedLLM:
        proxy = _SharedLLM(shared_llm, record["tokenizer"])
        record["llms"].append(proxy)
        return proxy

    class RecordedSession(ChatSession):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            record["sessions"].append(self)

    monkeypatch.setattr(minisgl.llm, "LLM", fake_llm)
    monkeypatch.setattr(minisgl.chat, "ChatSession", RecordedSession)
    return record


def _chat(messages: list[dict[str, str]], llm, max_tokens: int = MAX_TOKENS) -> str:
    return llm.chat(messages, SamplingParams(max_tokens=max_tokens)).text


def _user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def _assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


@pytest.mark.slow
def test_two_turns_keep_the_history(chat_cli, shared_llm) -> None:
    result = CliRunner().invoke(
        main, ["chat", "--max-tokens", str(MAX_TOKENS), "-q"], input=f"{FIRST}\n{SECOND}\n"
    )
    assert result.exit_code == 0, result.output
    first = _chat([_user(FIRST)], shared_llm)
    second = _chat([_user(FIRST), _assistant(first), _user(SECOND)], shared_llm)
    assert result.stdout == f"{first}\n{second}\n"
    [session] = chat_cli["sessions"]
    assert session.history == [_user(FIRST), _assistant(first), _user(SECOND), _assistant(second)]
    # the second prompt's token ids hold the first turn: they start with the first prompt's
    [one, two] = chat_cli["llms"][0].prompts
    assert one == shared_llm.chat_prompt([_user(FIRST)])
    assert two == shared_llm.chat_prompt([_user(FIRST), _assistant(first), _user(SECOND)])
    assert two[: len(one)] == one and len(two) > len(one)
    assert chat_cli["llms"][0].shutdowns == 1


@pytest.mark.slow
def test_reset_exit_and_system_prompt(chat_cli, shared_llm) -> None:
    system = "You are a terse assistant."
    lines = f"{FIRST}\n/reset\n\n{FIRST}\n/exit\n{SECOND}\n"  # nothing after /exit runs
    args = ["chat", "--max-tokens", str(MAX_TOKENS), "--system", system, "-q"]
    result = CliRunner().invoke(main, args, input=lines)
    assert result.exit_code == 0, result.output
    reply = _chat([{"role": "system", "content": system}, _user(FIRST)], shared_llm)
    assert result.stdout == f"{reply}\n{reply}\n"  # after /reset the same question gets the same answer
    assert "[conversation cleared]" in result.stderr
    [session] = chat_cli["sessions"]
    assert session.history == [_user(FIRST), _assistant(reply)]
    session.reset()
    assert session.history == [] and session.messages() == [{"role": "system", "content": system}]


@pytest.mark.slow
def test_end_of_input_exits_zero(chat_cli) -> None:
    result = CliRunner().invoke(main, ["chat", "--max-tokens", "2", "-q"], input="")
    assert result.exit_code == 0, result.output
    assert result.stdout == ""
    [session] = chat_cli["sessions"]
    assert session.history == []
    assert chat_cli["llms"][0].shutdowns == 1


@pytest.mark.slow
def test_interrupted_reply_keeps_the_session(shared_llm) -> None:
    session = ChatSession(shared_llm, SamplingParams(max_tokens=6, ignore_eos=True))
    shown: list[str] = []

    def write(delta: str) -> None:
        shown.append(delta)
        if len(shown) == 2:
            raise KeyboardInterrupt  # as a Ctrl-C during the reply

    text, interrupted = session.reply(FIRST, write)
    assert interrupted and text == "".join(shown)
    assert session.history == [_user(FIRST), _assistant(text)]
    assert not shared_llm.scheduler.running and not shared_llm.scheduler.waiting  # the request was aborted
    text2, interrupted2 = session.reply(SECOND, lambda d: None)  # the session goes on
    assert not interrupted2 and len(session.history) == 4 and session.history[-1] == _assistant(text2)


@pytest.mark.slow
def test_request_that_cannot_run_keeps_the_session(chat_cli) -> None:
    result = CliRunner().invoke(main, ["chat", "--max-tokens", "100000", "-q"], input=f"{FIRST}\n")
    assert result.exit_code == 0, result.output
    assert "max_tokens=100000" in result.stderr and "Traceback" not in result.output
    assert chat_cli["sessions"][0].history == []


@pytest.mark.slow
def test_model_without_chat_template(chat_cli) -> None:
    chat_cli["tokenizer"] = None
    result = CliRunner().invoke(main, ["chat", "-q"], input=f"{FIRST}\n")
    assert result.exit_code == 1
    assert "no chat template" in result.stderr and "Traceback" not in result.output
    assert chat_cli["llms"][0].shutdowns == 1


def test_no_chat_template_without_a_model() -> None:
    class Bare:
        tokenizer = None
        model_name = "dummy"

    with pytest.raises(NoChatTemplate, match="no chat template"):
        ChatSession(Bare())
