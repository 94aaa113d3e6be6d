"""Engine API, KV pool and page table, bad input (clear errors, engine still usable), compile-cleanliness."""

import gc
import json
import logging
import os
import weakref

import pytest
import torch
from conftest import compiled_runner, rel_err
from safetensors.torch import load_file, save_file

from minisgl.attention import BaseAttnBackend
from minisgl.core import Batch, SamplingParams
from minisgl.distributed import DistributedInfo
from minisgl.engine import Engine, EngineConfig, ForwardOutput
from minisgl.engine.sample import Sampler
from minisgl.engine.sampling_args import BatchSamplingArgs
from minisgl.kvcache import BaseKVCachePool, bytes_per_page
from minisgl.scheduler import BatchPreparer, generate

PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 40)), [3], list(range(100, 117))]


@pytest.fixture(scope="module")
def tiny_llama(tiny_model):
    return tiny_model("llama")


def _engine(folder, **kw) -> Engine:
    kw.setdefault("dtype", torch.float32)
    kw.setdefault("device", "cpu")
    return Engine(EngineConfig(model_path=str(folder), **kw))


def test_documented_construction_and_attributes(tiny_llama):
    config = EngineConfig(
        model_path=str(tiny_llama),
        dtype=torch.float32,
        tp_info=DistributedInfo(rank=0, size=1),
        page_size=16,
        max_running_req=8,
        device="cpu",
    )
    engine = Engine(config)
    assert isinstance(engine.model, torch.nn.Module)
    assert isinstance(engine.kv_cache, BaseKVCachePool)
    assert isinstance(engine.attn_backend, BaseAttnBackend)
    assert isinstance(engine.sampler, Sampler)
    assert engine.moe_backend is None
    assert engine.graph_runner is not None and not engine.graph_runner.enabled
    assert engine.ctx.attn_backend is engine.attn_backend and engine.ctx.page_size == 16
    # page table: one row per table_idx plus the dummy request's, width max_seq_len aligned to pages
    assert engine.page_table.dtype == torch.int32
    assert engine.page_table.shape == (9, 512)
    dummy_page = engine.kv_cache.num_pages
    assert engine.kv_cache.dummy_page == dummy_page
    assert torch.equal(engine.page_table[8, :16], dummy_page * 16 + torch.arange(16, dtype=torch.int32))
    assert engine.kv_cache.k_cache(0).shape == (engine.num_pages + 1, 16, 2, 16)
    assert (
        config.model_config.num_layers == 3
        and config.configured_max_seq_len == 512
        and engine.max_seq_len == 512
    )
    engine.shutdown()


def test_forward_batch_output_and_shutdown(tiny_llama):
    engine = _engine(tiny_llama)
    prep = BatchPreparer(engine)
    reqs = [prep.add_request(p, SamplingParams(max_tokens=4)) for p in PROMPTS]
    batch = prep.prefill(reqs)
    assert batch.input_ids.dtype == torch.int32 and batch.input_ids.shape == (sum(map(len, PROMPTS)),)
    assert batch.positions.tolist()[:5] == [0, 1, 2, 3, 4]
    output = engine.forward_batch(batch, prep.sampling_args(batch))
    assert isinstance(output, ForwardOutput)
    output.copy_done_event.synchronize()
    assert output.next_tokens_cpu.shape == (4,) and output.next_tokens_cpu.dtype == torch.int32
    assert output.next_tokens_cpu.device.type == "cpu"
    # greedy: the sampled token is the argmax of the last position's logits
    engine2 = _engine(tiny_llama)
    prep2 = BatchPreparer(engine2)
    logits = engine2.forward_logits(
        prep2.prefill([prep2.add_request(p, SamplingParams(max_tokens=4)) for p in PROMPTS])
    )
    assert output.next_tokens_cpu.tolist() == logits.argmax(-1).tolist()
    for req in reqs:
        assert req.cached_len == len(req.input_ids)
    engine.shutdown()
    engine.shutdown()  # idempotent
    with pytest.raises(RuntimeError, match="shut down"):
        engine.forward_batch(batch, prep.sampling_args(batch))


def test_shutdown_releases_the_weights_while_the_engine_is_held(tiny_llama):
    """`Engine.shutdown` lets go of the model's parameters and buffers and of the LoRA pool while the
    caller still holds the engine, the compiled forward's too: the graph runner's `torch.compile` of the
    bound `model.forward` holds the model (here the compile half of a runner on a CPU engine). Dynamo's
    cache of the forward, which the engines of one model class share, keeps none of them: the other
    engine's compiled forward runs on without a recompile."""
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    engines = [_engine(tiny_llama, enable_lora=True, max_loras=2, max_lora_rank=4), _engine(tiny_llama)]
    for engine in engines:
        compiled = torch.compile(engine.model.forward, fullgraph=True, dynamic=False, backend=counter)
        engine.graph_runner = engine.forward_path.graph_runner = compiled_runner(engine, compiled)

    def step(engine):
        prep = BatchPreparer(engine)
        req = prep.add_request([5, 6, 7], SamplingParams(max_tokens=2))
        batch = prep.prefill([req])
        assert engine.forward_batch(batch, prep.sampling_args(batch)).mode == "compiled"
        prep.release([req])

    for engine in engines:
        step(engine)
    frames = counter.frame_count  # with and without a LoraBatch
    first = engines[0]
    held = [weakref.ref(t) for t in (*first.model.parameters(), *first.model.buffers())]
    held.append(weakref.ref(first.lora.pool))
    first.shutdown()
    gc.collect()
    assert [ref() for ref in held] == [None] * len(held)
    step(engines[1])
    assert counter.frame_count == frames
    first.shutdown()  # idempotent
    engines[1].shutdown()


def test_kv_pool_sizing(tiny_llama):
    engine = _engine(tiny_llama, num_page_override=7)
    assert engine.num_pages == 7 and engine.kv_cache.k_cache(0).shape[0] == 8  # + dummy page
    assert engine.max_seq_len == 7 * 16  # a sequence can't outgrow the pool
    cfg = engine.config.model_config
    page_bytes = bytes_per_page(cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    engine = _engine(tiny_llama, cpu_kv_budget_gib=100 * page_bytes / 2**30)
    assert engine.num_pages == 100
    with pytest.raises(MemoryError, match="KV cache does not fit"):
        _engine(tiny_llama, cpu_kv_budget_gib=0.5 * page_bytes / 2**30)
    engine = _engine(tiny_llama, max_running_req=2)  # default budget, capped at what 2 requests can use
    assert engine.num_pages == 2 * 512 // 16


def test_pages_are_freed_and_reused(tiny_llama):
    engine = _engine(tiny_llama, num_page_override=8, page_size=4)
    prep = BatchPreparer(engine)
    first = generate(engine, [PROMPTS[1]], SamplingParams(max_tokens=2), preparer=prep)
    assert prep.pages.num_used == 0 and prep.table_idxs.num_free == engine.config.max_running_req
    again = generate(engine, [PROMPTS[1]], SamplingParams(max_tokens=2), preparer=prep)
    assert first == again


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"page_size": 0}, "page_size=0"),
        ({"page_size": 257}, "page_size=257"),
        ({"num_page_override": 0}, "num_page_override=0"),
        ({"memory_ratio": 0.0}, "memory_ratio=0.0"),
        ({"memory_ratio": 1.5}, "memory_ratio=1.5"),
        ({"max_running_req": 0}, "max_running_req=0"),
        ({"attention_backend": "flash"}, "attention_backend='flash'"),
        ({"dtype": "int8"}, "dtype='int8'"),
    ],
)
def test_invalid_config_values(tiny_llama, kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(model_path=str(tiny_llama), device="cpu", **kwargs)


def test_host_threads(tiny_llama):
    """On CPU the engine keeps torch's threads (the model's GEMMs use them) unless host_threads says;
    tests/gpu/test_gpu.py checks the CUDA default of one thread."""
    before = torch.get_num_threads()
    try:
        _engine(tiny_llama, num_page_override=8)
        assert torch.get_num_threads() == before
        _engine(tiny_llama, num_page_override=8, host_threads=1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="host_threads=0"):
        EngineConfig(model_path=str(tiny_llama), device="cpu", host_threads=0)


def test_start_phases_are_timed_and_logged(tiny_llama, caplog):
    with caplog.at_level(logging.INFO, logger="minisgl.engine.start"):
        engine = _engine(tiny_llama, num_page_override=8)
    phases = [
        "communication", "model", "kv cache", "page table", "backends", "cuda graphs", "sampler",
        "sampler graphs", "prefill warm-up",
    ]  # fmt: skip
    assert list(engine.start_phases) == phases and all(s >= 0 for s in engine.start_phases.values())
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("start phase ")]
    assert [line.split(":")[0].removeprefix("start phase ") for line in logged] == phases


def test_cache_dir_points_every_compile_cache_at_one_folder(tiny_llama, tmp_path, monkeypatch):
    for variable in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "FLASHINFER_WORKSPACE_BASE"):
        monkeypatch.delenv(variable, raising=False)  # restored after the test
    _engine(tiny_llama, num_page_override=8, cache_dir=str(tmp_path / "caches"))
    for variable, sub in [
        ("TORCHINDUCTOR_CACHE_DIR", "inductor"),
        ("TRITON_CACHE_DIR", "triton"),
        ("FLASHINFER_WORKSPACE_BASE", "flashinfer"),
    ]:
        assert os.environ[variable] == str(tmp_path / "caches" / sub) and (tmp_path / "caches" / sub).is_dir()
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    assert cache_dir() == str(tmp_path / "caches" / "inductor")  # what inductor itself will use
    compiled = torch.compile(lambda x: torch.sin(x) * 3 + 1)
    assert torch.allclose(compiled(torch.ones(5)), torch.sin(torch.ones(5)) * 3 + 1)
    assert any(
        path.is_file() for path in (tmp_path / "caches" / "inductor").rglob("*")
    )  # its code went there


def test_missing_model_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        EngineConfig(model_path=str(tmp_path / "nowhere"))


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    )
    with pytest.raises(
        ValueError,
        match="GPT2LMHeadModel.*LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM",
    ):
        Engine(EngineConfig(model_path=str(tmp_path), device="cpu"))


def test_missing_and_misshaped_tensors(tmp_path, tiny_llama):
    tensors = load_file(tiny_llama / "model.safetensors")
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "config.json").write_text((tiny_llama / "config.json").read_text())
    name = "model.layers.1.self_attn.k_proj.weight"
    save_file({k: v for k, v in tensors.items() if k != name}, folder / "model.safetensors")
    with pytest.raises(ValueError, match=f"missing tensor.*{name}"):
        _engine(folder)
    bad = dict(tensors)
    bad[name] = bad[name][:-1].clone()
    save_file(bad, folder / "model.safetensors")
    with pytest.raises(ValueError, match=rf"{name}.*shape \(31, 64\), expected \(32, 64\)"):
        _engine(folder)
    (folder / "model.safetensors").unlink()
    torch.save(tensors, folder / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="never loads pickled"):
        _engine(folder)


def test_bad_requests_leave_engine_usable(tiny_llama):
    engine = _engine(tiny_llama, max_running_req=2, num_page_override=12, page_size=4)  # max_seq_len 48
    prep = BatchPreparer(engine)
    expected = generate(engine, PROMPTS[:2], SamplingParams(max_tokens=5), preparer=prep)

    with pytest.raises(ValueError, match="exceeds max_seq_len=48"):
        prep.add_request(list(range(3, 50)), SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        prep.add_request([5, 320], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="empty"):
        prep.add_request([], SamplingParams(max_tokens=4))
    held = [prep.add_request([5, 6], SamplingParams(max_tokens=4)) for _ in range(2)]
    with pytest.raises(RuntimeError, match="max_running_req=2"):
        prep.add_request([5, 6], SamplingParams(max_tokens=4))
    prep.release(held)
    # the pool has 12 pages of 4 tokens: two 30-token prompts need 16
    reqs = [prep.add_request(list(range(3, 33)), SamplingParams(max_tokens=4)) for _ in range(2)]
    with pytest.raises(MemoryError, match="out of KV cache pages: 16 needed, 12 of 12 free"):
        prep.prefill(reqs)
    assert prep.pages.num_used == 0 and all(req.cached_len == 0 for req in reqs)
    prep.release(reqs)
    for bad in (dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2), dict(min_p=2.0)):
        with pytest.raises(ValueError, match=f"{next(iter(bad))}="):
            SamplingParams(**bad)
    # a batch larger than max_running_req, and a decode batch with a multi-token request
    big = Batch(reqs=[held[0]] * 3, phase="decode")
    big.input_ids = big.positions = big.out_loc = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match="more than max_running_req=2"):
        engine.forward_batch(big, BatchSamplingArgs.from_reqs(big.reqs, engine.device))
    unprepared = Batch(reqs=[held[0]], phase="prefill")
    with pytest.raises(ValueError, match="batch.input_ids is not set"):
        engine.forward_batch(unprepared, BatchSamplingArgs.from_reqs(unprepared.reqs, engine.device))

    assert prep.pages.num_used == 0 and prep.table_idxs.num_free == 2
    assert generate(engine, PROMPTS[:2], SamplingParams(max_tokens=5), preparer=prep) == expected


def test_compiled_forward_matches_eager(tiny_llama):
    torch._dynamo.reset()
    engines = [_engine(tiny_llama) for _ in range(2)]
    engines[1].model.forward = torch.compile(engines[1].model.forward, fullgraph=True, dynamic=True)
    results = []
    for engine in engines:
        prep = BatchPreparer(engine)
        reqs = [prep.add_request(p, SamplingParams(max_tokens=3)) for p in PROMPTS]
        logits = [engine.forward_logits(prep.prefill(reqs))]
        for step in range(2):
            for req in reqs:
                req.input_ids.append(7 + step)
            logits.append(engine.forward_logits(prep.decode(reqs)))
        results.append(torch.cat(logits))
    assert rel_err(results[1], results[0]) < 1e-5


def test_batch_invariant_flag_reaches_the_forward(tiny_llama, monkeypatch):
    """`batch_invariant` (setting MINISGL_BATCH_INVARIANT) is the context's flag, which `linear` reads
    while that engine's forward runs (and only then) to keep the one-row GEMV kernel out; so does
    `use_gemv_kernel` off."""
    import minisgl.models.llama as llama
    from minisgl.compile import gemv_kernel_mode
    from minisgl.settings import EngineSettings

    monkeypatch.setenv("MINISGL_BATCH_INVARIANT", "1")
    assert EngineSettings.load(model_path=str(tiny_llama)).to_engine_config().batch_invariant
    seen, real = [], llama.linear
    monkeypatch.setattr(llama, "linear", lambda *a: seen.append(gemv_kernel_mode()) or real(*a))
    for batch_invariant, use_gemv in ((True, True), (False, True), (False, False)):
        engine = _engine(tiny_llama, batch_invariant=batch_invariant, use_gemv_kernel=use_gemv)
        assert engine.ctx.batch_invariant is batch_invariant
        generate(engine, [PROMPTS[0]], SamplingParams(max_tokens=2))
        assert seen and set(seen) == {use_gemv and not batch_invariant}
        seen.clear()
    assert gemv_kernel_mode()  # outside a forward: no engine forbids it


def test_sampler_warm_up_compiles_in_the_mode_forward_batch_samples_in(tiny_llama):
    """The compiled sampler's guards include the grad mode and the inputs' dispatch keys: its warm-up
    must run in inference mode with inference-mode logits and normal argument tensors, as
    `Engine.forward_batch` samples, or every path compiles again at the first requests. (On a CPU the
    sampler runs eagerly; the compiled function is replaced by a recorder.)"""
    engine = _engine(tiny_llama)
    sampler, modes = engine.sampler, []

    def recorder(logits, floats, ints, need_filter):
        modes.append((torch.is_inference_mode_enabled(), logits.is_inference(), floats.is_inference()))
        return torch.zeros(logits.shape[0], dtype=torch.int32)

    sampler._compiled = recorder
    sampler.warm_up()
    assert len(modes) == 2 and set(modes) == {(True, True, False)}  # with and without filters
    prep = BatchPreparer(engine)
    req = prep.add_request([5, 6, 7], SamplingParams(max_tokens=2, temperature=0.7))
    batch = prep.prefill([req])
    engine.forward_batch(batch, prep.sampling_args(batch))
    assert modes[-1] == (True, True, False)  # what a real step's sampling looks like
    # arguments made inside inference mode are normal tensors too
    with torch.inference_mode():
        args = BatchSamplingArgs.from_reqs([req], engine.device)
    assert not args.floats.is_inference() and not args.ints.is_inference()
    prep.release([req])
    engine.shutdown()


def test_compiled_forward_passes_normal_tensors_marked_unbacked(tiny_llama):
    """dynamo guards on the inputs' dispatch keys: `compiled_forward` copies inference tensors (a
    prefill's `last_indices` is planned in inference mode) to normal ones, as the graphs' static buffers
    are, marks their token dimension unbacked, and gives a decode batch every row as `last_indices`.
    The prefill warm-up runs a prefill through it, in inference mode."""
    engine = _engine(tiny_llama)
    seen = []

    def forward(input_ids, positions, last_indices, return_hidden=False):
        assert return_hidden  # the compiled forward gives every row's hidden state too
        inputs = (input_ids, positions, last_indices)
        seen.append(
            (
                torch.is_inference_mode_enabled(),
                [t.is_inference() for t in inputs],
                [getattr(t, "_dynamo_unbacked_indices", None) for t in inputs],
                last_indices.tolist(),
            )
        )
        return None, None  # (logits, hidden states)

    runner = compiled_runner(engine, forward)
    ids = torch.tensor([5, 6, 7])
    with torch.inference_mode():
        runner.compiled_forward(ids, torch.arange(3), torch.tensor([2]))
        runner.compiled_forward(ids, torch.arange(3))
    assert seen == [(True, [False] * 3, [{0}] * 3, [2]), (True, [False] * 3, [{0}] * 3, [0, 1, 2])]
    too_many = len(runner.rows) + 1
    with pytest.raises(ValueError, match=f"{too_many} tokens without last_indices"):
        runner.compiled_forward(torch.zeros(too_many, dtype=torch.int64), torch.arange(too_many))
    seen.clear()
    runner.warm_up_prefill()
    assert seen == [(True, [False] * 3, [{0}] * 3, [2, 4])]  # requests of 3 and 2 tokens
    engine.shutdown()


def test_compiled_forward_is_one_graph_for_every_token_count(tiny_llama):
    """The forward compiled through `compiled_forward` (inductor's CPU backend): one graph for prefills
    and decode batches of 1, 2 and 3 rows, each equal to the eager forward."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    engine = _engine(tiny_llama)
    counter = CompileCounterWithBackend("inductor")
    runner = compiled_runner(
        engine, torch.compile(engine.model.forward, fullgraph=True, dynamic=False, backend=counter)
    )
    prep = BatchPreparer(engine)
    reqs = [prep.add_request(p, SamplingParams(max_tokens=3)) for p in PROMPTS[:3]]

    def run(batch):
        with torch.inference_mode(), engine.ctx.forward_batch(batch):
            engine.attn_backend.prepare_metadata(batch)
            args = (batch.input_ids, batch.positions, batch.attn_metadata.last_indices)
            assert rel_err(runner.compiled_forward(*args), engine.model(*args)) < 1e-5
        for req in batch.reqs:
            req.complete_one()

    run(prep.prefill(reqs[:1]))
    run(prep.prefill(reqs[1:]))
    for rows in (1, 3, 2):
        for req in reqs[:rows]:
            req.input_ids.append(7)
        run(prep.decode(reqs[:rows]))
    assert counter.frame_count == 1
    prep.release(reqs)
    engine.shutdown()
