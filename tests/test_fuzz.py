"""Property tests (hypothesis) over what a user can pass: sampling parameters, prompts and settings.

Any input either raises a clear error up front (a ValueError, TypeError or SettingsError naming the
value, or a MemoryError naming the setting that asked too much) or generates normally (finish reason
"stop" or "length", never "error"); afterwards no request holds a page, every slot is free, and a
normal request gives the same tokens as before. Examples are bounded in number and size and have no
deadline, so the run takes the same time on a slow machine."""

import json
import math
from pathlib import Path

import httpx2 as httpx
import pytest
from conftest import FIXED_EXAMPLES, llm_clean
from hypothesis import event, given, settings
from hypothesis import strategies as st

from minisgl.core import SamplingParams
from minisgl.llm import LLM, RequestError
from minisgl.settings import SettingsError

VOCAB = 49152  # the tokenizer's, as the default model's
NORMAL_PROMPT, NORMAL = "The capital of France is", SamplingParams(max_tokens=4, ignore_eos=True)
FUZZ = settings(FIXED_EXAMPLES, max_examples=150)

# values of the wrong kind or far out of range, mixed into every field
ANYTHING = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([2**63, 2**63 - 1, -(2**63), 2**31, -1, 0]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4),
    st.binary(max_size=3),
    st.lists(st.integers(min_value=-3, max_value=60000), max_size=3),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=1),
)


def one_field_corrupted(fields: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
    """Keyword arguments drawn from `fields` (each key given or not), half of them with one key's value
    replaced by ANYTHING: errors come one at a time, and valid inputs stay common."""
    valid = st.fixed_dictionaries({}, optional=fields)

    @st.composite
    def corrupted(draw: st.DrawFn) -> dict:
        kwargs = draw(valid)
        kwargs[draw(st.sampled_from(sorted(fields)))] = draw(ANYTHING)
        return kwargs

    return st.one_of(valid, corrupted())


TOKEN = st.one_of(st.integers(min_value=0, max_value=VOCAB - 1), st.sampled_from([0, 1, 2, VOCAB - 1]))
SAMPLING = one_field_corrupted(
    {
        "temperature": st.one_of(st.floats(0, 3), st.sampled_from([0.0, 1e-50, 1e-8, 1e30, 3.4e38, 3.5e38])),
        "top_k": st.one_of(st.integers(-1, VOCAB + 5), st.sampled_from([2**62, 2**63 - 1])),
        "top_p": st.one_of(st.floats(1e-60, 1.0), st.sampled_from([1e-300, 5e-324, 1.0])),
        "min_p": st.floats(0.0, 1.0),
        "seed": st.one_of(st.none(), st.integers(0, 2**63 - 1)),
        "max_tokens": st.integers(3, 8),
        "min_tokens": st.integers(0, 3),
        "ignore_eos": st.booleans(),
        "stop": st.one_of(
            st.text(min_size=1, max_size=3), st.lists(st.text(min_size=1, max_size=3), max_size=3)
        ),
        "stop_token_ids": st.lists(st.one_of(TOKEN, st.sampled_from([VOCAB, 10**6, 2**70])), max_size=4),
        "logprobs": st.one_of(st.none(), st.integers(-1, 21)),
        "prompt_logprobs": st.one_of(st.none(), st.integers(-1, 21)),
        "logit_bias": st.dictionaries(st.one_of(TOKEN, st.just(VOCAB)), st.floats(-101, 101), max_size=3),
        "presence_penalty": st.floats(-2.5, 2.5),
        "frequency_penalty": st.floats(-2.5, 2.5),
        "repetition_penalty": st.floats(0.0, 11.0),
    }
).map(lambda kwargs: {"max_tokens": 4, **kwargs})  # not the default 1024: a CPU run stays short
TEXT, IDS = st.text(max_size=40), st.lists(TOKEN, max_size=24)
ONE_PROMPT = st.one_of(
    TEXT,
    IDS,
    TEXT,
    IDS,
    st.lists(st.integers(min_value=-(2**64), max_value=2**64), max_size=4),
    st.lists(st.floats(0, 100), min_size=1, max_size=3),
)
PROMPTS = st.one_of(ONE_PROMPT, ONE_PROMPT, st.lists(ONE_PROMPT, max_size=3), ANYTHING)
# words a clear error of the LLM's checks uses (Python internals such as "unhashable" or "NoneType"
# without a word on what to pass are not clear)
CLEAR = ("prompt", "token", "max_tokens", "max_seq_len", "vocabulary", "tokenizer", "stop", "sampling")


def check_outputs(outputs, params: SamplingParams) -> None:
    for out in outputs:
        assert out.finish_reason in ("stop", "length"), out.error
        assert len(out.token_ids) <= params.max_tokens
        assert all(0 <= t < VOCAB for t in out.token_ids)
        if out.finish_reason == "length":
            assert len(out.token_ids) == params.max_tokens
        if params.logprobs is not None:  # one entry per token, its k alternatives, log probabilities <= 0
            assert [e.token_id for e in out.logprobs] == out.token_ids
            assert all(len(e.top) == params.logprobs and e.logprob <= 1e-6 for e in out.logprobs)
        if params.prompt_logprobs is not None:
            assert len(out.prompt_logprobs) == len(out.prompt_token_ids) and out.prompt_logprobs[0] is None
            assert all(len(e.top) == params.prompt_logprobs for e in out.prompt_logprobs[1:])


def sampling_params(kwargs: dict) -> SamplingParams | None:
    """SamplingParams(**kwargs), or None after checking its error names a field given."""
    try:
        return SamplingParams(**kwargs)
    except (TypeError, ValueError) as e:
        assert any(name in str(e) for name in kwargs), e
        event("SamplingParams refused")
        return None


def run_one(llm: LLM, prompt, params: SamplingParams, stream: bool) -> None:
    """Generates (or streams) the prompt: a clear error up front, or a normal finish."""
    try:
        if stream:
            deltas = llm.stream(prompt, params)
        else:
            outputs = llm.generate(prompt, params)
    except (TypeError, ValueError) as e:
        assert any(word in str(e) for word in CLEAR), e
        llm_clean(llm)  # refused: nothing was queued
        event(f"request refused: {type(e).__name__}")
        return
    event("generated")
    if stream:
        text = "".join(deltas)
        assert deltas.finish_reason in ("stop", "length") and isinstance(text, str)
    else:
        check_outputs(outputs, params)


@pytest.fixture(scope="module")
def tiny_llm(tiny_model):
    folder = tiny_model("llama", tokenizer=True)
    with LLM(str(folder), device="cpu", dtype="float32", max_running_req=8, page_size=4) as llm:
        llm.normal = llm.generate(NORMAL_PROMPT, NORMAL)[0].token_ids
        yield llm


@FUZZ
@given(kwargs=SAMPLING, prompt=PROMPTS, stream=st.booleans())
def test_any_sampling_params_and_prompt_either_raise_clearly_or_generate(tiny_llm, kwargs, prompt, stream):
    params = sampling_params(kwargs)
    if params is not None:
        run_one(tiny_llm, prompt, params, stream and isinstance(prompt, str))
    llm_clean(tiny_llm)
    assert tiny_llm.generate(NORMAL_PROMPT, NORMAL)[0].token_ids == tiny_llm.normal
    llm_clean(tiny_llm)


@pytest.fixture(scope="module")
def default_llm():
    llm = LLM(device="cpu", dtype="float32")  # the embedded SmolLM2-135M-Instruct
    llm.normal = llm.generate(NORMAL_PROMPT, NORMAL)[0].token_ids
    yield llm
    llm.shutdown()


@settings(FUZZ, max_examples=40)
@given(kwargs=SAMPLING, prompt=PROMPTS)
def test_the_default_model_survives_the_same_inputs(default_llm, kwargs, prompt):
    params = sampling_params(kwargs)
    if params is not None:
        run_one(default_llm, prompt, params, stream=False)
    llm_clean(default_llm)
    assert default_llm.generate(NORMAL_PROMPT, NORMAL)[0].token_ids == default_llm.normal
    llm_clean(default_llm)


# settings a CPU engine reads, with values around their bounds (tp_size only where it fails before any
# process starts: the tiny model has 4 heads)
SETTINGS = one_field_corrupted(
    {
        "page_size": st.sampled_from([1, 2, 4, 16, 256, 257, 0]),
        "max_running_req": st.sampled_from([1, 2, 8, 16384, 16385, 0]),
        "num_page_override": st.sampled_from([None, 1, 3, 64, 10**9, 10**13, 0]),
        "max_seq_len_override": st.sampled_from([None, 1, 8, 600, 2**20, 2**20 + 1, 0]),
        "max_prefill_tokens": st.sampled_from([None, 1, 3, 64, 0]),
        "overlap_scheduling": st.booleans(),
        "cpu_kv_budget_gib": st.sampled_from([None, 1e-9, 0.01, 0.05, 1e6, 0.0, math.inf]),
        "memory_ratio": st.sampled_from([0.5, 1.0, 0.0, 1.5]),
        "dtype": st.sampled_from(["auto", "float32", "bfloat16", "int8"]),
        "attention_backend": st.sampled_from(["auto", "torch", "torch,torch", "bogus"]),
        "cuda_graph_max_bs": st.sampled_from([None, 0, 4, -1]),
        "tp_size": st.sampled_from([1, 0, 3]),
        "device": st.sampled_from(["cpu", "auto", "tpu", "cpu:x"]),
    }
)


@pytest.fixture(scope="module")
def tiny_folder(tiny_model):
    return tiny_model("llama", tokenizer=True)


@settings(FUZZ, max_examples=60)
@given(kwargs=SETTINGS)
def test_any_settings_either_raise_clearly_or_serve(tiny_folder, kwargs):
    kwargs = {"cpu_kv_budget_gib": 0.05, **kwargs}  # a small KV pool unless the example says otherwise
    if kwargs.get("device") == "auto":
        kwargs["device"] = "cpu"  # not a GPU, where there is one
    try:
        llm = LLM(str(tiny_folder), **kwargs)
    except (SettingsError, ValueError, TypeError, MemoryError) as e:
        named = [*kwargs, "max_seq_len", "num_attention_heads", "tensor-parallel"]
        assert any(name in str(e) for name in named), e
        event(f"settings refused: {type(e).__name__}")
        return
    event("settings served")
    try:
        [out] = llm.generate(NORMAL_PROMPT, NORMAL)
        assert out.finish_reason == "length" and len(out.token_ids) == NORMAL.max_tokens
    except ValueError as e:  # a max_seq_len too short for the prompt
        assert "max_seq_len" in str(e), e
    finally:
        llm_clean(llm)
        llm.shutdown()


# ------------------------------------------------------------------------------- structured output

SCHEMA_KEYS = ["type", "properties", "items", "enum", "required", "minItems", "maxItems", "maxLength"]
SCHEMA_KEYS += ["pattern", "const", "anyOf", "minimum", "maximum", "additionalProperties", "$ref", "format"]
JSON_ANY = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
    | st.sampled_from(["object", "array", "string", "integer", "number", "boolean", "null"]),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.sampled_from(SCHEMA_KEYS) | st.text(max_size=4), inner, max_size=4)
    ),
    max_leaves=10,
)
SCHEMAS = st.one_of(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["object", "array", "string", "integer", "boolean"])},
        optional={
            "properties": st.dictionaries(st.text(max_size=3), JSON_ANY, max_size=2),
            "items": JSON_ANY,
            "maxLength": st.integers(0, 5),
            "maxItems": st.integers(0, 3),
            "enum": st.lists(JSON_ANY, max_size=3),
            "pattern": st.text(alphabet="ab.*+?()[]|^$\\{}0-9", max_size=8),
        },
    ),
    st.dictionaries(st.sampled_from(SCHEMA_KEYS) | st.text(max_size=3), JSON_ANY, max_size=3),
)
REGEXES = st.one_of(st.text(alphabet="ab.*+?()[]|^$\\{},-09dsw", max_size=10), st.text(max_size=6))
EBNFS = st.one_of(
    st.text(alphabet='ab "|()*+?[]-', max_size=12).map(lambda body: f"root ::= {body}"),
    st.sampled_from(['root ::= "a" root | "b"', 'root ::= x\nx ::= [a-c]+ ("," x)?', "root ::= "]),
    st.text(max_size=10),
)
GRAMMAR_VALUES = {
    "json_schema": st.one_of(SCHEMAS, SCHEMAS.map(json.dumps)),
    "json_object": st.booleans(),
    "regex": REGEXES,
    "ebnf": EBNFS,
}


@st.composite
def grammar_kwargs(draw: st.DrawFn) -> dict:
    """One structured-output field (now and then two, or a value of the wrong kind), a few tokens, maybe
    min_tokens, a temperature and (now and then) ignore_eos."""
    kwargs: dict = {"max_tokens": draw(st.integers(3, 6))}
    names = draw(st.lists(st.sampled_from(sorted(GRAMMAR_VALUES)), min_size=2, max_size=2, unique=True))
    for name in names[: 1 + (draw(st.integers(0, 5)) == 0)]:
        wrong_kind = draw(st.integers(0, 4)) == 0
        kwargs[name] = draw(ANYTHING if wrong_kind else GRAMMAR_VALUES[name])
    if draw(st.booleans()):
        kwargs["min_tokens"] = draw(st.integers(0, 3))
    if draw(st.booleans()):
        kwargs["temperature"] = 1.0
    if draw(st.integers(0, 5)) == 0:
        kwargs["ignore_eos"] = draw(st.booleans())
    return kwargs


def generate_one(llm: LLM, params: SamplingParams, stream: bool) -> tuple[str, str, str | None]:
    """(text, finish reason, error) of one request, streamed or not."""
    if not stream:
        [out] = llm.generate("Hi", params)
        return out.text, out.finish_reason, out.error
    deltas = llm.stream("Hi", params)
    text = ""
    try:
        for delta in deltas:
            text += delta
    except RequestError:
        pass
    return text, deltas.finish_reason, deltas.state.error


@FUZZ
@given(kwargs=grammar_kwargs(), stream=st.booleans())
def test_any_structured_output_either_raises_clearly_or_generates(tiny_llm, kwargs, stream):
    """A grammar either raises up front, naming the field at fault, or generates: "stop" (then a JSON
    grammar's text is JSON) or "length", or "error" only where the grammar allows no token."""
    params = sampling_params(kwargs)
    if params is not None:
        try:
            text, reason, error = generate_one(tiny_llm, params, stream)
        except (TypeError, ValueError) as e:
            assert any(name in str(e) for name in kwargs), e
            llm_clean(tiny_llm)  # refused: nothing was queued
            event(f"structured output refused: {type(e).__name__}")
        else:
            event(f"structured output: {reason}")
            assert reason in ("stop", "length") or "allows no token" in (error or ""), (reason, error)
            if reason == "stop" and params.grammar[0] in ("json_schema", "json_object"):
                json.loads(text)
    llm_clean(tiny_llm)
    assert tiny_llm.generate(NORMAL_PROMPT, NORMAL)[0].token_ids == tiny_llm.normal
    llm_clean(tiny_llm)


def _serve_tiny(folder, *options: str):
    """A server of the tiny model (`options`: more of its settings), with its model's name and the
    normal request's text; it must stop cleanly, without a traceback in its log."""
    from test_server import Server

    srv = Server(
        "--model", str(folder), "--device", "cpu", "--dtype", "float32", "--max-running-req", "8", *options
    )
    srv.model = httpx.get(srv.url + "/models", timeout=10).json()["data"][0]["id"]
    srv.normal = _http_normal(srv)
    yield srv
    log = srv.output()
    assert srv.stop() == 0, log
    assert "Traceback" not in log, log


@pytest.fixture(scope="module")
def tiny_server(tiny_folder):
    """The tiny model's one server, with the tool template and parser the tool fields' test needs
    (TEMPLATE, below): a request without tools reads neither but the template, so the structured-output
    fields' test shares it (a server start and stop is most of a minute on a loaded 2-core machine)."""
    yield from _serve_tiny(tiny_folder, "--chat-template", str(TEMPLATE), "--tool-call-parser", "hermes")


def _http_normal(srv) -> str:
    body = {
        "model": srv.model,
        "prompt": NORMAL_PROMPT,
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
    }
    r = httpx.post(srv.url + "/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


JSON_VALUE = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
SCHEMA_FORMATS = st.fixed_dictionaries(
    {"type": st.just("json_schema"), "json_schema": st.fixed_dictionaries({"name": st.text(max_size=8)})},
).flatmap(
    lambda base: SCHEMAS.map(
        lambda schema: {**base, "json_schema": {**base["json_schema"], "schema": schema}}
    )
)
RESPONSE_FORMATS = st.one_of(
    SCHEMA_FORMATS,
    st.sampled_from([{"type": "json_object"}, {"type": "text"}, {"type": "json_schema"}]),
    st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema"]) | JSON_VALUE},
        optional={"json_schema": JSON_VALUE},
    ),
)
DEAD_END = "allows no token after"
STRUCTURED_VALUES = {"response_format": RESPONSE_FORMATS, "regex": REGEXES, "ebnf": EBNFS}


@st.composite
def structured_fields(draw: st.DrawFn) -> dict:
    """response_format, regex or ebnf (now and then two of them, or a JSON value of any kind)."""
    names = draw(st.lists(st.sampled_from(sorted(STRUCTURED_VALUES)), min_size=2, max_size=2, unique=True))
    fields = {}
    for name in names[: 1 + (draw(st.integers(0, 5)) == 0)]:
        wrong_kind = draw(st.integers(0, 4)) == 0
        fields[name] = draw(JSON_VALUE if wrong_kind else STRUCTURED_VALUES[name])
    return fields


@settings(FUZZ, max_examples=100)
@given(fields=structured_fields(), chat=st.booleans(), stream=st.booleans())
def test_any_structured_output_fields_over_http_get_200_or_a_clear_400(tiny_server, fields, chat, stream):
    """response_format, regex and ebnf of any value and type: a 200 whose choice ends normally, or a 400
    with OpenAI's error body; a 200 stream carries no error event; the server stays usable. The one
    error after generation starts: a random regex can lead where no token of the vocabulary continues
    its text and the end is not allowed either (a 400, or an error event in the stream, naming it;
    logged without a traceback, which the fixture checks)."""
    route, prompt = (
        ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})
        if chat
        else ("completions", {"prompt": "Hi"})
    )
    body = {"model": tiny_server.model, "max_tokens": 4, "stream": stream, **prompt, **fields}
    r = httpx.post(f"{tiny_server.url}/{route}", json=body, timeout=60)
    if r.status_code == 400:
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], error
        dead_end = error["code"] == "grammar_dead_end" and DEAD_END in error["message"]
        event("400: the grammar's dead end" if dead_end else f"400 on {error['param']}")
    elif stream:
        assert r.status_code == 200, (r.status_code, r.text[:300], fields)
        assert r.text.endswith("data: [DONE]\n\n"), r.text[-300:]
        errors = [line for line in r.text.splitlines() if '"error"' in line]
        assert all(DEAD_END in line for line in errors), errors
        event("200 streamed" + (" ending with the grammar's dead end" if errors else ""))
    else:
        assert r.status_code == 200, (r.status_code, r.text[:300], fields)
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length"), r.text[:300]
        event("200")
    assert _http_normal(tiny_server) == tiny_server.normal


# ------------------------------------------------------------------------------------------- tool calls

TEMPLATE = Path(__file__).resolve().parents[1] / "configs" / "templates" / "hermes-tools.jinja"
NAMES = st.sampled_from(["get_weather", "f", "search"]) | st.text(max_size=5)
TOOL = st.fixed_dictionaries(
    {
        "type": st.just("function"),
        "function": st.fixed_dictionaries({"name": NAMES}, optional={"parameters": SCHEMAS}),
    }
)
TOOL_CHOICES = st.one_of(
    st.sampled_from(["none", "auto", "required"]),
    NAMES.map(lambda name: {"type": "function", "function": {"name": name}}),
)
HISTORY_CALL = st.fixed_dictionaries(
    {
        "id": st.text(max_size=4),
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {"name": NAMES, "arguments": JSON_ANY.map(json.dumps) | st.text(max_size=4)}
        ),
    }
)
HISTORY = st.lists(
    st.one_of(
        st.fixed_dictionaries(
            {
                "role": st.just("assistant"),
                "content": st.none() | st.text(max_size=4),
                "tool_calls": st.lists(HISTORY_CALL, max_size=2),
            }
        ),
        st.fixed_dictionaries(
            {"role": st.just("tool"), "content": st.text(max_size=6)},
            optional={"tool_call_id": st.text(max_size=4)},
        ),
    ),
    max_size=3,
)
TOOL_VALUES = {
    "tools": st.lists(TOOL, max_size=3),
    "tool_choice": TOOL_CHOICES,
    "parallel_tool_calls": st.booleans(),
}


@st.composite
def tool_fields(draw: st.DrawFn) -> dict:
    """tools, tool_choice and parallel_tool_calls, each given or not (now and then a value of any
    kind), and now and then tool calls and results in the conversation."""
    fields = {}
    for name, values in TOOL_VALUES.items():
        if draw(st.integers(0, 3)):
            fields[name] = draw(JSON_VALUE if draw(st.integers(0, 5)) == 0 else values)
    history = draw(HISTORY) if draw(st.integers(0, 2)) == 0 else []
    fields["messages"] = [{"role": "user", "content": "Hi"}, *history]
    return fields


@pytest.fixture(scope="module")
def tools_server(tiny_server):
    return tiny_server


@settings(FUZZ, max_examples=80)
@given(fields=tool_fields(), stream=st.booleans())
def test_any_tool_fields_over_http_get_200_or_a_clear_400(tools_server, fields, stream):
    """tools, tool_choice, parallel_tool_calls and tool calls and results in the conversation, of any
    value and type: a 400 with OpenAI's error body naming a field, or a 200 whose choice ends normally
    with calls that name a given tool and whose arguments are JSON objects; the server stays usable."""
    body = {"model": tools_server.model, "max_tokens": 6, "stream": stream, **fields}
    r = httpx.post(f"{tools_server.url}/chat/completions", json=body, timeout=60)
    if r.status_code == 400:
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"] and error["param"], (
            error
        )
        event(f"400 on {error['param'].split('[')[0].split('.')[0]}")
    elif stream:
        assert r.status_code == 200, (r.status_code, r.text[:300], fields)
        assert r.text.endswith("data: [DONE]\n\n"), r.text[-300:]
        errors = [line for line in r.text.splitlines() if '"error"' in line]
        assert all(DEAD_END in line for line in errors), errors
        event("200 streamed")
    else:
        assert r.status_code == 200, (r.status_code, r.text[:300], fields)
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] in ("stop", "length", "tool_calls"), r.text[:300]
        names = {t["function"]["name"] for t in fields.get("tools") or []}
        for call in choice["message"].get("tool_calls") or []:
            assert call["function"]["name"] in names and isinstance(
                json.loads(call["function"]["arguments"]), dict
            )
        event(f"200 {choice['finish_reason']}")
    assert _http_normal(tools_server) == tools_server.normal
