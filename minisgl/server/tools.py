"""Tool calling in the chat API: the request's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` and
the tool calls and results of its history, checked; what the request asks of its reply (`ToolPlan`);
each choice's calls read from its text (`ChoiceTools`) and shaped as OpenAI's ``tool_calls``, whole or
as stream deltas. Pure functions, no HTTP and no engine. What each ``tool_choice`` does: docs/tools.md.

The checks that need no setting run when the request is parsed (`check_chat`, from
`minisgl.server.protocol`); the rest when it is planned (`plan_tools`).
"""

from __future__ import annotations

import json
import re
import secrets
import string
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationError
from pydantic_core import PydanticCustomError

from minisgl.harmony import HarmonyParser
from minisgl.server.errors import APIError, short
from minisgl.server.tool_grammar import check_parameters, forced_grammar
from minisgl.server.tool_parsers import FORMATS, CallFormat, ParsedCall, ThinkGate, ToolCallParser

FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
NO_PARAMETERS = {"type": "object", "properties": {}}  # a function without parameters: "{}"
FORCED_MODES = ("required", "function")
_ALPHANUMERIC = string.ascii_letters + string.digits


class _Strict(BaseModel):
    # as the protocol's request models: no coercion, no unknown field
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


def _function_name(value: str) -> str:
    if not FUNCTION_NAME.fullmatch(value):
        raise PydanticCustomError("function_name", "a function name is 1 to 64 of a-z, A-Z, 0-9, _, . and -")
    return value


def _json_text(value: str) -> str:
    try:
        json.loads(value)
    except ValueError as e:
        raise PydanticCustomError(
            "arguments", "arguments must be JSON text ({reason})", {"reason": str(e)}
        ) from None
    return value


class FunctionDefinition(_Strict):
    """A tool's ``function``: its name, what it does, its parameters as a JSON schema."""

    name: Annotated[str, AfterValidator(_function_name)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # accepted: forced calls always follow the schema


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``."""

    type: Literal["function"]
    function: FunctionName


def parse_tool_choice(value: Any) -> Any:
    """`tool_choice` as "none", "auto", "required" or a `NamedToolChoice`."""
    if value is None or value in ("none", "auto", "required"):
        return value
    if isinstance(value, dict):
        try:
            return NamedToolChoice.model_validate(value, strict=True)
        except ValidationError as e:
            error = e.errors(include_url=False)[0]
            where = ".".join(map(str, error["loc"]))
            raise PydanticCustomError(
                "tool_choice", "{where}: {message}", {"where": where, "message": error["msg"]}
            ) from None
    raise PydanticCustomError(
        "tool_choice",
        'give "none", "auto", "required" or {{"type": "function", "function": {{"name": ...}}}}',
    )


class CalledFunction(_Strict):
    name: str
    arguments: Annotated[str, AfterValidator(_json_text)]  # JSON text, as the API gave it out


class HistoryToolCall(_Strict):
    """One of an assistant message's ``tool_calls``, as the API gave it out."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction

    def as_dict(self) -> dict[str, Any]:
        """As a template reads it (transformers' convention): the arguments as an object."""
        call = {"name": self.function.name, "arguments": json.loads(self.function.arguments)}
        return {"id": self.id, "type": self.type, "function": call}


def check_chat(tools: list[Tool] | None, tool_choice: Any, messages: list[dict[str, Any]]) -> None:
    """What a chat request's tool fields must be, whatever the server's settings (APIError 400 naming
    the field): tool names unique, parameters objects, a named tool_choice among the tools,
    "required" with tools, tool messages with a tool_call_id, tool_calls only on assistant messages."""
    names: dict[str, int] = {}
    for i, tool in enumerate(tools or ()):
        name = tool.function.name
        if name in names:
            raise APIError(
                f"tools[{i}].function.name {short(name)} is the name of tools[{names[name]}] too: give each "
                "tool a name of its own",
                param=f"tools[{i}].function.name",
            )
        names[name] = i
        kind = (tool.function.parameters or {}).get("type", "object")
        if kind != "object":
            raise APIError(
                f"tools[{i}].function.parameters must describe a JSON object (type 'object'), got type "
                f"{short(kind)}",
                param=f"tools[{i}].function.parameters",
            )
    if tool_choice == "required" and not names:
        raise APIError('tool_choice "required" needs tools: give at least one', param="tool_choice")
    if isinstance(tool_choice, NamedToolChoice) and tool_choice.function.name not in names:
        raise APIError(
            f"tool_choice names the function {short(tool_choice.function.name)}, which is not among the "
            f"tools ({', '.join(map(repr, names)) or 'none given'})",
            param="tool_choice",
        )
    for i, message in enumerate(messages):
        if message["role"] == "tool" and "tool_call_id" not in message:
            raise APIError(
                f"missing required parameter 'messages[{i}].tool_call_id': a tool message answers one "
                "of the tool_calls of an assistant message by its id",
                param=f"messages[{i}].tool_call_id",
            )
        if message["role"] != "tool" and "tool_call_id" in message:
            raise APIError(
                f"messages[{i}].tool_call_id goes with role 'tool', not {message['role']!r}",
                param=f"messages[{i}].tool_call_id",
            )
        if message["role"] != "assistant" and "tool_calls" in message:
            raise APIError(
                f"messages[{i}].tool_calls goes with role 'assistant', not {message['role']!r}",
                param=f"messages[{i}].tool_calls",
            )


@dataclass(frozen=True)
class ToolPlan:
    """What one chat request with tools asks of its reply (see the module docstring)."""

    mode: str  # "auto", "required" or "function"
    fmt: CallFormat
    tools: tuple[Tool, ...]  # all of the request's (rendered)
    names: frozenset[str]  # the functions a call may name (a named tool_choice: that one)
    multiple: bool  # several calls allowed (parallel_tool_calls; see `plan_tools`)

    @property
    def forced(self) -> bool:
        return self.mode in FORCED_MODES

    def template_tools(self) -> list[dict[str, Any]]:
        """The tools as the template's `tools` variable: OpenAI's objects, as given."""
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    def template_kwargs(self, given: Mapping[str, Any] | None) -> dict[str, Any] | None:
        """The template's variables: forced calls render with thinking off unless the client says."""
        if not self.forced:
            return dict(given) if given else None
        return {"enable_thinking": False, **(given or {})}

    def functions(self, every: bool = False) -> tuple[tuple[str, str], ...]:
        """(name, parameter schema as JSON text) of each tool a call may name (`every`: of each tool)."""
        out = []
        for tool in self.tools:
            if every or tool.function.name in self.names:
                parameters = tool.function.parameters
                schema = NO_PARAMETERS if parameters is None else {"type": "object", **parameters}
                out.append((tool.function.name, json.dumps(schema, separators=(",", ":"))))
        return tuple(out)

    def check_schemas(self) -> None:
        """A 400 naming the first tool whose parameters xgrammar cannot compile (all modes)."""
        for i, (_, schema) in enumerate(self.functions(every=True)):
            reason = check_parameters(schema)
            if reason is not None:
                raise APIError(
                    f"tools[{i}].function.parameters is not a JSON schema this server can use: {reason}",
                    param=f"tools[{i}].function.parameters",
                )

    def grammar(self, think: str | None) -> str | None:
        """The EBNF forcing the reply (None unless forced); `think` as `forced_grammar` takes it."""
        if not self.forced:
            return None
        return forced_grammar(self.fmt, self.functions(), self.multiple, think)

    def choice(self, in_think: bool, reasoning_split: bool) -> ChoiceTools:
        """A choice's reader; `in_think`: the prompt ended inside <think>; `reasoning_split`: the
        think block is taken out before (separate_reasoning)."""
        limit = None if self.multiple else 1
        parser = ToolCallParser(self.fmt, self.names, limit)
        return ChoiceTools(parser, None if reasoning_split else ThinkGate(in_think), self.fmt.short_ids)


def plan_tools(
    tools: list[Tool] | None, tool_choice: Any, parallel: bool | None, parser: str | None
) -> ToolPlan | None:
    """The plan of a checked request (`check_chat`) on a server whose setting `tool_call_parser` is
    `parser`; None when the reply is not about tools (no tools, or tool_choice "none")."""
    if not tools or tool_choice == "none":
        return None
    choice = tool_choice or "auto"
    if choice == "auto" and parser is None:
        raise APIError(
            'tool_choice "auto" (the default with tools) needs a tool-call parser, and this server has '
            "none: start it with --tool-call-parser NAME (setting tool_call_parser: hermes, llama3_json "
            'or mistral), or ask for tool_choice "required" or a named function',
            param="tool_choice",
        )
    fmt = FORMATS[parser or "hermes"]
    # auto reads every call unless told otherwise; a forced reply holds one unless told otherwise (a
    # model forced on may repeat calls until max_tokens)
    multiple = parallel is not False if choice == "auto" else parallel is True
    if isinstance(choice, NamedToolChoice):
        return ToolPlan("function", fmt, tuple(tools), frozenset([choice.function.name]), False)
    return ToolPlan(choice, fmt, tuple(tools), frozenset(t.function.name for t in tools), multiple)


def new_call_id(short_ids: bool) -> str:
    """A call's id: "call_" and 24 hex digits, or 9 letters and digits (Mistral's template)."""
    if short_ids:
        return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(frozen=True)
class ToolCall:
    """A call of the reply, with its id."""

    id: str
    call: ParsedCall

    def as_json(self) -> dict[str, Any]:
        """OpenAI's ``tool_calls`` entry."""
        function = {"name": self.call.name, "arguments": self.call.arguments}
        return {"id": self.id, "type": "function", "function": function}

    def deltas(self, index: int) -> list[dict[str, Any]]:
        """The call streamed: its id, type and name first, then its arguments."""
        head = {"index": index, "id": self.id, "type": "function", "function": {"name": self.call.name}}
        return [head, {"index": index, "function": {"arguments": self.call.arguments}}]


class ChoiceTools:
    """One choice's reply read for calls: the think block (if any) passes through, then the parser."""

    def __init__(self, parser: ToolCallParser, gate: ThinkGate | None, short_ids: bool) -> None:
        self.parser, self.gate, self.short_ids = parser, gate, short_ids
        self.calls: list[ToolCall] = []

    def feed(self, text: str, final: bool, stopped: bool) -> tuple[str, list[ToolCall]]:
        """The content and the calls of the next piece of the reply (as `ToolCallParser.feed`)."""
        passed = ""
        if self.gate is not None:
            passed, text = self.gate.feed(text, final)
        content, found = self.parser.feed(text, final, stopped)
        calls = [ToolCall(new_call_id(self.short_ids), call) for call in found]
        self.calls += calls
        return passed + content, calls

    def finish_reason(self, reason: str) -> str:
        """OpenAI's finish reason: "tool_calls" for a reply that ended by itself with calls."""
        return "tool_calls" if reason == "stop" and self.calls else reason


class HarmonyTools:
    """One choice of a harmony model (gpt-oss) read as `ChoiceTools` reads one: content and calls from
    `feed`, and the reasoning (the analysis channel) of the last piece in `reasoning`, of all in
    `all_reasoning`. `plan`: the request's tools (None: a call is dropped, as one to an unknown name)."""

    def __init__(self, plan: ToolPlan | None) -> None:
        self.parser = HarmonyParser()
        self.names = frozenset() if plan is None else plan.names
        self.limit = None if plan is None or plan.multiple else 1
        self.calls: list[ToolCall] = []
        self.reasoning = self.all_reasoning = ""

    def feed(self, text: str, final: bool, stopped: bool) -> tuple[str, list[ToolCall]]:
        self.reasoning, content, found = self.parser.feed(text, final, stopped)
        self.all_reasoning += self.reasoning
        calls = []
        for name, arguments in found:
            if name in self.names and (self.limit is None or len(self.calls) + len(calls) < self.limit):
                calls.append(ToolCall(new_call_id(False), ParsedCall(name, arguments)))
        self.calls += calls
        return content, calls

    def finish_reason(self, reason: str) -> str:
        return "tool_calls" if reason == "stop" and self.calls else reason
