"""`python -m perf.gpu.latency --shape cpu` end to end (its dry run, one subprocess, on a tiny Llama
with the default model's tokenizer and chat template: what is checked is the script's report, not the
model's speed): the engine's TTFT stages in order, every decode configuration timed, the server's
request-trace stages read back."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repository root: perf.gpu.latency
import perf.gpu.latency as L  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def report(tmp_path_factory, tiny_model):
    out = tmp_path_factory.mktemp("latency") / "latency.json"
    model = tiny_model("llama", tokenizer=True)
    command = [sys.executable, "-m", "perf.gpu.latency", "--shape", "cpu", "--out", str(out)]
    done = subprocess.run(
        [*command, "--model", str(model)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert "--- latency (cpu" in done.stdout and "decode step, context 64" in done.stdout
    return json.loads(out.read_text())


def test_engine_stages_are_in_order(report):
    assert report["errors"] == {} and report["device"] == "cpu"
    engine = report["engine"]
    for key in ("alone", "beside_decodes"):
        assert list(engine[key]) == [str(n) for n in L.CPU.prompts]
        for length, row in engine[key].items():
            stages = row["stages_ms"]
            assert all(stages[name] >= 0 for name in (*L.STAGES, "device_forward_ms", "device_sample_ms"))
            for chain in (L.HOST_STAGES, ("prepared", *L.DEVICE_STAGES, "first_token")):
                values = [stages[name] for name in chain]
                assert values == sorted(values), (key, length, dict(zip(chain, values)))
            # on a CPU the forward and the sampler run inside forward_batch
            assert stages["sampled"] <= stages["launched"]
            assert row["ttft_ms"] == stages["first_token"] and row["prefill_mode"] == {"eager": L.CPU.reps}
    longest = str(L.CPU.prompts[-1])
    # the longest prompt's TTFT: more than its forward, less than 10 s; beside decodes it waits longer
    alone, beside = engine["alone"][longest], engine["beside_decodes"][longest]
    assert alone["stages_ms"]["device_forward_ms"] < alone["ttft_ms"] < 10_000
    assert beside["ttft_ms"] < 10_000


def test_every_decode_configuration_is_timed(report):
    steps = report["steps"]
    assert list(steps) == [str(n) for n in L.CPU.contexts]
    for rows in steps.values():
        assert list(rows) == [str(b) for b in L.CPU.batches]
        assert rows["1"]["greedy"]["ratio_wall"] == 1.0
        for by_variant in rows.values():
            assert list(by_variant) == list(L.VARIANTS)
            for row in by_variant.values():
                assert 0 < row["wall_ms"] < 5_000 and row["ratio_wall"] > 0
                assert row["records"] == L.CPU.steps and row["device_ms"] is None  # CUDA only
                assert row["launch_ms"] > 0 and row["process_ms"] >= 0


def test_server_trace_stages(report):
    server = report["server"]
    assert server["endpoint"] == "chat"  # the tokenizer (SmolLM2's) has a chat template
    assert list(server["lengths"]) == [str(n) for n in L.CPU.prompts]
    for length, row in server["lengths"].items():
        for kind in ("non_streamed", "streamed"):
            r = row[kind]
            assert r["requests"] == L.CPU.requests and r["prompt_tokens"] >= int(length)
            assert set(r["stages_ms"]) >= {"parse_tokenize", "to_scheduler", "queue", "prefill", "to_client"}
            assert all(r["stages_ms"][s] >= 0 for s in ("parse_tokenize", "to_scheduler", "queue", "prefill"))
            stamps = r["stamps_ms"]
            assert stamps["tokenized"] <= stamps["arrived"] <= stamps["admitted"] <= stamps["first_token"]
            assert stamps["first_token"] <= stamps["first_received"] <= stamps["done"]
            # the client sent before the server received and read after the scheduler had the token
            assert stamps["first_token"] <= r["client_ttft_ms"] < 10_000
        assert row["streamed"]["stamps_ms"]["first_written"] is not None
