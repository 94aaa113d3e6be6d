"""Where a served request's time goes: the request trace (`request_trace`), the scheduler's stage
histograms and the front end's delivery histogram over HTTP, and a front end that stalls while the
scheduler keeps stepping. Servers are real subprocesses on loopback ports; every loop is bounded."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from pathlib import Path

import httpx2 as httpx
import openai
import pytest
import transformers
from test_server import Server, _wait_for

from minisgl.core import SamplingParams
from minisgl.server.jobs import TRACE_STAGES, Choice, Job, trace_record
from minisgl.server.worker import Outbox, ids_frame, unpack

STAGES = [stage for _, stage in TRACE_STAGES]
# how long a stopped front end waits for the scheduler to go idle; the CPU time "idle" allows a second
STALL_LIMIT_S = 120.0
IDLE_CPU_S = 0.05


def test_trace_record_stages_add_up_to_the_request_time() -> None:
    job = Job(received=100.0)
    job.tokenized, job.sent = 100.002, 100.003
    for i, times in enumerate([[100.004, 100.010, 100.050, 100.400], [100.005, 100.011, 100.060, 100.500]]):
        choice = Choice(i, i, SamplingParams(max_tokens=4), None, job, token_ids=[1, 2, 3, 4], times=times)
        choice.finish_reason = "length"
        job.choices.append(choice)
    job.news(100.050, 100.0505, 100.051)
    assert job.written(100.0512) == pytest.approx(0.0012)
    job.news(100.500, 100.5002, 100.5005)
    job.written(100.5009)
    job.done = 100.501
    record = trace_record(job, "cmpl-x", 7, clock_offset=1000.0)
    stages = record["stages_s"]
    assert list(stages) == STAGES
    # the scheduler's stamps: first arrival and admission, first token, last finish over the choices
    assert stages["to_scheduler"] == pytest.approx(0.002)
    assert stages["queue"] == pytest.approx(0.006)
    assert stages["prefill"] == pytest.approx(0.040)
    assert stages["decode"] == pytest.approx(0.450)
    assert stages["to_client"] == pytest.approx(0.001)
    assert sum(stages.values()) == pytest.approx(record["e2e_s"], abs=1e-9) == pytest.approx(0.501)
    assert record["stamps"]["received"] == pytest.approx(1100.0)
    delivery = record["delivery"]
    assert (delivery["writes"], delivery["mean_s"], delivery["max_s"]) == (
        2,
        pytest.approx(0.00105),
        pytest.approx(0.0012),
    )
    # split into the scheduler's part, the ZeroMQ hop and the front end's: (0.5+0.2, 0.5+0.3, 0.2+0.4) ms / 2
    assert delivery["split_mean_s"] == pytest.approx([0.00035, 0.0004, 0.0003])
    assert (record["completion_tokens"], record["n"], record["prompt_tokens"]) == (8, 2, 7)


def test_a_request_refused_before_the_scheduler_has_no_scheduler_stages() -> None:
    job = Job(received=5.0)
    job.done = 5.001
    record = trace_record(job, "cmpl-y", 0, clock_offset=0.0)
    assert record["stages_s"]["parse_tokenize"] is None and record["stages_s"]["decode"] is None
    assert record["e2e_s"] == pytest.approx(0.001)


# -- over HTTP ------------------------------------------------------------------------------------


def _trace(path: Path, count: int, timeout: float = 30.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = path.read_text().splitlines() if path.exists() else []
        if len(lines) >= count:
            return [json.loads(line) for line in lines]
        time.sleep(0.1)
    raise AssertionError(f"the trace has {len(lines)} lines, expected {count}")


def _cpu_s(pids: list[int]) -> float:
    """The CPU time (user and system, seconds) the live processes `pids` have used (from /proc)."""
    ticks = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def _idle(pids: list[int], window_s: float = 1.0, busy_s: float = IDLE_CPU_S):
    """A condition for `_wait_for`: true once `pids` together used under `busy_s` of CPU time in a
    `window_s` (an idle scheduler polls its inbox every 50 ms; a stepping one uses far more, even on a
    loaded machine's shared cores)."""
    since = [time.monotonic(), _cpu_s(pids)]

    def idle() -> bool:
        now = time.monotonic()
        if now - since[0] < window_s:
            return False
        used = _cpu_s(pids) - since[1]
        since[:] = now, since[1] + used
        return used < busy_s

    return idle


@pytest.fixture(scope="module")
def traced(tmp_path_factory) -> tuple[Server, Path]:
    trace = tmp_path_factory.mktemp("trace") / "requests.jsonl"
    # prompts tokenized by two processes
    srv = Server("--max-running-req", "8", "--request-trace", str(trace), "--tokenizer-workers", "2")
    try:
        yield srv, trace
    finally:
        assert srv.stop() == 0, srv.output()


@pytest.mark.slow
def test_traces_and_stage_histograms_count_every_request(traced, smollm2_path) -> None:
    server, trace = traced
    client = openai.OpenAI(base_url=server.url, api_key="unused", timeout=60, max_retries=0)
    before = server.metrics()
    model = client.models.list().data[0].id
    answers = []  # completion tokens
    stream = client.completions.create(
        model=model,
        prompt="Once upon a time",
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    answers.append([chunk.usage.completion_tokens for chunk in stream if chunk.usage][0])
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    answers.append(chat.usage.completion_tokens)
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_path)
    template = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat.usage.prompt_tokens == len(tokenizer(template, add_special_tokens=False)["input_ids"])
    both = client.completions.create(
        model=model, prompt=[1, 2, 3], max_tokens=4, n=2, seed=1, stream=True, extra_body={"ignore_eos": True}
    )
    answers.append(
        sum(
            len(c.model_extra["token_ids"])
            for chunk in both
            for c in chunk.choices
            if c.model_extra.get("token_ids")
        )
    )
    assert answers == [6, 5, 8]
    records = _trace(trace, 3)
    assert [r["completion_tokens"] for r in records] == answers
    assert [r["n"] for r in records] == [1, 1, 2]
    for r in records:
        stages = r["stages_s"]
        assert all(stages[s] is not None and stages[s] >= 0 for s in STAGES), stages
        assert abs(sum(stages.values()) - r["e2e_s"]) < 1e-3  # within a millisecond
        stamps = [r["stamps"][name] for name, _ in TRACE_STAGES] + [r["stamps"]["done"]]
        assert stamps == sorted(stamps)  # one clock across the two processes
    assert records[0]["delivery"]["writes"] >= 1 and records[1]["delivery"]["writes"] == 0
    after = server.metrics()
    grown = {k: after[k] - before.get(k, 0.0) for k in after if k.endswith("_count")}
    for stage in ("queue", "prefill", "decode", "inference"):
        assert grown[f"minisgl_request_{stage}_time_seconds_count"] == 4  # one per choice served
    writes = sum(r["delivery"]["writes"] for r in records)
    assert grown["minisgl_token_delivery_seconds_count"] == writes


@pytest.mark.slow
def test_a_stalled_front_end_does_not_stall_the_scheduler(traced) -> None:
    server, trace = traced
    already = len(trace.read_text().splitlines()) if trace.exists() else 0
    body = {
        "model": "smollm2-135m-instruct",
        "prompt": "The capital of France is",
        "max_tokens": 16,
        "temperature": 0,
        "ignore_eos": True,
    }
    reference = httpx.post(server.url + "/completions", json=body, timeout=STALL_LIMIT_S)
    reference = reference.json()["choices"][0]["text"]
    texts, stalled_until = [], None
    with httpx.stream(
        "POST", server.url + "/completions", json={**body, "stream": True}, timeout=2 * STALL_LIMIT_S
    ) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            texts.append(json.loads(line[6:])["choices"][0]["text"])
            if stalled_until is None:
                # first chunk: stop the front end's process (its event loop) until its children (the
                # scheduler) have gone idle, however long a loaded machine makes the remaining steps. A
                # scheduler that waited on the front end would go idle too, and finish only after.
                os.kill(server.proc.pid, signal.SIGSTOP)
                try:
                    _wait_for(_idle(server.children()), STALL_LIMIT_S, "the scheduler to go idle")
                finally:
                    stalled_until = time.time()
                    os.kill(server.proc.pid, signal.SIGCONT)
    # nothing lost: the same greedy text as without the stall
    assert "".join(texts) == reference
    streamed = _trace(trace, already + 2)[-1]
    assert streamed["completion_tokens"] == 16
    # the scheduler went on while the front end was stopped: its last token was on the host before the
    # front end could run again, which reads it only afterwards
    assert streamed["stamps"]["finished"] < stalled_until <= streamed["stamps"]["last_received"]


def test_the_outbox_never_blocks_and_delivers_everything_in_order(tmp_path) -> None:
    # the scheduler's side of its connection to the front end: a reader that stalls makes a backlog,
    # never a blocked send, and every message arrives whole and in order once it reads again
    path = str(tmp_path / "tokens")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    outbox = Outbox(path)
    reader, _ = listener.accept()
    sent = [({"op": "step", "i": i}, ids_frame(list(range(i, i + 512)))) for i in range(2000)]  # ~8 MB
    for header, frame in sent:
        outbox.send(header, frame)  # the socket is non-blocking: this returns whatever the reader does
    assert outbox.backlog  # more than the kernel's buffer: the rest waits here
    received, buffer = [], bytearray()
    reader.settimeout(10)
    deadline = time.monotonic() + 30
    while len(received) < len(sent) and time.monotonic() < deadline:
        outbox.flush()
        buffer += reader.recv(1 << 20)
        while len(buffer) >= 4 and len(buffer) >= 4 + int.from_bytes(buffer[:4], "little"):
            end = 4 + int.from_bytes(buffer[:4], "little")
            received.append(unpack(bytes(buffer[4:end])))
            del buffer[:end]
    assert [(json.loads(h), ids) for h, ids in received] == [(h, f) for h, f in sent]
    assert not outbox.backlog
    outbox.close()
    reader.close()
    listener.close()
