"""The LoRA kernels compiled for the GPU (minisgl.kernels.lora) against the torch path, at a real model's
widths: prefill segments and one-row decode segments, captured in a CUDA graph and replayed on other
adapter mixes, and under torch.compile. Skips without CUDA."""

import dataclasses

import pytest
import torch
from conftest import make_peft_adapter, teacher_forced_logits

from minisgl.layers.lora import LoraBatch, lora_add, lora_add_reference

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
# a Llama-3-8B-like QKV projection (32 query / 8 KV heads of 128) on one rank
SIZES, HIDDEN, SLOTS = [4096, 1024, 1024], 4096, 4


def _weights(rank, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(SLOTS, len(SIZES) * rank, HIDDEN, generator=g, device="cuda") / HIDDEN**0.5
    b = torch.randn(SLOTS, sum(SIZES), rank, generator=g, device="cuda") / rank**0.5
    b[2] = 0  # slot 2 is empty
    return a.to(dtype), b.to(dtype)


def _mix(rows, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-1, SLOTS, (len(rows),), generator=g).tolist()


def _check(x, base, a, b, batch, tol):
    want = lora_add_reference(x, base.clone(), a, b, batch.row_slots, SIZES)
    got = lora_add(x, base.clone(), a, b, batch, SIZES)
    err = ((got.float() - want.float()).norm() / (want.float() - base.float()).norm()).item()
    assert err < tol, err
    untouched = batch.row_slots == -1
    assert torch.equal(got[untouched], base[untouched])
    return got


@pytest.mark.parametrize("rank", [8, 16, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [[1] * 64, [300, 1, 45, 7, 160, 33, 2]], ids=["decode", "prefill"])
def test_kernels_match_the_torch_path(rank, dtype, rows):
    a, b = _weights(rank, dtype)
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(sum(rows), HIDDEN, generator=g, device="cuda").to(dtype)
    base = torch.randn(sum(rows), sum(SIZES), generator=g, device="cuda").to(dtype)
    batch = LoraBatch.build(rows, _mix(rows, rank), "cuda")
    _check(x, base, a, b, batch, 1e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("rows", [[1] * 64, [300, 1, 45, 7, 160, 33, 2]], ids=["decode", "prefill"])
def test_kernels_read_each_slot_within_its_rank(rows):
    """A pool of rank 64 holding adapters of rank 16, 8, 64 and 0 (`ranks`): garbage in the padding
    past each slot's rank changes nothing (the reference runs on the padding zeroed)."""
    a, b = _weights(64, torch.bfloat16)
    ranks = torch.tensor([16, 8, 64, 0], dtype=torch.int32, device="cuda")
    zeroed_a, zeroed_b = a.clone(), b.clone()
    for slot, r in enumerate(ranks.tolist()):
        zeroed_a[slot].view(len(SIZES), 64, HIDDEN)[:, r:] = 0
        zeroed_b[slot, :, r:] = 0
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(sum(rows), HIDDEN, generator=g, device="cuda").to(torch.bfloat16)
    base = torch.randn(sum(rows), sum(SIZES), generator=g, device="cuda").to(torch.bfloat16)
    batch = LoraBatch.build(rows, _mix(rows, 5), "cuda")
    want = lora_add_reference(x, base.clone(), zeroed_a, zeroed_b, batch.row_slots, SIZES)
    got = lora_add(x, base.clone(), a, b, batch, SIZES, ranks)
    err = ((got.float() - want.float()).norm() / (want.float() - base.float()).norm()).item()
    assert err < 1e-2, err


def test_a_cuda_graph_serves_every_adapter_mix():
    rows = [1] * 48
    a, b = _weights(16, torch.bfloat16)
    x = torch.randn(len(rows), HIDDEN, device="cuda", dtype=torch.bfloat16)
    base = torch.randn(len(rows), sum(SIZES), device="cuda", dtype=torch.bfloat16)
    static = LoraBatch.build(rows, _mix(rows, 0), "cuda", max_loras=SLOTS)
    out = base.clone()
    lora_add(x, out, a, b, static, SIZES)  # warm up (compiles the kernels)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(base)
        lora_add(x, out, a, b, static, SIZES)
    for seed in (1, 2, 3):
        batch = LoraBatch.build(rows, _mix(rows, seed), "cuda", max_loras=SLOTS)
        for field in dataclasses.fields(static):
            getattr(static, field.name).copy_(getattr(batch, field.name))
        graph.replay()
        assert torch.equal(out, lora_add(x, base.clone(), a, b, batch, SIZES))


def test_torch_compile_traces_the_op_once_for_every_mix():
    rows = [5, 1, 9, 1]
    a, b = _weights(16, torch.bfloat16)
    w = torch.randn(sum(SIZES), HIDDEN, device="cuda", dtype=torch.bfloat16) / HIDDEN**0.5

    def qkv(x, batch):
        return lora_add(x, x @ w.T, a, b, batch, SIZES).float().square().sum(dim=1)

    compiled = torch.compile(qkv, fullgraph=True, dynamic=False)
    x = torch.randn(sum(rows), HIDDEN, device="cuda", dtype=torch.bfloat16)
    for seed in range(3):
        batch = LoraBatch.build(rows, _mix(rows, seed), "cuda", max_loras=SLOTS)
        torch.testing.assert_close(compiled(x, batch), qkv(x, batch), rtol=2e-2, atol=1e-1)


# -- an engine with a LoRA pool: its compiled forward and CUDA graphs --------------------------------


def _save_adapter(model_folder, out, seed, **lora):
    """A PEFT adapter of `model_folder` (A and B random), saved in `out`."""
    return make_peft_adapter(model_folder, out, seed, scale=0.05, **lora)


def _lora_logits(engine, seqs, lens, slots, steps):
    """Prefill of each seq[:n] under its slot in one batch, then teacher-forced decode steps:
    (requests, steps + 1, vocab) float32 logits on the host."""
    return teacher_forced_logits(engine, seqs, lens, steps, lora_slots=slots).cpu()


@pytest.fixture(scope="module")
def lora_engines(tmp_path_factory):
    """(model folder, [adapter folders], an eager engine, an engine with graphs): a tiny Qwen3 of the GPU
    tests' shape, two adapter slots holding adapters of ranks 8 (all targets) and 16 (rsLoRA), the
    second engine's forward compiled afresh (decode graphs up to 8, prefill graphs up to 256 tokens)."""
    pytest.importorskip("flashinfer")
    from conftest import GPU_SHAPE, make_tiny_model

    from minisgl.engine import Engine, EngineConfig

    tmp = tmp_path_factory.mktemp("lora-engine")
    folder = make_tiny_model(tmp, "qwen3", randomize=(), **GPU_SHAPE)
    adapters = [
        _save_adapter(folder, tmp / "a", 0, r=8, lora_alpha=16, target_modules="all-linear"),
        _save_adapter(
            folder,
            tmp / "b",
            1,
            r=16,
            lora_alpha=8,
            use_rslora=True,
            target_modules=["q_proj", "o_proj", "down_proj"],
        ),
    ]

    def engine(**kw):
        config = EngineConfig(
            model_path=str(folder), dtype=torch.bfloat16, device="cuda", attention_backend="fi", max_running_req=16,
            num_page_override=512, enable_lora=True, max_loras=2, max_lora_rank=16, **kw,
        )  # fmt: skip
        e = Engine(config)
        for slot, path in enumerate(adapters):
            e.load_lora(slot, e.read_lora(f"a{slot}", path))
        return e

    eager = engine(cuda_graph_max_bs=0)
    torch._dynamo.reset()
    return folder, adapters, eager, engine(cuda_graph_max_bs=8, prefill_graph_max_tokens=256)


def test_an_engine_replays_one_graph_for_every_adapter_mix(lora_engines):
    """Decode graphs, prefill graphs and the compiled forward against the same engine's eager forward
    (graphs off), on mixes of both adapters and base requests, the adapters swapped between slots (no
    capture, no recompile: one compiled forward); and within bf16 of transformers + PEFT in float32."""
    import transformers
    from conftest import gpu_seqs, rel_err
    from peft import PeftModel
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    folder, adapters, eager, graphs = lora_engines
    lens, steps = [7, 33, 1, 150, 64], 6
    seqs = gpu_seqs(512, lens)
    runner = graphs.graph_runner
    assert runner.batch_sizes == [1, 2, 4, 8] and runner.prefill_sizes == [16, 32, 64, 128, 256]
    compiled, replayed = [], []
    run, replay = runner.run_compiled, runner.replay_prefill
    runner.run_compiled = lambda batch: compiled.append(batch.num_tokens) or run(batch)
    runner.replay_prefill = lambda batch: replayed.append(batch.num_tokens) or replay(batch)
    order = list(adapters)
    for mix in ([0, -1, 1, 0, 1], [1, 1, -1, 0, -1]):
        want = _lora_logits(eager, seqs, lens, mix, steps)
        assert rel_err(_lora_logits(graphs, seqs, lens, mix, steps), want) < 2e-2, mix
        for i in (1, 3):  # alone: a prefill graph
            got = _lora_logits(graphs, seqs[i : i + 1], lens[i : i + 1], mix[i : i + 1], steps)
            assert rel_err(got, want[i : i + 1]) < 2e-2, (mix, i)
        order.reverse()
        for e in (eager, graphs):  # the slots' adapters swapped
            for slot, path in enumerate(order):
                e.load_lora(slot, e.read_lora(f"a{slot}", path))
    runner.run_compiled, runner.replay_prefill = run, replay
    assert compiled == [sum(lens)] * 2 and replayed == [lens[1], lens[3]] * 2
    # two compiled forwards: with a LoraBatch, and without one (the base-only decode graphs)
    assert len(_debug_get_cache_entry_list(type(graphs.model).forward.__code__)) == 2
    # against transformers + PEFT in float32 (the slots hold the adapters in their first order again)
    slots = [0, -1, 1, 0, 1]
    got = _lora_logits(graphs, seqs, lens, slots, steps)
    for i, slot in enumerate(slots):
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        if slot >= 0:
            model = PeftModel.from_pretrained(model, adapters[slot])
        with torch.no_grad():
            full = model.eval()(torch.tensor([seqs[i]])).logits[0]
        assert rel_err(got[i], full[lens[i] - 1 : lens[i] + steps]) < 2e-2, (i, slot)


def test_base_only_decode_batches_replay_graphs_without_adapter_work(lora_engines):
    """A decode batch of base rows only replays the graph captured without LoRA (its logits in the
    same output the sampler's graphs read), equal to the eager engine's base logits; a batch with one
    adapter row after it replays the LoRA graph again, equal to the eager engine's mix."""
    from conftest import gpu_seqs, rel_err

    _, _, eager, graphs = lora_engines
    runner = graphs.graph_runner
    assert sorted(runner.base_graphs) == runner.batch_sizes
    for bs, (_, logits) in runner.base_graphs.items():
        assert logits.data_ptr() == runner.graphs[bs][1].data_ptr()
    replayed = []
    for bs, (graph, logits) in list(runner.base_graphs.items()):
        runner.base_graphs[bs] = (_Spy(graph, replayed, ("base", bs)), logits)
    for bs, (graph, logits) in list(runner.graphs.items()):
        runner.graphs[bs] = (_Spy(graph, replayed, ("lora", bs)), logits)
    try:
        lens, steps = [9, 40, 3], 4
        seqs = gpu_seqs(512, lens)
        for slots, kind in (([-1, -1, -1], "base"), ([-1, 0, -1], "lora")):
            replayed.clear()
            got, want = (_lora_logits(e, seqs, lens, slots, steps) for e in (graphs, eager))
            assert rel_err(got, want) < 2e-2, slots
            assert replayed and {k for k, _ in replayed} == {kind}, (slots, replayed)
    finally:
        for graph_set in (runner.base_graphs, runner.graphs):
            for bs, (graph, logits) in list(graph_set.items()):
                graph_set[bs] = (graph.graph, logits)


class _Spy:
    """A CUDA graph that records its replays."""

    def __init__(self, graph, log: list, name) -> None:
        self.graph, self.log, self.name = graph, log, name

    def replay(self) -> None:
        self.log.append(self.name)
        self.graph.replay()


def test_verify_graphs_read_each_rows_adapter(lora_engines):
    """Speculative decoding's verify step with adapters: a verify graph (four requests, a block each) and
    the decode graph of one request's rows (`as_decode_rows`) give the eager engine's logits."""
    from conftest import gpu_seqs, rel_err

    from minisgl.core import SamplingParams
    from minisgl.scheduler import BatchPreparer

    _, _, eager, graphs = lora_engines
    graphs.graph_runner.capture_verify(5, 4)
    assert sorted(graphs.graph_runner.verify_graphs) == [16, 32, 64]

    def verify_logits(engine, seqs, drafts, slots):
        prep = BatchPreparer(engine)
        reqs = [prep.add_request(seq, SamplingParams(max_tokens=8)) for seq in seqs]
        for req, slot in zip(reqs, slots):
            req.lora_slot = slot
        engine.forward_logits(prep.prefill(reqs, [len(s) - n - 1 for s, n in zip(seqs, drafts)]))
        batch = prep.prefill(reqs, [n + 1 for n in drafts])
        mode = engine.forward_mode(batch, all_rows=True, verify=True)
        with torch.inference_mode():
            rows = torch.arange(batch.num_tokens, device="cuda")
            logits = engine.forward_path.run(batch, rows=rows, verify=True).logits.float().cpu()
        prep.release(reqs)
        return logits, mode

    for seqs, drafts, slots in (
        (gpu_seqs(512, [40, 90, 7, 200]), [4, 0, 2, 4], [1, 0, -1, 1]),
        (gpu_seqs(512, [90]), [4], [1]),
    ):
        want, mode = verify_logits(eager, seqs, drafts, slots)
        assert mode == "eager"
        got, mode = verify_logits(graphs, seqs, drafts, slots)
        assert mode == "cuda_graph" and rel_err(got, want) < 2e-2, slots
