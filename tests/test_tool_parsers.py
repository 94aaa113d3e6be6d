"""Tool calls read from a model's text (minisgl.server.tool_parsers) and the grammars of forced calls
(minisgl.server.tool_grammar), without a model: each parser on canned replies of its format, split
into pieces at every position (the same content and calls as the whole text), the hard cases (markup
cut across pieces, nested JSON, unicode, a literal </tool_call> inside a string, empty arguments, a
call cut by max_tokens, markup that never reaches the content), hypothesis' round trips, and each
format's forced grammar accepting what its parser reads back and refusing what breaks the schema."""

from __future__ import annotations

import json

import pytest
from conftest import FIXED_EXAMPLES
from hypothesis import given, settings
from hypothesis import strategies as st

from minisgl.server.tool_grammar import check_parameters, forced_grammar
from minisgl.server.tool_parsers import FORMATS, JSONSpan, ThinkGate, ToolCallParser, items, members

NAMES = frozenset({"get_weather", "get_time", "search"})


def parse(fmt: str, pieces: list[str], stopped: bool = True, names=NAMES, limit=None):
    """(content, [(name, arguments)]) of a reply fed as `pieces`."""
    parser = ToolCallParser(FORMATS[fmt], names, limit)
    content, calls = [], []
    for i, piece in enumerate(pieces):
        text, found = parser.feed(piece, final=i == len(pieces) - 1, stopped=stopped)
        content.append(text)
        calls += [(c.name, c.arguments) for c in found]
    return "".join(content), calls


def every_split(text: str) -> list[list[str]]:
    """The text in one piece, in two at every position, in three at every pair of positions (short
    texts), and one character at a time."""
    n = len(text)
    splits = [[text], list(text) or [""]]
    splits += [[text[:i], text[i:]] for i in range(n + 1)]
    if n <= 90:
        splits += [[text[:i], text[i:j], text[j:]] for i in range(n + 1) for j in range(i, n + 1)]
    return splits


def check(fmt: str, text: str, content: str, calls: list[tuple[str, str]], stopped: bool = True) -> None:
    """`text` reads as (`content`, `calls`) whole and in every split."""
    assert parse(fmt, [text], stopped) == (content, calls)
    for pieces in every_split(text):
        assert parse(fmt, pieces, stopped) == (content, calls), pieces


WEATHER = '{"city": "Paris", "days": [1, 2], "opts": {"unit": "c", "deep": {"x": null}}}'
TRICKY = '{"q": "a </tool_call> b } ] \\" \\\\", "emoji": "日本 🌧", "n": -1.5e3}'


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        # text before a call stays content, the blanks before and after the markup do not
        (
            f'Let me look.\n<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>\n',
            "Let me look.",
            [("get_weather", WEATHER)],
        ),
        # a literal </tool_call>, brackets, escapes and unicode inside strings
        (
            f'<tool_call>\n{{"name": "search", "arguments": {TRICKY}}}\n</tool_call>',
            "",
            [("search", TRICKY)],
        ),
        # no arguments: "{}"; arguments first; two calls and text between and after
        (
            '<tool_call>{"name": "get_time"}</tool_call>\n<tool_call>{"arguments": {}, "name": "search"}'
            "</tool_call> Done.",
            "Done.",
            [("get_time", "{}"), ("search", "{}")],
        ),
        # plain text, with pieces of markup that never become markup, and trailing blanks
        (
            "a < b and <tool or <tool_call but no call  \n",
            "a < b and <tool or <tool_call but no call  \n",
            [],
        ),
        # not a call: dropped to its closing markup (markup never reaches the content)
        ("<tool_call>not json</tool_call>after", "after", []),
        ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', "", []),  # not a tool of the request
        ('<tool_call>{"name": "search", "arguments": "x"}</tool_call>', "", []),  # arguments no object
        ('<tool_call>{"name": "search", "arguments": {}} junk</tool_call>ok', "ok", []),
        ('<tool_call>{"name": "search", "arguments": {]}</tool_call>x', "x", []),  # broken brackets
        # a reply that stops without closing its call: the call counts
        ('<tool_call>\n{"name": "search", "arguments": {"q": "x"}}\n</tool', "", [("search", '{"q": "x"}')]),
        ('<tool_call>\n{"name": "search", "arguments": {"q": "x"', "", []),  # unfinished JSON: none
    ],
)
def test_hermes(text: str, content: str, calls: list) -> None:
    check("hermes", text, content, calls)


def test_a_call_cut_by_max_tokens_is_no_call() -> None:
    text = '<tool_call>\n{"name": "search", "arguments": {"q": "x"}}\n</tool'
    check("hermes", text, "", [], stopped=False)
    check("hermes", text + "_call>", "", [("search", '{"q": "x"}')], stopped=False)


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        (f'{{"name": "get_weather", "parameters": {WEATHER}}}', "", [("get_weather", WEATHER)]),
        (
            '<|python_tag|>{"name": "search", "arguments": {"q": "日本"}}; {"name": "get_time", "parameters": {}}',
            "",
            [("search", '{"q": "日本"}'), ("get_time", "{}")],
        ),
        ('Sure. <|python_tag|>{"name": "get_time", "parameters": {}}', "Sure.", [("get_time", "{}")]),
        # a JSON answer that is no call is content, as written
        ('  {"answer": 42} is it', '  {"answer": 42} is it', []),
        ('{"answer": "unfinished', '{"answer": "unfinished', []),
        ('{"name": "search", "parameters": {"q": "}"}} and more', "and more", [("search", '{"q": "}"}')]),
        ("no call here {at all}", "no call here {at all}", []),
    ],
)
def test_llama3_json(text: str, content: str, calls: list) -> None:
    check("llama3_json", text, content, calls)


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        (
            f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {WEATHER}}}, {{"name": "get_time", "arguments": {{}}}}]',
            "",
            [("get_weather", WEATHER), ("get_time", "{}")],
        ),
        ('Hi [TOOL_CALLS] [{"name": "search", "arguments": {"q": "]["}}]', "Hi", [("search", '{"q": "]["}')]),
        # a forced call's bare array; one element of it is no call
        ('[{"name": "search", "arguments": {}}, {"name": "nope", "arguments": {}}]', "", [("search", "{}")]),
        ("[1, 2] is a list", "[1, 2] is a list", []),
        ("[", "[", []),
        ('[TOOL_CALLS][{"name": "search", "arguments": {}}', "", []),  # the array never closes
    ],
)
def test_mistral(text: str, content: str, calls: list) -> None:
    check("mistral", text, content, calls)


def test_calls_past_the_limit_are_dropped_with_their_markup() -> None:
    two = '<tool_call>{"name": "search"}</tool_call><tool_call>{"name": "get_time"}</tool_call>end'
    assert parse("hermes", [two], limit=1) == ("end", [("search", "{}")])
    assert parse("hermes", [two], names=None) == ("end", [("search", "{}"), ("get_time", "{}")])


def test_a_think_block_passes_through_and_parsing_starts_after_it() -> None:
    reply = '<think>maybe <tool_call>{"name": "search"}</tool_call>?</think>\n\n<tool_call>{"name": "get_time"}</tool_call>'
    head = '<think>maybe <tool_call>{"name": "search"}</tool_call>?</think>'
    for in_think, text in ((False, reply), (True, reply.removeprefix("<think>"))):
        for pieces in every_split(text):
            gate, parser = ThinkGate(in_think), ToolCallParser(FORMATS["hermes"], NAMES)
            content, calls = "", []
            for i, piece in enumerate(pieces):
                final = i == len(pieces) - 1
                passed, rest = gate.feed(piece, final)
                text_part, found = parser.feed(rest, final)
                content += passed + text_part
                calls += [(c.name, c.arguments) for c in found]
            assert (content, calls) == (
                head if not in_think else head.removeprefix("<think>"),
                [("get_time", "{}")],
            )


def test_json_span_and_members_keep_the_text_as_written() -> None:
    text = '{"a": "}\\"", "b": [1, {"c": "]"}]}tail'
    span = JSONSpan()
    assert [span.scan(text[:k]) for k in (5, 20)] == [None, None] and span.scan(text) == len(text) - 4
    assert members(text[:-4]) == {"a": ('}"', '"}\\""'), "b": ([1, {"c": "]"}], '[1, {"c": "]"}]')}
    assert members('{"a": 1,}') is None and members("[1]") is None and members('{"a": 1} x') is None
    assert members('{"a": 1, "a": 2}') is None and members(" { } ") == {}
    assert items(' [1, {"a": "]"}] ') == [(None, 1, "1"), (None, {"a": "]"}, '{"a": "]"}')]
    assert items("[]") == [] and items("[1,]") is None and items("[1 2]") is None and items('"x"') is None


# ---------------------------------------------------------------------------------------------- round trips

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**6), 10**6) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)
ARGUMENTS = st.dictionaries(st.text(max_size=6), JSON_VALUES, max_size=3)
CALLS = st.lists(st.tuples(st.sampled_from(sorted(NAMES)), ARGUMENTS), min_size=1, max_size=3)
PROSE = st.text(st.characters(blacklist_characters="<[{"), max_size=20).map(str.strip)


def write(fmt: str, prose: str, calls: list[tuple[str, dict]]) -> tuple[str, list[tuple[str, str]]]:
    """A reply of `fmt` with `prose` and `calls`, and the calls as the parser must read them."""
    want = [(name, json.dumps(args, ensure_ascii=False)) for name, args in calls]
    objects = [f'{{"name": "{name}", "{FORMATS[fmt].arguments_key}": {args}}}' for name, args in want]
    if fmt == "hermes":
        body = "".join(f"\n<tool_call>\n{o}\n</tool_call>" for o in objects)
    elif fmt == "llama3_json":
        body = " <|python_tag|>" + "; ".join(objects)
    else:
        body = " [TOOL_CALLS][" + ", ".join(objects) + "]"
    return prose + body, want


@settings(FIXED_EXAMPLES, max_examples=150)
@given(
    fmt=st.sampled_from(sorted(FORMATS)),
    prose=PROSE,
    calls=CALLS,
    cuts=st.lists(st.integers(0, 400), max_size=6),
)
def test_any_calls_read_back_the_same_in_any_pieces(fmt, prose, calls, cuts) -> None:
    text, want = write(fmt, prose, calls)
    cuts = sorted({c % (len(text) + 1) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    assert parse(fmt, [text]) == parse(fmt, pieces) == (prose, want)


# ---------------------------------------------------------------------------------------------- grammars


def accepts(ebnf: str, text: str) -> bool:
    """Whether the grammar's language holds `text` (xgrammar's matcher over characters)."""
    import xgrammar as xgr

    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo([]), cache_enabled=False).compile_grammar(ebnf)
    matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
    return matcher.accept_string(text) and matcher.is_terminated()


WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
}
FUNCTIONS = (("get_weather", json.dumps(WEATHER_SCHEMA)), ("get_time", '{"type":"object","properties":{}}'))


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_forced_grammars_accept_what_their_parser_reads_and_nothing_else(fmt: str) -> None:
    weather = ("get_weather", {"city": "x </tool_call> 日本", "unit": "c"})
    one, want_one = write(fmt, "", [weather])
    two, want_two = write(fmt, "", [weather, ("get_time", {})])
    strip = {"hermes": "\n", "llama3_json": " <|python_tag|>", "mistral": " [TOOL_CALLS]"}[fmt]
    one, two = one.removeprefix(strip), two.removeprefix(strip)  # the grammar writes no marker
    single, several = (
        forced_grammar(FORMATS[fmt], FUNCTIONS, False),
        forced_grammar(FORMATS[fmt], FUNCTIONS, True),
    )
    assert accepts(single, one) and accepts(several, one) and accepts(several, two)
    assert not accepts(single, two)
    assert parse(fmt, [one]) == ("", want_one) and parse(fmt, [two]) == ("", want_two)
    bad = one.replace('"unit": "c"', '"unit": "k"')  # outside the schema
    assert not accepts(several, bad) and not accepts(several, one.replace("get_weather", "get_whether"))
    named = forced_grammar(FORMATS[fmt], FUNCTIONS[1:], False)
    assert not accepts(named, one) and accepts(
        named, write(fmt, "", [("get_time", {})])[0].removeprefix(strip)
    )


def test_forced_grammars_may_think_first_as_told() -> None:
    call = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    fmt = FORMATS["hermes"]
    assert accepts(forced_grammar(fmt, FUNCTIONS[1:], False, "open"), "hmm </thin</think>\n\n" + call)
    optional = forced_grammar(fmt, FUNCTIONS[1:], False, "optional")
    assert accepts(optional, call) and accepts(optional, "<think>x</think>\n" + call)
    assert not accepts(forced_grammar(fmt, FUNCTIONS[1:], False), "<think>x</think>\n" + call)


def test_parameter_schemas_xgrammar_cannot_compile_are_named() -> None:
    assert check_parameters(json.dumps(WEATHER_SCHEMA)) is None
    assert "foo" in check_parameters('{"type": "object", "properties": {"a": {"type": "foo"}}}')
    assert check_parameters('{"type": "object", "required": "a"}') is not None
