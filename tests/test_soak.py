"""`python -m perf.soak`: its checks fail on a leak or an error (no server), and a one-minute soak of
`minisgl-run serve` on the default model runs every row of the mix and passes every check."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from test_server import Server

from perf import soak
from perf.soak import Call, Outcome

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 65536  # the server's --max-request-bytes: the oversized row sends more

OK_CHAT = [{"choices": [{"index": 0, "message": {"content": "Hi."}, "finish_reason": "stop"}]}]
USAGE = {"usage": {"prompt_tokens": 5, "completion_tokens": 2}}


def _row(name: str) -> soak.Row:
    return next(row for row in soak.MIX if row.name == name)


def _chunk(text: str, finish: str | None = None, **logprobs) -> dict:
    choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": logprobs or None}
    return {"choices": [choice]}


@pytest.mark.parametrize(
    "row,body,outcome,problem",
    [
        ("chat", {"max_tokens": 8}, Outcome(200, [*OK_CHAT, USAGE]), None),
        ("chat", {"max_tokens": 8}, Outcome(503, error={"type": "server_error"}), "503"),
        ("chat", {"max_tokens": 8}, Outcome(200, OK_CHAT), "no usage"),
        ("chat", {"max_tokens": 1}, Outcome(200, [*OK_CHAT, USAGE]), "usage"),
        ("n_choices", {"n": 2, "max_tokens": 8}, Outcome(200, [*OK_CHAT, USAGE]), "choices [0] for n=2"),
        (
            "chat_stream",
            {"max_tokens": 8},
            Outcome(200, [_chunk("a")], error={"type": "server_error", "code": "generation_failed"}),
            "200 + error event: generation_failed",
        ),
        ("completion", {"max_tokens": 8}, Outcome(client_error="ConnectionError: closed"), "no response"),
        ("completion", {"max_tokens": 8}, Outcome(timed_out=True), "timeout"),
        (
            "stop_strings",
            {"max_tokens": 8, "stop": ["."]},
            Outcome(200, [_chunk("a. b", "stop"), USAGE]),
            "stop strings ['.']",
        ),
        (
            "logprobs_completion",
            {"max_tokens": 8, "logprobs": 1},
            Outcome(200, [_chunk("ab", "length", tokens=["a"], top_logprobs=[{"a": -1}]), USAGE]),
            "log probabilities of 1 tokens for 2 (length)",
        ),
        (
            "logprobs_chat",
            {"max_tokens": 8, "top_logprobs": 0},
            Outcome(200, [_chunk("ab", "stop", content=[{"top_logprobs": []}]), USAGE]),
            None,  # the final EOS has no entry
        ),
        (
            "logprobs_chat",
            {"max_tokens": 8, "top_logprobs": 0},
            Outcome(200, [_chunk("ab", "stop", content=[]), USAGE]),
            "log probabilities of 0 tokens for 2 (stop)",
        ),
        (
            "logprobs_completion",
            {"max_tokens": 8, "logprobs": 1},
            Outcome(200, [_chunk("ab", "length", tokens=["a", "b"], top_logprobs=[{}, {"b": -1}]), USAGE]),
            "alternatives per token [0]",
        ),
        (
            "json_schema",
            {"max_tokens": 32},
            Outcome(200, [_chunk('{"answer": "yes", "sure": 1}', "stop"), USAGE]),
            "not the schema's object",
        ),
        ("abort", {"max_tokens": 8}, Outcome(dropped=True), None),
        ("abort", {"max_tokens": 8}, Outcome(500, error={"type": "server_error"}), "500"),
        ("oversized_body", {}, Outcome(413, error={"message": "too large"}), None),
        ("oversized_body", {}, Outcome(400, error={"message": "bad"}), "400 (expected 413)"),
        ("unknown_model", {}, Outcome(404, error={"message": "no", "code": "x"}), "expected model_not_found"),
    ],
)
def test_each_row_tells_an_unexpected_outcome(row, body, outcome, problem) -> None:
    got = _row(row).expect(Call("/x", body), outcome)
    assert got == problem if problem is None else problem in got


def _soak_with(samples: list[dict], at_rest: dict, tally: soak.Tally) -> dict:
    run = soak.Soak(
        soak.Server.parse("http://127.0.0.1:9/v1"), soak.Server.parse("http://127.0.0.1:9"), 1, 60
    )
    run.samples = samples
    start = {"1": {"rss_kib": 1000, "fds": 10, "command": "front end"}}
    return run.report(tally, start, samples[-1], at_rest)["checks"]


def _sample(t: float, rss: int) -> dict:
    return {"t": t, "processes": {"1": {"rss_kib": rss, "fds": 14}}}


def test_the_checks_fail_on_growth_leaked_descriptors_held_pages_and_5xx() -> None:
    rest = {"kv_usage": 0.0, "prefix_pages": 0.0, "running": 0.0, "waiting": 0.0}
    clean = {"processes": {"1": {"rss_kib": 1000, "fds": 10}}, "after_flush": rest, "flush_status": 200}
    clean["freed_pages"] = 12
    samples = [_sample(0, 1000), _sample(12, 1040), _sample(60, 1090)]
    checks = _soak_with(samples, clean, soak.Tally(1))
    assert all(c["ok"] for c in checks.values()), checks  # +4.8% after the baseline at 12 s

    tally = soak.Tally(1)
    tally.add(_row("chat"), Call("/chat/completions", {"max_tokens": 8}), Outcome(503), 0)
    leaky = {**clean, "processes": {"1": {"rss_kib": 1000, "fds": 11}, "2": {"rss_kib": 5, "fds": 1}}}
    leaky["after_flush"] = {**rest, "kv_usage": 0.01}
    checks = _soak_with([_sample(0, 1000), _sample(12, 1000), _sample(60, 1051)], leaky, tally)
    failed = {name for name, c in checks.items() if not c["ok"]}
    assert failed == {"rss", "descriptors", "processes", "kv_at_rest", "no_5xx_for_valid", "as_expected"}


def test_the_mix_is_seeded() -> None:
    ctx = soak.Context("m", 16, LIMIT)
    for row in soak.MIX:
        calls = [row.build(random.Random(f"0:{row.name}"), ctx) for _ in range(2)]
        assert calls[0] == calls[1], row.name


@pytest.mark.slow
def test_a_one_minute_soak_runs_every_row_and_passes(tmp_path) -> None:
    server = Server("--max-request-bytes", str(LIMIT))
    report_path = tmp_path / "soak.json"
    command = [sys.executable, "-m", "perf.soak", "--minutes", "1", "--url", server.base]
    command += ["--log", server.log.name, "--max-request-bytes", str(LIMIT), "--max-tokens", "8"]
    try:
        # bounded: the first pass, the minute, requests' own 120 s limit and the rest's 60 s
        run = subprocess.run(
            [*command, "--report", str(report_path)], cwd=ROOT, capture_output=True, text=True, timeout=900
        )
    finally:
        exit_code = server.stop()
    assert run.returncode == 0, run.stdout + run.stderr
    assert exit_code == 0 and soak.TRACEBACK not in Path(server.log.name).read_text()  # shutdown too
    report = json.loads(report_path.read_text())
    assert report["settings"]["pid"] == server.proc.pid  # found as the port's listener
    assert {name: c["ok"] for name, c in report["checks"].items()} == dict.fromkeys(
        ["no_5xx_for_valid", "as_expected", "rss", "descriptors", "processes", "kv_at_rest", "log"], True
    )
    assert all(stats["sent"] >= 1 for stats in report["rows"].values()), report["rows"]
    assert report["requests"] > len(soak.MIX) and report["minutes"][0]["served"] > 0
    assert 1 <= report["max_in_flight"] <= soak.MAX_IN_FLIGHT
    assert {"413", "404", "400", "client went away"} <= set(report["statuses"])
