import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

# the test files' order, the slowest first, and `--record-durations` (tests/durations.py)
from durations import (  # noqa: F401
    pytest_addoption,
    pytest_collection_modifyitems,
    pytest_configure,
    pytest_runtest_logreport,
    pytest_sessionfinish,
)
from hypothesis import HealthCheck, settings

# Without a GPU, minisgl's Triton kernels run on CPU tensors under Triton's interpreter
# (tests/test_fused_kernels.py). Triton reads this when a kernel is decorated, at the import of
# minisgl.kernels, so it is set here, before any test module imports minisgl.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from interpreter import skip_repeated_patching

    skip_repeated_patching()

logging.basicConfig(level=logging.INFO)

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The embedded default model (SmolLM2-135M-Instruct) as a safetensors folder."""
    from minisgl.models.default import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smollm2_server():
    """One `minisgl-run serve` of the default model (`Server` of test_server.py: 16 requests at a time,
    bodies up to 64 KiB) for every module whose tests only send it requests (test_server,
    test_logit_bias, test_penalties, test_logprobs, test_structured_output): a server start is a
    process with its own imports and model load, several seconds on 2 cores. Stopped at the end of the
    session, and it must exit 0."""
    from test_server import Server

    srv = Server("--max-running-req", "16", "--max-request-bytes", "65536")
    try:
        yield srv
    finally:
        assert srv.stop() == 0, srv.output()


@pytest.fixture(scope="module")
def ranks():
    """A module's tensor-parallel rank processes (tests/tp_ranks.py, `assert_tp_matches_single` of
    test_tp.py): started once, each a rank of one run after another."""
    from tp_ranks import RankPool

    pool = RankPool()
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Callable[..., Path]:
    """`tiny_model(arch, **overrides)`: `make_tiny_model`'s folder (`tokenizer=True`:
    `make_tiny_model_with_tokenizer`'s), built and saved once a session (an xdist worker) for each set
    of arguments, in a folder of its own. For tests that only read the model: a test that changes the
    folder (deletes the weights, rewrites config.json) builds its own with `make_tiny_model`. Each call
    leaves torch's global generator as the build left it (`make_tiny_model` seeds it), as a build would."""
    saved: dict[str, tuple[Path, torch.Tensor]] = {}

    def get(arch: str = "llama", tokenizer: bool = False, **overrides: Any) -> Path:
        key = repr((arch, tokenizer, sorted(overrides.items())))
        if key not in saved:
            make = make_tiny_model_with_tokenizer if tokenizer else make_tiny_model
            folder = make(tmp_path_factory.mktemp(f"tiny-{arch}"), arch, **overrides)
            saved[key] = folder, torch.get_rng_state()
        folder, rng = saved[key]
        torch.set_rng_state(rng)
        return folder

    return get


@pytest.fixture(scope="session")
def tiny_server_args(tiny_model) -> list[str]:
    """`minisgl-run serve` options for a tiny Llama with the default model's tokenizer, served under the
    default model's name: for servers whose tests check the front end and its processes, not a real
    model's tokens (requests written for the default model reach it unchanged; its engine loads in a
    moment, and loads again in a moment after a kill)."""
    folder = tiny_model("llama", tokenizer=True)
    options = ["--model", str(folder), "--device", "cpu", "--dtype", "float32"]
    return [*options, "--served-model-name", "smollm2-135m-instruct"]


@pytest.fixture(scope="module")
def llm32(smollm2_path):
    """`LLM` on the default model, float32 on the CPU, 8 requests at a time (shut down after the module)."""
    from minisgl.llm import LLM

    with LLM(str(smollm2_path), device="cpu", dtype="float32", max_running_req=8) as llm:
        yield llm


GEMMA2_CAPS = dict(attn_logit_softcapping=5.0, final_logit_softcapping=3.0)
# the transformers config class of each model family make_tiny_model builds, and the family's shape
# beyond TINY_COMMON
TINY_FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": (
        "LlamaConfig",
        dict(
            head_dim=16,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    # a window shorter than most test sequences (Mistral-7B v0.1's is 4096)
    "mistral": ("MistralConfig", dict(head_dim=16, rope_theta=1000000.0, sliding_window=12)),
    "qwen2": ("Qwen2Config", dict(rope_theta=10000.0)),
    "qwen3": ("Qwen3Config", dict(head_dim=32, rope_theta=1000000.0)),
    # 3 layers, layer 1 dense (mlp_only_layers), 8 experts, top-2
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            head_dim=16,
            rope_theta=1000000.0,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        ),
    ),
    # gpt-oss: 3 layers (sliding, full, sliding) under a window of 8, 8 experts top-2 with a low SwiGLU
    # clamp (it bites at these scales), YaRN over an original context of 64
    "gpt_oss": (
        "GptOssConfig",
        dict(
            head_dim=16,
            num_local_experts=8,
            num_experts_per_tok=2,
            sliding_window=8,
            swiglu_limit=0.3,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 8.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    # Gemma 2: head_dim 24 (not hidden / heads), sliding and full layers with a window of 7, soft caps
    # small enough to bite, tied embeddings
    "gemma2": (
        "Gemma2Config",
        dict(
            head_dim=24, query_pre_attn_scalar=20, sliding_window=7, tie_word_embeddings=True, **GEMMA2_CAPS
        ),
    ),
    # Gemma 3: q/k norms, a window of 6 on layers 0 and 2, each layer type its own RoPE (full: linear x4)
    "gemma3": (
        "Gemma3TextConfig",
        dict(
            head_dim=16,
            query_pre_attn_scalar=12,
            sliding_window=6,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
            },
        ),
    ),
    # Phi-3: half of each head rotated, LongRoPE past 20 positions
    "phi3": (
        "Phi3Config",
        dict(
            partial_rotary_factor=0.5,
            original_max_position_embeddings=20,
            rope_scaling={
                "rope_type": "longrope",
                "short_factor": [1.0, 1.2, 1.5, 2.0],
                "long_factor": [2.0, 3.0, 4.0, 8.0],
            },
        ),
    ),
}
TINY_COMMON: dict[str, Any] = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
    tie_word_embeddings=False,
)
# the GPU tests' shape, with Qwen3-0.6B's attention (head_dim 128, 16 query / 8 KV heads) so that the
# FlashInfer kernels compile once
QWEN3_0_6B_ATTENTION: dict[str, Any] = dict(num_attention_heads=16, num_key_value_heads=8, head_dim=128)
GPU_SHAPE: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=512,
    max_position_embeddings=1024,
    pad_token_id=None,
    **QWEN3_0_6B_ATTENTION,
)
# parameters make_tiny_model draws again after transformers' init: group -> (selects a name, mean, std).
# Norm weights start at ones, biases and the MoE router at zeros: random ones show a weight skipped.
RANDOMIZE: dict[str, tuple[Callable[[str], bool], float, float]] = {
    "norm": (lambda name: "norm" in name, 1.0, 0.2),
    "bias": (lambda name: name.endswith("bias"), 0.0, 0.2),
    "router": (lambda name: name.endswith(("mlp.gate.weight", "mlp.router.weight")), 0.0, 0.5),
    "sinks": (lambda name: name.endswith("self_attn.sinks"), 0.0, 1.0),
    "lm_head": (lambda name: name == "lm_head.weight", 0.0, 1.0),
}


def make_tiny_model(
    tmp_path: Path,
    arch: str,
    seed: int = 0,
    randomize: tuple[str, ...] = ("norm", "bias", "router", "sinks"),
    adjust: Callable[[torch.nn.Module], None] | None = None,
    **overrides: Any,
) -> Path:
    """Builds a tiny random model of family `arch` (llama, mistral, qwen2, qwen3, qwen3_moe) with transformers
    (the reference) and saves it as safetensors in `tmp_path / tiny-<arch>`. `overrides` are config keys
    over the family's shape; `randomize` names the RANDOMIZE groups drawn again (in that order of
    precedence) after transformers' init under `torch.manual_seed(seed)`; `adjust(model)`, when given,
    then changes the weights in place (under no_grad) before the model is saved."""
    import transformers

    if arch not in TINY_FAMILIES:
        raise ValueError(f"arch={arch!r} is not a tiny-model family: use one of {', '.join(TINY_FAMILIES)}")
    config_class, family = TINY_FAMILIES[arch]
    cfg = getattr(transformers, config_class)(**{**TINY_COMMON, **family, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    groups = [RANDOMIZE[group] for group in randomize]
    with torch.no_grad():
        for name, param in model.named_parameters():
            drawn = next(((mean, std) for selects, mean, std in groups if selects(name)), None)
            if drawn is not None:
                param.normal_(*drawn)
        if adjust is not None:
            adjust(model)
    folder = tmp_path / f"tiny-{arch}"
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def soft_capped(scores: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Attention scores under a soft cap (Gemma 2's): cap * tanh(scores / cap); None: as they are."""
    return scores if cap is None else torch.tanh(scores / cap) * cap


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# hypothesis for the tests that drive an engine: the same examples on every run (CI does not flake on a
# new one), nothing written to .hypothesis/, no deadline, module fixtures shared by the examples; a test
# adds its count: @settings(FIXED_EXAMPLES, max_examples=N)
FIXED_EXAMPLES = settings(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


# the GPU tests' batch: prompt lengths, and the teacher-forced decode steps after each
GPU_PROMPT_LENS = [7, 33, 1, 150, 64]
GPU_STEPS = 6


def gpu_seqs(vocab: int = GPU_SHAPE["vocab_size"], lens=GPU_PROMPT_LENS) -> list[list[int]]:
    """Seeded random sequences of `lens` prompt tokens plus GPU_STEPS more (token ids from 3)."""
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (n + GPU_STEPS,), generator=g).tolist() for n in lens]


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory) -> Path:
    """A tiny Qwen3 of the GPU tests' shape (`GPU_SHAPE`), its weights as transformers draws them."""
    return make_tiny_model(tmp_path_factory.mktemp("models"), "qwen3", randomize=(), **GPU_SHAPE)


def replay_matches(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, x2: torch.Tensor) -> bool:
    """Whether `fn` captured in a CUDA graph on a copy of `x` (after one warm call), replayed on `x2`,
    gives `fn(x2)` bit for bit."""
    static_x = x.clone()
    graph = torch.cuda.CUDAGraph()
    fn(static_x)
    with torch.cuda.graph(graph):
        out = fn(static_x)
    static_x.copy_(x2)
    graph.replay()
    return torch.equal(out, fn(x2))


def teacher_forced_logits(
    engine,
    seqs: list[list[int]],
    prompt_lens: list[int],
    steps: int,
    on_step: Callable[[int, Any], None] | None = None,
    lora_slots: list[int] | None = None,
) -> torch.Tensor:
    """Prefills each seq[:n] as one batch, then decodes `steps` steps fed from the sequences (teacher
    forcing). Returns the float32 logits, (requests, steps + 1, vocab): step 0 predicts position n.
    `on_step(step, batch)`, when given, is called after each forward (step 0: the prefill).
    `lora_slots`: each request's LoRA slot in the engine's pool (-1: none)."""
    from minisgl.core import SamplingParams
    from minisgl.scheduler import BatchPreparer

    prep = BatchPreparer(engine)
    reqs = [prep.add_request(s[:n], SamplingParams(max_tokens=steps + 1)) for s, n in zip(seqs, prompt_lens)]
    for req, slot in zip(reqs, lora_slots or []):
        req.lora_slot = slot
    out = []
    for step in range(steps + 1):
        if step > 0:
            for req, s, n in zip(reqs, seqs, prompt_lens):
                req.input_ids.append(s[n + step - 1])
        batch = prep.prefill(reqs) if step == 0 else prep.decode(reqs)
        out.append(engine.forward_logits(batch))
        if on_step is not None:
            on_step(step, batch)
    prep.release(reqs)
    assert prep.pages.num_used == 0
    return torch.stack(out, dim=1).float()


def hf_forward(model: torch.nn.Module, ids: torch.Tensor, cache: Any = None, **kwargs: Any) -> tuple:
    """One forward of a transformers causal LM on its KV cache (None: the first, which makes it):
    (logits, cache). transformers 5 calls the cache `cache` (`past_key_values` deprecated), 4 calls it
    `past_key_values`."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    name = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
    out = model(ids, use_cache=True, **({name: cache} if cache is not None else {}), **kwargs)
    return out.logits, getattr(out, name)


def hf_model(folder: Path | str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """transformers' model of `folder` in `dtype`, in eval mode. gpt-oss's clamped SwiGLU takes the
    config's `swiglu_limit` / `swiglu_alpha` (transformers up to 5.18 fixed them at 7.0 / 1.702, which
    real checkpoints use, and ignored the tiny models' low limit)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    limit = getattr(model.config, "swiglu_limit", None)
    if limit is not None:
        alpha = getattr(model.config, "swiglu_alpha", 1.702)
        for module in model.modules():
            if hasattr(module, "limit") and hasattr(module, "alpha"):
                module.limit, module.alpha = limit, alpha
    return model


def reference_logits(folder: Path, seqs: list[list[int]], prompt_lens: list[int], steps: int) -> torch.Tensor:
    """transformers' logits at the same positions as `teacher_forced_logits`, each sequence alone."""
    model = hf_model(folder)
    with torch.no_grad():
        full = [model(torch.tensor([s])).logits[0] for s in seqs]
    return torch.stack([f[n - 1 : n + steps] for f, n in zip(full, prompt_lens)])


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def make_tiny_model_with_tokenizer(tmp_path: Path, arch: str = "llama", **overrides: Any) -> Path:
    """A tiny model (see `make_tiny_model`) with the embedded default model's tokenizer and its
    vocabulary size, so that text prompts, streams and stop strings run at a tiny model's speed."""
    import shutil

    from minisgl.models.default import default_model_path

    source = default_model_path()
    folder = make_tiny_model(tmp_path, arch, vocab_size=49152, **overrides)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, folder / name)
    return folder


def make_peft_adapter(model_folder: Path | str, out: Path, seed: int, scale: float = 0.3, **lora: Any) -> str:
    """A PEFT LoRA adapter of the model in `model_folder`, `LoraConfig(**lora)`, its A and B drawn at
    random (N(0, scale**2); PEFT starts B at zero, which would add nothing), saved in `out` as
    `save_pretrained` writes it; returns `out` as a string (`make_peft_model`: the PEFT model too)."""
    return str(make_peft_model(model_folder, out, seed, scale, **lora)[1])


def make_peft_model(model_folder: Path | str, out: Path, seed: int, scale: float = 0.3, **lora: Any):
    """`make_peft_adapter`'s (PEFT model, folder)."""
    import torch
    from peft import LoraConfig, get_peft_model

    model = hf_model(model_folder)
    peft_model = get_peft_model(model, LoraConfig(**lora)).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=g) * scale)
    peft_model.save_pretrained(out)
    return peft_model, out


def compiled_runner(engine, forward):
    """The compile half of a GraphRunner on a CPU engine (which has no graphs): `forward` as its
    compiled function (`torch.compile` of the model's forward, or a stand-in), the engine's LoRA part
    its own."""
    from minisgl.engine.graph import GraphRunner

    runner = GraphRunner.__new__(GraphRunner)
    runner.model, runner.ctx, runner.device = engine.model, engine.ctx, engine.device
    runner.lora, runner.graphs, runner.base_graphs = engine.lora, {}, {}
    runner.max_running_req = engine.config.max_running_req
    runner.dummy_loc = engine.kv_cache.dummy_page * engine.config.page_size
    runner.rows = torch.arange(engine.config.max_running_req + 1)
    runner.batch_sizes, runner.prefill_sizes, runner.compile_prefill = [1], [], True
    runner.forward = forward
    return runner


def check_clean(sched) -> None:
    """Nothing queued or running on the scheduler, no KV page held by a request (the prefix cache may
    hold pages, unreferenced), every slot free."""
    assert not sched.running and not sched.waiting
    assert sched.prep.num_request_pages == 0 and sched.held_pages == 0
    sched.prep.check_pages()
    cache = sched.prep.cache
    assert sched.prep.pages.num_used == (0 if cache is None else cache.num_pages)
    assert cache is None or cache.num_referenced_pages == 0
    assert sched.prep.table_idxs.num_free == sched.engine.config.max_running_req


def llm_clean(llm) -> None:
    """`check_clean` of an LLM's scheduler, and no dropped stream waiting to be aborted."""
    check_clean(llm.scheduler)
    assert not llm._abandoned


def one_decode_step(engine, prompts: list[list[int]], next_token: int = 5) -> tuple[torch.Tensor, bool]:
    """Prefills `prompts`, feeds each `next_token`, and returns the logits of that one decode step and
    whether it replayed a CUDA graph."""
    from minisgl.core import SamplingParams
    from minisgl.scheduler import BatchPreparer

    prep = BatchPreparer(engine)
    reqs = [prep.add_request(p, SamplingParams(max_tokens=2)) for p in prompts]
    engine.forward_logits(prep.prefill(reqs))
    for req in reqs:
        req.input_ids.append(next_token)
    batch = prep.decode(reqs)
    replayed = engine.graph_runner.can_use_cuda_graph(batch)
    logits = engine.forward_logits(batch)
    prep.release(reqs)
    return logits, replayed


@pytest.fixture(scope="module")
def shared_llm():
    """One CPU LLM (float32, a small KV budget) for a test module's CLI runs."""
    import minisgl.llm

    with minisgl.llm.LLM(device="cpu", dtype="float32", cpu_kv_budget_gib=0.25) as llm:
        yield llm
