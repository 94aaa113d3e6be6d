"""The comparison machinery of `python -m perf.gpu.numerics` on a CPU, on one tiny MoE shape: minisgl in
float32 has errors far below transformers' bf16 and passes the bounds, the same logits with noise of a
few times bf16's fail them, and the experts recorded inside minisgl's forward are float32's (no flips)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: perf.gpu.numerics
import perf.gpu.numerics as N  # noqa: E402

TINY = N.Shape(
    "tiny_moe", "qwen3_moe", dict(vocab_size=512, intermediate_size=96, max_position_embeddings=128)
)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    lens = [1, 9, 24]
    return N.prepare_shape(TINY, tmp_path_factory.mktemp("numerics"), "cpu", lens, (1, 24))


def test_float32_engine_passes_and_noise_fails(run):
    yardstick = run.yardstick(64)
    assert 1e-3 < yardstick.mean < yardstick.p99  # bf16 rounding shows, as a spread
    # the fused MoE backend (it runs on a CPU too): the torch one's index_add_ is slow there
    [alone, batch] = run.measure("float32", {"dtype": torch.float32, "moe_backend": "fused"})
    assert alone.batch == 1 and batch.batch == len(run.seqs)
    for row in (alone, batch):
        assert row.passed and row.stats.mean < yardstick.mean / 100, N.table([row])
        assert row.stats.positions == (len(run.alone) if row.batch == 1 else len(run.seqs)) * (N.STEPS + 1)
        assert row.stats.flips == 0  # every recorded expert is float32's
    # the reference with noise of 3x bf16's mean error per logit fails the mean bound
    std = run.fp32.logits.std(-1, keepdim=True)
    noisy = N.Forced(run.fp32.logits + 3 * yardstick.mean * std * torch.randn_like(std), run.fp32.experts)
    stats = N.error_stats(noisy, run.fp32)
    assert stats.mean > N.MEAN_BOUND * yardstick.mean and not N.within_bounds(stats, yardstick)


def test_flip_mask_counts_positions_routed_elsewhere(run):
    experts = run.fp32.experts.clone()
    experts[0, 3, 1] = (experts[0, 3, 1] + 1) % 8  # one layer of one position
    flipped = N.Forced(run.fp32.logits, experts)
    mask = N.flip_mask(flipped, run.fp32)
    assert mask.sum() == 1 and mask[0, 3]
    assert N.error_stats(flipped, run.fp32).flips == 1


def test_fp8_rows_are_reported_not_judged(run):
    """FP8 KV (its K and V rounded to e4m3) on a float32 engine: far from float32, reported with "-"."""
    settings = {"dtype": torch.float32, "moe_backend": "fused", **N.PATHS["fp8 kv"]}
    [alone, batch] = run.measure("fp8 kv", settings)
    for row in (alone, batch):
        assert row.passed is None and row.stats.mean > 1e-3, N.table([row])
        assert N.table([row]).split("\n")[1].split()[-1] == "-"
    assert "fp8" in N.NO_MOE and N.PATHS["fp8"] == {"quantization": "fp8"}
