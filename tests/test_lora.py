"""LoRA adapters served by `LLM` (docs/lora.md) on the default model, float32 on the CPU, against
transformers + peft on the same weights and adapters: greedy tokens equal for adapters of different
ranks and targets (rsLoRA too) in one batch with base requests, with fewer device slots than adapters;
the same prompt under the base and two adapters in every order (the prefix cache is keyed by adapter);
load, use, unload, reload; every refusal; nothing held at rest."""

from __future__ import annotations

import itertools

import pytest
import torch
import transformers
from conftest import hf_forward, llm_clean, make_peft_adapter

from minisgl.core import SamplingParams
from minisgl.llm import LLM
from minisgl.lora import LoraError

NEW_TOKENS = 10
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
# name -> LoraConfig arguments: two ranks, attention only / MLP and q, plain and rsLoRA scaling
ADAPTERS = {
    "attn": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "mlp": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "gate_proj", "up_proj", "down_proj"]),
}  # fmt: skip
PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "1, 2, 3, 4,",
]


@pytest.fixture(scope="module")
def adapters(smollm2_path, tmp_path_factory) -> dict[str, str]:
    """The adapters' PEFT folders (A and B drawn at random, small enough to keep the text coherent)."""
    root = tmp_path_factory.mktemp("adapters")
    out = {}
    for seed, (name, lora) in enumerate(ADAPTERS.items()):
        make_peft_adapter(smollm2_path, root / name, seed, scale=0.05, **lora)
        out[name] = str(root / name)
    return out


@pytest.fixture(scope="module")
def reference(smollm2_path, adapters):
    """Transformers + peft greedy tokens: reference(prompt ids, adapter name or None)."""
    from peft import PeftModel

    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32)
    names = list(adapters)
    peft_model = PeftModel.from_pretrained(model, adapters[names[0]], adapter_name=names[0]).eval()
    for name in names[1:]:
        peft_model.load_adapter(adapters[name], adapter_name=name)
    cache: dict[tuple[tuple[int, ...], str | None], tuple[list[int], list[float]]] = {}

    def greedy(ids: list[int]) -> tuple[list[int], list[float]]:
        """Argmax after argmax, EOS included (as ignore_eos generates; `generate` would stop or ban
        it), and each token's log probability: the prompt in one forward, then one token a forward on
        transformers' KV cache."""
        tokens, logprobs, cache, step = [], [], None, torch.tensor([ids])
        with torch.no_grad():
            for _ in range(NEW_TOKENS):
                logits, cache = hf_forward(peft_model, step, cache)
                scores = logits[0, -1].log_softmax(-1)
                tokens.append(int(scores.argmax()))
                logprobs.append(float(scores.max()))
                step = torch.tensor([[tokens[-1]]])
        return tokens, logprobs

    def run(ids: list[int], name: str | None) -> tuple[list[int], list[float]]:
        key = (tuple(ids), name)
        if key not in cache:
            if name is None:
                with peft_model.disable_adapter():
                    cache[key] = greedy(ids)
            else:
                peft_model.set_adapter(name)
                cache[key] = greedy(ids)
        return cache[key]

    def tokens(ids: list[int], name: str | None) -> list[int]:
        return run(ids, name)[0]

    tokens.logprobs = lambda ids, name: run(ids, name)[1]
    return tokens


def _llm(smollm2_path, adapters, **settings) -> LLM:
    """`LLM` of the default model in float32 with both adapters, pages of 4 tokens, rank 8 at most."""
    base = dict(device="cpu", dtype="float32", page_size=4, lora_modules=adapters, max_lora_rank=8)
    return LLM(str(smollm2_path), **{**base, **settings})


@pytest.fixture(scope="module")
def llm(smollm2_path, adapters):
    """One device slot for two adapters: a batch of both takes turns."""
    with _llm(smollm2_path, adapters, max_running_req=8, max_loras=1, cpu_kv_budget_gib=0.25) as llm:
        yield llm


def _clean(llm: LLM) -> None:
    """Nothing queued, running or held; no adapter pinned."""
    llm_clean(llm)
    manager = llm.scheduler.lora
    assert all(loaded.pins == 0 for loaded in manager.by_name.values())
    assert manager.resident <= llm.engine.config.max_loras


def test_mixed_batch_matches_transformers_and_peft(llm, reference) -> None:
    ids = [llm.tokenizer(p)["input_ids"] for p in PROMPTS]
    names = [None, "attn", "mlp", "mlp", "attn", None]
    prompts = [ids[i % len(ids)] for i in range(len(names))]
    got = llm.generate(prompts, GREEDY, lora=names)
    want = [reference(p, name) for p, name in zip(prompts, names)]
    assert [o.token_ids for o in got] == want
    # the adapters change the outputs (the test would not see them otherwise)
    assert len({tuple(reference(ids[0], name)) for name in (None, "attn", "mlp")}) == 3
    _clean(llm)


def test_the_prefix_cache_is_keyed_by_adapter(llm, reference) -> None:
    """The same (long enough to be cached) prompt under the base and both adapters, one after the other,
    each directly after each of the others (a sequence through all six ordered pairs): each gets its own
    reference's tokens, never another's cached KV."""
    prompt = llm.tokenizer(" ".join(PROMPTS) * 2)["input_ids"]
    scored = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    sequence = [None, "attn", "mlp", "attn", None, "mlp", None]
    pairs = set(zip(sequence, sequence[1:]))
    assert pairs == set(itertools.permutations([None, "attn", "mlp"], 2))
    for step, name in enumerate(sequence):
        [out] = llm.generate([prompt], scored, lora=name)
        assert out.token_ids == reference(prompt, name), (step, name)
        # log probabilities too: KV of the prompt computed under another adapter would move them (the
        # tokens alone could survive it)
        got = [entry.logprob for entry in out.logprobs]
        assert got == pytest.approx(reference.logprobs(prompt, name), abs=1e-3), (step, name)
    assert llm.scheduler.prefix_cached_tokens > 0  # the cache was used: same-adapter repeats hit
    _clean(llm)


def test_streamed_equals_whole_and_chat_takes_an_adapter(llm, reference) -> None:
    prompt = llm.tokenizer(PROMPTS[1])["input_ids"]
    whole = llm.generate([prompt], GREEDY, lora="attn")[0]
    assert "".join(llm.stream(prompt, GREEDY, lora="attn")) == whole.text
    messages = [{"role": "user", "content": "Hi!"}]
    reply = llm.chat(messages, GREEDY, lora="mlp")
    assert reply.token_ids == reference(llm.chat_prompt(messages), "mlp")
    _clean(llm)


def test_load_use_unload_reload(llm, adapters, reference, smollm2_path, tmp_path) -> None:
    prompt = llm.tokenizer(PROMPTS[0])["input_ids"]
    llm.load_lora("again", adapters["attn"])
    assert llm.lora_adapters == ["attn", "mlp", "again"]
    assert llm.generate([prompt], GREEDY, lora="again")[0].token_ids == reference(prompt, "attn")
    llm.unload_lora("again")
    with pytest.raises(KeyError, match="no LoRA adapter named 'again' is loaded"):
        llm.generate([prompt], GREEDY, lora="again")
    # the same name from another folder: its own tokens (no KV of the first load is reused)
    llm.load_lora("again", adapters["mlp"])
    assert llm.generate([prompt], GREEDY, lora="again")[0].token_ids == reference(prompt, "mlp")
    llm.unload_lora("again")
    with pytest.raises(KeyError):
        llm.unload_lora("again")
    _clean(llm)


def test_refusals_name_the_reason(llm, adapters, smollm2_path, tmp_path) -> None:
    with pytest.raises(LoraError, match="already loaded"):
        llm.load_lora("attn", adapters["mlp"])
    with pytest.raises(LoraError, match="adapter_config.json"):
        llm.load_lora("nothing", str(tmp_path))
    big = make_peft_adapter(smollm2_path, tmp_path / "big", 0, r=16, lora_alpha=16, target_modules=["q_proj"])
    with pytest.raises(LoraError, match="max_lora_rank=8"):
        llm.load_lora("big", big)
    dora = make_peft_adapter(
        smollm2_path, tmp_path / "dora", 0, r=4, lora_alpha=8, use_dora=True, target_modules=["q_proj"]
    )
    with pytest.raises(LoraError, match="DoRA"):
        llm.load_lora("dora", dora)
    with pytest.raises(ValueError, match="lora has 2 entries for 1 prompts"):
        llm.generate([PROMPTS[0]], GREEDY, lora=["attn", "mlp"])
    assert llm.lora_adapters == ["attn", "mlp"]
    _clean(llm)


def test_an_engine_without_adapters_says_how_to_get_them(smollm2_path) -> None:
    with LLM(str(smollm2_path), device="cpu", dtype="float32", cpu_kv_budget_gib=0.05) as llm:
        assert llm.engine.lora_pool is None and llm.lora_adapters == []
        with pytest.raises(ValueError, match="start it with lora_modules"):
            llm.generate([PROMPTS[0]], GREEDY, lora="attn")
        with pytest.raises(ValueError, match="allow_runtime_lora"):
            llm.load_lora("attn", "/nowhere")


@pytest.mark.parametrize("overlap", [False, True])
def test_preemption_chunks_and_ngram_speculation_keep_each_adapter(
    smollm2_path, adapters, reference, overlap
):
    """Few KV pages (requests preempted and recomputed), prefill chunks of 8 tokens and n-gram
    speculation, with and without overlap scheduling: every request still gets its own adapter's
    tokens, the drafts verified under it."""
    from minisgl import metrics

    with _llm(
        smollm2_path,
        adapters,
        max_running_req=6,
        num_page_override=16,
        max_prefill_tokens=8,
        overlap_scheduling=overlap,
        speculative_method="ngram",
        max_loras=2,  # both adapters run together: the pages, not the slots, are short
    ) as llm:
        counted = {"model_name": llm.model_name}
        accepted = metrics.REGISTRY.get_sample_value("minisgl_spec_accepted_tokens_total", counted) or 0
        ids = [llm.tokenizer(p * 2)["input_ids"] for p in PROMPTS]  # repeats: the n-gram drafts find them
        names = ["mlp", None, "attn", "attn", "mlp", None]
        prompts = [ids[i % len(ids)] for i in range(len(names))]
        got = llm.generate(prompts, GREEDY, lora=names)
        assert [o.token_ids for o in got] == [reference(p, name) for p, name in zip(prompts, names)]
        assert llm.scheduler.preemptions > 0
        assert metrics.REGISTRY.get_sample_value("minisgl_spec_accepted_tokens_total", counted) > accepted
        _clean(llm)
