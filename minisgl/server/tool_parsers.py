"""Tool calls in a model's reply: the text in, piece by piece, the reply's content and its calls out
(`ToolCallParser`, one of `FORMATS`: hermes, llama3_json, mistral; calls past `limit` dropped). Pure
functions over text, no HTTP and no engine. The formats and the rules, the same for every split of the
text into pieces: docs/tools.md ("Parsers").
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from minisgl.templates import THINK_CLOSE, THINK_OPEN, partial_tag


@dataclass(frozen=True)
class ParsedCall:
    """A call in the reply: the function's name and its arguments' JSON text as generated."""

    name: str
    arguments: str


@dataclass(frozen=True)
class CallFormat:
    """How one family of models writes its calls (see the module docstring)."""

    name: str
    opening: str | None  # markup that opens a region inside the text
    closing: str | None  # markup that closes a region (hermes)
    container: str  # "{": the region holds objects; "[": one array of objects
    separator: str | None  # between the objects of a region (llama3_json)
    bare: bool  # a reply whose first non-blank character is `container` opens a region
    arguments_key: str  # the key the forced calls write (and the template shows)
    keep_special_tokens: bool  # the text is read with special tokens kept (its markup is one)
    short_ids: bool  # calls get 9-character alphanumeric ids (Mistral's template requires them)


FORMATS = {
    "hermes": CallFormat(
        "hermes", "<tool_call>", "</tool_call>", "{", None, False, "arguments", False, False
    ),
    "llama3_json": CallFormat(
        "llama3_json", "<|python_tag|>", None, "{", ";", True, "parameters", True, False
    ),
    "mistral": CallFormat("mistral", "[TOOL_CALLS]", None, "[", None, True, "arguments", True, True),
}
ARGUMENT_KEYS = ("arguments", "parameters")

_decoder = json.JSONDecoder()
_WS = re.compile(r"[ \t\n\r]*")
_IN_STRING = re.compile(r'["\\]')
_OUTSIDE = re.compile(r'["{}\[\]]')
_CLOSERS = {"{": "}", "[": "]"}


class JSONSpan:
    """Where a JSON object or array that starts a growing text ends: strings (and their escapes) and
    nesting are followed across pieces; `scan` returns the end once the outermost bracket closes."""

    __slots__ = ("pos", "stack", "in_string", "escape", "broken")

    def __init__(self) -> None:
        self.pos = 0
        self.stack: list[str] = []
        self.in_string = self.escape = self.broken = False

    def scan(self, text: str) -> int | None:
        """The index just past the value in `text` (the same text, grown), or None while it is open.
        A closing bracket of the wrong kind ends it too, with `broken` set."""
        pos, n = self.pos, len(text)
        while pos < n:
            if self.escape:
                self.escape, pos = False, pos + 1
                continue
            if self.in_string:
                found = _IN_STRING.search(text, pos)
                if found is None:
                    pos = n
                    break
                pos = found.end()
                if found.group() == "\\":
                    self.escape = True
                else:
                    self.in_string = False
                continue
            found = _OUTSIDE.search(text, pos)
            if found is None:
                pos = n
                break
            char, pos = found.group(), found.end()
            if char == '"':
                self.in_string = True
            elif char in _CLOSERS:
                self.stack.append(_CLOSERS[char])
            elif not self.stack or self.stack.pop() != char:
                self.broken = True
                return pos
            elif not self.stack:
                return pos
        self.pos = pos
        return None


def items(text: str) -> list[tuple[str | None, object, str]] | None:
    """The items of the JSON object or array `text` (exactly one, blanks around it allowed), in order:
    (key, or None in an array; value; the value's own text). None when it is neither or no valid JSON
    (a key given twice keeps both entries)."""
    pos = _WS.match(text, 0).end()
    if text[pos : pos + 1] not in _CLOSERS:
        return None
    close, keyed = _CLOSERS[text[pos]], text[pos] == "{"
    out: list[tuple[str | None, object, str]] = []
    try:
        pos = _WS.match(text, pos + 1).end()
        while not text.startswith(close, pos) or out:
            key = None
            if keyed:
                if not text.startswith('"', pos):
                    return None
                key, pos = json.decoder.scanstring(text, pos + 1)
                pos = _WS.match(text, pos).end()
                if not text.startswith(":", pos):
                    return None
                pos = _WS.match(text, pos + 1).end()
            value, end = _decoder.raw_decode(text, pos)
            out.append((key, value, text[pos:end]))
            pos = _WS.match(text, end).end()
            if text.startswith(close, pos):
                break  # pos: at the closing bracket
            if not text.startswith(",", pos):
                return None
            pos = _WS.match(text, pos + 1).end()
    except ValueError:  # json's errors (JSONDecodeError is one)
        return None
    return out if _WS.match(text, pos + 1).end() == len(text) else None


def members(text: str) -> dict[str, tuple[object, str]] | None:
    """The members of the JSON object `text`: key -> (value, the value's own text); None when it is no
    valid object (or names a key twice)."""
    found = items(text)
    if found is None or text.lstrip()[:1] != "{" or len({key for key, _, _ in found}) < len(found):
        return None
    return {key: (value, raw) for key, value, raw in found}  # type: ignore[misc]


def read_call(text: str, names: frozenset[str] | None) -> ParsedCall | None:
    """The call an object's text holds (rule 3 of the module docstring), or None."""
    found = members(text)
    if found is None or not isinstance(found.get("name", (None,))[0], str):
        return None
    name = found["name"][0]
    if names is not None and name not in names:
        return None
    given = [found[key] for key in ARGUMENT_KEYS if key in found]
    if len(given) > 1 or (given and not isinstance(given[0][0], dict)):
        return None
    return ParsedCall(name, given[0][1] if given else "{}")


class ToolCallParser:
    """The content and the calls of one reply, fed piece by piece (`feed`); the same for any split."""

    def __init__(
        self, fmt: CallFormat, names: frozenset[str] | None = None, limit: int | None = None
    ) -> None:
        self.fmt, self.names, self.limit = fmt, names, limit
        self.held = ""  # text read and not decided yet
        self.state = "text"  # text, open (before a region's JSON), json, after (past it), skip, drop
        self.fresh = fmt.bare  # nothing but blanks read yet: a bare region may open
        self.after_region = False  # the blanks that follow a region are dropped
        self.bare_text: str | None = None  # a bare region's text so far (content if it holds no call)
        self.span = JSONSpan()
        self.pending: list[ParsedCall] = []  # a hermes call waiting for its </tool_call>
        self.calls = 0  # calls given out so far

    def feed(self, text: str, final: bool = False, stopped: bool = True) -> tuple[str, list[ParsedCall]]:
        """The content and the calls that `text` (the next piece) completes. `final`: the reply ends
        here (nothing is held back); `stopped`: it ended by itself (EOS), not cut by max_tokens."""
        self.held += text
        content: list[str] = []
        calls: list[ParsedCall] = []
        while getattr(self, "_" + self.state)(content, calls, final, stopped):
            pass
        return "".join(content), calls

    # each state's step: True to go on stepping, False when it waits for more text

    def _text(self, content: list[str], calls: list[ParsedCall], final: bool, stopped: bool) -> bool:
        fmt, held = self.fmt, self.held
        if self.after_region or self.fresh:
            rest = held.lstrip()
            if not rest:
                if final:
                    content.append(held if self.fresh else "")
                    self.held = ""
                return False
            marked = fmt.opening is not None and rest[: len(fmt.opening)] == fmt.opening[: len(rest)]
            if self.fresh and marked and len(rest) < len(fmt.opening) and not final:
                return False  # [TOOL_CALLS] or a bare [: one more piece tells
            if self.fresh and rest[0] == fmt.container and not marked:
                self.bare_text, self.held = held[: len(held) - len(rest)], rest
                self.fresh, self.state = False, "open"
                return True
            if self.after_region:
                held = self.held = rest
            self.fresh = self.after_region = False
        at = held.find(fmt.opening) if fmt.opening else -1
        if at >= 0:
            content.append(held[:at].rstrip())
            self.held, self.state, self.bare_text = held[at + len(fmt.opening) :], "open", None
            return True
        if final:
            content.append(held)
            self.held = ""
            return False
        keep = partial_tag(held, fmt.opening) if fmt.opening else 0
        body = held[: len(held) - keep]
        shown = body.rstrip()  # blanks wait: markup may follow them
        content.append(shown)
        self.held = held[len(shown) :]
        return False

    def _open(self, content: list[str], calls: list[ParsedCall], final: bool, stopped: bool) -> bool:
        rest = self.held.lstrip()
        if not rest:
            if final:
                self._no_call(content, unfinished=True)
            return False
        self._keep_bare(self.held[: len(self.held) - len(rest)])
        self.held = rest
        if rest[0] != self.fmt.container:
            self._no_call(content)
            return True
        self.span, self.state = JSONSpan(), "json"
        return True

    def _json(self, content: list[str], calls: list[ParsedCall], final: bool, stopped: bool) -> bool:
        end = self.span.scan(self.held)
        if end is None:
            if final:
                self._no_call(content, unfinished=True)
            return False
        value, self.held = self.held[:end], self.held[end:]
        self._keep_bare(value)
        found = [] if self.span.broken else self._calls_in(value)
        if not found:
            self._no_call(content)
            return True
        self.bare_text = None  # a region with a call is never content
        if self.fmt.closing:
            self.pending = found
        else:
            self._give(found, calls)
        self.state = "after"
        return True

    def _after(self, content: list[str], calls: list[ParsedCall], final: bool, stopped: bool) -> bool:
        fmt, rest = self.fmt, self.held.lstrip()
        if fmt.closing is None:
            if fmt.separator and (rest.startswith(fmt.separator) or (not rest and not final)):
                if rest:
                    self.held, self.state = rest[len(fmt.separator) :], "open"
                return bool(rest)
            self.state, self.after_region = "text", True
            return True
        if rest.startswith(fmt.closing):
            self._give(self.pending, calls)
            self.held, self.state, self.after_region = rest[len(fmt.closing) :], "text", True
            return True
        if fmt.closing.startswith(rest):  # blanks, or a piece of the closing markup
            if final:
                if stopped:  # the reply ended by itself without closing its last call
                    self._give(self.pending, calls)
                self.pending, self.held = [], ""
            return False
        self.pending, self.state = [], "skip"
        return True

    def _skip(self, content: list[str], calls: list[ParsedCall], final: bool, stopped: bool) -> bool:
        closing = self.fmt.closing
        at = self.held.find(closing) if closing else -1
        if at >= 0:
            self.held, self.state, self.after_region = self.held[at + len(closing) :], "text", True
            return True
        keep = 0 if final or not closing else partial_tag(self.held, closing)
        self.held = self.held[len(self.held) - keep :]
        return False

    def _drop(self, content: list[str], calls: list[ParsedCall], final: bool, stopped: bool) -> bool:
        self.held = ""
        return False

    # helpers

    def _keep_bare(self, text: str) -> None:
        if self.bare_text is not None:
            self.bare_text += text

    def _no_call(self, content: list[str], unfinished: bool = False) -> None:
        """The region holds no call: a bare one is content as written, one opened by markup is dropped
        (to its closing markup, or to the end of the reply). `unfinished`: the reply ended inside it."""
        if unfinished:
            self.bare_text, self.held = (None if self.bare_text is None else self.bare_text + self.held), ""
        if self.bare_text is not None:
            content.append(self.bare_text)
            self.bare_text, self.state = None, "text"
        else:
            self.state = "skip" if self.fmt.closing else "drop"

    def _calls_in(self, value: str) -> list[ParsedCall]:
        if self.fmt.container == "[":
            texts = [raw for _, element, raw in items(value) or [] if isinstance(element, dict)]
        else:
            texts = [value]
        return [call for call in (read_call(text, self.names) for text in texts) if call is not None]

    def _give(self, found: list[ParsedCall], calls: list[ParsedCall]) -> None:
        for call in found:
            if self.limit is None or self.calls < self.limit:
                calls.append(call)
                self.calls += 1
        self.pending = []


class ThinkGate:
    """A reply that thinks first (it starts with ``<think>``, or its prompt ended inside one,
    `in_think`): its ``<think>...</think>`` passes through as it is, and only what follows goes to the
    tool-call parser. `feed` returns (the text passed through, the text after the think block)."""

    def __init__(self, in_think: bool = False) -> None:
        self.mode = "think" if in_think else "start"
        self.held = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        held, passed = self.held + text, ""
        self.held = ""
        if self.mode == "start":
            rest = held.lstrip()
            if rest.startswith(THINK_OPEN):
                self.mode = "think"
            elif THINK_OPEN.startswith(rest) and not final:
                self.held = held
                return "", ""
            else:
                self.mode = "after"
        if self.mode == "think":
            end = held.find(THINK_CLOSE)
            if end < 0:
                keep = 0 if final else partial_tag(held, THINK_CLOSE)
                self.held = held[len(held) - keep :]
                return held[: len(held) - keep], ""
            end += len(THINK_CLOSE)
            passed, held, self.mode = held[:end], held[end:], "after"
        return passed, held
