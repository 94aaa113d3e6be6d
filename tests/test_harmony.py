"""gpt-oss's harmony format (`minisgl.harmony`): replies of the format read into reasoning (analysis),
content (final) and tool calls (commentary to=functions.NAME), the same for every split of the text;
malformed channels are content. Then through the server's front end over canned replies (test_tools'
seam) under a harmony chat template: reasoning_content, content and OpenAI tool_calls, streamed and
whole, never a 500."""

from __future__ import annotations

import json

import pytest
from test_tools import ASK, MODEL, TOOLS, CannedServer, calls_of

from minisgl.harmony import HarmonyParser, parse_harmony

CALL = '{"city": "Paris, \\"FR\\"", "unit": "celsius"}'
REPLIES = [
    # (reply, reasoning, content, calls)
    (
        "<|channel|>analysis<|message|>The user wants the weather.<|end|><|start|>assistant<|channel|>commentary"
        f" to=functions.get_weather <|constrain|>json<|message|>{CALL}<|call|>",
        "The user wants the weather.",
        "",
        [("get_weather", CALL)],
    ),
    (
        "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>It is 4.<|return|>",
        "Easy.",
        "It is 4.",
        [],
    ),
    (" to=functions.get_time<|channel|>commentary json<|message|>{}", "", "", [("get_time", "{}")]),
    ("<|channel|>nonsense<|message|>odd channel<|end|>", "", "odd channel", []),
    ("no header at all", "", "no header at all", []),
    ("<|channel|>commentary to=functions.get_time<|message|>not json<|call|>", "", "not json", []),
    ("<|channel|>analysis<|message|>a<|channel|>final<|message|>b", "a", "b", []),
]


@pytest.mark.parametrize(("reply", "reasoning", "content", "calls"), REPLIES)
def test_replies_read_whole_and_in_every_split(reply, reasoning, content, calls) -> None:
    want = (reasoning, content, calls)
    assert parse_harmony(reply) == want
    for step in (1, 2, 7):
        parser, got = HarmonyParser(), ["", "", []]
        for i in range(0, len(reply), step):
            r, c, k = parser.feed(reply[i : i + step], final=i + step >= len(reply))
            got[0], got[1], got[2] = got[0] + r, got[1] + c, got[2] + k
        assert tuple(got) == want, step


def test_a_call_cut_off_is_dropped() -> None:
    cut = "<|channel|>commentary to=functions.get_time<|message|>{}"
    assert parse_harmony(cut, stopped=False) == ("", "", [])


@pytest.fixture(scope="module")
def harmony(tmp_path_factory):
    template = tmp_path_factory.mktemp("harmony") / "harmony.jinja"
    template.write_text(
        "{% for m in messages %}<|start|>{{ m.role }}{% if m.role == 'assistant' %}<|channel|>final{% endif %}"
        "<|message|>{{ m.content }}<|end|>{% endfor %}"
        "{% if tools %}{{ tools | length }} tools{% endif %}<|start|>assistant"
    )
    srv = CannedServer(chat_template=str(template))
    yield srv
    srv.stop()


def test_the_server_gives_reasoning_content_and_calls_streamed_as_whole(harmony) -> None:
    fields = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=300)
    for reply, reasoning, content, calls in REPLIES[:2] + REPLIES[3:4]:
        harmony.say(reply)
        whole = harmony.client.chat.completions.create(**fields).choices[0]
        assert whole.message.model_extra.get("reasoning_content") == (reasoning or None)
        assert (whole.message.content or "", calls_of(whole.message)) == (content, calls)
        assert whole.finish_reason == ("tool_calls" if calls else "stop")
        streamed = {"reasoning": "", "content": "", "calls": {}}
        finish = None
        for chunk in harmony.client.chat.completions.create(**fields, stream=True):
            delta, finish = chunk.choices[0].delta, chunk.choices[0].finish_reason or finish
            streamed["reasoning"] += (delta.model_extra or {}).get("reasoning_content") or ""
            streamed["content"] += delta.content or ""
            for call in delta.tool_calls or ():
                name, args = streamed["calls"].get(call.index, ("", ""))
                streamed["calls"][call.index] = (
                    name + (call.function.name or ""),
                    args + (call.function.arguments or ""),
                )
        assert (streamed["reasoning"], streamed["content"]) == (reasoning, content)
        assert [streamed["calls"][i] for i in sorted(streamed["calls"])] == calls
        assert finish == whole.finish_reason
        if calls:
            assert json.loads(calls[0][1])["unit"] == "celsius"


def test_without_tools_a_call_is_dropped_and_forced_calls_are_refused(harmony) -> None:
    harmony.say(REPLIES[0][0])
    reply = harmony.client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=300).choices[0]
    assert reply.message.tool_calls is None and reply.finish_reason == "stop"
    r = harmony.client.chat.completions.with_raw_response
    with pytest.raises(Exception, match="harmony") as e:
        r.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=8)
    assert getattr(e.value, "status_code", None) == 400
