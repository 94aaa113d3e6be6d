"""The Triton prefill attention kernel of the prefill CUDA graphs (`minisgl.kernels.prefill_attention`)
against a torch reference in float32: requests laid out in blocks of `ALIGN` tokens as the graph runner
lays them (a cached prefix before the chunk, padding after each request and after the last), head groups
of 1 to 8, a head dim that is not a power of two, bf16, sliding windows (Mistral's).

On a CPU it runs under Triton's interpreter (conftest sets TRITON_INTERPRET=1), so CI checks it."""

import pytest
import torch
from conftest import soft_capped
from hypothesis import given, settings
from hypothesis import strategies as st

from minisgl.kernels import prefill_attention as PA

pytestmark = pytest.mark.skipif(PA.triton is None, reason="needs triton (its interpreter on a CPU)")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def _case(chunks, num_heads, num_kv_heads, head_dim, dtype, seed, pad_blocks=1):
    """`chunks`: (cached, new) tokens per request. The padded layout: each request's new tokens start a
    block; padding tokens (the rest of a block, `pad_blocks` blocks at the end) attend to their row's
    first token, the end blocks on a spare row."""
    g = torch.Generator().manual_seed(seed)
    width = max(c + n for c, n in chunks) + 3
    num_rows = len(chunks) + 1
    locations = num_rows * width + 5
    k = torch.randn(locations, num_kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(locations, num_kv_heads, head_dim, generator=g).to(dtype)
    table = torch.randperm(locations, generator=g)[: num_rows * width].view(num_rows, width).to(torch.int32)
    block_rows, lens, real = [], [], []
    for i, (cached, new) in enumerate(chunks):
        blocks = -(-new // PA.ALIGN)
        block_rows += [num_rows - 1 - i] * blocks
        real += range(len(lens), len(lens) + new)
        lens += list(range(cached + 1, cached + new + 1)) + [1] * (blocks * PA.ALIGN - new)
    block_rows += [0] * pad_blocks
    lens += [1] * (pad_blocks * PA.ALIGN)
    q = torch.randn(len(lens), num_heads, head_dim, generator=g).to(dtype)
    tensors = (
        q,
        k,
        v,
        table,
        torch.tensor(block_rows, dtype=torch.int32),
        torch.tensor(lens, dtype=torch.int32),
    )
    return [t.to(DEVICE) for t in tensors], torch.tensor(real)


def _reference(q, k, v, table, block_rows, lens, window=None, scale=None, cap=None):
    group = q.shape[1] // k.shape[1]
    out = []
    for t in range(q.shape[0]):
        first = 0 if window is None else max(0, int(lens[t]) - window)
        loc = table[block_rows[t // PA.ALIGN], first : lens[t]].long()
        kt = k[loc].float().repeat_interleave(group, dim=1)
        vt = v[loc].float().repeat_interleave(group, dim=1)
        scores = soft_capped(
            torch.einsum("hd,nhd->hn", q[t].float(), kt) * (scale or q.shape[2] ** -0.5), cap
        )
        out.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), vt))
    return torch.stack(out)


def _check(chunks, num_heads, num_kv_heads, head_dim, dtype, seed=0, window=None):
    case, real = _case(chunks, num_heads, num_kv_heads, head_dim, dtype, seed)
    got = PA.prefill_attention(*case, window=window)
    want = _reference(*case, window=window)
    assert got.shape == want.shape and got.dtype == dtype
    err = (got.float() - want).abs().max().item()  # padding included: it must stay finite and exact too
    assert err < TOL[dtype], (chunks, window, err)
    assert real.numel() == sum(n for _, n in chunks)
    return got, case


@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_matches_reference(group):
    # one token; a whole block; a block and one behind a cached prefix of more than a KV block
    _check([(0, 1), (0, 16), (70, 17)], 2 * group, 2, 32, torch.float32)


def test_head_dim_not_a_power_of_two_and_bf16():
    _check([(3, 20), (0, 5)], num_heads=4, num_kv_heads=2, head_dim=20, dtype=torch.float32)
    _check([(100, 40)], num_heads=4, num_kv_heads=1, head_dim=64, dtype=torch.bfloat16)


def test_refuses_tokens_not_in_blocks():
    case, _ = _case([(0, 3)], 2, 1, 16, torch.float32, 0)
    q, k, v, table, block_rows, lens = case
    with pytest.raises(ValueError, match="blocks of 16"):
        PA.prefill_attention(q[:-1], k, v, table, block_rows, lens[:-1])


@settings(max_examples=6, deadline=None)
@given(
    chunks=st.lists(st.tuples(st.integers(0, 90), st.integers(1, 40)), min_size=1, max_size=3),
    group=st.sampled_from([1, 2, 3]),
    seed=st.integers(0, 1000),
)
def test_any_chunks(chunks, group, seed):
    _check(chunks, 2 * group, 2, 16, torch.float32, seed)


@pytest.mark.parametrize("window", [1, 10, 64, 90])
def test_sliding_window(window):
    """Each token attends to its last `window` tokens: a chunk behind a cached prefix longer than the
    window, a fresh prompt longer than it, one shorter; windows of one token, under a block, of a KV
    block (BLOCK_N), and one past the block size. Rows that reach past the window differ from full
    attention (so the window is used), the others do not."""
    chunks = [(150, 20), (0, 70), (0, 5)]
    got, case = _check(chunks, 4, 2, 16, torch.float32, window=window)
    full = _reference(*case)
    lens = case[5].cpu()
    gap = (got.float() - full.to(got.device)).abs().amax(dim=(1, 2)).cpu()
    assert torch.equal(gap > 1e-3, lens > window), (window, gap)


@settings(max_examples=6, deadline=None)
@given(
    chunks=st.lists(st.tuples(st.integers(0, 90), st.integers(1, 40)), min_size=1, max_size=3),
    window=st.integers(1, 100),
    seed=st.integers(0, 1000),
)
def test_sliding_window_any_chunks(chunks, window, seed):
    _check(chunks, 4, 2, 16, torch.float32, seed, window=window)


def test_prefill_buckets_and_layout():
    from minisgl.core import Batch, Req
    from minisgl.engine.graph import prefill_buckets, prefill_layout

    assert prefill_buckets(1024) == [16, 32, 64, 128, 256, 512, 1024]
    assert prefill_buckets(100) == [16, 32, 64, 112]
    assert prefill_buckets(16) == [16] and prefill_buckets(15) == prefill_buckets(0) == []
    reqs = [
        Req(input_ids=list(range(n)), table_idx=i, cached_len=c, output_len=1, uid=i)
        for i, (c, n) in enumerate([(0, 1), (10, 42), (0, 16)])
    ]
    # 1 token: a block; 32 tokens behind a cached prefix of 10: two blocks; 16: one
    assert prefill_layout(Batch(reqs=reqs, phase="prefill")) == ([0, 16, 48], 64)


def test_soft_cap_and_scale():
    """Gemma's options: scores soft-capped at 5 (small enough to bite) after a softmax scale of the
    model's own, under a window; without the cap the output differs (so the cap is applied)."""
    case, real = _case([(30, 20), (0, 40)], 4, 2, 16, torch.float32, 0)
    got = PA.prefill_attention(*case, window=20, sm_scale=0.3, soft_cap=5.0)[real]
    want = _reference(*case, window=20, scale=0.3, cap=5.0)[real]
    assert (got.float() - want.to(got.device)).abs().max().item() < 1e-4
    uncapped = _reference(*case, window=20, scale=0.3)[real]
    assert (got.float() - uncapped.to(got.device)).abs().max().item() > 1e-3
