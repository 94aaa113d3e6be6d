"""A server that outlives its engine: `minisgl-run serve` (one replica, the default `engine_restart`)
whose scheduler process is killed with SIGKILL while streamed and non-streamed requests run. Each ends
with a 503 `engine_restarting` (an error event in a begun stream), `/health` answers 503 naming the
cause and then 200 again, and the next greedy request gives the usual tokens from a new process. Also:
the crash-loop limit leaves the server up and answering 503; `--no-engine-restart` keeps the exit;
`--tp 2` on the CPU (a tiny model): the dead leader's follower rank goes with it and the pair comes
back; SIGKILL of the front end leaves no child process. The killed-engine test needs requests long
enough to be in flight at the kill (the default model); the others only start, kill and restart
engines, on a tiny model with the default model's tokenizer served under its name (conftest.py's
`tiny_server_args`). Every request loop
is bounded in count and time; every server is stopped at the end."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator

import httpx2 as httpx
import pytest
from test_server import MODEL, Server, _alive, _descendants, _wait_for

pytestmark = pytest.mark.slow

# the time from the kill to each request's error, asserted with a margin for a loaded 2-core machine
# (the front end learns of the death from the scheduler's socket closing, at once)
ERROR_WITHIN_S = 2.0
MARGIN_S = 6.0
RESTART_TIMEOUT_S = 180


def health(server: Server) -> tuple[int, dict]:
    response = httpx.get(server.base + "/health", timeout=10)
    return response.status_code, response.json()


def engine_pid(server: Server) -> int:
    [replica] = health(server)[1]["replicas"]
    return replica["pid"]


def greedy(server: Server, prompt: str = "The capital of France is") -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    return httpx.post(server.url + "/completions", json=body, timeout=120)


def error_code(response: httpx.Response) -> str | None:
    return response.json().get("error", {}).get("code")


def _requests_in_flight(server: Server, results: list, ended: list) -> list[threading.Thread]:
    """Two streams and two non-streamed requests of 400 tokens each, in threads: each appends
    (kind, outcome) to `results` and its end time (monotonic) to `ended`."""
    long = {"model": MODEL, "prompt": "Count:", "max_tokens": 400, "temperature": 0, "ignore_eos": True}

    def plain() -> None:
        response = httpx.post(server.url + "/completions", json=long, timeout=300)
        ended.append(time.monotonic())
        results.append(("plain", response.status_code, error_code(response)))

    def stream() -> None:
        events = []
        with httpx.stream(
            "POST", server.url + "/completions", json={**long, "stream": True}, timeout=300
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
        ended.append(time.monotonic())
        errors = [json.loads(e)["error"] for e in events if e != "[DONE]" and "error" in json.loads(e)]
        results.append(("stream", r.status_code, errors[0]["code"] if errors else None, events[-1]))

    threads = [threading.Thread(target=fn) for fn in (plain, plain, stream, stream)]
    for thread in threads:
        thread.start()
    return threads


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    srv = Server("--max-running-req", "8")
    try:
        yield srv
    finally:
        srv.stop()


def test_a_killed_engine_fails_its_requests_with_503_and_comes_back(server: Server) -> None:
    before = greedy(server)
    assert before.status_code == 200
    victim = engine_pid(server)
    group = [pid for pid in server.children() if os.getpgid(pid) == victim]
    assert victim in group
    results: list = []
    ended: list[float] = []
    threads = _requests_in_flight(server, results, ended)
    try:
        _wait_for(lambda: server.metrics().get("minisgl_requests_running") == 4, 60, "4 requests running")
        killed = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        _wait_for(lambda: health(server)[0] == 503, 10, "/health to answer 503")
        status, body = health(server)
        assert body["status"] == "restarting" and body["error"]["code"] == "engine_restarting"
        assert "scheduler process" in body["error"]["message"]  # the cause
        during = greedy(server)
        assert during.status_code == 503 and error_code(during) == "engine_restarting"
    finally:
        for thread in threads:
            thread.join(300)
    assert not any(t.is_alive() for t in threads)
    slowest = max(ended) - killed
    assert slowest < ERROR_WITHIN_S + MARGIN_S, slowest
    plain = [r for r in results if r[0] == "plain"]
    streams = [r for r in results if r[0] == "stream"]
    assert plain == [("plain", 503, "engine_restarting")] * 2
    # begun (200, maybe with tokens already), then an error event and [DONE]
    assert streams == [("stream", 200, "engine_restarting", "[DONE]")] * 2
    # the group is gone (the scheduler and whatever it started), then a new process serves
    _wait_for(lambda: not any(_alive(pid) for pid in group), 30, "the dead engine's processes to go")
    _wait_for(lambda: health(server)[0] == 200, RESTART_TIMEOUT_S, "the engine to come back")
    status, body = health(server)
    assert body["status"] == "ok" and body["replicas"][0]["restarts"] == 1
    assert engine_pid(server) != victim
    after = greedy(server)
    assert after.status_code == 200
    assert after.json()["choices"][0]["text"] == before.json()["choices"][0]["text"]
    assert server.metrics()["minisgl_dp_replica_restarts_total,dp_rank=0"] == 1


def test_a_crash_loop_leaves_the_server_up_answering_503(tiny_server_args: list[str]) -> None:
    srv = Server(*tiny_server_args, "--engine-restart-limit", "2")
    try:
        first = engine_pid(srv)
        os.kill(first, signal.SIGKILL)
        _wait_for(lambda: health(srv)[0] == 200 and engine_pid(srv) != first, RESTART_TIMEOUT_S, "a restart")
        os.kill(engine_pid(srv), signal.SIGKILL)  # the second death within the window: no more restarts
        _wait_for(lambda: health(srv)[1]["status"] == "failed", 10, "/health to give up")
        status, body = health(srv)
        assert status == 503 and body["error"]["code"] == "engine_failed"
        assert "not started again" in body["error"]["message"]
        assert body["replicas"][0]["state"] == "failed" and body["replicas"][0]["restarts"] == 1
        time.sleep(3)  # no restart comes, and the server stays up
        assert srv.proc.poll() is None and health(srv)[1]["replicas"][0]["restarts"] == 1
        refused = greedy(srv)
        assert refused.status_code == 503 and error_code(refused) == "engine_failed"
    finally:
        assert srv.stop() == 1  # SIGTERM ends it, with the engine failed: status 1


def test_without_engine_restart_a_dead_engine_ends_the_server(tiny_server_args: list[str]) -> None:
    srv = Server(*tiny_server_args, "--no-engine-restart")
    try:
        [scheduler] = [pid for pid in srv.children() if os.getpgid(pid) == pid]  # leads its group
        os.kill(scheduler, signal.SIGKILL)
        assert srv.proc.wait(30) == 1
        assert "the engine failed" in srv.output()
    finally:
        srv.stop()


def test_tensor_parallel_ranks_of_a_dead_leader_are_killed_and_the_pair_comes_back(tiny_model) -> None:

    folder = tiny_model("llama")
    srv = Server("--model", str(folder), "--device", "cpu", "--dtype", "float32", "--tp", "2")
    try:
        body = {
            "model": folder.name,
            "prompt": [5, 17, 42],
            "max_tokens": 4,
            "temperature": 0,
            "ignore_eos": True,
        }
        want = httpx.post(srv.url + "/completions", json=body, timeout=120).json()["choices"][0]["token_ids"]
        leader = engine_pid(srv)
        followers = [pid for pid in _descendants(leader) if os.getpgid(pid) == leader]
        assert followers  # rank 1 (and what it started), in the leader's process group
        os.kill(leader, signal.SIGKILL)
        _wait_for(lambda: not any(_alive(pid) for pid in followers), 30, "rank 1 to be killed")
        _wait_for(lambda: health(srv)[0] == 200, RESTART_TIMEOUT_S, "the pair to come back")
        again = httpx.post(srv.url + "/completions", json=body, timeout=120)
        assert again.status_code == 200 and again.json()["choices"][0]["token_ids"] == want
    finally:
        assert srv.stop() == 0


def test_a_killed_front_end_leaves_no_child_process(tiny_server_args: list[str]) -> None:
    srv = Server(*tiny_server_args)
    children = srv.children()
    assert engine_pid(srv) in children
    srv.proc.kill()
    srv.proc.wait(30)
    _wait_for(lambda: not any(_alive(pid) for pid in children), 30, "every child to follow its parent")
    srv.stop()
