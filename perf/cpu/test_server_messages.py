"""The server's per-step messages at 256 concurrent streams: what one decode step costs the scheduler
process (building and sending its tokens message) and the front end (receiving it and turning each
stream's token into text with its incremental detokenizer, stop-string check included), over the real
Unix stream socket of `minisgl.server.worker.Outbox`. Run with `nox -s perf`; the figures are printed
and kept in extra_info."""

import json
import socket
import tempfile
import time
from types import SimpleNamespace

import pytest
import transformers

from minisgl.core import SamplingParams, TokenLogprobs
from minisgl.models import default_model_path
from minisgl.scheduler.detokenizer import IncrementalDetokenizer
from minisgl.scheduler.request import RequestState, Update
from minisgl.server import responses
from minisgl.server.jobs import Choice, Job
from minisgl.server.logprobs import TokenTexts
from minisgl.server.openai_api import _Generation, _json_response, _streamed_logprobs
from minisgl.server.scheduler_client import SchedulerClient
from minisgl.server.worker import Outbox, frame_ids, ids_frame, step_message, unpack

STREAMS = 256
STEPS = 200


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(default_model_path())


@pytest.fixture
def channel():
    """The scheduler's `Outbox` and a function that receives its next message's frames, over the
    real Unix stream socket."""
    folder = tempfile.mkdtemp(prefix="minisgl-perf-")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(f"{folder}/tokens")
    listener.listen(1)
    outbox = Outbox(f"{folder}/tokens")
    pull, _ = listener.accept()

    def receive() -> list[bytes]:
        data = bytearray()
        while len(data) < 4 or len(data) < 4 + int.from_bytes(data[:4], "little"):
            data += pull.recv(1 << 20)
        return unpack(bytes(data[4:]))

    yield outbox, receive
    outbox.close()
    pull.close()
    listener.close()


@pytest.mark.parametrize("detokenize", [True, False], ids=["text", "token-ids"])
def test_step_message_256_streams(benchmark, tokenizer, channel, detokenize):
    outbox, receive = channel

    rids = list(range(1000, 1000 + STREAMS))
    text_ids = tokenizer("The quick brown fox jumps over the lazy dog. " * 40)["input_ids"]
    # text: a stop string checked on each stream; token ids: a model without tokenizer (GPU presets)
    params = SamplingParams(max_tokens=10**6, stop=("\n\n",) if detokenize else ())

    def run() -> tuple[float, float]:
        choices = {
            rid: Choice(rid, 0, params, IncrementalDetokenizer(tokenizer) if detokenize else None)
            for rid in rids
        }
        send_s = recv_s = 0.0
        for step in range(STEPS):
            token = text_ids[step % len(text_ids)]
            t0 = time.perf_counter()
            header = {"op": "step", "t": t0, "s": t0, "n": None, "done": []}  # as the worker builds it
            outbox.send(header, ids_frame(rids), ids_frame([token] * STREAMS))
            t1 = time.perf_counter()
            frames = receive()
            header = json.loads(frames[0])
            served, tokens = frame_ids(frames[1]), frame_ids(frames[2])
            done = {row: (reason, error) for row, reason, error in header["done"]}
            for row, rid in enumerate(served):
                choice = choices[rid]
                choice.feed(tokens[row : row + 1], row in done, *done.get(row, (None, None)))
                choice.take()
            t2 = time.perf_counter()
            send_s, recv_s = send_s + (t1 - t0), recv_s + (t2 - t1)
        return send_s / STEPS, recv_s / STEPS

    send_s, recv_s = benchmark.pedantic(run, rounds=1, iterations=1)
    benchmark.extra_info.update(
        {"streams": STREAMS, "scheduler_send_us": send_s * 1e6, "front_end_per_step_us": recv_s * 1e6}
    )
    print(
        f"\n{STREAMS} streams ({'text' if detokenize else 'token ids'}), per decode step: scheduler builds and sends its message in "
        f"{send_s * 1e6:.0f} us; the front end receives it and handles every stream in "
        f"{recv_s * 1e6:.0f} us ({recv_s * 1e6 / STREAMS:.2f} us per stream)"
    )


# ------------------------------------------------------------------------------------ log probabilities

K = 5  # alternatives per token (logprobs: 5, top_logprobs: 5)
RESPONSE_TOKENS = 256  # tokens of the non-streamed response


def _add_entry(entries: TokenLogprobs, token: int, step: int, text_ids: list[int]) -> None:
    """A token's log probability and K alternatives, with values of full precision, added."""
    values = sorted((-((token * 7 + step * 13 + j * 31) % 997) / 97.0 for j in range(K)), reverse=True)
    alts = [text_ids[(step + 3 * j) % len(text_ids)] for j in range(K)]
    entries.extend([token], [values[0] - 0.25], alts, values)


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_logprobs_step_256_streams(benchmark, tokenizer, channel, kind):
    """One decode step of 256 streams with `logprobs` 5 (completions) or `top_logprobs` 5 (chat), per
    step: the scheduler process builds and sends its message (`step_message`), the front end takes it
    (`SchedulerClient.handle`), and each stream's chunk with its log probabilities is rendered as the
    server-sent event it writes."""
    outbox, receive = channel
    texts = SimpleNamespace(token_texts=TokenTexts(tokenizer))
    text_ids = tokenizer("The quick brown fox jumps over the lazy dog, naïve café 日本語. " * 20)["input_ids"]
    for token in set(text_ids):
        texts.token_texts.get(token)  # the cache as it is once the server has run a while
    params = SamplingParams(max_tokens=10**6, logprobs=K)
    rids = list(range(1000, 1000 + STREAMS))

    def run() -> tuple[float, float, float]:
        client = SchedulerClient.__new__(SchedulerClient)
        client.choices = {}
        states, uids = {}, {}
        for rid in rids:
            choice = Choice(rid, 0, params, IncrementalDetokenizer(tokenizer), job=Job(0.0))
            choice.logprobs = TokenLogprobs(K)
            client.choices[rid] = choice
            states[rid] = RequestState(rid, [1, 2, 3], params, 0.0)
            uids[rid] = rid
        formats = {kind: responses.ChunkFormat(kind, "cmpl-1", "m", 0, False, 1, True)}
        send_s = recv_s = render_s = 0.0
        for step in range(STEPS):
            token = text_ids[step % len(text_ids)]
            updates = []
            for rid in rids:
                state = states[rid]
                _add_entry(state.logprobs, token, step, text_ids)
                updates.append(Update(state, [token], "", False, state.logprobs))
            t0 = time.perf_counter()
            outbox.send(*step_message(updates, uids, states, t0))
            t1 = time.perf_counter()
            client.handle(receive())
            t2 = time.perf_counter()
            for rid in rids:
                choice = client.choices[rid]
                text, _ = choice.take()
                formats[kind].event(text, (), _streamed_logprobs(texts, kind, choice))
            t3 = time.perf_counter()
            send_s, recv_s, render_s = send_s + (t1 - t0), recv_s + (t2 - t1), render_s + (t3 - t2)
        return send_s / STEPS, recv_s / STEPS, render_s / STEPS

    send_s, recv_s, render_s = benchmark.pedantic(run, rounds=1, iterations=1)
    benchmark.extra_info.update(
        {
            "streams": STREAMS,
            "scheduler_send_us": send_s * 1e6,
            "front_end_per_step_us": recv_s * 1e6,
            "render_per_token_us": render_s * 1e6 / STREAMS,
        }
    )
    print(
        f"\n{STREAMS} streams ({kind}, {K} log probabilities), per decode step: scheduler builds and sends "
        f"its message in {send_s * 1e6:.0f} us; the front end takes it in {recv_s * 1e6:.0f} us and "
        f"renders the chunks in {render_s * 1e6:.0f} us ({render_s * 1e6 / STREAMS:.2f} us per token)"
    )


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_logprobs_response(benchmark, tokenizer, kind):
    """A non-streamed response of 256 tokens with 5 log probabilities each, rendered to its body."""
    texts = TokenTexts(tokenizer)
    text_ids = tokenizer("The quick brown fox jumps over the lazy dog, naïve café 日本語. " * 20)["input_ids"]
    ids = [text_ids[i % len(text_ids)] for i in range(RESPONSE_TOKENS)]
    choice = Choice(0, 0, SamplingParams(max_tokens=RESPONSE_TOKENS, logprobs=K), None)
    choice.feed(ids, True, "length", None)
    choice.logprobs = TokenLogprobs(K)
    for i, token in enumerate(ids):
        _add_entry(choice.logprobs, token, i, text_ids)
    respond = responses.chat_response if kind == "chat" else responses.completion_response

    def render() -> bytes:
        generation = _Generation(choice, None, None, texts, kind)
        return _json_response(respond("cmpl-1", "m", 3, [generation], created=1)).body

    render()  # the token texts cached
    body = benchmark.pedantic(render, rounds=50, iterations=1, warmup_rounds=2)
    per_token = benchmark.stats.stats.median / RESPONSE_TOKENS
    benchmark.extra_info.update({"tokens": RESPONSE_TOKENS, "per_token_us": per_token * 1e6})
    print(
        f"\n{kind} response, {RESPONSE_TOKENS} tokens with {K} log probabilities: {per_token * 1e6:.2f} us per token"
    )
    assert len(json.loads(body)["choices"][0]["logprobs"]) > 0
