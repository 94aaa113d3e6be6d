"""Tool calling in the chat API (docs/tools.md), through the `openai` package.

- The request's checks: every refusal a 400 naming its field (no engine).
- A real server on the default model with configs/templates/hermes-tools.jinja and the hermes parser:
  named and "required" calls (sampled at temperature 1.0) parse and validate against their schemas;
  streamed and whole give the same calls, usage counted; "none" renders no tools and gives no calls;
  a conversation with tool calls and results renders as the template says, its arguments parsed; a
  forced call cut by max_tokens finishes "length" with no calls; the refusals over HTTP.
- `auto` on canned replies: the real front end in this process over a fake scheduler client that
  answers with the tokens of a canned text (the test seam), for each parser: the content and the calls
  read from the tokens, streamed as whole; no parser: auto refused, forced calls in hermes's format.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx2 as httpx
import jsonschema
import openai
import pytest
import transformers
from test_server import Server

from minisgl.server.errors import APIError
from minisgl.server.protocol import parse_chat_request
from minisgl.server.responses import chat_chunk, chat_response
from minisgl.server.sampling import sampling_params
from minisgl.server.tool_parsers import ParsedCall
from minisgl.server.tools import ToolCall, plan_tools

TEMPLATE = Path(__file__).resolve().parents[1] / "configs" / "templates" / "hermes-tools.jinja"
MODEL = "smollm2-135m-instruct"
EOS = 2  # SmolLM2's <|im_end|>
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "description": "The current time"}},
]
SCHEMAS = {
    "get_weather": WEATHER,
    "get_time": {"type": "object", "properties": {}, "additionalProperties": False},
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def body(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": ASK, "tools": TOOLS, **fields}


def refusal(fields: dict[str, Any], parser: str | None = "hermes") -> APIError:
    """The APIError a request body gets when parsed and planned."""
    with pytest.raises(APIError) as caught:
        req = parse_chat_request(body(**fields), MODEL)
        plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, parser)
        sampling_params(req, 10, 1000, plan and plan.grammar(None))
    return caught.value


# --------------------------------------------------------------------------------- request checks (no engine)

BAD_REQUESTS = [
    (
        {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
        "not among the tools",
    ),
    ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [], "tool_choice": NAMED}, "tool_choice", "none given"),
    ({"tool_choice": "sometimes"}, "tool_choice", '"required"'),
    ({"tool_choice": {"type": "function"}}, "tool_choice", "function"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name", "tools[0] too"),
    (
        {"tools": [{"type": "function", "function": {"name": "a b"}}]},
        "tools[0].function.name",
        "function name",
    ),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
        "tools[0].function.parameters",
        "object",
    ),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
        "tools[0].function.parameters",
        "",
    ),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type", ""),
    ({"tools": [{"type": "function", "function": {"name": "f"}, "x": 1}]}, "tools[0].x", "unknown"),
    ({"messages": [*ASK, {"role": "tool", "content": "18C"}]}, "messages[1].tool_call_id", "tool_call_id"),
    (
        {"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]},
        "messages[0].tool_call_id",
        "role 'tool'",
    ),
    (
        {
            "messages": [
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{nope"}}
                    ],
                }
            ]
        },
        "messages[0].tool_calls[0].function.arguments",
        "JSON",
    ),
    (
        {"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
        "messages[0].tool_calls",
        "role 'assistant'",
    ),
    (
        {"tool_choice": "required", "response_format": {"type": "json_object"}},
        "tool_choice",
        "response_format",
    ),
    ({"tool_choice": NAMED, "ignore_eos": True}, "tool_choice", "ignore_eos"),
    ({"functions": [{"name": "f"}]}, "functions", "not supported"),
]


@pytest.mark.parametrize(("fields", "param", "words"), BAD_REQUESTS)
def test_bad_tool_fields_are_400s_naming_the_field(fields: dict, param: str, words: str) -> None:
    error = refusal(fields)
    assert (error.status, error.param) == (400, param), error.message
    assert words in error.message, error.message


def test_auto_needs_a_parser_and_forced_calls_do_not() -> None:
    error = refusal({}, parser=None)  # tool_choice unset: auto, with tools
    assert (
        error.param == "tool_choice"
        and "tool_call_parser" in error.message
        and "--tool-call-parser" in error.message
    )
    req = parse_chat_request(body(tool_choice=NAMED), MODEL)
    plan = plan_tools(req.tools, req.tool_choice, None, None)
    assert plan.fmt.name == "hermes" and plan.names == {"get_weather"} and not plan.multiple
    grammar = plan.grammar(None)
    assert '\\"get_weather\\"' in grammar and "get_time" not in grammar
    assert sampling_params(req, 10, 1000, grammar)[0].ebnf == grammar


def test_plans_follow_tool_choice_and_parallel_tool_calls() -> None:
    def plan(**fields):
        req = parse_chat_request(body(**fields), MODEL)
        return plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, "llama3_json")

    assert plan(tool_choice="none") is None and plan(tools=[], tool_choice="auto") is None
    auto = plan()
    assert (auto.mode, auto.forced, auto.multiple, auto.grammar(None)) == ("auto", False, True, None)
    assert not plan(parallel_tool_calls=False).multiple
    assert not plan(tool_choice="required").multiple  # forced: one call unless told
    assert plan(tool_choice="required", parallel_tool_calls=True).multiple
    assert plan(tool_choice="required").template_kwargs({"x": 1}) == {"enable_thinking": False, "x": 1}
    assert plan(tool_choice="required").template_kwargs({"enable_thinking": True}) == {
        "enable_thinking": True
    }
    assert auto.template_kwargs(None) is None
    assert [t["function"]["name"] for t in plan(tool_choice=NAMED).template_tools()] == [
        "get_weather",
        "get_time",
    ]
    assert dict(plan().functions())["get_time"] == '{"type":"object","properties":{}}'


def test_history_tool_calls_reach_the_template_with_parsed_arguments() -> None:
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "18C"}]},
    ]
    req = parse_chat_request(body(messages=messages), MODEL)
    assert req.messages[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    }
    assert req.messages[2] == {"role": "tool", "content": "18C", "tool_call_id": "call_1"}


def test_tool_call_responses_have_openais_shape() -> None:
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    call = ToolCall("call_abc", ParsedCall("get_time", "{}"))
    gen = SimpleNamespace(
        text="", token_ids=[1, 2], finish_reason="tool_calls", error=None, tool_calls=[call.as_json()]
    )
    reply = ChatCompletion.model_validate(chat_response("chatcmpl-1", MODEL, 5, [gen]))
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [(c.id, c.type, c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
        ("call_abc", "function", "get_time", "{}")
    ]
    head, args = (
        ChatCompletionChunk.model_validate(chat_chunk("c", MODEL, 0, tool_calls=[d])) for d in call.deltas(3)
    )
    first, rest = head.choices[0].delta.tool_calls[0], args.choices[0].delta.tool_calls[0]
    assert (first.index, first.id, first.type, first.function.name) == (3, "call_abc", "function", "get_time")
    assert (rest.index, rest.id, rest.function.name, rest.function.arguments) == (3, None, None, "{}")


# ------------------------------------------------------------------------------------ a real server (engine)


@pytest.fixture(scope="module")
def server():
    srv = Server(
        "--device", "cpu", "--dtype", "float32", "--max-running-req", "8",
        "--chat-template", str(TEMPLATE), "--tool-call-parser", "hermes",
    )  # fmt: skip
    yield srv
    log = srv.output()
    assert srv.stop() == 0 and "Traceback" not in log, log


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key="unused", timeout=300, max_retries=0)


def calls_of(message: Any) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def streamed(client: openai.OpenAI, **fields: Any) -> tuple[str, list[tuple[str, str]], str, Any, list]:
    """(content, calls, finish reason, usage, tool-call deltas) of a streamed request."""
    content, deltas, calls, reason, usage = "", [], {}, None, None
    for chunk in client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **fields
    ):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            content += choice.delta.content or ""
            reason = choice.finish_reason or reason
            for delta in choice.delta.tool_calls or []:
                deltas.append(delta)
                entry = calls.setdefault(delta.index, ["", ""])
                entry[0] += delta.function.name or "" if delta.function else ""
                entry[1] += delta.function.arguments or "" if delta.function else ""
    return content, [tuple(calls[i]) for i in sorted(calls)], reason, usage, deltas


def valid(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_a_named_call_validates_and_streams_as_it_answers(client) -> None:
    fields = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED, max_tokens=48, temperature=0)
    whole = client.chat.completions.create(**fields)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    [(name, arguments)] = calls_of(choice.message)
    assert name == "get_weather" and choice.message.tool_calls[0].id.startswith("call_")
    valid(name, arguments)
    content, calls, reason, usage, deltas = streamed(client, **fields)
    assert (content, calls, reason) == ("", [(name, arguments)], "tool_calls")
    assert (
        usage.completion_tokens == whole.usage.completion_tokens
        and usage.prompt_tokens == whole.usage.prompt_tokens
    )
    head, *rest = deltas  # the id, type and name first, then the arguments
    assert head.id.startswith("call_") and head.type == "function" and head.function.name == name
    assert rest and all(d.id is None and d.function.name is None for d in rest)


def test_required_calls_sampled_at_temperature_1_all_validate(client) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=48,
        temperature=1.0,
        n=4,
        seed=7,
    )
    finished = [c for c in reply.choices if c.finish_reason != "length"]  # calls cut by max_tokens aside
    assert len(finished) >= 2, [c.finish_reason for c in reply.choices]
    for choice in finished:
        assert choice.finish_reason == "tool_calls", choice
        [(name, arguments)] = calls_of(choice.message)  # one call: parallel_tool_calls not given
        valid(name, arguments)


def test_none_renders_no_tools_and_gives_no_calls(client) -> None:
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=3, temperature=0)
    none = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=3, temperature=0
    )
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason == "length"
    assert none.choices[0].message.content == plain.choices[0].message.content
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens
    auto = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=3, temperature=0)
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens + 50  # the tools, rendered


def test_a_conversation_with_tool_results_renders_as_the_template_says(client) -> None:
    arguments = '{"city":"Paris","unit":"celsius"}'  # compact: the template writes its own JSON
    messages = [
        {"role": "system", "content": "Answer briefly."},
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"},
    ]
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, max_tokens=2, temperature=0
    )
    assert reply.choices[0].finish_reason == "length"
    from minisgl.models.default import default_model_path

    tokenizer = transformers.AutoTokenizer.from_pretrained(default_model_path())
    tokenizer.chat_template = TEMPLATE.read_text()

    def prompt_tokens(args: Any) -> int:
        history = json.loads(json.dumps(messages))
        history[2]["content"], history[2]["tool_calls"][0]["function"]["arguments"] = "", args
        text = tokenizer.apply_chat_template(history, tools=TOOLS, add_generation_prompt=True, tokenize=False)
        assert "<tool_response>\n18 degrees, sunny\n</tool_response>" in text and "get_time" in text
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    assert reply.usage.prompt_tokens == prompt_tokens(json.loads(arguments)) != prompt_tokens(arguments)


def test_a_forced_call_cut_by_max_tokens_finishes_length_without_calls(client) -> None:
    fields = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED, max_tokens=6, temperature=0)
    cut = client.chat.completions.create(**fields).choices[0]
    assert (cut.finish_reason, cut.message.tool_calls, cut.message.content) == ("length", None, "")
    content, calls, reason, _, deltas = streamed(client, **fields)
    assert (content, calls, reason, deltas) == ("", [], "length", [])


@pytest.mark.parametrize(("fields", "param", "words"), BAD_REQUESTS[:8] + BAD_REQUESTS[11:14])
def test_refusals_over_http(server, fields, param, words) -> None:
    r = httpx.post(server.url + "/chat/completions", json=body(max_tokens=2, **fields), timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_a_parameter_schema_xgrammar_cannot_compile_is_a_400(server) -> None:
    tools = [
        TOOLS[1],
        {"type": "function", "function": {"name": "f", "parameters": {"properties": {"a": {"type": "foo"}}}}},
    ]
    for choice in ("auto", "none", "required"):
        r = httpx.post(
            server.url + "/chat/completions",
            json=body(tools=tools, tool_choice=choice, max_tokens=2),
            timeout=60,
        )
        if choice == "none":  # nothing rendered, nothing forced: the tools are not looked at
            assert r.status_code == 200, r.text
            continue
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "tools[1].function.parameters" and "foo" in error["message"], error


# ---------------------------------------------------------------------------- canned replies (the test seam)


def _canned_client_class() -> type:
    from minisgl.server.scheduler_client import SchedulerClient

    class CannedClient(SchedulerClient):
        """A scheduler that answers every request with the tokens of `reply`, a token per step, then
        finishes with `reason` ("stop": EOS last); `params` keeps what each request asked for."""

        def __init__(self, settings: dict[str, Any], config: str | None, *where: Any) -> None:
            from minisgl.models.default import default_model_path

            self.settings, self.config, self.failed, self.on_failure = settings, config, None, None
            self.proc = SimpleNamespace(pid=0)
            self.choices, self.rids, self._ids = {}, iter(range(1 << 62)), iter(range(1 << 62))
            self.info = {
                "model_path": str(default_model_path()),
                "model_name": MODEL,
                "max_context": 8192,
                "max_running_req": 8,
                "vocab_size": 49152,
                "eos_token_ids": [EOS],
            }
            self.reply, self.reason, self.params = [EOS], "stop", []
            self.running: dict[int, list[int]] = {}
            self.ready = asyncio.Event()
            self.ready.set()
            self._tasks = [asyncio.create_task(self._run())]

        def _send(self, header: dict[str, Any], *frames: bytes) -> None:
            if header["op"] == "add":
                self.params.append(header["params"])
                self.running[header["rid"]] = list(self.reply)
            elif header["op"] == "abort":
                self.running.pop(header["rid"], None)

        async def _run(self) -> None:
            while True:
                await asyncio.sleep(0.001)
                served, tokens, done = list(self.running), [], []
                for row, rid in enumerate(served):
                    tokens.append(self.running[rid].pop(0))
                    if not self.running[rid]:
                        del self.running[rid]
                        done.append([row, self.reason, None, [time.perf_counter()] * 4, [0, 0]])
                if served:
                    now = time.perf_counter()
                    self._step({"t": now, "s": now, "n": None, "done": done}, served, tokens)

        async def close(self) -> None:
            for task in self._tasks:
                task.cancel()

    return CannedClient


class CannedServer:
    """The front end (`minisgl.server.app`) in a thread of this process, on 127.0.0.1, over
    `CannedClient`; `say(text)` sets the reply every request gets next."""

    def __init__(self, **settings: Any) -> None:
        import uvicorn

        from minisgl.models.default import default_model_path
        from minisgl.server.app import create_app
        from minisgl.server.state import ServerState
        from minisgl.settings import EngineSettings

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        explicit = {"port": self.port, "engine_restart": False, "chat_template": str(TEMPLATE), **settings}
        self.state = ServerState(EngineSettings.load(None, **explicit), explicit, None)
        self.state.client_class = _canned_client_class()
        config = uvicorn.Config(create_app(self.state), host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(default_model_path())
        self.url = f"http://127.0.0.1:{self.port}/v1"
        deadline = time.monotonic() + 120
        while not self.state.ready:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the front end did not start"
            time.sleep(0.05)
        self.client = openai.OpenAI(base_url=self.url, api_key="unused", timeout=60, max_retries=0)

    def say(self, text: str, reason: str = "stop") -> None:
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        self.state.client.reply = ids + [EOS] if reason == "stop" else ids
        self.state.client.reason = reason

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def canned():
    servers: dict[str | None, CannedServer] = {}

    def get(parser: str | None) -> CannedServer:
        if parser not in servers:
            servers[parser] = CannedServer(**({"tool_call_parser": parser} if parser else {}))
        return servers[parser]

    yield get
    for srv in servers.values():
        srv.stop()


ARGS = '{"city": "Paris </tool_call> \\"x\\"", "unit": "celsius", "nested": {"a": [1, {"b": "日本"}]}}'
CANNED = [
    # (parser, reply, content, calls)
    (
        "hermes",
        f'Let me check.\n<tool_call>\n{{"name": "get_weather", "arguments": {ARGS}}}\n</tool_call>',
        "Let me check.",
        [("get_weather", ARGS)],
    ),
    (
        "hermes",
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "get_time"}\n</tool_call>',
        None,
        [("get_time", "{}"), ("get_time", "{}")],
    ),
    (
        "hermes",
        "It is sunny in <b>Paris</b>, no call needed.",
        "It is sunny in <b>Paris</b>, no call needed.",
        [],
    ),
    ("hermes", '<tool_call>\n{"name": "delete_all", "arguments": {}}\n</tool_call>Sorry.', "Sorry.", []),
    ("llama3_json", f'{{"name": "get_weather", "parameters": {ARGS}}}', None, [("get_weather", ARGS)]),
    ("llama3_json", '{"answer": "no call"}', '{"answer": "no call"}', []),
    (
        "mistral",
        f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {ARGS}}}, {{"name": "get_time", "arguments": {{}}}}]',
        None,
        [("get_weather", ARGS), ("get_time", "{}")],
    ),
]


@pytest.mark.parametrize(("parser", "reply", "content", "calls"), CANNED)
def test_auto_reads_canned_replies_streamed_as_whole(canned, parser, reply, content, calls) -> None:
    srv = canned(parser)
    srv.say(reply)
    fields = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=200)
    whole = srv.client.chat.completions.create(**fields).choices[0]
    assert srv.state.client.params[-1].get("ebnf") is None  # auto forces nothing
    assert (whole.message.content, calls_of(whole.message)) == (content, calls)
    assert whole.finish_reason == ("tool_calls" if calls else "stop")
    ids = [c.id for c in whole.message.tool_calls or []]
    short = parser == "mistral"
    assert all((len(i) == 9 and i.isalnum()) if short else i.startswith("call_") for i in ids) and len(
        set(ids)
    ) == len(ids)
    text, got, reason, _, deltas = streamed(srv.client, **fields)
    assert (text, got, reason) == (content or "", calls, whole.finish_reason)
    assert [d.index for d in deltas] == [i for i in range(len(calls)) for _ in (0, 1)]


def test_parallel_tool_calls_false_keeps_the_first_call(canned) -> None:
    srv = canned("hermes")
    srv.say(CANNED[1][1])
    reply = srv.client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, parallel_tool_calls=False, max_tokens=99
    )
    assert calls_of(reply.choices[0].message) == [("get_time", "{}")]


def test_without_a_parser_auto_is_refused_and_forced_calls_are_hermes(canned) -> None:
    srv = canned(None)
    with pytest.raises(openai.BadRequestError) as caught:
        srv.client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=9)
    assert caught.value.body["param"] == "tool_choice" and "tool_call_parser" in caught.value.body["message"]
    srv.say('<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    reply = srv.client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=99
    )
    assert (
        calls_of(reply.choices[0].message) == [("get_time", "{}")]
        and reply.choices[0].finish_reason == "tool_calls"
    )
    assert "<tool_call>" in srv.state.client.params[-1]["ebnf"]  # the grammar went to the scheduler


def test_a_canned_call_cut_by_max_tokens_is_no_call(canned) -> None:
    srv = canned("hermes")
    srv.say('Sure.\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool', reason="length")
    fields = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=99)
    whole = srv.client.chat.completions.create(**fields).choices[0]
    assert (whole.message.content, whole.message.tool_calls, whole.finish_reason) == ("Sure.", None, "length")
    assert streamed(srv.client, **fields)[:3] == ("Sure.", [], "length")


def test_parsing_starts_after_a_think_block(canned) -> None:
    srv = canned("hermes")
    thought = 'maybe <tool_call>{"name": "get_time"}</tool_call>?'
    srv.say(f'<think>{thought}</think>\n<tool_call>\n{{"name": "search", "arguments": {{}}}}\n</tool_call>')
    tools = [*TOOLS, {"type": "function", "function": {"name": "search"}}]
    fields = dict(model=MODEL, messages=ASK, tools=tools, max_tokens=99)
    whole = srv.client.chat.completions.create(**fields).choices[0]
    assert (whole.message.content, calls_of(whole.message)) == (
        f"<think>{thought}</think>",
        [("search", "{}")],
    )
    assert streamed(srv.client, **fields)[:3] == (
        f"<think>{thought}</think>",
        [("search", "{}")],
        "tool_calls",
    )
    split = srv.client.chat.completions.create(**fields, extra_body={"separate_reasoning": True}).choices[0]
    assert (split.message.reasoning_content, split.message.content) == (thought, None)  # type: ignore[attr-defined]
    assert calls_of(split.message) == [("search", "{}")]


def test_a_reply_with_calls_goes_back_into_the_conversation(canned) -> None:
    """The openai client's usual loop: the reply's message, then the tool's result, sent back."""
    srv = canned("hermes")
    srv.say(
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    )
    messages: list[Any] = list(ASK)
    reply = srv.client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=99)
    message = reply.choices[0].message
    messages += [message, {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "18 C"}]
    srv.say("It is 18 C in Paris.")
    final = srv.client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=99)
    assert (final.choices[0].message.content, final.choices[0].finish_reason) == (
        "It is 18 C in Paris.",
        "stop",
    )
    assert final.usage.prompt_tokens > reply.usage.prompt_tokens + 20  # the call and its result, rendered


def test_the_settings_name_the_parsers_and_read_template_paths_beside_their_file(
    tmp_path, monkeypatch
) -> None:
    from minisgl.server.tool_parsers import FORMATS
    from minisgl.settings import TOOL_CALL_PARSERS, EngineSettings, SettingsError

    assert tuple(FORMATS) == TOOL_CALL_PARSERS
    (tmp_path / "t.jinja").write_text(TEMPLATE.read_text())
    (tmp_path / "serve.yaml").write_text("chat_template: t.jinja\ntool_call_parser: llama3_json\n")
    server = EngineSettings.load(tmp_path / "serve.yaml").to_server_config()
    assert (server.chat_template, server.tool_call_parser) == (str(tmp_path / "t.jinja"), "llama3_json")
    monkeypatch.setenv("MINISGL_TOOL_CALL_PARSER", "mistral")
    assert EngineSettings.load(tmp_path / "serve.yaml").to_server_config().tool_call_parser == "mistral"
    with pytest.raises(SettingsError, match="chat_template"):
        EngineSettings.load(chat_template=str(tmp_path / "missing.jinja"))


def test_mistral_and_llama3_json_read_the_text_with_special_tokens_kept(canned) -> None:
    for parser, kept in (("mistral", True), ("llama3_json", True), ("hermes", False)):
        srv = canned(parser)
        srv.say("Hi<|im_start|>there")  # <|im_start|>: one of SmolLM2's special tokens
        assert 1 in srv.state.client.reply  # the special token's id, not its spelling
        reply = srv.client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=99)
        assert reply.choices[0].message.content == ("Hi<|im_start|>there" if kept else "Hithere"), parser
