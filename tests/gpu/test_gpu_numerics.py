"""Every GPU path as close to float32 as transformers' bf16 (`python -m perf.gpu.numerics`):
tiny random models with peaked weights, teacher-forced through transformers in float32 (the reference)
and in bf16 (the yardstick) and through minisgl with its defaults and one switch changed at a time; batch
1 and a batch of 64 sequences of 1 to 1,000 tokens. Each path's mean error at most 1.5x transformers'
bf16 mean and its p99 at most 2x (MoE positions routed to other experts than float32's left out and
counted apart). Then greedy tokens against float32's argmax, and the radix cache and preemption against
naive runs. Skips without CUDA."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: perf.gpu.numerics
import perf.gpu.numerics as N  # noqa: E402

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="needs flashinfer"),
]

SHAPES = list(N.SHAPES)
PATHS = [path for path in N.PATHS if path not in N.REPORTED]  # FP8's: tests/gpu/test_gpu_fp8*.py
LONGEST = 1000


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One prepared shape (model, sequences, transformers' float32 and bf16 logits) per name, on demand."""
    torch.backends.cuda.matmul.allow_tf32 = False
    prepared = {}

    def get(name: str):
        if name not in prepared:
            folder = tmp_path_factory.mktemp(name)
            lens = N.batch_lengths(64, LONGEST)
            prepared[name] = N.prepare_shape(N.SHAPES[name], folder, "cuda", lens, N.BATCH1_LENS)
        return prepared[name]

    return get


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("shape", SHAPES)
def test_path_within_bf16_bounds(runs, shape, path):
    run = runs(shape)
    rows = run.measure(path, N.PATHS[path])
    print("\n" + N.table(rows))
    for row in rows:
        assert row.passed, N.table([row])
        if shape != "qwen3_moe":
            assert row.stats.flips == 0
        else:  # a routing flip is rare, not the rule: a recorder reading the wrong layer flips most
            assert row.stats.flips < row.stats.positions / 4


def test_greedy_tokens_against_float32_argmax(runs):
    """2,000 greedy tokens: the default path's tokens are float32's argmax or a near-tie as often as
    transformers' bf16 argmax is at the same positions, and never further than bf16 noise reaches."""
    run = runs("llama3")
    greedy = N.greedy_check(run)
    print(greedy)
    assert greedy["tokens"] == N.GREEDY_TOKENS
    assert greedy["beyond"] <= greedy["bf16_beyond"]
    assert greedy["max_gap"] < N.P99_BOUND * run.yardstick(64).p99


def test_radix_cache_and_preemption_differ_only_at_near_ties(runs):
    run = runs("llama3")
    extras = N.cache_and_preemption(run)
    print(extras)
    assert extras["radix_cached_tokens"] > 0 and extras["preemptions"] > 0
    tie = N.P99_BOUND * run.yardstick(64).p99  # two bf16 runs' logits may each be this far off
    for key in ("radix_pass1", "radix_pass2", "preempted"):
        assert all(gap < tie for gap in extras[key]["first_gaps"]), (key, extras[key])
