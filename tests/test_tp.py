"""Tensor parallelism on CPU: one process per rank (spawned, kept for the module: tests/tp_ranks.py),
gloo collectives, the same tokens as TP=1.

Every rank builds its own Engine and runs the same prompts in lockstep; greedy decoding makes every rank
produce the same tokens. Each run also returns the first step's (prefill) logits, compared to TP=1.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import transformers
from conftest import make_tiny_model, rel_err
from tp_ranks import (
    COLLECTIVE_TIMEOUT_S,
    MAX_TOKENS,
    PROMPTS,
    RankFailure,
    RankPool,
    make_engine,
    run_prompts,
)

from minisgl.distributed import DistributedInfo, HeadShard, set_tp_info, shard_heads
from minisgl.models import ModelConfig, build_model
from minisgl.models.weights import Shard


def run_tp(ranks: RankPool, model_path: Path, size: int, **kw) -> list[tuple[str, object]]:
    """Runs `size` ranks (`RankPool.run`); returns each rank's ("ok", (tokens, logits)) or ("error",
    message). Never hangs: a rank that dies without reporting, or a run past the deadline, fails the
    test, and the run's ranks that did not report are killed."""
    try:
        return ranks.run(model_path, size, **kw)
    except RankFailure as e:
        pytest.fail(str(e))


def assert_tp_matches_single(
    ranks: RankPool,
    model_path: Path,
    size: int,
    prompts=PROMPTS,
    max_tokens=MAX_TOKENS,
    logits_tol: float = 1e-5,
) -> None:
    single = make_engine(model_path, DistributedInfo())
    try:
        want_tokens, want_logits = run_prompts(single, prompts, max_tokens)
    finally:
        single.shutdown()
    outcomes = run_tp(ranks, model_path, size, prompts=prompts, max_tokens=max_tokens)
    for rank, (status, payload) in enumerate(outcomes):
        assert status == "ok", f"rank {rank} of {size} failed: {payload}"
        tokens, logits = payload
        err = rel_err(torch.from_numpy(logits), torch.from_numpy(want_logits))
        print(f"TP={size} rank {rank}: first-step logits relative error {err:.2e}")
        assert err < logits_tol, f"rank {rank}: first-step logits relative error {err:.2e}"
        assert tokens == want_tokens, f"rank {rank} of {size}: TP tokens differ from TP=1"


def test_shard_heads():
    assert shard_heads(8, 4, DistributedInfo(1, 2)) == HeadShard(4, 2, 1, 2)  # split KV heads
    assert shard_heads(9, 3, DistributedInfo(2, 3)) == HeadShard(3, 1, 2, 3)
    # 2 KV heads over 4 ranks: ranks 0-1 use KV head 0, ranks 2-3 KV head 1
    assert [shard_heads(4, 2, DistributedInfo(r, 4)).kv_part for r in range(4)] == [0, 0, 1, 1]
    assert shard_heads(16, 1, DistributedInfo(3, 8)) == HeadShard(2, 1, 0, 1)  # MQA: one replicated head
    assert shard_heads(6, 3, DistributedInfo(5, 6)) == HeadShard(1, 1, 2, 3)
    with pytest.raises(
        ValueError, match="num_attention_heads=4 is not divisible by the tensor-parallel size 3"
    ):
        shard_heads(4, 2, DistributedInfo(0, 3))
    with pytest.raises(ValueError, match="num_key_value_heads=4 .* tensor-parallel size 6"):
        shard_heads(12, 4, DistributedInfo(0, 6))  # rank 1's 2 query heads would use KV heads 0 and 1


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_tp2_matches_tp1(tiny_model, arch, ranks):
    """llama: llama3 RoPE scaling; mistral: a sliding window (12); qwen2: q/k/v biases; qwen3: q/k norms.
    4 query, 2 KV heads: split."""
    assert_tp_matches_single(ranks, tiny_model(arch), 2)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "phi3", "gpt_oss"])
def test_tp2_matches_tp1_for_the_newer_families(tiny_model, arch, ranks):
    """gemma2: soft caps and a window of 7; gemma3: q/k norms and RoPE per layer type; phi3: fused
    qkv / gate_up split at load, then sharded, partial rotary and LongRoPE; gpt_oss: sinks sharded with
    their heads, biased experts and YaRN. Prompts past every window and past Phi-3's LongRoPE threshold."""
    assert_tp_matches_single(ranks, tiny_model(arch), 2)


def test_tp4_replicates_kv_heads(tiny_model, ranks):
    """4 query heads, 2 KV heads, 4 ranks: one query head per rank, each with a copy of its KV head;
    tied embeddings, so the vocab-parallel LM head reuses the embedding's slice."""
    assert_tp_matches_single(ranks, tiny_model("llama", tie_word_embeddings=True), 4)


def test_tp3_smollm2(smollm2_path, ranks):
    """The real SmolLM2-135M-Instruct: 9 heads, 3 KV heads, intermediate 1536, vocab 49152 over 3 ranks."""
    prompts = [[1, 9690, 198, 2683, 359, 253, 5356, 5646, 30], [504, 3458, 282, 4649, 314], [42] * 3]
    assert_tp_matches_single(
        ranks, smollm2_path, 3, prompts, max_tokens=16, logits_tol=1e-4
    )  # 30 layers: ~3e-6


@pytest.mark.parametrize(("arch", "size", "tied"), [("qwen3", 2, False), ("llama", 4, True)])
def test_vocab_the_ranks_do_not_divide(tiny_model, arch, size, tied, ranks):
    """A vocabulary of 317 (prime): each rank holds ceil(317 / size) rows, the last ones zero padding, and
    the gathered logits are cut back to 317 columns (tied: the LM head reuses the padded embedding)."""
    folder = tiny_model(arch, vocab_size=317, tie_word_embeddings=tied)
    assert_tp_matches_single(ranks, folder, size)


def test_padded_shard_loads_its_part():
    full = torch.arange(10.0).view(5, 2)  # 5 rows over 3 parts of 2 rows: [0, 2), [2, 4), [4, 5) + padding
    parts = [torch.full((2, 2), -1.0) for _ in range(3)]
    for i, dest in enumerate(parts):
        shard = Shard(dest, 0, i, 3, total=5)
        assert shard.full_shape == (5, 2)
        shard.load(full)
    assert torch.equal(torch.cat(parts)[:5], full) and torch.equal(parts[2][1], torch.zeros(2))


def test_sizes_that_do_not_divide(tiny_model, ranks):
    folder = tiny_model("llama")  # 4 heads, intermediate 96, vocab 320
    with pytest.raises(
        ValueError, match="num_attention_heads=4 is not divisible by the tensor-parallel size 3"
    ):
        make_engine(folder, DistributedInfo(0, 3))
    odd = tiny_model("llama", intermediate_size=90)
    with pytest.raises(
        ValueError, match="intermediate_size=90 is not divisible by the tensor-parallel size 4"
    ):
        make_engine(odd, DistributedInfo(0, 4))
    # the same error reaches a real multi-process launch, from every rank, without hanging
    for status, message in run_tp(ranks, folder, 3):
        assert status == "error" and "num_attention_heads=4 is not divisible" in message


def test_tp2_qwen3_moe_matches_tp1(tiny_model, ranks):
    """Qwen3-MoE: 8 experts, top-2, moe_intermediate_size 32 split over 2 ranks (every rank holds every
    expert's half), replicated router, all-reduced MoE output; layer 1 is dense (mlp_only_layers)."""
    assert_tp_matches_single(ranks, tiny_model("qwen3_moe"), 2)


def test_qwen3_moe_shards_experts(tmp_path):
    """Each rank's w13 rows are [gate part r | up part r] of each expert, its w2 columns part r of down;
    the router is replicated. A moe_intermediate_size the ranks cannot split fails clearly."""
    folder = make_tiny_model(tmp_path, "qwen3_moe")  # moe_intermediate_size 32
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    experts = ref.model.layers[0].mlp.experts  # fused in memory: gate_up_proj (E, 2I, H), down_proj (E, H, I)
    gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
    inter = gate_up.shape[1] // 2
    for rank in range(2):
        set_tp_info(DistributedInfo(rank, 2))
        try:
            model = build_model(ModelConfig.from_path(folder), folder, 64, torch.device("cpu"), torch.float32)
        finally:
            set_tp_info(DistributedInfo())
        layer = model.layers[0]
        part = slice(rank * inter // 2, (rank + 1) * inter // 2)
        want_w13 = torch.cat([gate_up[:, :inter][:, part], gate_up[:, inter:][:, part]], dim=1)
        assert torch.equal(layer.w13, want_w13)
        assert torch.equal(layer.w2, down[:, :, part])
        assert torch.equal(layer.gate, ref.model.layers[0].mlp.gate.weight.detach())
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "moe_intermediate_size": 30}))
    set_tp_info(DistributedInfo(0, 4))
    try:
        with pytest.raises(
            ValueError, match="moe_intermediate_size=30 is not divisible by the tensor-parallel size 4"
        ):
            build_model(
                ModelConfig.from_path(folder), folder, 64, torch.device("cpu"), torch.float32, dummy=True
            )
    finally:
        set_tp_info(DistributedInfo())


def test_dummy_weights_under_tp(tmp_path, ranks):
    """Dummy weights fill each rank's local shards without a checkpoint; the ranks still agree."""
    folder = make_tiny_model(tmp_path, "qwen3")
    for file in folder.glob("*.safetensors"):
        file.unlink()
    outcomes = run_tp(ranks, folder, 2, dummy=True)
    assert [status for status, _ in outcomes] == ["ok", "ok"], outcomes
    (tokens0, _), (tokens1, _) = (payload for _, payload in outcomes)
    assert tokens0 == tokens1 and all(len(t) == MAX_TOKENS for t in tokens0)


def test_dead_rank_fails_fast(tiny_model, ranks):
    """A rank that dies mid-run fails the test at once (not after the collective timeout), and the
    surviving rank, stuck in a collective, is killed."""
    started = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match=r"rank\(s\) \[1\] of 2 exited"):
        run_tp(ranks, tiny_model("llama"), 2, crash_rank=1)
    assert time.monotonic() - started < COLLECTIVE_TIMEOUT_S
