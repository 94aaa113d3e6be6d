"""`python -m perf.gpu.embeddings --shape cpu` end to end (its dry run, one subprocess, on a tiny Llama
with the default model's tokenizer and chat template: what is checked is the script's report, not the
model's speed): every figure there and positive, the vectors of the model's hidden size."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_model):
    """The dry run's report, its standard output and the model's hidden size."""
    model = tiny_model("llama", tokenizer=True)
    hidden = json.loads((model / "config.json").read_text())["hidden_size"]
    out = tmp_path_factory.mktemp("embeddings") / "embeddings.json"
    argv = ["--shape", "cpu", "--model", str(model), "--out", str(out)]
    # a subprocess: its servers and engine are gone with it, and a hang ends at the timeout
    done = subprocess.run(
        [sys.executable, "-m", "perf.gpu.embeddings", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return json.loads(out.read_text()), done.stdout, hidden


def test_offline_figures(run):
    report, _, hidden = run
    offline = report["offline"]
    assert offline["inputs"] == 16 and offline["dims"] == hidden
    assert offline["embed_tok_s"] > 0 and offline["prefill_tok_s"] > 0 and offline["ratio"] > 0
    assert len(offline["tok_s"]["embed"]) == len(offline["tok_s"]["prefill"]) == 1


def test_server_figures(run):
    report, _, hidden = run
    server = report["server"]
    assert server["dims"] == hidden and server["endpoint"] == "chat"
    assert server["latency"]["requests"] == 5 and server["latency"]["p50_ms"] > 0
    assert set(server["tpot_p50_ms"]) == {"alone", "beside", "ratio"}
    assert all(v > 0 for v in server["tpot_p50_ms"].values())
    for key in ("alone", "beside"):
        [chat] = server[key]
        assert chat["failed"] == 0 and chat["completed"] > 0
    [load] = server["embeddings"]
    assert load["requests"] > 0 and load["failed"] == 0 and load["tokens_per_s"] > 0


def test_table_is_printed_last(run):
    report, stdout, _ = run
    assert report["errors"] == {}
    table = stdout.split("--- embeddings (cpu;")[1]
    for row in ("embed / prefill", "32-token input, idle server p50 ms", "beside / alone"):
        assert row in table
