"""The OpenAI protocol layer of the server (minisgl.server.protocol): request bodies -> SamplingParams,
engine results -> responses and streamed chunks, checked against the `openai` package's own types and,
end to end, through the openai client over an in-process HTTP transport (no server, no engine)."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any, Literal

import httpx2 as httpx  # the HTTP client the openai package is built on
import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st
from openai.types import Completion, CompletionChoice, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from minisgl.core import INT64_MAX, SamplingParams
from minisgl.server.errors import APIError, error_body, invalid_request
from minisgl.server.guards import load_json
from minisgl.server.protocol import (
    MAX_N,
    ChatCompletionRequest,
    CompletionRequest,
    check_model,
    parse_chat_request,
    parse_completion_request,
)
from minisgl.server.responses import (
    SSE_DONE,
    ChunkFormat,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    model_card,
    model_list,
    new_request_id,
    openai_finish_reason,
    sse,
    usage_chunk,
)
from minisgl.server.sampling import sampling_params

MODEL = "tiny-model"
CONTEXT = 64


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Hello", **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **fields}


def parse(body: dict[str, Any]) -> CompletionRequest | ChatCompletionRequest:
    return parse_chat_request(body, MODEL) if "messages" in body else parse_completion_request(body, MODEL)


def params_of(body: dict[str, Any], prompt_len: int = 4, max_context: int = CONTEXT) -> list[SamplingParams]:
    return sampling_params(parse(body), prompt_len, max_context)


def refused(body: dict[str, Any], prompt_len: int = 4, max_context: int = CONTEXT) -> APIError:
    """The APIError the body gets, from parsing or from the mapping onto SamplingParams."""
    with pytest.raises(APIError) as info:
        params_of(body, prompt_len, max_context)
    return info.value


@dataclass
class Output:
    """An engine result as the builders read it (minisgl.llm.RequestOutput has these fields)."""

    text: str
    token_ids: list[int]
    finish_reason: str = "stop"
    error: str | None = None


# ------------------------------------------------------------------------------------------------ errors


def test_error_body_has_openai_shape():
    error = APIError("bad top_p", param="top_p", code="x")
    assert (error.status, error.type) == (400, "invalid_request_error")
    assert error_body(error) == {
        "error": {"message": "bad top_p", "type": "invalid_request_error", "param": "top_p", "code": "x"}
    }
    assert str(error) == "bad top_p"


def test_wrong_model_is_a_404_model_not_found():
    with pytest.raises(APIError) as info:
        parse_completion_request(completion(model="gpt-4o"), MODEL)
    error = info.value
    assert (error.status, error.code, error.param) == (404, "model_not_found", "model")
    assert "gpt-4o" in error.message and MODEL in error.message
    with pytest.raises(APIError):
        parse_chat_request(chat(model=MODEL + "x"), MODEL)
    check_model(MODEL, MODEL)  # the served name passes


def test_missing_model_and_non_object_bodies_are_400():
    error = refused({"prompt": "x"})
    assert (error.status, error.param) == (400, "model")
    assert "missing" in error.message
    for body in ([completion()], "text", None):
        with pytest.raises(APIError, match="JSON object") as info:
            parse_completion_request(body, MODEL)
        assert info.value.status == 400


def test_load_json_refuses_invalid_json_and_non_objects():
    assert load_json(b'{"model": "m"}') == {"model": "m"}
    with pytest.raises(APIError, match="not valid JSON"):
        load_json(b"{model")
    with pytest.raises(APIError, match="JSON object, got list"):
        load_json(b"[1, 2]")


def test_load_json_bounds_depth_and_refuses_lone_surrogates():
    from minisgl.server.guards import MAX_DEPTH

    nested = lambda n: b'{"x":' + b"[" * (n - 1) + b"]" * (n - 1) + b"}"  # noqa: E731
    assert load_json(nested(MAX_DEPTH))  # the deepest allowed
    for n in (MAX_DEPTH + 1, 100_000):  # past it, and past the interpreter's recursion
        with pytest.raises(APIError, match="more than 64 deep") as info:
            load_json(nested(n))
        assert info.value.code == "too_deep"
    assert load_json(b'{"x":"\\ud83d\\ude00"}') == {"x": "\U0001f600"}  # an escaped pair is one character
    with pytest.raises(APIError, match="lone surrogate") as info:
        load_json(b'{"messages":[{"role":"user","content":"a\\udc00"}]}')
    assert info.value.param == "messages[0].content"
    with pytest.raises(APIError, match="not valid UTF-8"):
        load_json(b'{"x":"\xed\xa0\x80"}')  # the surrogate's raw bytes
    error = APIError("bad \ud800 " + "y" * 10_000, param="p\udfff")
    assert json.dumps(error_body(error), ensure_ascii=False).encode()  # always encodable
    assert len(error.message) <= 2000 and "\\ud800" in error.message


def test_errors_quote_a_short_prefix_of_what_the_client_sent():
    huge = "m" * (1 << 20)
    for body in ({"model": huge, "prompt": "x"}, {"model": MODEL, "prompt": "x", huge: 1}):
        with pytest.raises(APIError) as info:
            parse_completion_request(body, MODEL)
        assert len(info.value.message) < 200 and len(info.value.param) <= 200


def test_stop_strings_are_bounded_in_number_and_length():
    from minisgl.server.protocol import Limits

    limits = Limits(max_stop_strings=3, max_stop_string_length=5)
    ok = parse_completion_request(completion(stop=["a", "bb", "ccccc"]), MODEL, limits)
    assert ok.stop == ["a", "bb", "ccccc"]
    for stop, words in ((["a"] * 4, "setting max_stop_strings"), ("x" * 6, "max_stop_string_length")):
        with pytest.raises(APIError, match=words) as info:
            parse_completion_request(completion(stop=stop), MODEL, limits)
        assert info.value.param == "stop"
    with pytest.raises(APIError, match="context_length|context holds") as info:
        parse_completion_request(completion(prompt=[1] * 10), MODEL, Limits(max_context=10))
    assert info.value.code == "context_length_exceeded"


def test_invalid_request_names_the_sampling_field_and_renames_aliases():
    with pytest.raises(ValueError) as info:
        SamplingParams(top_p=2.0)
    error = invalid_request(info.value)
    assert (error.status, error.param, error.message) == (400, "top_p", str(info.value))
    with pytest.raises(ValueError) as info:
        SamplingParams(max_tokens=-1)
    assert (
        invalid_request(info.value, {"max_tokens": "max_completion_tokens"}).param == "max_completion_tokens"
    )
    assert invalid_request(ValueError("token id 9 is outside the vocabulary [0, 5)")).param is None


# ------------------------------------------------------------------------------------- parameter mapping


def test_defaults_follow_openai_temperature_1_and_the_rest_of_the_context():
    [params] = params_of(completion(), prompt_len=10, max_context=CONTEXT)
    assert params == SamplingParams(temperature=1.0, max_tokens=CONTEXT - 10)
    [params] = params_of(chat(temperature=None, n=None, seed=None), prompt_len=60)
    assert (params.temperature, params.max_tokens, params.seed) == (1.0, CONTEXT - 60, None)


def test_every_parameter_maps_onto_sampling_params():
    body = completion(
        max_tokens=12,
        temperature=0.5,
        top_p=0.9,
        seed=3,
        stop=["\n", "END"],
        top_k=20,
        min_p=0.05,
        min_tokens=2,
        ignore_eos=True,
        stop_token_ids=[7, 8],
    )
    [params] = params_of(body)
    assert params == SamplingParams(
        temperature=0.5,
        top_p=0.9,
        seed=3,
        max_tokens=12,
        stop=("\n", "END"),
        top_k=20,
        min_p=0.05,
        min_tokens=2,
        ignore_eos=True,
        stop_token_ids=(7, 8),
    )
    [chat_params] = params_of({**chat(), **{k: v for k, v in body.items() if k not in ("model", "prompt")}})
    assert chat_params == params


def test_temperature_zero_is_greedy_and_integers_are_numbers():
    [params] = params_of(chat(temperature=0))
    assert params.is_greedy and params.temperature == 0.0
    [params] = params_of(completion(temperature=2, top_p=1))
    assert (params.temperature, params.top_p) == (2.0, 1.0)


def test_stop_may_be_one_string():
    assert params_of(completion(stop="###"))[0].stop == ("###",)
    assert params_of(chat(stop=None))[0].stop == ()


def test_chat_max_completion_tokens_and_its_older_name():
    assert params_of(chat(max_completion_tokens=5))[0].max_tokens == 5
    assert params_of(chat(max_tokens=6))[0].max_tokens == 6
    assert params_of(chat(max_tokens=7, max_completion_tokens=7))[0].max_tokens == 7
    error = refused(chat(max_tokens=7, max_completion_tokens=8))
    assert error.param == "max_tokens" and "max_tokens=7" in error.message and "=8" in error.message
    error = refused(chat(max_completion_tokens=0))
    assert error.param == "max_completion_tokens" and "max_completion_tokens=0" in error.message


def test_n_gives_n_params_with_consecutive_seeds():
    params = params_of(completion(n=3, seed=41, temperature=0.8, max_tokens=5))
    assert [p.seed for p in params] == [41, 42, 43]
    assert all(replace(p, seed=41) == params[0] for p in params)  # only the seed differs
    assert params_of(completion(n=3, seed=41))[2].seed == 43  # reproducible
    unseeded = params_of(chat(n=2))
    assert len(unseeded) == 2 and all(p.seed is None for p in unseeded)  # each draws its own seed
    assert len(params_of(chat(n=MAX_N))) == MAX_N


def test_n_out_of_range_and_seed_overflow_are_400():
    for n in (0, -1, MAX_N + 1):
        error = refused(completion(n=n))
        assert (error.status, error.param) == (400, "n")
        assert str(n) in error.message
    error = refused(completion(n=2, seed=INT64_MAX))
    assert error.param == "seed" and str(INT64_MAX - 1) in error.message
    assert params_of(completion(n=2, seed=INT64_MAX - 1))[1].seed == INT64_MAX


# --------------------------------------------------------------------------------- unsupported and unknown


@pytest.mark.parametrize(
    ("endpoint", "name", "value"),
    [
        ("completion", "best_of", 2),
        ("completion", "suffix", " end"),
        ("chat", "functions", [{"name": "f"}]),  # the API's older tools (tools: tests/test_tools.py)
        ("chat", "function_call", "auto"),
        ("chat", "prediction", {"type": "content", "content": "x"}),
        ("chat", "modalities", ["text", "audio"]),
        ("chat", "reasoning_effort", "low"),
        ("chat", "store", True),
    ],
)
def test_unsupported_parameters_are_named_in_a_400(endpoint: str, name: str, value: Any):
    body = (completion if endpoint == "completion" else chat)(**{name: value})
    error = refused(body)
    assert (error.status, error.param, error.code) == (400, name, "unsupported_parameter")
    assert f"'{name}'" in error.message and "not supported" in error.message


@pytest.mark.parametrize(
    ("endpoint", "fields"),
    [
        ("completion", dict(logprobs=None, echo=False, best_of=1, suffix=None, logit_bias={})),
        ("chat", dict(logprobs=False, top_logprobs=0, tools=[], tool_choice="none", store=False)),
        ("chat", dict(response_format={"type": "text"}, modalities=["text"], logit_bias=None)),
    ],
)
def test_unsupported_parameters_asking_for_nothing_are_accepted(endpoint: str, fields: dict[str, Any]):
    body = (completion if endpoint == "completion" else chat)(**fields, max_tokens=3)
    assert params_of(body)[0].max_tokens == 3


def test_metadata_is_accepted_and_ignored():
    fields = dict(
        user="u1", metadata={"k": "v"}, service_tier="auto", prompt_cache_key="p", safety_identifier="s"
    )
    assert params_of(completion(**fields)) == params_of(completion())
    assert params_of(chat(parallel_tool_calls=False, **fields)) == params_of(chat())
    error = refused(completion(user=5))  # still type-checked
    assert error.param == "user"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (completion(foo=1), "foo"),
        (chat(max_new_tokens=5), "max_new_tokens"),
        (completion(length_penalty=1.1), "length_penalty"),
        (chat(messages=[{"role": "user", "content": "x", "audio": {}}]), "messages[0].audio"),
        (
            chat(stream=True, stream_options={"include_usage": True, "chunk_size": 2}),
            "stream_options.chunk_size",
        ),
    ],
)
def test_unknown_fields_are_refused(body: dict[str, Any], param: str):
    error = refused(body)
    assert (error.status, error.param, error.code) == (400, param, "unknown_parameter")
    assert param in error.message


def test_the_other_endpoints_fields_are_unknown():
    with pytest.raises(APIError) as info:
        parse_completion_request(completion(messages=[{"role": "user", "content": "x"}]), MODEL)
    assert (info.value.param, info.value.code) == ("messages", "unknown_parameter")
    with pytest.raises(APIError) as info:
        parse_chat_request(chat(prompt="x"), MODEL)
    assert (info.value.param, info.value.code) == ("prompt", "unknown_parameter")


# ------------------------------------------------------------------------------------- types and ranges


@pytest.mark.parametrize(
    ("body", "param", "shown"),
    [
        (completion(temperature="0.5"), "temperature", "'0.5'"),
        (completion(temperature=True), "temperature", "True"),
        (completion(max_tokens=1.5), "max_tokens", "1.5"),
        (completion(max_tokens=16.0), "max_tokens", "16.0"),
        (chat(max_completion_tokens="16"), "max_completion_tokens", "'16'"),
        (completion(n="2"), "n", "'2'"),
        (completion(seed=1.0), "seed", "1.0"),
        (chat(stream="yes"), "stream", "'yes'"),
        (chat(top_k=2.5), "top_k", "2.5"),
        (chat(ignore_eos=1), "ignore_eos", "1"),
        (chat(stop_token_ids=[1.0]), "stop_token_ids[0]", "1.0"),
        (chat(stream=True, stream_options={"include_usage": "yes"}), "stream_options.include_usage", "'yes'"),
        (chat(messages="Hi"), "messages", "'Hi'"),
        (chat(messages=[{"role": "user", "content": 5}]), "messages[0].content", "5"),
        (chat(model=None), "model", "None"),
    ],
)
def test_wrong_types_are_400_naming_param_and_value(body: dict[str, Any], param: str, shown: str):
    error = refused(body)
    assert (error.status, error.param) == (400, param)
    assert f"'{param}'" in error.message and error.message.endswith(f"got {shown}")


@pytest.mark.parametrize("stop", [5, ["a", 3], {"a": 1}])
def test_stop_of_the_wrong_type_is_400(stop: Any):
    error = refused(chat(stop=stop))
    assert error.param == "stop" and "string or a list of strings" in error.message


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (dict(top_p=0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(min_p=2), "min_p"),
        (dict(top_k=-2), "top_k"),
        (dict(seed=-1), "seed"),
        (dict(stop=[""]), "stop"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(min_tokens=10, max_tokens=5), "min_tokens"),
        (dict(min_tokens=-1), "min_tokens"),
    ],
)
def test_out_of_range_values_give_sampling_params_message(fields: dict[str, Any], param: str):
    error = refused(completion(**fields))
    assert (error.status, error.param) == (400, param)
    # the message is SamplingParams' own
    engine_fields = {"temperature": 1.0, "max_tokens": CONTEXT - 4, **fields}
    with pytest.raises((TypeError, ValueError)) as info:
        SamplingParams(**engine_fields)
    assert error.message == str(info.value)


def test_negative_or_zero_max_tokens_is_400():
    for value in (-5, 0):
        error = refused(completion(max_tokens=value))
        assert (error.status, error.param) == (400, "max_tokens")
        assert f"max_tokens={value}" in error.message and "at least 1" in error.message


def test_prompt_too_long_for_the_context_is_400():
    for prompt_len in (CONTEXT, CONTEXT + 10):
        error = refused(completion(), prompt_len=prompt_len)
        assert (error.status, error.param, error.code) == (400, "prompt", "context_length_exceeded")
        assert f"{prompt_len} tokens" in error.message and f"at most {CONTEXT - 1}" in error.message
    error = refused(chat(), prompt_len=CONTEXT)
    assert error.param == "messages"
    assert params_of(completion(), prompt_len=CONTEXT - 1)[0].max_tokens == 1  # room for one token


def test_max_tokens_past_the_context_is_400():
    error = refused(completion(max_tokens=20), prompt_len=50)
    assert (error.status, error.param, error.code) == (400, "max_tokens", "context_length_exceeded")
    assert "max_tokens=20" in error.message and "at most 14" in error.message
    error = refused(chat(max_completion_tokens=15), prompt_len=50)
    assert error.param == "max_completion_tokens"
    assert params_of(completion(max_tokens=14), prompt_len=50)[0].max_tokens == 14  # exactly full


def test_empty_prompt_is_400():
    error = refused(completion(prompt=""), prompt_len=0)
    assert (error.status, error.param) == (400, "prompt") and "empty" in error.message


# ------------------------------------------------------------------------------------- prompts, messages


def test_prompt_forms():
    assert parse(completion(prompt="Hello")).prompt == "Hello"
    assert parse(completion(prompt=[1, 2, 3])).prompt == [1, 2, 3]
    assert parse(completion(prompt=["Hello"])).prompt == "Hello"  # a batch of one
    assert parse(completion(prompt=[[4, 5]])).prompt == [4, 5]


def test_token_id_prompts_return_token_ids_by_default():
    assert parse(completion(prompt=[1, 2])).wants_token_ids
    assert not parse(completion(prompt=[1, 2], return_token_ids=False)).wants_token_ids
    assert not parse(completion(prompt="text")).wants_token_ids
    assert parse(completion(prompt="text", return_token_ids=True)).wants_token_ids
    assert not parse(chat()).wants_token_ids and parse(chat(return_token_ids=True)).wants_token_ids


@pytest.mark.parametrize(
    ("prompt", "words"),
    [
        (["a", "b", "c"], "batch of 3 prompts"),
        ([[1], [2]], "batch of 2 prompts"),
        ([], "empty"),
        ([1, -2], ">= 0"),
        ([1, True], "list of integer token ids"),
        ([1, 2.0], "list of integer token ids"),
        ({"text": "x"}, "list of integer token ids"),
        ([["a"]], "list of integer token ids"),
        (None, "list of integer token ids"),
    ],
)
def test_bad_prompts_are_400(prompt: Any, words: str):
    error = refused(completion(prompt=prompt))
    assert (error.status, error.param) == (400, "prompt") and words in error.message


def test_messages_become_plain_dicts():
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": None},
        {"role": "user", "content": "Again", "name": "ann"},
    ]
    request = parse(chat(messages=messages))
    assert request.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi\nthere"},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "Again", "name": "ann"},
    ]
    assert all(type(m) is dict for m in request.messages)


@pytest.mark.parametrize(
    ("messages", "param", "words"),
    [
        ([], "messages", "empty"),
        ([{"role": "function", "content": "x"}], "messages[0].role", "'function'"),
        ([{"role": "tool", "content": "x"}], "messages[0].tool_call_id", "tool_call_id"),
        ([{"content": "x"}], "messages[0].role", "missing"),
        ([{"role": "user", "content": "x"}, "Hi"], "messages[1]", "'Hi'"),
        (
            # an image part's url must be a string (image parts themselves reach the model: docs/vision.md)
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": 5}}]}],
            "messages[0].content",
            "'image_url'",
        ),
        ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content", "text parts"),
    ],
)
def test_bad_messages_are_400(messages: list[Any], param: str, words: str):
    error = refused(chat(messages=messages))
    assert (error.status, error.param) == (400, param) and words in error.message


def test_stream_options_need_stream():
    error = refused(chat(stream_options={"include_usage": True}))
    assert error.param == "stream_options" and "stream: true" in error.message
    assert parse(chat(stream=True, stream_options={"include_usage": True})).include_usage
    assert not parse(chat(stream=True)).include_usage
    assert not parse(completion(stream=True, stream_options={"include_usage": False})).include_usage


# ------------------------------------------------------------------------------------------- responses


def test_completion_response_validates_as_openai_completion():
    outputs = [Output(" Paris.", [5, 6], "stop"), Output(" Lyon is", [7, 8, 9], "length")]
    body = completion_response("cmpl-1", MODEL, 4, outputs, created=123)
    parsed = Completion.model_validate(body)
    assert (parsed.id, parsed.object, parsed.created, parsed.model) == (
        "cmpl-1",
        "text_completion",
        123,
        MODEL,
    )
    assert [(c.index, c.text, c.finish_reason) for c in parsed.choices] == [
        (0, " Paris.", "stop"),
        (1, " Lyon is", "length"),
    ]
    assert parsed.usage is not None
    assert (parsed.usage.prompt_tokens, parsed.usage.completion_tokens, parsed.usage.total_tokens) == (
        4,
        5,
        9,
    )
    assert "token_ids" not in body["choices"][0]
    with_ids = Completion.model_validate(completion_response("c", MODEL, 4, outputs, return_token_ids=True))
    assert [c.token_ids for c in with_ids.choices] == [[5, 6], [7, 8, 9]]  # type: ignore[attr-defined]


def test_chat_response_validates_as_openai_chat_completion():
    body = chat_response(
        "chatcmpl-1", MODEL, 10, [Output("4", [19], "stop")], created=5, return_token_ids=True
    )
    parsed = ChatCompletion.model_validate(body)
    assert (parsed.object, parsed.created, parsed.model) == ("chat.completion", 5, MODEL)
    [choice] = parsed.choices
    assert (choice.message.role, choice.message.content, choice.finish_reason) == ("assistant", "4", "stop")
    assert choice.token_ids == [19]  # type: ignore[attr-defined]
    assert parsed.usage is not None and parsed.usage.total_tokens == 11


def test_new_request_ids_are_unique_and_prefixed():
    a, b = new_request_id("completion"), new_request_id("completion")
    assert a.startswith("cmpl-") and a != b
    assert new_request_id("chat").startswith("chatcmpl-")


def test_finish_reasons_stop_and_length_map_directly():
    assert openai_finish_reason("stop") == "stop" and openai_finish_reason("length") == "length"


def test_abort_and_error_become_server_errors():
    with pytest.raises(APIError) as info:
        openai_finish_reason("abort")
    assert (info.value.status, info.value.type, info.value.code) == (503, "server_error", "request_aborted")
    with pytest.raises(APIError) as info:
        openai_finish_reason("error", "CUDA out of memory")
    assert (info.value.status, info.value.code) == (500, "generation_failed")
    assert "CUDA out of memory" in info.value.message
    with pytest.raises(APIError, match="unknown finish reason 'weird'"):
        openai_finish_reason("weird")
    # one failed choice fails the whole non-streamed response
    outputs = [Output("ok", [1]), Output("", [], "error", "step failed")]
    with pytest.raises(APIError, match="step failed"):
        chat_response("c", MODEL, 3, outputs)
    with pytest.raises(APIError) as info:
        completion_response("c", MODEL, 3, [Output("par", [1], "abort")])
    assert info.value.status == 503


class _StreamedCompletionChoice(CompletionChoice):
    # openai's CompletionChoice declares finish_reason non-null, yet the API streams null until a
    # choice's last chunk (the client builds streamed objects without validating them)
    finish_reason: Literal["stop", "length", "content_filter"] | None  # type: ignore[assignment]


class _StreamedCompletion(Completion):
    choices: list[_StreamedCompletionChoice]  # type: ignore[assignment]


def test_completion_chunks_validate_as_openai_completion():
    middle = completion_chunk("cmpl-2", MODEL, 1, " wor", created=9, token_ids=[3, 4])
    parsed = _StreamedCompletion.model_validate(middle)
    assert (parsed.object, parsed.choices[0].index, parsed.choices[0].text) == ("text_completion", 1, " wor")
    assert parsed.choices[0].finish_reason is None and parsed.choices[0].token_ids == [3, 4]  # type: ignore[attr-defined]
    last = Completion.model_validate(completion_chunk("cmpl-2", MODEL, 1, "ld", finish_reason="length"))
    assert last.choices[0].finish_reason == "length"
    assert "token_ids" not in completion_chunk("c", MODEL, 0, "x")["choices"][0]
    end = Completion.model_validate(usage_chunk("completion", "cmpl-2", MODEL, 3, 8, created=9))
    assert end.choices == [] and end.usage is not None and end.usage.total_tokens == 11


def test_chat_chunks_validate_as_openai_chat_completion_chunk():
    first = ChatCompletionChunk.model_validate(
        chat_chunk("chatcmpl-3", MODEL, 0, role="assistant", content="")
    )
    assert first.choices[0].delta.role == "assistant" and first.choices[0].delta.content == ""
    assert first.object == "chat.completion.chunk" and first.choices[0].finish_reason is None
    body = chat_chunk("chatcmpl-3", MODEL, 2, content="Hel", token_ids=[11])
    assert body["choices"][0]["delta"] == {"content": "Hel"}  # no role after the first chunk
    middle = ChatCompletionChunk.model_validate(body)
    assert (middle.choices[0].index, middle.choices[0].delta.content) == (2, "Hel")
    assert middle.choices[0].token_ids == [11]  # type: ignore[attr-defined]
    last_body = chat_chunk("chatcmpl-3", MODEL, 0, finish_reason="stop")
    assert last_body["choices"][0]["delta"] == {}
    assert ChatCompletionChunk.model_validate(last_body).choices[0].finish_reason == "stop"
    end = ChatCompletionChunk.model_validate(usage_chunk("chat", "chatcmpl-3", MODEL, 5, 2))
    assert end.choices == [] and end.usage is not None
    assert (end.usage.prompt_tokens, end.usage.completion_tokens, end.usage.total_tokens) == (5, 2, 7)


def test_models_list_validates_as_openai_models():
    body = model_list(MODEL, created=77)
    assert body["object"] == "list"
    [card] = [Model.model_validate(m) for m in body["data"]]
    assert (card.id, card.object, card.created, card.owned_by) == (MODEL, "model", 77, "minisgl")
    assert Model.model_validate(model_card(MODEL, owned_by="me")).owned_by == "me"


def test_sse_framing():
    event = sse({"text": "a\nb\r\nc", "city": "Zürich"})
    assert event.startswith("data: ") and event.endswith("\n\n")
    assert event.count("\n") == 2 and "\r" not in event  # one line: newlines in strings stay escaped
    assert json.loads(event[len("data: ") : -2]) == {"text": "a\nb\r\nc", "city": "Zürich"}
    assert "Zürich" in event  # UTF-8, not \\u escapes
    assert SSE_DONE == "data: [DONE]\n\n"
    error = sse(error_body(APIError("boom", status=500, type="server_error")))
    assert json.loads(error[6:])["error"]["message"] == "boom"


# ------------------------------------------------------------------ end to end through the openai client


def _fake_generate(params: SamplingParams, finish: str | None) -> Output:
    """A stand-in engine: up to 3 tokens, ids from the seed; `finish` forces a finish reason."""
    base = 100 if params.seed is None else params.seed
    ids = [base + k for k in range(min(params.max_tokens, 3))]
    reason = finish or ("length" if params.max_tokens <= 3 else "stop")
    return Output("".join(f"<{t}>" for t in ids), ids, reason, "boom" if reason == "error" else None)


def _fake_server(finish: str | None = None) -> httpx.MockTransport:
    """What `minisgl-run serve` does around the protocol layer, on canned generations."""

    def stream(
        request: CompletionRequest | ChatCompletionRequest, rid: str, prompt_len: int, outputs: list[Output]
    ) -> str:
        is_chat = isinstance(request, ChatCompletionRequest)
        ids = request.wants_token_ids
        events = []
        for i, out in enumerate(outputs):
            if is_chat:
                events.append(sse(chat_chunk(rid, MODEL, i, role="assistant", content="")))
            for t in out.token_ids:
                piece = f"<{t}>"
                chunk = (
                    chat_chunk(rid, MODEL, i, content=piece, token_ids=[t] if ids else None)
                    if is_chat
                    else completion_chunk(rid, MODEL, i, piece, token_ids=[t] if ids else None)
                )
                events.append(sse(chunk))
            try:
                reason = openai_finish_reason(out.finish_reason, out.error)
            except APIError as e:
                events.append(sse(error_body(e)))
                break
            last = (
                chat_chunk(rid, MODEL, i, finish_reason=reason)
                if is_chat
                else completion_chunk(rid, MODEL, i, "", finish_reason=reason)
            )
            events.append(sse(last))
        else:
            if request.include_usage:
                kind = "chat" if is_chat else "completion"
                total = sum(len(o.token_ids) for o in outputs)
                events.append(sse(usage_chunk(kind, rid, MODEL, prompt_len, total)))
        events.append(SSE_DONE)
        return "".join(events)

    def handle(http: httpx.Request) -> httpx.Response:
        try:
            if http.method == "GET" and http.url.path == "/v1/models":
                return httpx.Response(200, json=model_list(MODEL, created=1))
            body = load_json(http.content)
            request: CompletionRequest | ChatCompletionRequest
            if http.url.path == "/v1/chat/completions":
                request = parse_chat_request(body, MODEL)
                prompt_len = sum(len(m["content"].split()) + 2 for m in request.messages)
            else:
                request = parse_completion_request(body, MODEL)
                prompt = request.prompt
                prompt_len = len(prompt) if isinstance(prompt, list) else len(prompt.split())
            outputs = [_fake_generate(p, finish) for p in sampling_params(request, prompt_len, CONTEXT)]
            is_chat = isinstance(request, ChatCompletionRequest)
            rid = new_request_id("chat" if is_chat else "completion")
            if request.stream:
                text = stream(request, rid, prompt_len, outputs)
                return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})
            build = chat_response if is_chat else completion_response
            return httpx.Response(
                200, json=build(rid, MODEL, prompt_len, outputs, return_token_ids=request.wants_token_ids)
            )
        except APIError as e:
            return httpx.Response(e.status, json=error_body(e))

    return httpx.MockTransport(handle)


def _client(finish: str | None = None) -> openai.OpenAI:
    http = httpx.Client(transport=_fake_server(finish))
    return openai.OpenAI(api_key="none", base_url="http://minisgl.test/v1", http_client=http, max_retries=0)


def test_openai_client_token_id_completion():
    result = _client().completions.create(
        model=MODEL, prompt=[1, 2, 3], max_tokens=2, seed=10, n=2, extra_body={"top_k": 5}
    )
    assert [c.text for c in result.choices] == ["<10><11>", "<11><12>"]
    assert [c.token_ids for c in result.choices] == [[10, 11], [11, 12]]  # type: ignore[attr-defined]
    assert [c.finish_reason for c in result.choices] == ["length", "length"]
    assert result.usage is not None and (result.usage.prompt_tokens, result.usage.completion_tokens) == (3, 4)


def test_openai_client_streamed_chat_with_usage():
    client = _client()
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi there"}],
            seed=1,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts = {0: "", 1: ""}
    for chunk in chunks[:-1]:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == {0: "<1><2><3>", 1: "<2><3><4>"}
    firsts = [c.choices[0] for c in chunks if c.choices and c.choices[0].delta.role]
    assert [(c.index, c.delta.role) for c in firsts] == [(0, "assistant"), (1, "assistant")]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "stop"
    ] * 2
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (4, 6)


def test_openai_client_streamed_completion():
    stream = _client().completions.create(model=MODEL, prompt="a b", max_tokens=2, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == "<100><101>"
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].usage is None


def test_openai_client_sees_errors():
    client = _client()
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    assert info.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="x", logprobs=21)
    assert bad.value.param == "logprobs" and "[0, 20]" in bad.value.message
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="x", max_tokens=CONTEXT)
    assert bad.value.code == "context_length_exceeded"
    assert [m.id for m in client.models.list()] == [MODEL]


def test_openai_client_raises_on_a_failed_stream():
    stream = _client(finish="error").chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], stream=True
    )
    seen = []
    with pytest.raises(openai.APIError, match="generation failed: boom"):
        for chunk in stream:
            seen.append(chunk)
    assert "".join(c.choices[0].delta.content or "" for c in seen) == "<100><101><102>"  # text came first
    with pytest.raises(openai.InternalServerError):  # non-streamed: the whole response is the error
        _client(finish="error").chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}]
        )


# text as the detokenizer makes it: any characters but lone surrogates (it decodes bytes)
_TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=20)


@given(
    kind=st.sampled_from(["completion", "chat"]),
    model=_TEXT,
    index=st.integers(0, MAX_N - 1),
    with_ids=st.booleans(),
    text=_TEXT,
    ids=st.lists(st.integers(0, 2**40), max_size=4),
)
def test_chunk_format_makes_the_chunks_bytes(kind, model, index, with_ids, text, ids):
    # the streaming path's pre-split chunk equals sse() of the chunk built as a dict
    fmt = ChunkFormat(kind, "cmpl-1", model, index, with_ids, 1700000000)
    wanted = ids if with_ids else None
    if kind == "chat":
        chunk = chat_chunk("cmpl-1", model, index, content=text, token_ids=wanted, created=1700000000)
    else:
        chunk = completion_chunk("cmpl-1", model, index, text, token_ids=wanted, created=1700000000)
    assert fmt.event(text, ids) == sse(chunk)
