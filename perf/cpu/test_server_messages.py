"""The server's per-step messages at 256 concurrent streams: what one decode step costs the scheduler
process (building and sending its tokens message) and the front end (receiving it and turning each
stream's token into text with its incremental detokenizer, stop-string check included), over the real
Unix stream socket of `minisgl.server.worker.Outbox`. Run with `nox -s perf`; the figures are printed
and kept in extra_info."""

import json
import socket
import tempfile
import time

import pytest
import transformers

from minisgl.core import SamplingParams
from minisgl.models import default_model_path
from minisgl.scheduler.detokenizer import IncrementalDetokenizer
from minisgl.server.app import Choice
from minisgl.server.worker import Outbox, frame_ids, ids_frame, unpack

STREAMS = 256
STEPS = 200


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(default_model_path())


@pytest.mark.parametrize("detokenize", [True, False], ids=["text", "token-ids"])
def test_step_message_256_streams(benchmark, tokenizer, detokenize):
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
    outbox.close()
    pull.close()
    listener.close()
