"""What a minisgl worker takes from SGLang's router and SGLang's clients, without a server or an engine:
the fields sglang-router 0.3.2 adds to OpenAI bodies (`protocol`), SGLang's native `/generate`
(`minisgl.server.native`), the replicas' merged metrics and their settings, and the replicas' routing,
failure and restart logic (`minisgl.server.replicas`) over stand-in scheduler clients."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
from click.testing import CliRunner
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from minisgl.core import SamplingParams
from minisgl.server import native, replicas
from minisgl.server.errors import APIError
from minisgl.server.protocol import parse_chat_request, parse_completion_request
from minisgl.server.sampling import sampling_params
from minisgl.settings import EngineSettings

MODEL = "tiny-model"
CONTEXT = 64

# the bodies sglang-router 0.3.2 forwarded to a stub worker for a plain openai request (captured)
ROUTER_COMPLETION = {
    "model": MODEL,
    "prompt": "hi",
    "max_tokens": 3,
    "stream": False,
    "echo": False,
    "logit_bias": {"5": 1.0},
    "no_stop_trim": False,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "return_hidden_states": False,
}
ROUTER_CHAT = {
    "messages": [{"role": "user", "content": "hi"}],
    "model": MODEL,
    "logit_bias": {"5": 1.0},
    "logprobs": False,
    "max_completion_tokens": 3,
    "stream": True,
    "top_k": 3,
    "no_stop_trim": False,
    "ignore_eos": False,
    "continue_final_message": False,
    "skip_special_tokens": True,
    "separate_reasoning": True,
    "stream_reasoning": True,
    "return_hidden_states": False,
}
ROUTER_GENERATE = {
    "model": None,
    "input_ids": [1, 2, 3],
    "sampling_params": {"max_new_tokens": 3},
    "return_text_in_logprobs": False,
    "stream": False,
    "log_metrics": True,
    "return_hidden_states": False,
    "background": False,
    "no_logs": False,
    "return_bytes": False,
    "return_entropy": False,
}


# ------------------------------------------------------------------------ the router's OpenAI bodies


def test_the_routers_completion_and_chat_bodies_are_accepted():
    completion = parse_completion_request(ROUTER_COMPLETION, MODEL)
    [params] = sampling_params(completion, 4, CONTEXT)
    assert params.max_tokens == 3 and params.logit_bias == ((5, 1.0),) and not params.ignore_eos
    chat = parse_chat_request(ROUTER_CHAT, MODEL)
    [params] = sampling_params(chat, 4, CONTEXT)
    assert (params.max_tokens, params.top_k, params.logit_bias) == (3, 3, ((5, 1.0),))  # the renamed max
    assert chat.separate_reasoning is True and chat.stream


@pytest.mark.parametrize(
    ("body", "name", "value"),
    [
        (ROUTER_COMPLETION, "no_stop_trim", True),
        (ROUTER_COMPLETION, "skip_special_tokens", False),
        (ROUTER_COMPLETION, "return_hidden_states", True),
        (ROUTER_CHAT, "continue_final_message", True),
        (ROUTER_CHAT, "stream_reasoning", False),
        (ROUTER_CHAT, "no_stop_trim", True),
    ],
)
def test_the_routers_fields_at_other_values_are_refused_by_name(body, name, value):
    parse = parse_chat_request if "messages" in body else parse_completion_request
    with pytest.raises(APIError) as info:
        parse({**body, name: value}, MODEL)
    error = info.value
    assert (error.status, error.param, error.code) == (400, name, "unsupported_parameter")
    assert f"'{name}'" in error.message


# ------------------------------------------------------------------------------------------ /generate


def generate_params(body: dict[str, Any], prompt_len: int = 4, max_context: int = CONTEXT) -> SamplingParams:
    request = native.parse_generate(body, MODEL)
    [params] = request.sampling_params(prompt_len, max_context)
    return params


def generate_refused(body: Any, prompt_len: int = 4, max_context: int = CONTEXT) -> APIError:
    with pytest.raises(APIError) as info:
        generate_params(body, prompt_len, max_context)
    return info.value


def test_the_routers_generate_body_is_accepted():
    request = native.parse_generate(ROUTER_GENERATE, MODEL)
    assert request.request.prompt == [1, 2, 3] and request.prompt_field == "input_ids" and not request.stream
    assert request.sampling_params(3, CONTEXT)[0].max_tokens == 3
    assert len(request.rid) == 32  # a fresh id when the body gives none
    assert native.parse_generate({**ROUTER_GENERATE, "rid": "r1"}, MODEL).rid == "r1"


def test_generate_sampling_params_map_onto_the_engines():
    params = generate_params(
        {
            "text": "Hello",
            "sampling_params": {
                "max_new_tokens": 9,
                "min_new_tokens": 2,
                "temperature": 0.5,
                "top_p": 0.9,
                "top_k": 7,
                "min_p": 0.1,
                "stop": ["\n"],
                "stop_token_ids": [11],
                "ignore_eos": True,
                "sampling_seed": 42,
                "logit_bias": {"3": -2.5},
                "frequency_penalty": 0.5,
                "presence_penalty": -0.5,
                "repetition_penalty": 1.2,
                "skip_special_tokens": True,
                "spaces_between_special_tokens": True,
                "no_stop_trim": False,
                "n": 1,
                "json_schema": None,
            },
        }
    )
    want = {
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 7,
        "min_p": 0.1,
        "max_tokens": 9,
        "min_tokens": 2,
        "stop": ("\n",),
        "stop_token_ids": (11,),
        "ignore_eos": True,
        "seed": 42,
        "logit_bias": {3: -2.5},
        "frequency_penalty": 0.5,
        "presence_penalty": -0.5,
        "repetition_penalty": 1.2,
    }
    assert params == SamplingParams(**want)


def test_generate_structured_output_fields_are_sglangs():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    given = {"text": "a", "sampling_params": {"json_schema": json.dumps(schema)}}
    assert json.loads(generate_params(given).json_schema) == schema
    assert generate_params({"text": "a", "sampling_params": {"regex": "[ab]+"}}).regex == "[ab]+"
    assert generate_params({"text": "a", "sampling_params": {"ebnf": 'root ::= "x"'}}).ebnf == 'root ::= "x"'


def test_generate_defaults_are_sglangs():
    params = generate_params({"text": "Hello"}, max_context=1000)
    assert (params.max_tokens, params.temperature) == (native.DEFAULT_MAX_NEW_TOKENS, 1.0)
    assert generate_params({"text": "Hello"}, prompt_len=60).max_tokens == CONTEXT - 60  # what is left
    assert native.parse_generate({"text": "Hi", "stream": True}, MODEL).stream


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"text": "a", "return_logprob": True}, "return_logprob", "unsupported_parameter"),
        ({"text": "a", "data_parallel_rank": 1}, "data_parallel_rank", "unsupported_parameter"),
        ({"text": "a", "sampling_params": {"n": 2}}, "sampling_params.n", "unsupported_parameter"),
        ({"text": "a", "sampling_params": {"no_stop_trim": True}}, "sampling_params.no_stop_trim", None),
        ({"text": "a", "sampling_params": {"structural_tag": "x"}}, "sampling_params.structural_tag", None),
        ({"text": "a", "lora": 1}, "lora", "unknown_parameter"),
        (
            {"text": "a", "sampling_params": {"max_tokens": 3}},
            "sampling_params.max_tokens",
            "unknown_parameter",
        ),
    ],
)
def test_generate_fields_it_does_not_implement_are_refused_by_name(body, param, code):
    error = generate_refused(body)
    assert (error.status, error.param) == (400, param)
    assert code is None or error.code == code
    assert param in error.message


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"text": "a", "sampling_params": {"temperature": "hot"}}, "sampling_params.temperature", "hot"),
        (
            {"text": "a", "sampling_params": {"max_new_tokens": 100}},
            "sampling_params.max_new_tokens",
            "max_new_tokens=100",
        ),
        (
            {"text": "a", "sampling_params": {"max_new_tokens": 0}},
            "sampling_params.max_new_tokens",
            "at least 1",
        ),
        ({"text": "a", "sampling_params": {"top_p": 2.0}}, "sampling_params.top_p", "top_p"),
        (
            {"text": "a", "sampling_params": {"sampling_seed": "x"}},
            "sampling_params.sampling_seed",
            "sampling_seed",
        ),
        ({"text": ["a", "b"]}, "text", "one request per prompt"),
        ({"input_ids": [1, -2]}, "input_ids", "token ids"),
        ({"text": "a", "input_ids": [1]}, "text", "exactly one"),
        ({"sampling_params": {}}, "text", "exactly one"),
        ({"text": "a", "sampling_params": [1]}, "sampling_params", "object"),
        ({"text": "a", "rid": 5}, "rid", "string"),
        (
            {"text": "a", "sampling_params": {"json_schema": "{"}},
            "sampling_params.json_schema",
            "not valid JSON",
        ),
        (
            {"text": "a", "sampling_params": {"json_schema": {"type": "object"}}},
            "sampling_params.json_schema",
            "string",
        ),
        ({"text": "a", "sampling_params": {"regex": 5}}, "sampling_params.regex", "regex"),
    ],
)
def test_generate_errors_name_sglangs_fields(body, param, words):
    error = generate_refused(body)
    assert (error.status, error.param) == (400, param), error.message
    assert words in error.message
    if param.startswith("sampling_params.max_new"):
        assert "max_tokens" not in error.message


def test_generate_model_must_be_the_served_one_when_given():
    assert generate_params({"text": "a", "model": MODEL}).max_tokens == CONTEXT - 4
    error = generate_refused({"text": "a", "model": "gpt-4"})
    assert (error.status, error.code) == (404, "model_not_found")


@dataclass
class FakeDetokenizer:
    text: str


@dataclass
class FakeChoice:
    """The fields of the server's Choice that the answers read."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    params: SamplingParams = field(default_factory=SamplingParams)
    error: str | None = None
    hidden_last: bool = False
    detokenizer: Any = None


def test_generate_answers_have_sglangs_shape():
    request = native.parse_generate({"text": "Hi", "rid": "abc"}, MODEL)
    length = native.generate_response(request, FakeChoice("x y", [5, 6], "length"), "x y", [5, 6], 3, 0.5)
    assert length == {
        "text": "x y",
        "output_ids": [5, 6],
        "meta_info": {
            "id": "abc",
            "finish_reason": {"type": "length", "length": 2},
            "prompt_tokens": 3,
            "completion_tokens": 2,
            "e2e_latency": 0.5,
        },
    }
    eos = FakeChoice("x", [5, 2], "stop", hidden_last=True)
    assert native.finish_reason(eos) == {"type": "stop", "matched": 2}
    stopped = FakeChoice(
        "x", [5, 9], "stop", SamplingParams(stop=("!", " y")), detokenizer=FakeDetokenizer("x y z")
    )
    assert native.finish_reason(stopped) == {"type": "stop", "matched": " y"}
    assert native.finish_reason(FakeChoice("x", [5], None)) is None  # running
    with pytest.raises(APIError) as info:
        native.finish_reason(FakeChoice("", [], "error", error="boom"))
    assert info.value.status == 500 and "boom" in info.value.message


def test_model_info_reads_the_models_config(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    )
    info = native.model_info(str(tmp_path), has_tokenizer=False)
    assert info["model_type"] == "llama" and info["architectures"] == ["LlamaForCausalLM"]
    assert info["tokenizer_path"] is None and info["model_path"] == str(tmp_path)


# ---------------------------------------------------------------------------------- replicas' metrics


def replica_text(tokens: float, running: float, waits: list[float]) -> str:
    registry = CollectorRegistry()
    counter = Counter("minisgl_tokens", "Tokens.", ["model_name"], registry=registry)
    counter.labels("m").inc(tokens)
    Gauge("minisgl_running", "Running.", registry=registry).set(running)
    histogram = Histogram("minisgl_wait_seconds", "Waits.", buckets=(0.1, 1.0), registry=registry)
    for wait in waits:
        histogram.observe(wait)
    return generate_latest(registry).decode()


def test_merged_metrics_label_every_sample_with_its_dp_rank():
    texts = [(0, replica_text(5, 1, [0.05])), (1, replica_text(7, 0, [0.5, 2.0]))]
    merged = replicas.merge_metrics(texts)
    assert (
        merged.count("# TYPE minisgl_tokens_total counter") == 1
        and merged.count("# HELP minisgl_running") == 1
    )
    samples = {}
    for family in text_string_to_metric_families(merged):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    assert samples[("minisgl_tokens_total", (("dp_rank", "0"), ("model_name", "m")))] == 5
    assert samples[("minisgl_tokens_total", (("dp_rank", "1"), ("model_name", "m")))] == 7
    assert samples[("minisgl_running", (("dp_rank", "0"),))] == 1
    assert samples[("minisgl_wait_seconds_count", (("dp_rank", "1"),))] == 2
    assert samples[("minisgl_wait_seconds_bucket", (("dp_rank", "1"), ("le", "1.0")))] == 1
    assert all(dict(labels).get("dp_rank") in ("0", "1") for _, labels in samples)
    # each replica's own samples and nothing else: a sample per replica for each of the one's
    single = [s for f in text_string_to_metric_families(texts[0][1]) for s in f.samples]
    assert len(samples) == 2 * len(single)


# --------------------------------------------------------------------------------- replicas' settings


def test_replica_settings_on_cpu_split_the_cores_and_run_one_replica_each(monkeypatch):
    monkeypatch.setattr(replicas.os, "sched_getaffinity", lambda pid: set(range(8)))
    settings = EngineSettings.load(None, device="cpu", dp_size=2)
    specs = replicas.replica_settings(settings, {"device": "cpu", "dp_size": 2})
    assert specs == [({"device": "cpu", "dp_size": 1, "host_threads": 4}, None)] * 2
    given = EngineSettings.load(None, device="cpu", dp_size=2, host_threads=3)
    assert replicas.replica_settings(given, {"host_threads": 3})[1] == (
        {"host_threads": 3, "dp_size": 1},
        None,
    )
    assert replicas.replica_settings(EngineSettings.load(None), {"port": 1}) == [({"port": 1}, None)]


@pytest.mark.parametrize(
    ("values", "words"),
    [
        (dict(device="cuda:1", dp_size=2), "device='cuda:1'"),
        (
            dict(device="cpu", dp_size=2, tp_size=2, distributed_addr="tcp://127.0.0.1:29500"),
            "distributed_addr=",
        ),
    ],
)
def test_replica_settings_that_cannot_work_are_refused_by_name(values, words):
    with pytest.raises(ValueError, match="dp_size=2") as info:
        replicas.replica_settings(EngineSettings.load(None, **values), values)
    assert words in str(info.value)


def test_dp_is_the_servers_alone():
    from minisgl.cli import main
    from minisgl.llm import LLM

    with pytest.raises(ValueError, match=r"dp_size=2 \(from explicit\).*minisgl-run serve --dp N"):
        LLM(dp_size=2)
    result = CliRunner().invoke(main, ["serve", "--dp", "2", "--device", "cuda:1", "--port", "1"])
    assert result.exit_code == 1 and "device='cuda:1' names one GPU" in result.output


# ------------------------------------------------------------------------ replicas over stand-in clients


class StandIn:
    """A scheduler client without a process: ready when told, fails when told."""

    pids = iter(range(1000, 2000))

    def __init__(self, settings: dict[str, Any], config: Any, devices: Any, name: str) -> None:
        self.settings, self.devices, self.name = settings, devices, name
        self.proc = SimpleNamespace(pid=next(self.pids))
        self.ready, self.failed, self.on_failure = asyncio.Event(), None, None
        self.info = {"max_running_req": 8, "max_context": 64, "model_path": "m"}
        self.load_tokens, self.submitted, self.closed = 0, [], False

    def up(self) -> None:
        self.ready.set()

    def die(self, error: str) -> None:
        self.failed = error
        self.on_failure()

    def submit(self, choices: list[Any], prompt: bytes, prompt_len: int) -> None:
        for choice in choices:
            choice.cost = prompt_len + choice.params.max_tokens
            self.load_tokens += choice.cost
        self.submitted += choices

    def release(self, choice: Any, abort: bool) -> None:
        self.load_tokens -= choice.cost

    async def close(self) -> None:
        self.closed = True


def choice(max_tokens: int) -> Any:
    job = SimpleNamespace(wake=asyncio.Event())
    return SimpleNamespace(
        rid=id(job), params=SamplingParams(max_tokens=max_tokens), cost=0, job=job, ended=None
    )


def test_replicas_route_by_outstanding_tokens_and_restart_a_dead_one(monkeypatch):
    monkeypatch.setattr(replicas, "BACKOFF_FIRST_S", 0.05)
    made: list[StandIn] = []

    def make(*args: Any) -> StandIn:
        made.append(StandIn(*args))
        return made[-1]

    async def main() -> None:
        group = replicas.Replicas([({"dp_size": 1}, "0"), ({"dp_size": 1}, "1")], None, make)
        failures = []
        group.on_failure = lambda: failures.append(1)
        assert [c.devices for c in made] == ["0", "1"] and made[1].name.endswith("dp1")
        made[0].up()
        await asyncio.sleep(0.01)
        assert not group.ready.is_set() and group.info is None  # ready once every replica is
        made[1].up()
        await asyncio.wait_for(group.ready.wait(), 5)
        assert group.info["max_running_req"] == 16 and group.failed is None
        # the fewest outstanding tokens: a long request on one, then short ones on the other
        long, short1, short2 = choice(100), choice(10), choice(10)
        for c in (long, short1, short2):
            group.submit([c], b"", 5)
        assert made[0].submitted == [long] and made[1].submitted == [short1, short2]
        group.release(long, False)
        assert made[0].load_tokens == 0
        group.submit([c3 := choice(10)], b"", 5)
        assert made[0].submitted[-1] is c3
        # replica 1 dies: no more requests for it, health names it, it starts again after the back-off
        made[1].die("the scheduler process exited (exit code -9)")
        status = group.status()
        assert status["status"] == "degraded" and status["down"] == [1] and failures == []
        assert (
            status["replicas"][1]["state"] == "restarting"
            and "exit code -9" in status["replicas"][1]["error"]
        )
        group.submit([c4 := choice(1)], b"", 5)
        assert made[0].submitted[-1] is c4
        deadline = asyncio.get_running_loop().time() + 5
        while len(made) < 3 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        assert len(made) == 3 and made[1].closed and made[2].devices == "1"  # its GPUs again
        assert group.status()["replicas"][1]["restarts"] == 1
        made[2].up()
        await asyncio.sleep(0.01)
        assert "down" not in group.status() and group.status()["replicas"][1]["pid"] == made[2].proc.pid
        # every replica down: no request can be served, and the ones sent meanwhile end with the error
        made[0].die("boom 0")
        made[2].die("boom 1")
        assert "no replica is serving" in group.failed and "boom 1" in group.failed
        c5 = choice(1)
        c5.end = lambda reason, error: setattr(c5, "ended", (reason, error))
        group.submit([c5], b"", 5)
        assert c5.ended[0] == "engine_died" and c5.job.wake.is_set()  # a 503 engine_restarting
        await group.close()
        assert all(c.closed for c in made) and failures == []  # no restart after close

    asyncio.run(main())


def test_a_replica_that_never_served_fails_the_server():
    made: list[StandIn] = []

    def make(*args: Any) -> StandIn:
        made.append(StandIn(*args))
        return made[-1]

    async def main() -> None:
        group = replicas.Replicas([({}, None), ({}, None)], None, make)
        failures = []
        group.on_failure = lambda: failures.append(1)
        made[0].up()
        made[1].die("MemoryError: no room")
        assert failures == [1] and group.failed == "replica dp_rank=1: MemoryError: no room"
        await asyncio.sleep(0.05)
        assert len(made) == 2  # no restart
        await group.close()
        assert made[0].closed and made[1].closed

    asyncio.run(main())


def test_one_engine_restarts_until_a_crash_loop_and_without_restarts_fails_the_server(monkeypatch):
    """One replica (a plain server's engine): a death restarts it; `crash_limit` deaths within the
    window end the restarts (the supervisor says why, and stops saying it restarts); with
    `restart=False` the first death calls `on_failure` (the server exits)."""
    monkeypatch.setattr(replicas, "BACKOFF_FIRST_S", 0.01)
    made: list[StandIn] = []

    def make(*args: Any) -> StandIn:
        made.append(StandIn(*args))
        return made[-1]

    async def until(condition) -> None:
        deadline = asyncio.get_running_loop().time() + 5
        while not condition() and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)

    async def main() -> None:
        group = replicas.Replicas([({}, None)], None, make, crash_limit=2, crash_window_s=60)
        failures = []
        group.on_failure = lambda: failures.append(1)
        made[0].up()
        await asyncio.wait_for(group.ready.wait(), 5)
        made[0].die("the scheduler process exited (exit code -9)")
        assert group.restarting and group.failed.startswith("the scheduler process exited")
        await until(lambda: len(made) == 2)
        made[1].up()
        await until(lambda: group.failed is None)
        assert group.failed is None and not group.restarting
        made[1].die("CUDA error: an illegal memory access")  # the second death within the window
        await asyncio.sleep(0.05)
        assert len(made) == 2 and not group.restarting and failures == []
        assert "illegal memory access" in group.failed and "not started again" in group.failed
        assert group.status()["replicas"][0]["state"] == "failed"
        await group.close()

        made.clear()
        once = replicas.Replicas([({}, None)], None, make, restart=False)
        once.on_failure = lambda: failures.append(1)
        made[0].up()
        await asyncio.wait_for(once.ready.wait(), 5)
        made[0].die("killed")
        await asyncio.sleep(0.05)
        assert failures == [1] and once.failed == "killed" and len(made) == 1
        await once.close()

    asyncio.run(main())
