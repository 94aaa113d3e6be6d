"""Mistral: `MistralForCausalLM` checkpoints, Llama's layers under a sliding attention
window of `sliding_window` tokens (null: full attention). Tiny random models of Mistral-7B v0.1's
(a window, RoPE theta 1e4), v0.2's (no window, theta 1e6) and v0.3's (no window, a larger vocabulary)
kinds against transformers on the CPU, with windows shorter than the sequences: logits with prefill and
teacher-forced decode, greedy tokens with chunked prefill, and through the scheduler with the radix
prefix cache and small prefill chunks; the config.json keys; the chat template of a
`chat_template.json`. The GPU backends' window: tests/gpu/test_gpu_mistral.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from conftest import make_tiny_model, reference_logits, rel_err, teacher_forced_logits

from minisgl.core import SamplingParams
from minisgl.engine import Engine, EngineConfig
from minisgl.models import ModelConfig
from minisgl.scheduler import Scheduler, SchedulerConfig, generate
from minisgl.templates import json_chat_template, load_tokenizer

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "models"
PROMPT_LENS = [5, 17, 1, 40]
DECODE_STEPS = 12
# tiny models of each release's kind (make_tiny_model's "mistral" has 4 query and 2 KV heads of 16)
SHAPES: dict[str, dict[str, Any]] = {
    "v0.1": dict(sliding_window=12, rope_theta=10000.0),
    "v0.2": dict(sliding_window=None, rope_theta=1000000.0),
    "v0.3": dict(sliding_window=None, rope_theta=1000000.0, vocab_size=400),
    "window-1": dict(sliding_window=1),  # each token sees itself only
    "window-16": dict(sliding_window=16),  # a whole page of 16
}


def _engine(folder: Path, **kw: Any) -> Engine:
    return Engine(EngineConfig(model_path=str(folder), dtype=torch.float32, device="cpu", **kw))


def _seqs(vocab: int, lens: list[int], extra: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab, (n + extra,), generator=gen).tolist() for n in lens]


def _hf_greedy(folder: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers' greedy tokens, every step a full forward of the sequence so far (no KV cache: the
    mask alone decides what each token sees)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            seq = list(prompt)
            for _ in range(max_tokens):
                seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
            out.append(seq[len(prompt) :])
    return out


@pytest.fixture(scope="module")
def tiny_mistral(tiny_model) -> Path:
    """make_tiny_model's Mistral: a window of 12 tokens."""
    return tiny_model("mistral")


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("page_size", [1, 16])
def test_logits_match_transformers(tmp_path: Path, shape: str, page_size: int) -> None:
    """Prefill of four prompts in one batch (1 to 40 tokens), then 12 teacher-forced decode steps: the
    logits of transformers' MistralForCausalLM at every position. Where there is a window, the same
    model without one gives other logits past the window (so the window is what matched)."""
    overrides = SHAPES[shape]
    folder = make_tiny_model(tmp_path, "mistral", **overrides)
    config = ModelConfig.from_path(folder)
    assert (config.architecture, config.family) == ("MistralForCausalLM", "mistral")
    assert config.sliding_window == overrides["sliding_window"]
    seqs = _seqs(config.vocab_size, PROMPT_LENS, DECODE_STEPS)
    engine = _engine(folder, page_size=page_size)
    assert engine.attn_backend.sliding_window == overrides["sliding_window"]
    got = teacher_forced_logits(engine, seqs, PROMPT_LENS, DECODE_STEPS)
    engine.shutdown()
    want = reference_logits(folder, seqs, PROMPT_LENS, DECODE_STEPS)
    err = rel_err(got, want)
    assert err < 1e-4, f"{shape} page_size={page_size}: relative error {err:.2e}"
    if overrides["sliding_window"] is not None:
        raw = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**raw, "sliding_window": None}))
        full = reference_logits(folder, seqs, PROMPT_LENS, DECODE_STEPS)
        print(f"{shape}: full attention against the window: relative difference {rel_err(full, want):.2f}")
        assert rel_err(full, want) > 0.05


@pytest.mark.parametrize("chunk_size", [None, 5, 12])
def test_greedy_tokens_match_transformers_with_chunked_prefill(tiny_mistral: Path, chunk_size) -> None:
    """Greedy generation, the prompts prefilled whole or in chunks of 5 or of the window (12), page
    size 4: transformers' tokens exactly."""
    prompts = [s[:n] for s, n in zip(_seqs(320, [3, 20, 33], 0), [3, 20, 33])]
    engine = _engine(tiny_mistral, page_size=4)
    got = generate(engine, prompts, SamplingParams(max_tokens=16, ignore_eos=True), chunk_size=chunk_size)
    engine.shutdown()
    assert got == _hf_greedy(tiny_mistral, prompts, 16)


@pytest.mark.parametrize("overlap", [False, True])
def test_radix_cache_and_chunked_prefill_under_the_window(tiny_mistral: Path, overlap: bool) -> None:
    """Requests over a shared prefix of 30 tokens (past the window of 12) arrive one after another;
    the radix cache gives the later ones the prefix's pages, which hold KV behind their window, and
    prefill chunks of 8 tokens cut the prompts: every request's greedy tokens are transformers'."""
    base = _seqs(320, [30], 0)[0]
    tails = _seqs(320, [1, 7, 14, 3], 0)
    prompts = [base + tail for tail in tails] + [base[:21]]
    engine = _engine(tiny_mistral, page_size=4, num_page_override=200, max_running_req=4)
    sched = Scheduler(
        engine,
        SchedulerConfig(max_prefill_tokens=8, overlap_scheduling=overlap, cache_type="radix"),
        eos_token_ids=[2],
    )
    states = []
    for prompt in prompts:  # one at a time, so that each finds the ones before it cached
        states.append(sched.add_request(prompt, SamplingParams(max_tokens=10, ignore_eos=True)))
        while sched.has_work():
            sched.step()
    assert [s.output_ids for s in states] == _hf_greedy(tiny_mistral, prompts, 10)
    # whole pages of 4 of the shared 30 tokens; the last prompt, 21 of them: all but its last token
    assert [s.prefix_found for s in states] == [0, 28, 28, 28, 20]
    engine.shutdown()


def test_a_window_longer_than_any_sequence_is_dropped(tmp_path: Path) -> None:
    """A window that reaches past `max_seq_len` hides no token: the backend runs without one."""
    folder = make_tiny_model(tmp_path, "mistral", sliding_window=64)
    assert _engine(folder, max_seq_len_override=64).attn_backend.sliding_window is None
    engine = _engine(folder, max_seq_len_override=65)
    assert engine.attention_window == engine.attn_backend.sliding_window == 64


# -- config.json ---------------------------------------------------------------------------------

# Mistral-7B v0.1 to v0.3 (their config.json files, as the hub holds them, less unread keys)
RELEASES: dict[str, dict[str, Any]] = {
    "v0.1": {"rope_theta": 10000.0, "sliding_window": 4096, "vocab_size": 32000},
    "v0.2": {"rope_theta": 1000000.0, "sliding_window": None, "vocab_size": 32000},
    "v0.3": {"rope_theta": 1000000.0, "sliding_window": None, "vocab_size": 32768},
}
MISTRAL_7B: dict[str, Any] = {
    "architectures": ["MistralForCausalLM"],
    "model_type": "mistral",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


@pytest.mark.parametrize("release", sorted(RELEASES))
def test_mistral_7b_configs(release: str) -> None:
    raw = {**MISTRAL_7B, **RELEASES[release]}
    config = ModelConfig.from_dict(raw)
    hf = transformers.MistralConfig(**raw)
    assert (config.family, config.num_layers, config.hidden_size, config.intermediate_size) == (
        "mistral",
        32,
        4096,
        14336,
    )
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (32, 8, 128)
    assert (config.vocab_size, config.rope.theta) == (raw["vocab_size"], raw["rope_theta"])
    assert config.sliding_window == hf.sliding_window == raw["sliding_window"]
    assert not (config.qkv_bias or config.o_bias or config.qk_norm or config.tie_word_embeddings)


@pytest.mark.parametrize("release", ["v0.1", "v0.3"])
def test_preset_model_folders(release: str) -> None:
    """configs/models/mistral-7b-v0.1 and -v0.3 (the H200 preset's) hold those releases' configs."""
    config = ModelConfig.from_path(CONFIGS / f"mistral-7b-{release}")
    want = ModelConfig.from_dict({**MISTRAL_7B, **RELEASES[release]})
    assert config == want


def test_sliding_window_key() -> None:
    """Absent: transformers' default of 4096; null: none; other families never read it."""
    base = {**MISTRAL_7B, **RELEASES["v0.1"]}
    del base["sliding_window"]
    assert ModelConfig.from_dict(base).sliding_window == transformers.MistralConfig(**base).sliding_window
    assert ModelConfig.from_dict(base).sliding_window == 4096
    assert ModelConfig.from_dict({**base, "sliding_window": None}).sliding_window is None
    assert ModelConfig.from_dict({**base, "sliding_window": 1}).sliding_window == 1
    for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        other = ModelConfig.from_dict({**base, "architectures": [arch], "sliding_window": 8})
        assert other.sliding_window is None, arch
    # transformers' Mistral has no attention biases, whatever the key says
    assert not ModelConfig.from_dict({**base, "attention_bias": True}).qkv_bias


@pytest.mark.parametrize(
    ("value", "shown"),
    [(0, "0"), (-4, "-4"), ("4096", '"4096"'), (4096.0, "4096.0"), (True, "true"), (2**31, str(2**31))],
)
def test_impossible_sliding_window_names_the_key(value: Any, shown: str) -> None:
    with pytest.raises(ValueError, match=f"^config.json: sliding_window={shown} must be an integer in"):
        ModelConfig.from_dict({**MISTRAL_7B, "vocab_size": 32000, "sliding_window": value})


# -- the chat template of chat_template.json -------------------------------------------------------

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)
MESSAGES = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]


@pytest.fixture
def template_folder(smollm2_path: Path, tmp_path: Path) -> Path:
    """The default model's tokenizer without a template of its own, and a chat_template.json."""
    folder = tmp_path / "tok"
    folder.mkdir()
    shutil.copy(smollm2_path / "tokenizer.json", folder)
    config = json.loads((smollm2_path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    return folder


def test_chat_template_json_is_the_template(template_folder: Path) -> None:
    tokenizer = load_tokenizer(template_folder)
    assert tokenizer.chat_template == TEMPLATE
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False)
    assert text == f"{tokenizer.bos_token}[INST] Hi [/INST]Hello{tokenizer.eos_token}"
    # without the file, the tokenizer has no template: the file is where it came from
    (template_folder / "chat_template.json").unlink()
    assert not load_tokenizer(template_folder).chat_template


def test_the_tokenizers_own_template_wins(template_folder: Path, smollm2_path: Path) -> None:
    shutil.copy(smollm2_path / "chat_template.jinja", template_folder)
    own = (smollm2_path / "chat_template.jinja").read_text()
    assert load_tokenizer(template_folder).chat_template == own != TEMPLATE


def test_chat_template_json_forms_and_errors(tmp_path: Path) -> None:
    path = tmp_path / "chat_template.json"
    assert json_chat_template(tmp_path) is None
    named = [{"name": "default", "template": "a"}, {"name": "tool_use", "template": "b"}]
    path.write_text(json.dumps({"chat_template": named}))
    assert json_chat_template(tmp_path) == {"default": "a", "tool_use": "b"}
    for bad in ("{", "[1]", json.dumps({"chat_template": 3}), json.dumps({"other": "x"})):
        path.write_text(bad)
        with pytest.raises(ValueError, match="chat_template.json: "):
            json_chat_template(tmp_path)


@pytest.mark.slow
def test_llm_chat_uses_chat_template_json(template_folder: Path, tiny_mistral: Path) -> None:
    """`LLM.chat_prompt` on a tiny Mistral whose only template is its chat_template.json."""
    from minisgl.llm import LLM

    folder = template_folder.parent / "model"
    shutil.copytree(tiny_mistral, folder)
    for entry in template_folder.iterdir():
        shutil.copy(entry, folder)
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "vocab_size": 49152}))
    with LLM(str(folder), device="cpu", dtype="float32", use_dummy_weight=True) as llm:
        prompt = llm.chat_prompt([MESSAGES[0]])
        assert llm.tokenizer.decode(prompt) == f"{llm.tokenizer.bos_token}[INST] Hi [/INST]"
