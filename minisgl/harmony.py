"""gpt-oss's chat format (harmony) in a reply, read piece by piece: the analysis channel is reasoning, the
final channel (and any message without a channel, or on a channel it does not know) content, and a
message to a function (`to=functions.NAME`, on the commentary channel) a tool call with its JSON
arguments. The reply's text must keep the special tokens.

A reply (the prompt ends with ``<|start|>assistant``) is a run of messages, each a header up to
``<|message|>`` (``<|channel|>analysis``, ``<|channel|>commentary to=functions.get_weather
<|constrain|>json``, or, after ``<|start|>assistant``, `` to=functions.x<|channel|>commentary json``),
then the body up to ``<|end|>``, ``<|call|>`` or ``<|return|>``. Text that is no header is content; a
call whose arguments are no JSON object is content as written; a call cut off (not `stopped`) is dropped.
A tag cut across pieces is held back until it is whole, so the result does not depend on the pieces.
docs/tools.md ("gpt-oss").
"""

from __future__ import annotations

import json
import re

MESSAGE, END, CALL, RETURN, START, CHANNEL = (
    "<|message|>", "<|end|>", "<|call|>", "<|return|>", "<|start|>", "<|channel|>"
)  # fmt: skip
# what ends a message's body (a <|start|> or <|channel|> there: the model began the next one unclosed)
_BODY_ENDS = (END, CALL, RETURN, START, CHANNEL)
# how a header may begin (anything else is the body of a message without one: content)
_HEADER_STARTS = (START, CHANNEL, "<|constrain|>", "to=", "assistant")
_MAX_HEADER = 256  # a longer "header" without <|message|> is content
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_TAG = re.compile(r"<\|[a-z_]+\|>")
FUNCTIONS = "functions."


def _held_tag(text: str, tags: tuple[str, ...]) -> int:
    """The length of the longest end of `text` that begins one of `tags`."""
    for n in range(min(max(map(len, tags)) - 1, len(text)), 0, -1):
        if any(tag.startswith(text[-n:]) for tag in tags):
            return n
    return 0


class HarmonyParser:
    """`feed(text, final, stopped)` -> (reasoning, content, calls): what the next piece of the reply
    completes; calls as (name, arguments JSON text)."""

    def __init__(self) -> None:
        self.held = ""
        self.header: str | None = ""  # the header read so far; None: in a body
        self.channel: str | None = None  # the body's: "reasoning", "content" or "call"
        self.name = ""  # a call's function
        self.arguments = ""  # a call's body so far

    def feed(
        self, text: str, final: bool = False, stopped: bool = True
    ) -> tuple[str, str, list[tuple[str, str]]]:
        self.held += text
        out: dict[str, list[str]] = {"reasoning": [], "content": []}
        calls: list[tuple[str, str]] = []
        while self._header(out, final) if self.header is not None else self._body(out, calls, final, stopped):
            pass
        return "".join(out["reasoning"]), "".join(out["content"]), calls

    def _header(self, out: dict[str, list[str]], final: bool) -> bool:
        held = self.header + self.held  # type: ignore[operator]
        rest = held.lstrip()
        if not rest:
            self.header, self.held = held, ""
            return False
        at = held.find(MESSAGE)
        if at >= 0:
            self._open(held[:at])
            self.held = held[at + len(MESSAGE) :]
            return True
        could_be = any(rest.startswith(s) or s.startswith(rest) for s in _HEADER_STARTS)
        if could_be and len(held) <= _MAX_HEADER and not final:
            self.header, self.held = held, ""
            return False
        if could_be and final:  # a reply that ends in a header: nothing more to show
            self.header, self.held = "", ""
            return False
        # no header: the body of a message without one (its tags dropped)
        self.header, self.channel, self.held = None, "content", _TAG.sub("", held) if could_be else held
        return True

    def _open(self, header: str) -> None:
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        self.header = None
        if recipient is not None and recipient.group(1).startswith(FUNCTIONS):
            self.channel, self.name = "call", recipient.group(1)[len(FUNCTIONS) :]
        elif channel is not None and channel.group(1) == "analysis":
            self.channel = "reasoning"
        else:  # final, a preamble on commentary, a channel or recipient it does not know
            self.channel = "content"

    def _body(
        self, out: dict[str, list[str]], calls: list[tuple[str, str]], final: bool, stopped: bool
    ) -> bool:
        held = self.held
        ends = [(i, tag) for tag in _BODY_ENDS if (i := held.find(tag)) >= 0]
        if ends:
            at, tag = min(ends)
            self._emit(out, held[:at])
            self._close(out, calls, complete=True)
            self.held = held[at + len(tag) :] if tag in (END, CALL, RETURN) else held[at:]
            self.header = ""
            return True
        keep = 0 if final else _held_tag(held, _BODY_ENDS)
        self._emit(out, held[: len(held) - keep])
        self.held = held[len(held) - keep :]
        if final:
            self._close(out, calls, complete=stopped)
        return False

    def _emit(self, out: dict[str, list[str]], text: str) -> None:
        if self.channel == "call":
            self.arguments += text
        else:
            out[self.channel].append(text)  # type: ignore[index]

    def _close(self, out: dict[str, list[str]], calls: list[tuple[str, str]], complete: bool) -> None:
        """A call's message ends: a call when whole with a JSON object, else content as written."""
        if self.channel != "call":
            return
        arguments, self.arguments = self.arguments.strip(), ""
        try:
            valid = isinstance(json.loads(arguments), dict)
        except ValueError:
            valid = False
        if valid and complete:
            calls.append((self.name, arguments))
        elif complete:
            out["content"].append(arguments)


def parse_harmony(text: str, stopped: bool = True) -> tuple[str, str, list[tuple[str, str]]]:
    """A whole reply's (reasoning, content, calls) (`HarmonyParser` in one piece)."""
    return HarmonyParser().feed(text, final=True, stopped=stopped)


def is_harmony_template(template: object) -> bool:
    """Whether a chat template writes harmony (gpt-oss's): it names the <|channel|> tag."""
    return CHANNEL in str(template or "")
