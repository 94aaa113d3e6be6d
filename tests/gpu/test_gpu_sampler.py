"""The compiled sampler on CUDA: batch invariance of seeded draws at Qwen3's vocabulary, greedy rows,
and exact distributions (chi-square), as tests/test_sampler.py checks the eager sampler on CPU.
Skips without CUDA."""

import dataclasses
import random

import pytest
import torch
from test_sampler import (
    NUM_DRAWS,
    check_distribution,
    expected_distribution,
    filtered_args,
    make_req,
    random_params,
    spread_logits,
    unfiltered_args,
)

from minisgl.core import SamplingParams
from minisgl.engine.draw import sample_rows, token_weights
from minisgl.engine.sample import GRAPH_MAX_BS, Sampler
from minisgl.engine.sampling_args import BatchSamplingArgs

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
CUDA = torch.device("cuda")
VOCAB = 151_936  # Qwen3's


def _sample(sampler: Sampler, logits: torch.Tensor, reqs) -> torch.Tensor:
    return sampler.sample(logits, BatchSamplingArgs.from_reqs(reqs, CUDA)).cpu()


def test_seeded_draw_alone_equals_inside_any_batch() -> None:
    """Each seeded request (random temperature and filters) draws the same token alone (its own
    compiled graph for one row) and at any position of batches of 2 to 256 rows of other requests."""
    sampler = Sampler(CUDA, VOCAB)
    assert sampler.compiled
    rng = random.Random(0)
    gen = torch.Generator(device=CUDA).manual_seed(0)
    checked = 0
    for trial in range(12):
        params = random_params(rng)
        if params.seed is None:
            params = dataclasses.replace(params, seed=rng.randrange(2**63))
        offset = rng.randrange(1, 100_000)
        row = torch.randn(VOCAB, generator=gen, device=CUDA) * rng.choice([1.0, 4.0])
        alone = _sample(sampler, row[None, :], [make_req(0, params, offset)])
        for batch_size in (2, 5, 64, 256):
            position = rng.randrange(batch_size)
            logits = torch.randn(batch_size, VOCAB, generator=gen, device=CUDA) * 3
            logits[position] = row
            reqs = [
                make_req(i, random_params(rng), offset=rng.randrange(1, 100_000)) for i in range(batch_size)
            ]
            reqs[position] = make_req(position, params, offset)
            out = _sample(sampler, logits, reqs)
            assert out[position] == alone[0], f"trial {trial}: {params}, batch {batch_size} at {position}"
            checked += 1
    assert checked == 48


def test_greedy_rows_and_tokens_of_weight() -> None:
    """In a mixed batch at Qwen3's vocabulary, greedy rows are the argmax and sampled rows draw tokens
    of non-zero weight that are not all the argmax."""
    sampler = Sampler(CUDA, VOCAB)
    gen = torch.Generator(device=CUDA).manual_seed(1)
    logits = torch.randn(256, VOCAB, generator=gen, device=CUDA)
    params = [
        SamplingParams(temperature=0.0) if i % 2 == 0 else SamplingParams(temperature=1.0, seed=i)
        for i in range(256)
    ]
    out = _sample(sampler, logits, [make_req(i, p) for i, p in enumerate(params)])
    argmax = logits.argmax(dim=-1).cpu().to(torch.int32)
    assert torch.equal(out[0::2], argmax[0::2])
    assert not torch.equal(out[1::2], argmax[1::2])
    weights = token_weights(logits, torch.ones(256, device=CUDA)).cpu()
    assert bool((weights.gather(1, out[:, None].long()) > 0).all())


def test_eager_sampler_draws_the_compiled_tokens() -> None:
    """`Sampler(..., compile=False)` (the `compile_sampler` setting off) runs the same function eagerly
    and draws the same tokens, greedy and sampled rows, with and without filters."""
    compiled, eager = Sampler(CUDA, VOCAB), Sampler(CUDA, VOCAB, compile=False)
    assert compiled.compiled and not eager.compiled
    rng = random.Random(3)
    gen = torch.Generator(device=CUDA).manual_seed(3)
    for batch_size in (1, 2, 64):
        logits = torch.randn(batch_size, VOCAB, generator=gen, device=CUDA) * 3
        reqs = [make_req(i, random_params(rng), offset=rng.randrange(1, 100_000)) for i in range(batch_size)]
        args = BatchSamplingArgs.from_reqs(reqs, CUDA, random.Random(4))
        assert torch.equal(compiled.sample(logits, args), eager.sample(logits, args)), batch_size


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.7},
        {"temperature": 1.0, "top_k": 7},
        {"temperature": 0.8, "top_p": 0.6},
        {"temperature": 1.0, "min_p": 0.25},
        {"temperature": 0.9, "top_k": 15, "top_p": 0.8, "min_p": 0.1},
    ],
)
def test_distribution_on_gpu(kwargs) -> None:
    """NUM_DRAWS seeded draws from one row (one offset each) follow the filtered softmax."""
    vocab = 40
    logits = spread_logits(vocab, seed=20)
    reqs = [make_req(i, SamplingParams(seed=77, **kwargs), offset=i) for i in range(NUM_DRAWS)]
    tokens = _sample(Sampler(CUDA, vocab), logits.to(CUDA)[None, :].expand(NUM_DRAWS, -1), reqs)
    counts = torch.bincount(tokens.long(), minlength=vocab).numpy()
    filters = {k: v for k, v in kwargs.items() if k != "temperature"}
    check_distribution(counts, expected_distribution(logits.tolist(), kwargs["temperature"], **filters))


def test_sampler_graphs_draw_the_compiled_tokens() -> None:
    """The sampler's CUDA graphs (captured on static logits of 1, 4 and 8 rows) draw what the compiled
    function draws for the first B rows, with and without filters, at every B up to the graph's size;
    a batch that transforms the logits (suppressed tokens) or is all greedy, or a size above
    GRAPH_MAX_BS, does not replay them."""
    sampler = Sampler(CUDA, VOCAB)
    gen = torch.Generator(device=CUDA).manual_seed(1)
    static = {
        bs: torch.randn(bs, VOCAB, generator=gen, device=CUDA) * 3 for bs in (1, 4, 8, GRAPH_MAX_BS + 8)
    }
    sampler.capture_graphs(static)
    assert sorted(sampler._graphs) == [(bs, f) for bs in (1, 4, 8) for f in (False, True)]
    rng = random.Random(2)
    replays = []
    for graph_bs, bs in [(1, 1), (4, 3), (4, 4), (8, 5), (8, 8), (4, 2)]:
        for filtered in (False, True):
            params = [random_params(rng) for _ in range(bs)]
            if not filtered:
                params = [
                    dataclasses.replace(p, temperature=0.7, top_k=-1, top_p=1.0, min_p=0.0) for p in params
                ]
            reqs = [make_req(i, p, offset=rng.randrange(1, 100_000)) for i, p in enumerate(params)]
            args = BatchSamplingArgs.from_reqs(reqs, CUDA)
            if args.all_greedy:
                continue
            logits = static[graph_bs][:bs]
            want = sampler.sample(logits, args).cpu()
            got = sampler.sample(logits, args, graph_bs=graph_bs)
            assert got.data_ptr() == sampler._graphs[(graph_bs, args.need_filter)][3].data_ptr()  # replayed
            assert torch.equal(got.cpu(), want), (graph_bs, bs, filtered)
            replays.append((graph_bs, args.need_filter))
    assert (8, True) in replays and (4, False) in replays
    # suppressed tokens transform the logits first: the compiled function runs, not the graph
    reqs = [make_req(0, SamplingParams(temperature=1.0, seed=3), offset=7)]
    args = BatchSamplingArgs.from_reqs(reqs, CUDA)
    args.suppress = torch.tensor([[int(static[1][0].argmax())]], device=CUDA)
    tokens = sampler.sample(static[1][:1], args, graph_bs=1)
    assert tokens.data_ptr() != sampler._graphs[(1, False)][3].data_ptr()


@pytest.mark.parametrize("need_filter", [False, True], ids=["unfiltered", "filtered"])
def test_triton_draws_equal_the_eager_function_at_qwen3_vocab(need_filter: bool) -> None:
    """A CUDA sampler draws with the Triton kernels (`minisgl.kernels.draw`): without filters
    (`draw_unfiltered`, greedy and sampled rows mixed) and with top-k / top-p / min-p (`draw_filtered`,
    every kind of request mixed), the tokens of `sample_rows` run eagerly, at batches of 1 to 256,
    float32 and bf16 logits."""
    sampler = Sampler(CUDA, VOCAB)
    assert sampler.fused_draw
    rng = random.Random(10 if need_filter else 9)
    gen = torch.Generator(device=CUDA).manual_seed(10 if need_filter else 9)
    for batch_size in (1, 2, 8, 64, 256):
        args = (filtered_args if need_filter else unfiltered_args)(batch_size, rng)
        assert args.need_filter == need_filter
        args = dataclasses.replace(args, floats=args.floats.to(CUDA), ints=args.ints.to(CUDA))
        scales = [1.0, 3.0, 8.0] if need_filter else [1.0, 3.0]
        logits = torch.randn(batch_size, VOCAB, generator=gen, device=CUDA) * rng.choice(scales)
        for rows in (logits, logits.to(torch.bfloat16)):
            want = sample_rows(rows, args.floats, args.ints, need_filter)
            assert torch.equal(sampler.sample(rows, args), want), (batch_size, rows.dtype)
