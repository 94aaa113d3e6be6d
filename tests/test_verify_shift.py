"""A pending verify batch (speculative decoding's overlap, docs/speculative.md): built on the host as if
the verify step before it had accepted every draft, it is moved on the device by what that step really
accepted (`Engine.forward_verify(pending=True)`, `Engine.move_pending`). Its logits must be those of the
same rows built at the true positions: on the CPU with the torch attention backend, and on a GPU through
the verify CUDA graphs (their attention plan is on the device)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from conftest import GPU_SHAPE, make_tiny_model, rel_err

from minisgl.core import SamplingParams
from minisgl.engine import Engine, EngineConfig
from minisgl.kernels import verify as verify_kernels
from minisgl.scheduler import BatchPreparer

K = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Qwen3 of each device's shape (FlashInfer needs the GPU tests' head size)."""
    folder = tmp_path_factory.mktemp("models")

    def build(device: str):
        (folder / device).mkdir(exist_ok=True)
        return make_tiny_model(folder / device, "qwen3", **(GPU_SHAPE if device == "cuda" else {}))

    return build


def _engines() -> list[dict]:
    cpu = dict(device="cpu", dtype=torch.float32, attention_backend="torch")
    if not torch.cuda.is_available() or importlib.util.find_spec("flashinfer") is None:
        return [cpu]
    return [cpu, dict(device="cuda", dtype=torch.bfloat16, attention_backend="fi", cuda_graph_max_bs=8)]


def _rows(
    engine: Engine, prep: BatchPreparer, seqs, drafts, rejected, pending: bool, move: bool = True
) -> torch.Tensor:
    """Each sequence's last token and its drafts as one verify batch, after the rest of it is in the KV
    cache: built at the true positions, or (`pending`) `rejected[i]` positions further on (as if those
    tokens had been accepted, with a wrong token in the first row), moved back on the device (unless
    not `move`)."""
    reqs = [prep.add_request(seq, SamplingParams(max_tokens=8)) for seq in seqs]
    try:
        engine.forward_logits(prep.prefill(reqs, [len(s) - 1 for s in seqs]))
        for req, draft, r in zip(reqs, drafts, rejected):
            if pending:  # r tokens supposed accepted, and a wrong newest token: the device's is right
                req.input_ids[-1:] = [0] * r + [1]
                req.cached_len += r
            req.input_ids += draft
        batch = prep.prefill(reqs, [len(d) + 1 for d in drafts])
        with torch.inference_mode():
            if pending and move:
                ext = [len(d) + 1 for d in drafts]
                idx = torch.tensor([req.table_idx for req in reqs], device=engine.device)
                engine.verify_shift[idx] = -torch.tensor(rejected, device=engine.device)
                engine.last_tokens[idx] = torch.tensor([s[-1] for s in seqs], device=engine.device).int()
                starts = torch.tensor([sum(ext[:i]) for i in range(len(ext))], device=engine.device)
                assert engine.can_shift(batch)
                engine.move_pending(
                    batch, None, idx, torch.tensor(ext, device=engine.device), starts, max(ext)
                )
            rows = torch.arange(batch.num_tokens, device=engine.device)
            return engine.forward_path.run(batch, rows=rows, verify=True).logits.float().clone()
    finally:
        prep.release(reqs)


# three requests (a GPU replays the verify graph: 16-row blocks), and one (the decode graph of its rows)
SHAPES = {"three": ((9, 30, 17), (K, K, 2), (3, 0, K)), "one": ((30,), (K,), (2,))}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kw", _engines(), ids=lambda kw: kw["device"])
def test_a_pending_verify_batch_equals_one_built_where_it_lands(tiny, kw, shape):
    model = tiny(kw["device"])
    engine = Engine(EngineConfig(model_path=str(model), max_running_req=8, num_page_override=256, **kw))
    try:
        if engine.device.type == "cuda":
            engine.graph_runner.capture_verify(K + 1, 4)
        g = torch.Generator().manual_seed(0)
        vocab = engine.config.model_config.vocab_size
        lens, widths, rejected = SHAPES[shape]  # rejected: the drafts the previous step rejected
        seqs = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]
        drafts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in widths]
        prep = BatchPreparer(engine)
        want = _rows(engine, prep, seqs, drafts, list(rejected), pending=False)
        got = _rows(engine, prep, seqs, drafts, list(rejected), pending=True)
        tol = 1e-5 if engine.device.type == "cpu" else 2e-2
        assert got.shape == want.shape and rel_err(got, want) < tol
        # unmoved, the pending batch computes other tokens at other positions: the check is not vacuous
        unmoved = _rows(engine, prep, seqs, drafts, list(rejected), pending=True, move=False)
        assert rel_err(unmoved[: K + 1], want[: K + 1]) > 10 * tol
        prep.check_pages()
        assert prep.pages.num_used == 0
    finally:
        engine.shutdown()


@pytest.mark.skipif(verify_kernels.triton is None, reason="needs triton (its interpreter on a CPU)")
@pytest.mark.parametrize("seed", range(6))
def test_the_triton_accept_and_move_equal_their_pytorch_versions(seed):
    """`minisgl.kernels.verify`: the Triton programs (compiled on a GPU, interpreted on a CPU) against
    the PyTorch versions, on random batches whose drafts match their rows' tokens for a random while."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(seed)
    ext = torch.randint(1, K + 2, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g)
    starts = torch.cumsum(ext, 0) - ext
    rows = torch.randperm(8, generator=g)[: len(ext)]
    tokens = torch.randint(0, 5, (int(ext.sum()),), generator=g)
    input_ids = torch.randint(0, 5, (int(ext.sum()),), generator=g).int()
    for s, n in zip(starts.tolist(), ext.tolist()):  # a random run of matches, then anything
        run = int(torch.randint(0, n, (1,), generator=g))
        input_ids[s + 1 : s + 1 + run] = tokens[s : s + run].int()
    table = torch.randint(0, 1000, (9, 64), generator=g).int()
    positions = torch.randint(K + 1, 40, (len(ext),), generator=g)[
        torch.repeat_interleave(torch.arange(len(ext)), ext)
    ]
    positions += torch.cat([torch.arange(n) for n in ext.tolist()])
    offsets = positions + 1
    outs = []
    for use_triton in (False, True):
        last = torch.zeros(9, dtype=torch.int32)
        shift = torch.zeros(9, dtype=torch.int64)
        args = [t.clone().to(device) for t in (tokens, input_ids, ext, starts, rows, last, shift)]
        verify_kernels.accept(*args, width=int(ext.max()), use_triton=use_triton)
        last, shift = args[5], args[6]
        moved = [t.clone().to(device) for t in (input_ids, positions, torch.zeros_like(positions), offsets)]
        shifts = verify_kernels.move(
            *moved,
            args[2],
            args[3],
            args[4],
            last,
            shift,
            table.to(device),
            int(ext.max()),
            use_triton=use_triton,
        )
        outs.append([t.cpu() for t in (last, shift, *moved, *shifts)])
    for want, got in zip(*outs):
        assert torch.equal(want, got.to(want.dtype))
    # the accepted counts are the runs: a shift of -(drafts rejected)
    assert (outs[0][1][rows] <= 0).all() and (outs[0][1][rows] > -ext).all()
