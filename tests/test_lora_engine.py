"""The engine with LoRA adapters (minisgl.engine.lora, the model forward's LoRA path) against transformers
+ PEFT, on the CPU in float32.

Tiny transformers models get PEFT adapters of different ranks and targets (rsLoRA, rank_pattern;
lora_B drawn at random: PEFT starts it at zero), saved with `save_pretrained` and read back into the
engine's pool. One batch mixes requests of every adapter with base requests (slot -1): prefill, then
teacher-forced decode steps, each request's logits against PEFT's model of its adapter (transformers
alone for the base). Swapping the adapter in a slot gives the new one's logits; clearing it, the base's.
"""

import logging

import pytest
import torch
from conftest import hf_model, make_peft_adapter, make_tiny_model, rel_err, teacher_forced_logits
from peft import PeftModel

import minisgl.models.llama as llama_module
from minisgl.core import Req, SamplingParams
from minisgl.engine import Engine, EngineConfig
from minisgl.scheduler import BatchPreparer

MAX_RANK = 8
# name -> LoraConfig arguments
ADAPTERS = {
    "all": dict(r=8, lora_alpha=16, use_rslora=True, target_modules="all-linear"),
    "qv-down": dict(
        r=2, lora_alpha=4, target_modules=["q_proj", "v_proj", "down_proj"], rank_pattern={"down_proj": 4}
    ),
    "o-mlp": dict(
        r=4, lora_alpha=8, target_modules=["o_proj", "gate_proj", "up_proj"], layers_to_transform=[0, 2]
    ),
}
ATTENTION = dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
PROMPT_LENS = [5, 17, 1, 9, 12]
STEPS = 3


def _save_adapter(model_folder, out, seed, **lora):
    """A PEFT adapter of `model_folder` (A and B random), saved in `out`."""
    return make_peft_adapter(model_folder, out, seed, scale=0.2, **lora)


def _seqs(n_steps=STEPS, lens=PROMPT_LENS, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 320, (n + n_steps,), generator=g).tolist() for n in lens]


def _reference(model_folder, adapter_folder, seqs, lens=PROMPT_LENS, steps=STEPS):
    """transformers' logits (with the PEFT adapter read from `adapter_folder`, or none) at the positions
    `_engine_logits` gives, each sequence alone."""
    model = hf_model(model_folder)
    if adapter_folder is not None:
        model = PeftModel.from_pretrained(model, adapter_folder)
    model.eval()
    with torch.no_grad():
        full = [model(torch.tensor([s])).logits[0] for s in seqs]
    return [f[n - 1 : n + steps] for f, n in zip(full, lens)]


def _engine_logits(engine, seqs, slots, lens=PROMPT_LENS, steps=STEPS):
    """One batch: prefill of each seq[:n] under its slot, then teacher-forced decode steps; the logits of
    each request, (steps + 1, vocab)."""
    return list(teacher_forced_logits(engine, seqs, lens, steps, lora_slots=slots))


def _engine(folder, **kw):
    kw = {"dtype": torch.float32, "device": "cpu", "num_page_override": 64, **kw}
    return Engine(EngineConfig(model_path=str(folder), enable_lora=True, max_lora_rank=MAX_RANK, **kw))


def _check(got, want, what):
    for i, (g, w) in enumerate(zip(got, want)):
        err = rel_err(g, w)
        assert err < 1e-4, f"{what}, request {i}: relative error {err:.2e}"


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(model folder, {name: adapter folder}, {name or None: reference logits of `_seqs()`})."""
    tmp = tmp_path_factory.mktemp("lora-engine")
    folder = make_tiny_model(tmp, "llama")
    adapters = {
        name: _save_adapter(folder, tmp / name, seed, **lora)
        for seed, (name, lora) in enumerate(ADAPTERS.items())
    }
    seqs = _seqs()
    refs = {name: _reference(folder, path, seqs) for name, path in {None: None, **adapters}.items()}
    return folder, adapters, refs


def test_a_mixed_batch_matches_peft_and_swapped_slots_follow(llama, caplog, monkeypatch):
    folder, adapters, refs = llama
    with caplog.at_level(logging.INFO, logger="minisgl.engine.start"):
        engine = _engine(folder, max_loras=3)
    assert "LoRA: 3 adapter slots of rank up to 8" in caplog.text
    assert engine.model.lora_pool is engine.lora_pool and engine.lora_pool.max_loras == 3
    for slot, name in enumerate(ADAPTERS):
        engine.load_lora(slot, engine.read_lora(name, adapters[name]))
    seqs = _seqs()
    # every adapter, twice for one, and two base requests in one batch
    names = ["all", None, "qv-down", "o-mlp", "all"]
    slots = [-1 if n is None else list(ADAPTERS).index(n) for n in names]
    got = _engine_logits(engine, seqs, slots)
    _check(got, [refs[n][i] for i, n in enumerate(names)], "mixed batch")
    assert rel_err(got[0], refs[None][0]) > 1e-2  # the adapters change the logits
    # slot 0 ("all") swapped for "o-mlp", slot 1 cleared: its requests now get the base model's logits
    engine.load_lora(0, engine.read_lora("o-mlp-again", adapters["o-mlp"]))
    engine.clear_lora(1)
    got = _engine_logits(engine, seqs, [0, 1, 1, 2, -1])
    _check(got, [refs["o-mlp"][0], refs[None][1], refs[None][2], refs["o-mlp"][3], refs[None][4]], "swapped")
    # a batch of base rows only runs no adapter work (the projections' LoRA op is not called)
    calls, lora_add = [], llama_module.lora_add
    monkeypatch.setattr(llama_module, "lora_add", lambda *args: calls.append(1) or lora_add(*args))
    _check(_engine_logits(engine, seqs, [-1] * len(seqs)), refs[None], "base only")
    assert calls == []
    _check(_engine_logits(engine, seqs[:1], [2], PROMPT_LENS[:1]), refs["o-mlp"][:1], "one adapter row")
    assert calls
    engine.shutdown()
    assert engine.lora_pool is None


def test_chunked_prefill_keeps_the_adapter(llama):
    """Prompts computed in two forwards (the second on the first's KV): an adapter's and a base one."""
    folder, adapters, refs = llama
    engine = _engine(folder, max_loras=1)
    engine.load_lora(0, engine.read_lora("all", adapters["all"]))
    seqs = _seqs()
    prep = BatchPreparer(engine)
    reqs = [prep.add_request(seqs[i][: PROMPT_LENS[i]], SamplingParams(max_tokens=2)) for i in (1, 3)]
    reqs[0].lora_slot = 0
    engine.forward_logits(prep.prefill(reqs, chunk_size=6))
    logits = engine.forward_logits(prep.prefill(reqs))
    prep.release(reqs)
    assert rel_err(logits[0], refs["all"][1][0]) < 1e-4 and rel_err(logits[1], refs[None][3][0]) < 1e-4


# Phi-3's modules as PEFT sees them: q/k/v and gate/up fused (minisgl cuts an adapter on them at the
# parts' rows), a rank and an alpha of their own
PHI3 = dict(
    r=2,
    lora_alpha=4,
    target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
    rank_pattern={"gate_up_proj": 4},
    alpha_pattern={"qkv_proj": 6},
)


@pytest.mark.parametrize(
    "arch", ["qwen3", "qwen2", "qwen3_moe", "mistral", "gemma2", "gemma3", "phi3", "gpt_oss"]
)
def test_other_families_match_peft(tmp_path, tiny_model, arch):
    """Qwen3 (q/k norms, head_dim != hidden / heads), Qwen2 (q/k/v biases: the unfused norm path),
    Qwen3-MoE and gpt-oss (attention projections only), Mistral, Gemma 2 and 3, Phi-3 (its fused
    modules)."""
    folder = tiny_model(arch)
    moe = arch in ("qwen3_moe", "gpt_oss")
    lora = ATTENTION if moe else PHI3 if arch == "phi3" else ADAPTERS["all"]
    adapter = _save_adapter(folder, tmp_path / "adapter", 7, **lora)
    engine = _engine(folder, max_loras=2)
    engine.load_lora(1, engine.read_lora("a", adapter))
    seqs = _seqs(lens=PROMPT_LENS[:3])
    got = _engine_logits(engine, seqs, [1, -1, 1], lens=PROMPT_LENS[:3])
    base = _reference(folder, None, seqs, lens=PROMPT_LENS[:3])
    want = _reference(folder, adapter, seqs, lens=PROMPT_LENS[:3])
    _check(got, [want[0], base[1], want[2]], arch)


def test_without_lora_there_is_no_pool(llama):
    folder, _, _ = llama
    engine = Engine(
        EngineConfig(model_path=str(folder), dtype=torch.float32, device="cpu", num_page_override=8)
    )
    assert (
        engine.lora_pool is None and engine.model.lora_pool is None and "lora pool" not in engine.start_phases
    )
    with pytest.raises(ValueError, match="no LoRA pool"):
        engine.clear_lora(0)


def test_the_pool_comes_out_of_the_kv_budget(llama, caplog, monkeypatch):
    """The pool's bytes are taken from the KV cache's budget (here the CPU default, a share of the RAM
    available) before the pages are counted, and the start log says so."""
    import minisgl.engine.start as start_module
    from minisgl.lora import LoraPool

    folder, _, _ = llama
    monkeypatch.setattr(start_module, "available_memory", lambda device: 64 << 20)
    budget = int((64 << 20) * start_module.CPU_KV_FRACTION)
    base = Engine(EngineConfig(model_path=str(folder), dtype=torch.float32, device="cpu"))
    page_bytes = budget // base.num_pages
    with caplog.at_level(logging.INFO, logger="minisgl.engine.start"):
        engine = _engine(folder, num_page_override=None, max_loras=2)
    pool_bytes = LoraPool.nbytes(
        engine.config.model_config, max_loras=2, max_rank=MAX_RANK, dtype=torch.float32
    )
    assert sum(t.nbytes for t in [*engine.lora_pool.a.values(), *engine.lora_pool.b.values()]) == pool_bytes
    assert engine.num_pages == (budget - pool_bytes) // page_bytes < base.num_pages
    assert "GiB of LoRA slots" in caplog.text


def test_row_at_keeps_the_adapter():
    req = Req(input_ids=[1, 2, 3], table_idx=0, cached_len=0, output_len=4, uid=1, lora_slot=2, lora_id=7)
    row = req.row_at(2)
    assert (row.lora_slot, row.lora_id) == (2, 7)
