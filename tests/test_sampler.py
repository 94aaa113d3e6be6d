"""Tests of the sampler (minisgl.engine.sample, .draw, .sampling_args): greedy, filters, seeded
reproducibility, exact distributions."""

from __future__ import annotations

import math
import os
import random
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from torch._dynamo.testing import CompileCounterWithBackend

from minisgl.compile import raise_recompile_limit
from minisgl.core import Batch, Req, SamplingParams
from minisgl.engine.draw import (
    SAMPLE_BLOCK,
    TOP_K_ALL,
    WEIGHT_BITS,
    blocked_cumsum,
    draw,
    keep_mask,
    mark_batch_unbacked,
    sample_rows,
    token_weights,
)
from minisgl.engine.sample import Sampler
from minisgl.engine.sampling_args import BatchSamplingArgs, LogprobArgs
from minisgl.kernels import draw as draw_kernels

CPU = torch.device("cpu")
NUM_DRAWS = 20_000


def make_req(uid: int, params: SamplingParams, offset: int = 5) -> Req:
    req = Req(input_ids=[1, 2, 3], table_idx=uid, cached_len=0, output_len=8, uid=uid, sampling_params=params)
    req.device_len = offset
    return req


def run_sampler(logits: torch.Tensor, reqs: list[Req], rng: random.Random | None = None) -> torch.Tensor:
    sampler = Sampler(CPU, logits.shape[1])
    if rng is None:
        args = sampler.prepare(Batch(reqs=reqs, phase="decode"))
    else:
        args = BatchSamplingArgs.from_reqs(reqs, CPU, rng)
    return sampler.sample(logits, args)


def random_params(rng: random.Random) -> SamplingParams:
    """Any kind of request: greedy or sampled, with or without filters and seed."""
    if rng.random() < 0.2:
        return SamplingParams(temperature=0.0)
    return SamplingParams(
        temperature=rng.choice([0.3, 0.7, 1.0, 1.5]),
        top_k=rng.choice([-1, 0, 1, 5, 40]),
        top_p=rng.choice([1.0, 0.9, 0.5]),
        min_p=rng.choice([0.0, 0.05, 0.2]),
        seed=rng.choice([None, rng.randrange(2**63)]),
    )


def expected_distribution(
    logits: list[float], temperature: float, top_k: int = -1, top_p: float = 1.0, min_p: float = 0.0
) -> np.ndarray:
    """The filtered, renormalised softmax, written out plainly in float64.

    Also checks that no token sits within a hair of a top-p or min-p threshold, where float32 and
    float64 could disagree and the test would not be well posed.
    """
    scaled = [x / temperature for x in logits]
    top = max(scaled)
    weights = [math.exp(x - top) for x in scaled]
    total = sum(weights)
    probs = [w / total for w in weights]
    order = sorted(range(len(probs)), key=lambda i: -probs[i])  # Python's sort is stable
    pmax = probs[order[0]]
    keep = [False] * len(probs)
    mass_before = 0.0
    for rank, token in enumerate(order):
        if top_p < 1.0:
            assert abs(mass_before - top_p) > 1e-4, "top_p too close to a cumulative sum"
        if min_p > 0.0:
            assert abs(probs[token] - min_p * pmax) > 1e-4 * pmax, "min_p too close to a probability"
        kept_by_k = top_k <= 0 or rank < top_k
        kept_by_p = top_p >= 1.0 or mass_before < top_p
        kept_by_min_p = probs[token] >= min_p * pmax
        keep[token] = kept_by_k and kept_by_p and kept_by_min_p
        mass_before += probs[token]
    filtered = np.array([p if k else 0.0 for p, k in zip(probs, keep)])
    return filtered / filtered.sum()


def draw_many(logits: torch.Tensor, params: SamplingParams, rng: random.Random | None = None) -> np.ndarray:
    """NUM_DRAWS draws from one row of logits, one per offset 0..NUM_DRAWS-1; returns counts per token."""
    reqs = [make_req(i, params, offset=i) for i in range(NUM_DRAWS)]
    tokens = run_sampler(logits[None, :].expand(NUM_DRAWS, -1), reqs, rng)
    return np.bincount(tokens.numpy(), minlength=logits.shape[0])


def check_distribution(counts: np.ndarray, expected: np.ndarray) -> None:
    assert counts.sum() == NUM_DRAWS
    dropped = expected == 0
    assert counts[dropped].sum() == 0, f"filtered-out tokens were drawn: {np.nonzero(counts * dropped)}"
    f_exp = expected[~dropped] * NUM_DRAWS
    assert f_exp.min() >= 5, "test setup: every surviving cell needs an expected count >= 5"
    result = chisquare(counts[~dropped], f_exp)
    assert result.pvalue > 1e-3, f"chi-square p={result.pvalue:.2e}, counts={counts}, expected={f_exp}"


def spread_logits(vocab: int, seed: int) -> torch.Tensor:
    """Distinct logits spread over [-1.5, 1.5] in a shuffled order (no ties, no vanishing tokens)."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.linspace(-1.5, 1.5, vocab) + 0.01 * torch.rand(vocab, generator=gen)
    return values[torch.randperm(vocab, generator=gen)]


# --- greedy ------------------------------------------------------------------------------------------


def test_greedy_is_argmax() -> None:
    logits = torch.randn(16, 100, generator=torch.Generator().manual_seed(0))
    reqs = [make_req(i, SamplingParams(temperature=0.0)) for i in range(16)]
    assert torch.equal(run_sampler(logits, reqs), logits.argmax(dim=-1).to(torch.int32))


def test_greedy_rows_in_mixed_batch_are_argmax() -> None:
    logits = torch.randn(12, 100, generator=torch.Generator().manual_seed(1))
    params = [
        SamplingParams(temperature=0.0)
        if i % 2 == 0
        else SamplingParams(temperature=1.5, top_k=50, top_p=0.9, min_p=0.01, seed=i)
        for i in range(12)
    ]
    out = run_sampler(logits, [make_req(i, p) for i, p in enumerate(params)])
    argmax = logits.argmax(dim=-1).to(torch.int32)
    assert torch.equal(out[0::2], argmax[0::2])
    # the sampled rows are not all stuck on the argmax at T=1.5 over 100 tokens
    assert not torch.equal(out[1::2], argmax[1::2])


def test_top_k_1_is_greedy() -> None:
    logits = torch.randn(32, 200, generator=torch.Generator().manual_seed(2))
    reqs = [make_req(i, SamplingParams(temperature=1.0, top_k=1)) for i in range(32)]
    assert torch.equal(run_sampler(logits, reqs), logits.argmax(dim=-1).to(torch.int32))


# --- seeds -------------------------------------------------------------------------------------------


def test_seed_gives_same_token_alone_and_in_any_batch() -> None:
    vocab = 64
    rng = random.Random(3)
    gen = torch.Generator().manual_seed(3)
    for pair in range(40):
        seed, offset = rng.randrange(2**63), rng.randrange(1, 100_000)
        params = SamplingParams(
            temperature=rng.choice([0.5, 1.0, 2.0]), top_k=rng.choice([-1, 30]), top_p=0.95, seed=seed
        )
        row = torch.randn(vocab, generator=gen) * 2
        alone = run_sampler(row[None, :], [make_req(0, params, offset)])
        for batch_size in (2, 5, 9):
            position = rng.randrange(batch_size)
            logits = torch.randn(batch_size, vocab, generator=gen) * 2
            logits[position] = row
            reqs = [
                make_req(i, random_params(rng), offset=rng.randrange(1, 100_000)) for i in range(batch_size)
            ]
            reqs[position] = make_req(position, params, offset)
            out = run_sampler(logits, reqs)
            assert out[position] == alone[0], f"pair {pair}: seed {seed} offset {offset}, batch {batch_size}"


def test_seed_and_offset_both_change_the_draw() -> None:
    logits = torch.zeros(1, 64)  # uniform: every token equally likely

    def draw(seed: int, offset: int) -> int:
        return int(run_sampler(logits, [make_req(0, SamplingParams(temperature=1.0, seed=seed), offset)]))

    assert len({draw(seed, 10) for seed in range(30)}) > 1
    assert len({draw(1234, offset) for offset in range(30)}) > 1
    assert draw(1234, 10) == draw(1234, 10)


def test_unseeded_requests_vary_between_prepares() -> None:
    logits = torch.zeros(8, 1000)
    reqs = [make_req(i, SamplingParams(temperature=1.0)) for i in range(8)]
    sampler = Sampler(CPU, 1000)
    batch = Batch(reqs=reqs, phase="decode")
    args1, args2 = sampler.prepare(batch), sampler.prepare(batch)
    assert args1.seeds is not None and args2.seeds is not None
    assert not torch.equal(args1.seeds, args2.seeds)
    assert not torch.equal(sampler.sample(logits, args1), sampler.sample(logits, args2))


# --- exact distributions (chi-square over NUM_DRAWS draws) ------------------------------------------


def test_distribution_temperature() -> None:
    logits = spread_logits(16, seed=10)
    counts = draw_many(logits, SamplingParams(temperature=0.7, seed=42))
    check_distribution(counts, expected_distribution(logits.tolist(), 0.7))


def test_distribution_unseeded() -> None:
    logits = spread_logits(20, seed=11)
    counts = draw_many(logits, SamplingParams(temperature=1.0), rng=random.Random(7))
    check_distribution(counts, expected_distribution(logits.tolist(), 1.0))


@pytest.mark.parametrize(
    "logits_seed, temperature, sample_seed, one_filter",
    [(12, 1.0, 43, {"top_k": 7}), (13, 0.8, 44, {"top_p": 0.6}), (14, 1.0, 45, {"min_p": 0.25})],
    ids=["top_k", "top_p", "min_p"],
)
def test_distribution_one_filter(logits_seed, temperature, sample_seed, one_filter) -> None:
    logits = spread_logits(24, seed=logits_seed)
    counts = draw_many(logits, SamplingParams(temperature=temperature, seed=sample_seed, **one_filter))
    expected = expected_distribution(logits.tolist(), temperature, **one_filter)
    assert 1 < (expected > 0).sum() < 24  # the filter drops some tokens, not all but one
    check_distribution(counts, expected)


def test_distribution_combined_filters() -> None:
    logits = spread_logits(40, seed=15)
    params = SamplingParams(temperature=0.9, top_k=15, top_p=0.8, min_p=0.1, seed=46)
    counts = draw_many(logits, params)
    expected = expected_distribution(logits.tolist(), 0.9, top_k=15, top_p=0.8, min_p=0.1)
    # each filter keeps a prefix of the tokens sorted by probability, so together they keep the shortest
    assert 1 < (expected > 0).sum() <= 15
    check_distribution(counts, expected)


# --- parameters and outputs --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "text"),
    [
        ({"temperature": -0.5}, "temperature=-0.5"),
        ({"top_p": 0.0}, "top_p=0.0"),
        ({"top_p": 1.5}, "top_p=1.5"),
        ({"top_k": -2}, "top_k=-2"),
        ({"min_p": 1.5}, "min_p=1.5"),
    ],
)
def test_invalid_params_raise(kwargs: dict[str, float], text: str) -> None:
    with pytest.raises(ValueError, match=re.escape(text)):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_output_dtype_shape_device(temperature: float, dtype: torch.dtype) -> None:
    logits = torch.randn(5, 50).to(dtype)
    out = run_sampler(logits, [make_req(i, SamplingParams(temperature=temperature)) for i in range(5)])
    assert out.dtype == torch.int32
    assert out.shape == (5,)
    assert out.device == logits.device


def test_args_from_reqs() -> None:
    greedy = BatchSamplingArgs.from_reqs([make_req(0, SamplingParams())], CPU)
    assert greedy.all_greedy and not greedy.need_filter and greedy.temperatures is None

    # filters on a greedy request do not count
    reqs = [make_req(0, SamplingParams(top_k=3)), make_req(1, SamplingParams(temperature=1.0), offset=17)]
    args = BatchSamplingArgs.from_reqs(reqs, CPU)
    assert not args.all_greedy and not args.need_filter
    assert args.offsets is not None and args.offsets.tolist() == [5, 17]
    assert args.top_k is not None and args.top_k.tolist() == [3, TOP_K_ALL]

    for params in (
        SamplingParams(temperature=1.0, top_k=5),
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=1.0, min_p=0.1),
    ):
        assert BatchSamplingArgs.from_reqs([make_req(0, params)], CPU).need_filter


def test_logprob_args_of_a_decode_batch_equal_the_general_paths() -> None:
    """Without prompt log probabilities (a decode step) `LogprobArgs.from_reqs` takes a shorter path:
    the same rows, targets, plan and top as the general one, for requests scored or not and one still
    prefilling (a partial chunk: its sampled token is not scored)."""
    partial = make_req(2, SamplingParams(logprobs=2))
    partial.input_ids = list(range(1, 12))  # its prefill has 6 prompt tokens left after this chunk
    reqs = [make_req(0, SamplingParams(logprobs=5)), make_req(1, SamplingParams()), partial]
    reqs += [make_req(3, SamplingParams(logprobs=0, temperature=1.0), offset=9)]
    fast, general = LogprobArgs._sampled_only(reqs, CPU), LogprobArgs._with_prompts(reqs, CPU)
    assert LogprobArgs.from_reqs(reqs, CPU).plan == fast.plan
    assert fast.rows is None and fast.last is None and general.rows is None and general.last is None
    for name in ("lp_rows", "targets", "sampled_of"):
        assert torch.equal(getattr(fast, name), getattr(general, name)), name
    assert fast.lp_rows.tolist() == [0, 3] and fast.targets.tolist() == [-1, -1]
    assert (fast.top, fast.plan) == (general.top, general.plan) == (5, fast.plan)
    assert fast.plan[2] == general.plan[2] == (0, 0, 0, 0, 0)
    assert LogprobArgs.from_reqs([make_req(0, SamplingParams())], CPU) is None


def test_padded_vocab_columns_are_ignored() -> None:
    logits = torch.randn(4, 40)
    logits[:, 32:] = 100.0
    reqs = [make_req(i, SamplingParams(temperature=1.0 if i % 2 else 0.0, seed=i)) for i in range(4)]
    args = BatchSamplingArgs.from_reqs(reqs, CPU)
    out = Sampler(CPU, 32).sample(logits, args)
    assert bool((out < 32).all())
    with pytest.raises(ValueError, match="vocab_size=64"):
        Sampler(CPU, 64).sample(logits, args)


@pytest.mark.parametrize("vocab", [1, 5, 1023, 1024, 1025, 3000, 151_936])
def test_two_level_search_equals_one_long_search(vocab: int) -> None:
    """The block-then-token search picks the token a search over one cumulative sum of the whole
    vocabulary picks, including rows where most tokens (whole blocks among them) weigh zero, and targets
    at the edges (0 and total - 1)."""
    gen = torch.Generator().manual_seed(vocab)
    rows = 64
    weights = torch.randint(0, 2**WEIGHT_BITS + 1, (rows, vocab), generator=gen)
    keep = torch.rand(rows, vocab, generator=gen) < torch.linspace(0.001, 1.0, rows)[:, None]
    keep[:, 0] |= ~keep.any(dim=1)
    weights = weights * keep
    weights[:, 0] += 1  # every row has weight
    cdf = weights.cumsum(dim=-1)
    targets = (torch.rand(rows, generator=gen, dtype=torch.float64) * cdf[:, -1]).floor().long()
    targets[0], targets[1] = 0, cdf[1, -1] - 1
    got = draw(weights, targets)
    assert torch.equal(got, torch.searchsorted(cdf, targets[:, None], right=True).squeeze(1))
    assert bool((weights.gather(1, got[:, None]) > 0).all())  # never a token of weight zero
    assert torch.equal(blocked_cumsum(weights), cdf)


def test_two_level_search_at_a_block_edge() -> None:
    """All the weight on the last token of one block and the first of the next: a target on either side
    of the boundary lands on each."""
    weights = torch.zeros(2, 4096, dtype=torch.int64)
    weights[:, SAMPLE_BLOCK - 1] = 10
    weights[:, SAMPLE_BLOCK] = 10
    assert draw(weights, torch.tensor([9, 10])).tolist() == [SAMPLE_BLOCK - 1, SAMPLE_BLOCK]


def test_token_weights_fixed_point() -> None:
    """The top token weighs exactly 2**WEIGHT_BITS, the others exp(-gap / T) of that (rounded), -inf 0."""
    logits = torch.tensor([[0.0, 2.0, float("-inf"), 1.0, -60.0]])
    weights = token_weights(logits, torch.tensor([0.5]))
    assert weights.dtype == torch.int64
    assert weights[0, 1] == 2**WEIGHT_BITS and weights[0, 2] == 0 and weights[0, 4] == 0
    assert abs(weights[0, 3].item() / 2**WEIGHT_BITS - math.exp(-2.0)) < 1e-6
    assert abs(weights[0, 0].item() / 2**WEIGHT_BITS - math.exp(-4.0)) < 1e-6


def test_sampler_runs_eagerly_on_cpu() -> None:
    """`compile` only applies on CUDA: a CPU sampler runs the function eagerly either way."""
    assert not Sampler(CPU, 10).compiled and not Sampler(CPU, 10, compile=False).compiled


def test_compiled_sampler_equals_eager() -> None:
    """`torch.compile` of the sampling function (what runs on CUDA, batch dimension unbacked) gives the
    tokens the eager function gives, on batches of 1 and several, with and without filters, on the CPU
    backend of inductor (integer weights: no rounding depends on how the compiler orders the sums); one
    graph per `need_filter`, for every batch size."""
    raise_recompile_limit()
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(sample_rows, fullgraph=True, dynamic=False, backend=counter)
    rng = random.Random(5)
    gen = torch.Generator().manual_seed(5)
    vocab = 3000
    for batch_size, need_filter in [(1, False), (2, False), (7, False), (1, True), (3, True), (9, True)]:
        reqs = [make_req(i, random_params(rng), offset=rng.randrange(10_000)) for i in range(batch_size)]
        reqs[0] = make_req(0, SamplingParams(temperature=0.8, top_p=0.9 if need_filter else 1.0, seed=1))
        args = BatchSamplingArgs.from_reqs(reqs, CPU)
        logits = torch.randn(batch_size, vocab, generator=gen) * 4
        mark_batch_unbacked(logits, args.floats, args.ints)
        want = sample_rows(logits, args.floats, args.ints, need_filter)
        assert torch.equal(compiled(logits, args.floats, args.ints, need_filter), want), (
            batch_size,
            need_filter,
        )
    assert counter.frame_count == 2  # one graph per need_filter value


# --- the draw without filters as Triton kernels (minisgl.kernels.draw; Triton's interpreter here) -------


def filtered_args(batch: int, rng: random.Random) -> BatchSamplingArgs:
    """Requests of every kind (`random_params`), seeded at random offsets, one of them filtered."""
    params = [random_params(rng) for _ in range(batch)]
    params[0] = SamplingParams(
        temperature=0.8, top_k=rng.choice([1, 3, 50]), top_p=0.9, seed=rng.randrange(2**63)
    )
    reqs = [make_req(i, p, rng.randrange(1, 10**6)) for i, p in enumerate(params)]
    args = BatchSamplingArgs.from_reqs(reqs, CPU)
    assert args.need_filter
    return args


def unfiltered_args(batch: int, rng: random.Random) -> BatchSamplingArgs:
    """Temperature-only requests, every third greedy, seeded at random offsets."""
    params = [
        SamplingParams(
            temperature=0.0 if i % 3 == 2 else rng.choice([0.3, 0.6, 1.0, 1.7]), seed=rng.randrange(2**63)
        )
        for i in range(batch)
    ]
    args = BatchSamplingArgs.from_reqs(
        [make_req(i, p, rng.randrange(1, 10**6)) for i, p in enumerate(params)], CPU
    )
    assert not args.need_filter
    return args


@pytest.mark.skipif(draw_kernels.triton is None, reason="needs triton (its interpreter on a CPU)")
@pytest.mark.parametrize("vocab", [40, 2047, 2048, 2049, 6000])
def test_triton_draw_equals_sample_rows(vocab: int) -> None:
    """`draw_unfiltered` (what a CUDA sampler runs for a batch without top-k / top-p / min-p) draws
    `sample_rows`' tokens: greedy and sampled rows mixed, rows of several blocks and a partial last one,
    suppressed (-inf) tokens, bf16 logits, a slice of wider rows; the sampled rows are not the argmax."""
    rng = random.Random(vocab)
    gen = torch.Generator().manual_seed(vocab)
    for batch, scale in [(1, 1.0), (5, 3.0), (9, 0.5)]:
        args = unfiltered_args(batch, rng)
        logits = torch.randn(batch, vocab + 7, generator=gen) * scale
        logits[:, rng.randrange(vocab)] = float("-inf")
        for rows in (logits[:, :vocab], logits[:, :vocab].to(torch.bfloat16)):
            want = sample_rows(rows, args.floats, args.ints, False)
            got = draw_kernels.draw_unfiltered(rows, args.floats, args.ints)
            assert got.dtype == torch.int32 and torch.equal(got, want), (vocab, batch, rows.dtype)
    sampled = args.floats[0] > 0
    assert not torch.equal(got[sampled], rows.float().argmax(dim=-1).to(torch.int32)[sampled])


@pytest.mark.skipif(draw_kernels.triton is None, reason="needs triton (its interpreter on a CPU)")
@pytest.mark.parametrize("vocab", [40, 3000])
def test_triton_filtered_draw_equals_sample_rows(vocab: int) -> None:
    """`draw_filtered` (what a CUDA sampler runs when a request uses top-k, top-p or min-p) draws
    `sample_rows`' tokens: every kind of request mixed (`random_params`), rows of several blocks and a
    partial last one, bf16 logits, a suppressed token, and rows whose weights tie at the filters'
    boundary (logits on a coarse grid), so that only some of the tied tokens, the first by id, are kept."""
    rng = random.Random(vocab)
    gen = torch.Generator().manual_seed(vocab)
    split_ties = 0
    for batch, scale, grid in [(6, 3.0, 0.0), (5, 1.0, 0.5), (4, 8.0, 2.0)]:
        args = filtered_args(batch, rng)
        logits = torch.randn(batch, vocab, generator=gen) * scale
        if grid:  # many tokens of equal logit, hence equal weight
            logits = (logits / grid).round() * grid
        logits[:, rng.randrange(vocab)] = float("-inf")
        for rows in (logits, logits.to(torch.bfloat16)):
            want = sample_rows(rows, args.floats, args.ints, True)
            got = draw_kernels.draw_filtered(rows, args.floats, args.ints)
            assert torch.equal(got, want), (batch, scale, grid, rows.dtype, got, want)
        temperature, top_p, min_p = args.floats.unbind(0)
        weights = token_weights(logits, torch.where(temperature == 0, 1.0, temperature))
        kept = keep_mask(weights, args.ints[0], top_p, min_p)
        for w, k in zip(weights, kept):  # the least kept weight: some of its tokens kept, not all?
            least = w[k].min()
            split_ties += bool(k[w == least].sum() < (w == least).sum())
    assert split_ties >= 2


@pytest.mark.skipif(draw_kernels.triton is None, reason="needs triton (its interpreter on a CPU)")
def test_triton_filtered_draw_at_the_filters_edges() -> None:
    """Top-k of 1 and of more than the vocabulary, top-p so small only the top token stays, min-p 1
    (only the tokens as heavy as the top one: a tie of three), every filter at once: `sample_rows`'
    tokens, and the kept set is what each filter says (top-k 1 and the tiny top-p give the argmax)."""
    vocab = 300
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(3)) * 2
    logits[4, [5, 77, 200]] = logits[4].max() + 1.0  # three tokens tie at the top
    params = [
        SamplingParams(temperature=1.0, top_k=1, seed=1),
        SamplingParams(temperature=1.0, top_k=10**6, seed=2),
        SamplingParams(temperature=1.0, top_p=1e-9, seed=3),
        SamplingParams(temperature=0.3, top_k=7, top_p=0.6, min_p=0.01, seed=4),
        SamplingParams(temperature=1.0, min_p=1.0, seed=5),
        SamplingParams(temperature=0.0, top_k=3),
    ]
    args = BatchSamplingArgs.from_reqs([make_req(i, p, 17 + i) for i, p in enumerate(params)], CPU)
    got = draw_kernels.draw_filtered(logits, args.floats, args.ints)
    assert torch.equal(got, sample_rows(logits, args.floats, args.ints, True))
    argmax = logits.argmax(dim=-1)
    assert got[0] == argmax[0] and got[2] == argmax[2] and got[5] == argmax[5]
    assert int(got[4]) in (5, 77, 200)


@pytest.mark.skipif(draw_kernels.triton is None, reason="needs triton (its interpreter on a CPU)")
def test_triton_filtered_draw_finds_the_boundary_among_close_weights() -> None:
    """Top-p's boundary inside a cluster of 2,999 weights that differ by about 1e5 (a 2**-23 step of the
    logit), closer than one search pass's interval: the search must narrow down to the exact weight
    (every pass, none skipped), or the cluster's lighter tokens are kept and the draws change."""
    vocab, rows = 3000, 12
    logits = -1.0 - torch.arange(vocab, dtype=torch.float32) * 2.0**-22
    logits[0] = 0.0
    params = [SamplingParams(temperature=1.0, top_p=0.5, seed=s) for s in range(rows)]
    args = BatchSamplingArgs.from_reqs([make_req(i, p, 5) for i, p in enumerate(params)], CPU)
    batch = logits.expand(rows, -1).contiguous()
    got = draw_kernels.draw_filtered(batch, args.floats, args.ints)
    assert torch.equal(got, sample_rows(batch, args.floats, args.ints, True))
    weights = token_weights(batch[:1], args.floats[0, :1])
    kept = keep_mask(weights, args.ints[0, :1], args.floats[1, :1], args.floats[2, :1])[0]
    assert 1000 < int(kept.sum()) < 2000  # the boundary is inside the cluster
    assert bool(kept[got.long()].all()) and len(set(got.tolist())) > rows // 2


def test_triton_draw_greedy_ties_and_flat_rows() -> None:
    """A greedy row whose max appears in several blocks takes its first token (argmax's); a row of equal
    logits draws by the hash alone, as `sample_rows` does; nothing lands past the vocabulary."""
    vocab = 3 * draw_kernels.BLOCK + 5
    logits = torch.zeros(4, vocab)
    logits[0, [draw_kernels.BLOCK + 3, 7, 2 * draw_kernels.BLOCK]] = 2.0  # greedy: 7
    logits[1, vocab - 1] = 1.0  # greedy: the last token, in the partial block
    args = BatchSamplingArgs.from_reqs(
        [
            make_req(i, SamplingParams(temperature=t, seed=i), 11 + i)
            for i, t in enumerate([0.0, 0.0, 1.0, 0.2])
        ],
        CPU,
    )
    got = draw_kernels.draw_unfiltered(logits, args.floats, args.ints)
    assert got[:2].tolist() == [7, vocab - 1]
    assert torch.equal(got, sample_rows(logits, args.floats, args.ints, False))


_COMPILE_DRAW = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from minisgl.kernels import draw as D

types = {"logits_ptr": "*bf16", "stride": "i32", "V": "i32", "max_ptr": "*fp32", "NB": "i32", "arg_ptr": "*i32"}
types |= {"floats_ptr": "*fp32", "sum_ptr": "*i64", "ints_ptr": "*i64", "istride": "i32", "out_ptr": "*i32"}
types |= {"fstride": "i32", "bounds_ptr": "*i64", "cnt_ptr": "*i32", "wsum_ptr": "*i64", "least_ptr": "*i64"}
types |= {"gt_sum_ptr": "*i64", "gt_cnt_ptr": "*i32", "tie_ptr": "*i32"}
values = {"BLOCK": D.BLOCK, "NB_POW2": 128, "PIVOTS": D.PIVOTS, "PIVOTS_POW2": 64, "FIRST": False}
for name in KERNELS:
    kernel = getattr(D, name)
    constexprs = {n: v for n, v in values.items() if n in kernel.arg_names}
    signature = {n: "constexpr" if n in constexprs else types[n] for n in kernel.arg_names}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    assert triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["cubin"]
    print("compiled", name)
"""
_DRAW_KERNELS = ("_block_max_kernel", "_block_weight_kernel", "_pick_kernel", "_search_block_kernel")
_DRAW_KERNELS += ("_search_row_kernel", "_least_kept_kernel", "_tie_block_kernel", "_filtered_pick_kernel")


@pytest.mark.skipif(draw_kernels.triton is None, reason="needs triton")
def test_triton_draw_kernels_compile_for_an_h100() -> None:
    """The draws' kernels compile to sm_90 machine code with Triton's own ptxas, no GPU needed (in a
    process without the interpreter): the tests above run their Python, but only the compiler refuses
    what a GPU build cannot take (a global that is not a constexpr, a type the hardware lacks)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # (Triton's default; set, so that it does not warn)
    done = subprocess.run(
        [sys.executable, "-c", f"KERNELS = {_DRAW_KERNELS!r}\n" + _COMPILE_DRAW],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[: len(_DRAW_KERNELS)] == [f"compiled {k}" for k in _DRAW_KERNELS]
