"""`python -m perf.gpu.vision --shape cpu --parts requests`, the dry run of the image-request figures of
the vision benchmark: a tiny Qwen2.5-VL with dummy weights on the CPU, run as a subprocess; every figure
of the report there, positive, with the counts asked for. And the Qwen2.5-VL-7B preset it runs on a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_requests_dry_run_reports_every_figure(tmp_path):
    out = tmp_path / "vision.json"
    cmd = [sys.executable, "-m", "perf.gpu.vision", "--shape", "cpu", "--parts", "requests"]
    cmd += ["--reps", "3", "--batch", "3", "--steps", "4", "--requests", "4", "--max-tokens", "5"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run(
        [*cmd, "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert (results["shape"], results["parts"]) == ("cpu", ["requests"])
    assert "encoder" not in results
    req = results["requests"]
    # a 224x168 image: 12 x 16 patches, 48 merged tokens, between vision start and end, then 32 ids
    assert (req["image"], req["image_tokens"], req["question_tokens"]) == ("224x168", 48, 32)
    assert req["prompt_tokens"] == 48 + 2 + 32
    assert req["start_s"] > 0 and req["preprocess_ms"] > 0

    ttft = req["ttft"]
    assert (ttft["reps"], len(ttft["runs_ms"])) == (3, 3)
    for name in ("ttft_ms", "preprocess_ms", "ttft_with_preprocess_ms", "encoder_ms"):
        assert ttft[name] > 0, name
    assert ttft["ttft_with_preprocess_ms"] > ttft["ttft_ms"]
    assert ttft["prefill_steps"] == 1  # one chunk: the encoder and the prefill ran for each request
    assert ttft["prefill_device_ms"] is None  # device times on CUDA only

    decode = req["decode"]
    assert (decode["batch"], decode["steps"], decode["context"]) == (3, 4, req["prompt_tokens"])
    for kind in ("image", "text"):
        assert decode[kind]["wall_ms"] > 0 and decode[kind]["device_ms"] is None
        assert decode[kind]["timed_steps"] == 4 * decode["rounds"]
    assert decode["ratio"] == decode["image"]["wall_ms"] / decode["text"]["wall_ms"]

    throughput = req["throughput"]
    assert (throughput["requests"], throughput["max_tokens"]) == (4, 5)
    for kind in ("image", "text"):
        row = throughput[kind]
        assert row["finished"] == 4 and row["output_tokens"] == 4 * 5
        assert row["prompt_tokens"] == 4 * req["prompt_tokens"]
        assert row["seconds"] > 0 and row["output_tok_s"] > 0 and row["total_tok_s"] > row["output_tok_s"]
        assert row["ttft_ms_max"] >= row["ttft_ms_median"] > 0
    assert throughput["image"]["encoder_calls"] >= 1 and throughput["image"]["encoder_ms"] > 0
    assert throughput["text"]["encoder_calls"] == 0
    assert throughput["ratio"] == throughput["image"]["output_tok_s"] / throughput["text"]["output_tok_s"]

    printed = done.stdout.split("--- vision requests (cpu;")[1].splitlines()
    assert printed[2].startswith("TTFT, one image request, median of 3: ")
    assert printed[2].count("(goal <= 100 ms: ") == 2
    assert printed[3].startswith("decode step, batch 3,") and "(goal <= 1.03x: " in printed[3]
    assert printed[4].startswith("4 image requests at once, 5 output tokens each: ")
    assert printed[5].startswith("4 text requests at once, 5 output tokens each: ")
    assert printed[6].startswith("image/text output tok/s: ") and "(goal >= 0.8x: " in printed[6]


def test_the_qwen2_5_vl_7b_preset():
    from minisgl.models.config import ModelConfig
    from minisgl.multimodal.qwen_vl import ImageProcessorConfig, num_image_tokens
    from perf.gpu import vision

    folder = ROOT / "configs" / "models" / "qwen2.5-vl-7b"
    config = ModelConfig.from_path(folder)
    assert (config.family, config.hidden_size, config.num_layers) == ("qwen2_5_vl", 3584, 28)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (28, 4, 128)
    assert (config.intermediate_size, config.vocab_size, config.rope.theta) == (18944, 152064, 1e6)
    assert (config.mrope_section, config.image_token_id) == ((16, 24, 24), 151655)
    raw = json.loads((folder / "config.json").read_text())
    assert raw["vision_start_token_id"] == 151652
    _, encoder = vision.MODELS["qwen2.5-vl-7b"]
    assert {key: raw["vision_config"][key] for key in encoder} == encoder
    processor = ImageProcessorConfig.from_folder(folder)
    assert num_image_tokens(720, 1280, processor) == 1196  # 52 x 92 patches of a 1280x720 image

    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    text = hf.text_config
    assert (text.hidden_size, text.num_hidden_layers, text.num_key_value_heads) == (3584, 28, 4)
    assert (text.vocab_size, hf.vision_config.depth, hf.image_token_id) == (152064, 32, 151655)
