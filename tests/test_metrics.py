"""Prometheus metrics: the registry after a generation, a real Prometheus server scraping them, and
`minisgl-run bench --metrics-port`. Everything listens on loopback (127.0.0.1) only.

The metrics are process-global, so the tests compare deltas: a registry value before generation plus
what the generation did."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from minisgl import metrics
from minisgl.core import SamplingParams

LOOPBACK = "127.0.0.1"
PROMPTS = ["Hello", "The capital of France is", "1, 2, 3, 4,"]
MAX_TOKENS = 6
NO_PROMETHEUS = "the Prometheus server is not on PATH (Debian: apt-get install prometheus; CI installs it)"
TIME_HISTOGRAMS = {
    "minisgl_forward_step_seconds",
    "minisgl_time_to_first_token_seconds",
    "minisgl_inter_token_latency_seconds",
    "minisgl_e2e_request_latency_seconds",
}
# a request's stages in the scheduler, named and bucketed as vLLM's
STAGE_HISTOGRAMS = {
    "minisgl_request_queue_time_seconds",
    "minisgl_request_prefill_time_seconds",
    "minisgl_request_decode_time_seconds",
    "minisgl_request_inference_time_seconds",
}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def sample(name: str, **labels: str) -> float:
    """A sample's value in minisgl's registry, 0 where it does not exist yet."""
    value = metrics.REGISTRY.get_sample_value(name, labels)
    return 0.0 if value is None else value


def wait_until(check: Callable[[], object], timeout: float, interval: float = 0.25) -> object:
    """Calls `check` until it returns something truthy or `timeout` seconds pass; returns its last result."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result or time.monotonic() > deadline:
            return result
        time.sleep(interval)


def http_get(url: str, timeout: float = 5.0) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.read().decode()
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None


def loopback_listeners(port: int) -> list[str] | None:
    """Local addresses (hex, as /proc/net/tcp writes them) of the IPv4 sockets listening on `port`,
    or None where /proc/net/tcp cannot be read."""
    try:
        lines = Path("/proc/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return None
    found = []
    for line in lines:
        fields = line.split()
        addr, port_hex = fields[1].split(":")
        if fields[3] == "0A" and int(port_hex, 16) == port:  # 0A: LISTEN
            found.append(addr)
    return found


@pytest.fixture(scope="session")
def metrics_port() -> int:
    """minisgl's metrics server, started once per session (a port binds once; the thread is a daemon)."""
    port = free_port()
    metrics.serve(port)
    return port


@pytest.fixture(scope="module")
def llm():
    from minisgl.llm import LLM

    with LLM(device="cpu", dtype="float32") as llm:
        yield llm


# the registry samples the tests compare, as (sample name, labels other than model_name)
WATCHED = [
    ("minisgl_generation_tokens_total", {}),
    ("minisgl_prompt_tokens_total", {}),
    ("minisgl_batch_tokens_sum", {"phase": "prefill"}),
    ("minisgl_batch_tokens_sum", {"phase": "decode"}),
    ("minisgl_requests_finished_total", {"reason": "length"}),
    ("minisgl_time_to_first_token_seconds_count", {}),
    ("minisgl_inter_token_latency_seconds_count", {}),
    ("minisgl_e2e_request_latency_seconds_count", {}),
    ("minisgl_forward_steps_total", {"phase": "prefill", "mode": "eager"}),
    ("minisgl_forward_steps_total", {"phase": "decode", "mode": "eager"}),
    ("minisgl_requests_running", {}),
    ("minisgl_requests_waiting", {}),
    ("minisgl_kv_cache_usage_ratio", {}),
    ("minisgl_e2e_request_latency_seconds_sum", {}),
    *((f"{name}_{part}", {}) for name in sorted(STAGE_HISTOGRAMS) for part in ("count", "sum")),
]


def key(name: str, **labels: str) -> str:
    return name + "".join(f",{k}={v}" for k, v in sorted(labels.items()))


def snapshot(model_name: str) -> dict[str, float]:
    return {key(n, **labels): sample(n, model_name=model_name, **labels) for n, labels in WATCHED}


def generate(llm) -> tuple[list, dict[str, float]]:
    """Runs PROMPTS for exactly MAX_TOKENS tokens each; returns the outputs and the registry values
    from before the generation."""
    before = snapshot(llm.model_name)
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    assert [len(o.token_ids) for o in outputs] == [MAX_TOKENS] * len(PROMPTS)
    assert all(o.finish_reason == "length" for o in outputs)
    return outputs, before


@pytest.fixture(scope="module")
def generation(llm) -> tuple[list, dict[str, float], dict[str, float]]:
    """One generation for the registry tests: outputs, registry values before and right after it."""
    outputs, before = generate(llm)
    return outputs, before, snapshot(llm.model_name)


# -- the registry itself ------------------------------------------------------------------------


@pytest.mark.slow
def test_registry_counts_a_generation_exactly(generation) -> None:
    outputs, before, after = generation
    generated = sum(len(o.token_ids) for o in outputs)
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    n = len(outputs)
    expected_delta = {
        key("minisgl_generation_tokens_total"): generated,
        key("minisgl_prompt_tokens_total"): prompt,
        # every prefill step's tokens are prompt tokens; each decode step's tokens are generated ones
        # (the first token of each request comes from its prefill step)
        key("minisgl_batch_tokens_sum", phase="prefill"): prompt,
        key("minisgl_batch_tokens_sum", phase="decode"): generated - n,
        key("minisgl_requests_finished_total", reason="length"): n,
        key("minisgl_time_to_first_token_seconds_count"): n,
        key("minisgl_inter_token_latency_seconds_count"): generated - n,
        key("minisgl_e2e_request_latency_seconds_count"): n,
        **{key(f"{name}_count"): n for name in STAGE_HISTOGRAMS},  # once per request served
        # the prompts fit one prefill chunk and run as one batch: 1 prefill step, MAX_TOKENS - 1 decode steps
        key("minisgl_forward_steps_total", phase="prefill", mode="eager"): 1,
        key("minisgl_forward_steps_total", phase="decode", mode="eager"): MAX_TOKENS - 1,
    }
    delta = {k: after[k] - before[k] for k in expected_delta}
    assert delta == expected_delta
    # the stages add up: queue + inference = E2E, prefill + decode = inference (sums over the requests)
    grown = {name: after[key(f"{name}_sum")] - before[key(f"{name}_sum")] for name in STAGE_HISTOGRAMS}
    e2e = (
        after[key("minisgl_e2e_request_latency_seconds_sum")]
        - before[key("minisgl_e2e_request_latency_seconds_sum")]
    )
    queue, prefill, decode, inference = (
        grown[f"minisgl_request_{stage}_time_seconds"]
        for stage in ("queue", "prefill", "decode", "inference")
    )
    assert prefill > 0 and decode > 0
    assert queue + inference == pytest.approx(e2e, abs=1e-6)
    assert prefill + decode == pytest.approx(inference, abs=1e-6)
    # nothing left running, waiting or holding KV pages
    assert after[key("minisgl_requests_running")] == 0
    assert after[key("minisgl_requests_waiting")] == 0
    assert after[key("minisgl_kv_cache_usage_ratio")] == 0


@pytest.mark.slow
def test_metric_names_and_labels(llm, generation) -> None:
    # after a generation, every labelled metric has samples
    families = list(metrics.REGISTRY.collect())
    assert families
    latency_bounds = [str(float(b)) for b in metrics._LATENCY_BUCKETS] + ["+Inf"]
    request_bounds = [str(float(b)) for b in metrics._REQUEST_BUCKETS] + ["+Inf"]
    seen_histograms = set()
    for family in families:
        assert family.name.startswith("minisgl_"), family.name
        assert family.samples, f"{family.name} has no samples after a generation"
        # the registry is process-wide: other tests' models (and schedulers built without a model name,
        # whose label is "") may have samples too, all labelled
        assert all("model_name" in s.labels for s in family.samples), family.name
        assert any(s.labels["model_name"] == llm.model_name for s in family.samples), family.name
        if family.type == "counter":
            names = {s.name for s in family.samples}
            assert f"{family.name}_total" in names, family.name
            assert names <= {f"{family.name}_total", f"{family.name}_created"}, names
        if family.type == "histogram":
            seen_histograms.add(family.name)
            bounds = list(dict.fromkeys(s.labels["le"] for s in family.samples if s.name.endswith("_bucket")))
            # a histogram of times is in seconds, with the latency buckets or, for a request's stages,
            # vLLM's request buckets; no other histogram has either
            timed = bounds in (latency_bounds, request_bounds)
            assert timed == family.name.endswith("_seconds"), (family.name, bounds)
            assert (bounds == request_bounds) == (family.name in STAGE_HISTOGRAMS), (family.name, bounds)
    assert TIME_HISTOGRAMS | STAGE_HISTOGRAMS <= seen_histograms
    # the text exposition shows the counters with their _total suffix
    from prometheus_client import generate_latest

    text = generate_latest(metrics.REGISTRY).decode()
    samples = {line.split("{")[0] for line in text.splitlines() if line and not line.startswith("#")}
    counters = {f.name for f in families if f.type == "counter"}
    assert {f"{name}_total" for name in counters} <= samples


@pytest.mark.slow
def test_serve_listens_on_loopback(metrics_port) -> None:
    text = http_get(f"http://{LOOPBACK}:{metrics_port}/metrics")
    assert text is not None and "minisgl_" in text
    listeners = loopback_listeners(metrics_port)
    if listeners is not None:
        assert listeners == ["0100007F"], f"metrics port {metrics_port} listens on {listeners}, not 127.0.0.1"


# -- a real Prometheus server scraping them -----------------------------------------------------


class Prometheus:
    def __init__(self, process: subprocess.Popen, port: int, log: Path) -> None:
        self.process, self.port, self.log = process, port, log

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def query(self, promql: str) -> list[dict]:
        url = f"http://{LOOPBACK}:{self.port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        text = http_get(url)
        if text is None:
            return []
        reply = json.loads(text)
        assert reply["status"] == "success", reply
        return reply["data"]["result"]

    def value(self, promql: str) -> float | None:
        """The value of a query that yields at most one series (None if it yields none)."""
        result = self.query(promql)
        assert len(result) <= 1, result
        return float(result[0]["value"][1]) if result else None


@pytest.fixture
def prometheus(tmp_path: Path, metrics_port: int) -> Iterator[Prometheus]:
    """A Prometheus server on loopback scraping minisgl's metrics every second; stopped afterwards."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip(NO_PROMETHEUS)
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n"
        "  scrape_interval: 1s\n"
        "  scrape_timeout: 1s\n"
        "  evaluation_interval: 1s\n"
        "scrape_configs:\n"
        "  - job_name: minisgl\n"
        "    static_configs:\n"
        f"      - targets: ['{LOOPBACK}:{metrics_port}']\n"
    )
    log = tmp_path / "prometheus.log"
    with open(log, "wb") as log_file:
        process = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address={LOOPBACK}:{port}",
            ],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    server = Prometheus(process, port, log)
    try:
        ready = wait_until(
            lambda: process.poll() is not None or http_get(f"http://{LOOPBACK}:{port}/-/ready") is not None,
            timeout=30,
        )
        if process.poll() is not None or not ready:
            pytest.fail(f"Prometheus did not start (exit code {process.poll()}):\n{server.log_tail()}")
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("prometheus") is None, reason=NO_PROMETHEUS)
def test_prometheus_scrapes_the_metrics(llm, prometheus: Prometheus) -> None:
    outputs, before = generate(llm)
    generated = sum(len(o.token_ids) for o in outputs)
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    sel = f'job="minisgl",model_name="{llm.model_name}"'
    expected = {
        f"minisgl_generation_tokens_total{{{sel}}}": lambda v: (
            v == before["minisgl_generation_tokens_total"] + generated
        ),
        f"minisgl_prompt_tokens_total{{{sel}}}": lambda v: (
            v == before["minisgl_prompt_tokens_total"] + prompt
        ),
        f'minisgl_forward_step_seconds_count{{{sel},phase="decode"}}': lambda v: v > 0,
        f'minisgl_forward_step_seconds_count{{{sel},phase="prefill"}}': lambda v: v > 0,
        f"minisgl_time_to_first_token_seconds_count{{{sel}}}": lambda v: v >= len(outputs),
        f"minisgl_e2e_request_latency_seconds_count{{{sel}}}": lambda v: v >= len(outputs),
        f'sum(minisgl_forward_steps_total{{{sel},mode="eager"}})': lambda v: v > 0,
        f"minisgl_kv_cache_usage_ratio{{{sel}}}": lambda v: v == 0,
        f"minisgl_requests_running{{{sel}}}": lambda v: v == 0,
        f"minisgl_requests_waiting{{{sel}}}": lambda v: v == 0,
    }
    last: dict[str, float | None] = {}

    def all_scraped() -> bool:
        # generation is over, so the first scrape after it shows every final value at once
        for promql, ok in expected.items():
            last[promql] = prometheus.value(promql)
            if last[promql] is None or not ok(last[promql]):
                return False
        return True

    if not wait_until(all_scraped, timeout=30, interval=0.5):
        up = prometheus.query('up{job="minisgl"}')
        pytest.fail(
            f"Prometheus did not scrape the expected values within 30 s (generated {generated}, prompt "
            f"{prompt}, registry before {before}):\n"
            + "\n".join(f"  {q} = {v}" for q, v in last.items())
            + f"\nup: {up}\nPrometheus log:\n{prometheus.log_tail()}"
        )
    # the histogram's buckets made it too: the +Inf bucket equals the count
    inf = prometheus.value(f'minisgl_forward_step_seconds_bucket{{{sel},phase="decode",le="+Inf"}}')
    assert inf == last[f'minisgl_forward_step_seconds_count{{{sel},phase="decode"}}']


# -- the CLI ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_cli_bench_serves_metrics(tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "bench.log"
    command = [
        sys.executable,
        "-m",
        "minisgl.cli",
        "bench",
        "--metrics-port",
        str(port),
        "--device",
        "cpu",
        "--num-seqs",
        "4",
        "--min-input",
        "8",
        "--max-input",
        "16",
        "--min-output",
        "64",
        "--max-output",
        "64",
        "-q",
    ]
    with open(log, "wb") as log_file:
        process = subprocess.Popen(
            command, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
    try:

        def scraped() -> str | None:
            if process.poll() is not None:
                return "exited"
            text = http_get(f"http://{LOOPBACK}:{port}/metrics", timeout=2)
            if text and any(
                line.startswith("minisgl_generation_tokens_total{") for line in text.splitlines()
            ):
                return text
            return None

        text = wait_until(scraped, timeout=60, interval=0.5)
        output = log.read_text(errors="replace")[-3000:]
        assert text and text != "exited", (
            f"no minisgl_generation_tokens_total from the bench (exit code {process.poll()}):\n{output}"
        )
        assert 'model_name="' in text
        listeners = loopback_listeners(port)
        if listeners is not None:
            assert listeners == ["0100007F"], (
                f"bench metrics port {port} listens on {listeners}, not 127.0.0.1"
            )
    finally:
        process.kill()
        process.wait(timeout=30)
