"""The Triton split-KV decode attention kernel (`minisgl.kernels.decode_attention`) against a torch
reference in float32: requests of different lengths scattered over a token-level page table, every
split count the kernel may pick (one split writes the output directly; several are merged), head groups
of 1 to 8 (Qwen3-30B-A3B's is 8), head dims that are and are not powers of two, splits that run past a
request's end, sliding windows shorter and longer than the requests (Mistral's).

On a CUDA machine the kernel runs compiled on the GPU (also inside a captured CUDA graph, replayed with
new lengths); without one it runs on CPU tensors under Triton's interpreter (conftest sets
TRITON_INTERPRET=1), so CI checks it too."""

import math

import pytest
import torch
from conftest import soft_capped
from hypothesis import given, settings
from hypothesis import strategies as st

from minisgl.kernels import decode_attention as DA

pytestmark = pytest.mark.skipif(DA.triton is None, reason="needs triton (its interpreter on a CPU)")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def _case(lens, num_heads, num_kv_heads, head_dim, dtype, seed):
    """q, the flat K and V caches, a page table whose rows hold each request's scattered locations (one
    spare row), and the rows and lengths of the requests (taking table rows in reverse order)."""
    g = torch.Generator().manual_seed(seed)
    bs, width = len(lens), max(lens) + 5
    locations = (bs + 1) * width + 7
    k = torch.randn(locations, num_kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(locations, num_kv_heads, head_dim, generator=g).to(dtype)
    q = torch.randn(bs, num_heads, head_dim, generator=g).to(dtype)
    table = torch.randperm(locations, generator=g)[: (bs + 1) * width].view(bs + 1, width).to(torch.int32)
    rows = torch.arange(bs, 0, -1)  # requests use rows bs..1
    return [t.to(DEVICE) for t in (q, k, v, table, rows, torch.tensor(lens, dtype=torch.int32))]


def _reference(q, k, v, table, rows, lens, window=None, scale=None, cap=None):
    out = []
    group = q.shape[1] // k.shape[1]
    for i in range(q.shape[0]):
        first = 0 if window is None else max(0, int(lens[i]) - window)
        loc = table[rows[i], first : lens[i]].long()
        ki = k[loc].float().repeat_interleave(group, dim=1)  # (n, H, D)
        vi = v[loc].float().repeat_interleave(group, dim=1)
        scores = soft_capped(
            torch.einsum("hd,nhd->hn", q[i].float(), ki) * (scale or q.shape[2] ** -0.5), cap
        )
        out.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), vi))
    return torch.stack(out)


def _check(lens, num_heads, num_kv_heads, head_dim, dtype, splits, seed=0, block_n=DA.BLOCK_N, window=None):
    case = _case(lens, num_heads, num_kv_heads, head_dim, dtype, seed)
    got = DA.decode_attention(*case, splits=splits, block_n=block_n, window=window)
    want = _reference(*case, window=window)
    assert got.shape == want.shape and got.dtype == dtype
    err = (got.float() - want).abs().max().item()
    assert err < TOL[dtype], (lens, splits, window, err)
    return got, want, case


@pytest.mark.parametrize("splits", [1, 2, 8])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_matches_reference(splits, group):
    # 1 token; one block; a block and one; several blocks; splits past the end of the short ones
    lens = [1, 64, 65, 300]
    _check(lens, 2 * group, 2, 32, torch.float32, splits=splits)


def test_head_dim_not_a_power_of_two_and_bf16():
    _check([3, 130], num_heads=4, num_kv_heads=2, head_dim=20, dtype=torch.float32, splits=4)
    _check([5, 200], num_heads=4, num_kv_heads=1, head_dim=64, dtype=torch.bfloat16, splits=2)


@settings(max_examples=8, deadline=None)
@given(
    lens=st.lists(st.integers(1, 150), min_size=1, max_size=3),
    splits=st.sampled_from([1, 2, 4, 16]),
    block_n=st.sampled_from([16, 32]),
    seed=st.integers(0, 1000),
)
def test_any_lengths_and_splits(lens, splits, block_n, seed):
    _check(lens, 4, 2, 16, torch.float32, splits=splits, seed=seed, block_n=block_n)


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("window", [1, 20, 64, 100])
def test_sliding_window(splits, window):
    """Each request attends to its last `window` tokens: windows of one token, shorter than a KV block,
    one block, longer than some requests; requests shorter than, equal to and longer than the window.
    The full-attention reference differs where a request passes the window (so the window is used)."""
    lens = [1, 20, 64, 65, 150, 300]
    got, _, case = _check(lens, 4, 2, 16, torch.float32, splits=splits, window=window)
    full = _reference(*case)
    for i, n in enumerate(lens):
        gap = (got[i].float() - full[i]).abs().max().item()
        assert (gap > 1e-3) == (n > window), (n, window, gap)


@settings(max_examples=6, deadline=None)
@given(
    lens=st.lists(st.integers(1, 150), min_size=1, max_size=3),
    splits=st.sampled_from([1, 2, 8]),
    window=st.integers(1, 160),
    seed=st.integers(0, 1000),
)
def test_sliding_window_any_lengths(lens, splits, window, seed):
    _check(lens, 4, 1, 16, torch.float32, splits=splits, seed=seed, block_n=16, window=window)


@pytest.mark.parametrize("window", [0, 50])
def test_merge_reads_only_the_splits_that_hold_tokens(window):
    """The merge weighs the parts of the splits that hold tokens and never reads the others: with NaN
    in every other split's part and log-sum-exp it still gives the live parts' weighted mean (a read
    of one empty split would make the output NaN)."""
    lens, heads, splits, block_n, d = [1, 17, 40, 200], 2, 8, 16, 16
    bs = len(lens)
    g = torch.Generator().manual_seed(5)
    part = torch.randn(bs * heads * splits, d, generator=g)
    lse = torch.randn(bs * heads * splits, generator=g)
    want = torch.empty(bs, heads, d)
    for b, n in enumerate(lens):
        n = min(n, window) if window else n
        chunk = math.ceil(math.ceil(n / splits) / block_n) * block_n
        live = math.ceil(n / chunk)
        for h in range(heads):
            base = (b * heads + h) * splits
            part[base + live : base + splits] = float("nan")
            lse[base + live : base + splits] = float("nan")
            w = lse[base : base + live].softmax(0)
            want[b, h] = (w[:, None] * part[base : base + live]).sum(0)
    out_dev = torch.empty(bs, heads, d, device=DEVICE)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    DA._merge_kernel[(bs, heads)](
        part.to(DEVICE), lse.to(DEVICE), lens_t.to(DEVICE), out_dev, out_dev.stride(0), out_dev.stride(1),
        NUM_HEADS=heads, HEAD_DIM=d, BLOCK_D=d, BLOCK_N=block_n, SPLITS=splits, WINDOW=window, USE_PDL=False,
    )  # fmt: skip
    assert torch.allclose(out_dev.cpu(), want, atol=1e-5), (out_dev.cpu() - want).abs().max()


def test_rejects_a_window_that_is_no_positive_integer():
    case = _case([4], 2, 2, 16, torch.float32, 0)
    for window in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="window must be None .* or an integer >= 1"):
            DA.decode_attention(*case, splits=1, window=window)


def test_num_splits_fills_the_gpu_with_powers_of_two():
    assert DA.num_splits(1, 8, 132) == 32  # 264 programs wanted: 8 heads x 32 splits
    assert DA.num_splits(4, 8, 132) == 8
    assert DA.num_splits(16, 8, 132) == 2
    assert DA.num_splits(64, 8, 132) == 1
    assert DA.num_splits(1, 1, 1000) == 64  # at most 64
    assert all(s & (s - 1) == 0 for s in (DA.num_splits(b, h, 132) for b in range(1, 300) for h in (1, 2, 8)))


def test_rejects_heads_that_do_not_group():
    q, k, v, table, rows, lens = _case([4], 3, 2, 16, torch.float32, 0)
    with pytest.raises(ValueError, match=r"multiple of KV heads.*\(1, 3, 16\)"):
        DA.decode_attention(q, k, v, table, rows, lens, splits=1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_captured_graph_replays_new_lengths():
    """Captured once on one-token requests, replayed after new rows and lengths are written into the
    same buffers: each replay equals the reference (the engine's decode graphs do this every step)."""
    q, k, v, table, rows, lens = _case([200, 40, 7], 16, 8, 128, torch.bfloat16, 3)
    n = torch.ones_like(lens)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        DA.decode_attention(q, k, v, table, rows, n)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = DA.decode_attention(q, k, v, table, rows, n)
    for new in ([200, 40, 7], [1, 180, 33]):
        n.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        err = (out.float() - _reference(q, k, v, table, rows, n.cpu())).abs().max().item()
        assert err < TOL[torch.bfloat16], (new, err)


@pytest.mark.parametrize("splits", [1, 4])
def test_soft_cap_and_scale(splits):
    """Gemma's options: scores soft-capped at 5 (small enough to bite) after a softmax scale of the
    model's own, under a window; without the cap the output differs (so the cap is applied)."""
    case = _case([1, 40, 130], 4, 2, 16, torch.float32, 0)
    got = DA.decode_attention(*case, splits=splits, window=20, sm_scale=0.3, soft_cap=5.0)
    want = _reference(*case, window=20, scale=0.3, cap=5.0)
    assert (got.float() - want.to(got.device)).abs().max().item() < 1e-4
    uncapped = _reference(*case, window=20, scale=0.3)
    assert (got.float() - uncapped.to(got.device)).abs().max().item() > 1e-3
