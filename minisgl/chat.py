"""`minisgl-run chat`: an interactive chat in the terminal, in-process over `LLM`.

`ChatSession(llm, params, system=...)` keeps the conversation (`history`) and streams each `reply`;
the commands (`/reset`, `/exit`) and Ctrl-C's effects: docs/bench-serving.md#chat.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TextIO

import click

from minisgl.core import SamplingParams

RESET_COMMANDS = frozenset({"/reset", "/clear"})
EXIT_COMMANDS = frozenset({"/exit", "/quit"})
PROMPT = ">>> "


class NoChatTemplate(ValueError):
    """The model has no tokenizer or its tokenizer no chat template."""


class ChatSession:
    """A conversation with `llm`: the system prompt, then alternating user and assistant turns."""

    def __init__(
        self,
        llm: Any,
        params: SamplingParams | None = None,
        system: str | None = None,
        lora: str | None = None,
    ) -> None:
        tokenizer = getattr(llm, "tokenizer", None)
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            where = getattr(getattr(getattr(llm, "engine", None), "config", None), "model_path", None)
            raise NoChatTemplate(
                f"the model {where or getattr(llm, 'model_name', '')!r} has no chat template "
                f"({'no tokenizer' if tokenizer is None else 'its tokenizer defines none'}): "
                "chat needs an instruction-tuned model; use `minisgl-run generate` for plain completion"
            )
        self.llm = llm
        self.params = params or SamplingParams()
        self.system, self.lora = system, lora  # lora: the LoRA adapter's name (None: the base model)
        self.history: list[dict[str, str]] = []

    def messages(self, user: str | None = None) -> list[dict[str, str]]:
        """The conversation as chat-template messages, with `user` as the next message if given."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        tail = [] if user is None else [{"role": "user", "content": user}]
        return [*head, *self.history, *tail]

    def reset(self) -> None:
        self.history.clear()

    def reply(self, user: str, write: Callable[[str], None]) -> tuple[str, bool]:
        """Streams the reply to `user` through `write`, delta by delta; returns (reply, interrupted).
        Both turns join the history, also when Ctrl-C stopped the reply (with the text shown so far).
        A request that cannot run (a ValueError: the conversation outgrew the context) or fails in the
        engine (RequestError) raises and leaves the history as it was."""
        prompt_ids = self.llm.chat_prompt(self.messages(user))
        adapter = {} if self.lora is None else {"lora": self.lora}
        # checks the request: raises before any output
        stream = self.llm.stream(prompt_ids, self.params, **adapter)
        parts: list[str] = []
        interrupted = False
        try:
            for delta in stream:
                parts.append(delta)
                write(delta)
        except KeyboardInterrupt:
            interrupted = True
        finally:
            stream.close()  # aborts the request if it is unfinished
        text = "".join(parts)
        self.history += [{"role": "user", "content": user}, {"role": "assistant", "content": text}]
        return text, interrupted


def _read_line(stdin: TextIO, interactive: bool) -> str | None:
    """The next line without its newline; None at end of input."""
    if interactive:
        try:
            return input(PROMPT)
        except EOFError:
            return None
    line = stdin.readline()
    return None if line == "" else line.rstrip("\r\n")


def run_chat(session: ChatSession, stdin: TextIO | None = None) -> None:
    """The read-reply loop until /exit, /quit or end of input. Replies go to stdout (click.echo),
    notes and errors to stderr. The prompt and a banner show only when stdin is a terminal."""
    from minisgl.llm import RequestError

    stdin = stdin or sys.stdin
    interactive = stdin.isatty()
    if interactive:
        click.echo(
            f"chat with {getattr(session.llm, 'model_name', 'the model')}: /reset clears the conversation, "
            "/exit or Ctrl-D ends, Ctrl-C stops a reply",
            err=True,
        )
    while True:
        try:
            line = _read_line(stdin, interactive)
        except KeyboardInterrupt:  # Ctrl-C at the prompt: drop the line
            click.echo("", err=True)
            continue
        if line is None:
            if interactive:
                click.echo("", err=True)
            return
        command = line.strip()
        if not command:
            continue
        if command in EXIT_COMMANDS:
            return
        if command in RESET_COMMANDS:
            session.reset()
            click.echo("[conversation cleared]", err=True)
            continue
        try:
            _, interrupted = session.reply(line, write=lambda delta: click.echo(delta, nl=False))
        except KeyboardInterrupt:  # before the stream began (tokenizing): nothing was added
            click.echo("\n[interrupted]", err=True)
            continue
        except (ValueError, TypeError, RequestError) as e:
            click.echo()
            click.echo(f"[error: {e}; /reset starts a new conversation]", err=True)
            continue
        click.echo()
        if interrupted:
            click.echo("[interrupted]", err=True)
