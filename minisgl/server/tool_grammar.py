"""The grammars of forced tool calls: `tool_choice` "required" or a named function constrains the
reply, through structured output's EBNF path, to calls in the parser's format whose arguments are
valid under the functions' parameter schemas. The grammar is built from an xgrammar structural tag and
printed as EBNF; `think` ("open", "optional") lets a thinking model think first. `check_parameters`
checks each function's schema, also for requests that force nothing; both are cached by their text.
docs/tools.md ("What each `tool_choice` does").
"""

from __future__ import annotations

import functools
import json

from minisgl.scheduler.grammar import xgrammar_reason
from minisgl.server.tool_parsers import CallFormat

CACHE_SIZE = 128  # distinct parameter schemas, and distinct forced-call grammars, kept
THINK_BLANKS = r"\s{0,4}"  # between a think block and the calls
# per format: the text before a call's name, after its arguments, and between two calls
LAYOUTS = {
    "hermes": ("<tool_call>\n", "}\n</tool_call>", "\n"),
    "llama3_json": ("", "}", "; "),
    "mistral": ("", "}", ", "),
}


@functools.lru_cache(maxsize=CACHE_SIZE)
def arguments_grammar(parameters: str) -> str:
    """The EBNF of the JSON text valid under the schema `parameters` (JSON text), no free whitespace;
    a ValueError with xgrammar's reason when it cannot compile it."""
    import xgrammar as xgr

    try:
        return str(xgr.Grammar.from_json_schema(parameters, any_whitespace=False, strict_mode=True))
    except Exception as e:  # xgrammar raises RuntimeError, ValueError, its own errors...
        raise ValueError(xgrammar_reason(e)) from None


def check_parameters(parameters: str) -> str | None:
    """Why xgrammar cannot compile the schema `parameters` (JSON text), or None when it can."""
    try:
        arguments_grammar(parameters)
    except ValueError as e:
        return str(e)
    return None


@functools.lru_cache(maxsize=CACHE_SIZE)
def forced_grammar(
    fmt: CallFormat, functions: tuple[tuple[str, str], ...], multiple: bool, think: str | None = None
) -> str:
    """The EBNF of a reply of one call (`multiple`: one or more) of one of `functions` ((name, parameter
    schema as JSON text), each schema checked first) in `fmt`'s format, after a think block as `think`
    says (None, "open" or "optional")."""
    import xgrammar as xgr
    from xgrammar import structural_tag as st

    before, after, separator = LAYOUTS[fmt.name]

    def call(name: str, parameters: str) -> st.Format:
        head = f'{before}{{"name": {json.dumps(name)}, "{fmt.arguments_key}": '
        arguments = st.GrammarFormat(grammar=arguments_grammar(parameters))
        return st.SequenceFormat(
            elements=[st.ConstStringFormat(value=head), arguments, st.ConstStringFormat(value=after)]
        )

    calls = [call(name, parameters) for name, parameters in functions]
    unit = calls[0] if len(calls) == 1 else st.OrFormat(elements=calls)
    body: st.Format = unit
    if multiple:
        more = st.SequenceFormat(elements=[st.ConstStringFormat(value=separator), unit])
        body = st.SequenceFormat(elements=[unit, st.StarFormat(content=more)])
    if fmt.container == "[":
        bracket = st.ConstStringFormat(value="["), st.ConstStringFormat(value="]")
        body = st.SequenceFormat(elements=[bracket[0], body, bracket[1]])
    parts: list[st.Format] = [body]
    if think == "open":
        thought = st.TagFormat(begin="", content=st.AnyTextFormat(), end="</think>")
        parts[:0] = [thought, st.RegexFormat(pattern=THINK_BLANKS)]
    elif think == "optional":
        thought = st.TagFormat(begin="<think>", content=st.AnyTextFormat(), end="</think>")
        parts[:0] = [st.OptionalFormat(content=thought), st.RegexFormat(pattern=THINK_BLANKS)]
    tag = st.StructuralTag(format=parts[0] if len(parts) == 1 else st.SequenceFormat(elements=parts))
    return str(xgr.Grammar.from_structural_tag(tag))
