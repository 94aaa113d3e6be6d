"""The real default model (SmolLM2-135M-Instruct, float32, CPU): greedy tokens identical to transformers."""

import pytest
import torch
import transformers
from conftest import hf_forward, rel_err

from minisgl.core import SamplingParams
from minisgl.engine import Engine, EngineConfig
from minisgl.scheduler import BatchPreparer, generate

NEW_TOKENS = 32
SINGLE_TOKENS = 8  # the requests run one at a time (each decode step a pass over the weights)
TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker who",
    "1, 2, 3, 5, 8, 13,",
    "Translate to French: The weather is nice today.",
    "Q: What is the boiling point of water at sea level?\nA:",
    "The",
    "Photosynthesis is the process by which green plants and some other organisms use sunlight to synthesize "
    "foods from carbon dioxide and water. Photosynthesis in plants generally involves the green pigment "
    "chlorophyll and generates oxygen as a byproduct. Explain in simple terms why this matters for animals:",
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    return transformers.AutoTokenizer.from_pretrained(smollm2_path)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    ids = [tokenizer(text)["input_ids"] for text in TEXTS]
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True, tokenize=False
    )
    ids.append(tokenizer(chat)["input_ids"])
    return ids


@pytest.fixture(scope="module")
def reference(smollm2_path, prompts):
    """transformers, plain argmax (EOS not special), and its logits: the prompts as one batch, left-padded
    under an attention mask with positions counted from it (equal to each prompt alone: the same tokens,
    logits within 2e-6 relative, in a third of the time)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    batch, width = len(prompts), max(map(len, prompts))
    ids = torch.zeros(batch, width, dtype=torch.long)
    mask = torch.zeros(batch, width, dtype=torch.long)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt) :], mask[i, width - len(prompt) :] = torch.tensor(prompt), 1
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        logits, cache = hf_forward(model, ids, attention_mask=mask, position_ids=positions)
        steps, tokens = [logits[:, -1]], []
        for step in range(NEW_TOKENS):
            tokens.append(steps[-1].argmax(-1))
            if step == NEW_TOKENS - 1:
                break
            mask = torch.cat([mask, torch.ones(batch, 1, dtype=torch.long)], dim=1)
            positions = positions[:, -1:] + 1
            logits, cache = hf_forward(
                model, tokens[-1][:, None], cache, attention_mask=mask, position_ids=positions
            )
            steps.append(logits[:, -1])
    return torch.stack(tokens, dim=1).tolist(), list(torch.stack(steps, dim=1))


def _engine(path, **kw) -> Engine:
    return Engine(EngineConfig(model_path=str(path), dtype=torch.float32, device="cpu", **kw))


@pytest.fixture(scope="module")
def engine(smollm2_path):
    engine = _engine(smollm2_path, page_size=16)
    yield engine
    engine.shutdown()


def test_greedy_tokens_match_transformers_in_one_batch(engine, prompts, reference):
    """One batch of mixed lengths through Engine.forward_batch: prefill, then decode steps."""
    expected_tokens, expected_logits = reference
    prep = BatchPreparer(engine)
    reqs = [prep.add_request(p, SamplingParams(max_tokens=NEW_TOKENS)) for p in prompts]
    batch = prep.prefill(reqs)
    for step in range(NEW_TOKENS):
        if step:
            batch = prep.decode(reqs)
        out = engine.forward_batch(batch, prep.sampling_args(batch))
        out.copy_done_event.synchronize()
        prep.append_tokens(batch, out.next_tokens_cpu)
    got = [req.input_ids[req.num_prompt_tokens :] for req in reqs]
    prep.release(reqs)
    assert prep.pages.num_used == 0
    for i, (g, e) in enumerate(zip(got, expected_tokens)):
        assert g == e, f"prompt {i} ({TEXTS[i][:30] if i < len(TEXTS) else 'chat'!r}): tokens differ"
    assert "Paris" in transformers.AutoTokenizer.from_pretrained(engine.config.model_path).decode(got[0])


def test_logits_match_transformers(engine, prompts, reference):
    """Teacher-forced on the reference tokens: logits of every step within 1e-4 relative error."""
    expected_tokens, expected_logits = reference
    prep = BatchPreparer(engine)
    reqs = [prep.add_request(p, SamplingParams(max_tokens=NEW_TOKENS)) for p in prompts]
    steps = [engine.forward_logits(prep.prefill(reqs))]
    for step in range(NEW_TOKENS - 1):
        for req, toks in zip(reqs, expected_tokens):
            req.input_ids.append(toks[step])
        steps.append(engine.forward_logits(prep.decode(reqs)))
    prep.release(reqs)
    got = torch.stack(steps, dim=1)  # (reqs, steps, vocab)
    assert rel_err(got, torch.stack(expected_logits)) < 1e-4


@pytest.mark.parametrize("page_size", [1, 16, 256])
def test_page_sizes_single_requests_and_chunked_prefill(smollm2_path, prompts, reference, page_size):
    expected_tokens, _ = reference
    engine = _engine(smollm2_path, page_size=page_size, max_running_req=16)
    params = SamplingParams(max_tokens=NEW_TOKENS)
    prep = BatchPreparer(engine)
    assert generate(engine, prompts, params, preparer=prep) == expected_tokens
    # the whole batch with prompts cut into chunks (later chunks extend cached tokens)
    longest = max(len(p) for p in prompts)
    assert generate(engine, prompts, params, chunk_size=(longest + 1) // 2, preparer=prep) == expected_tokens
    if page_size == 16:  # one request at a time, its prompt prefilled in one chunk and in two: the
        # first SINGLE_TOKENS of the reference (a prefill that went wrong shows at once; the batched runs
        # above decode every token)
        short = SamplingParams(max_tokens=SINGLE_TOKENS)
        for prompt, expected in zip(prompts, expected_tokens):
            assert generate(engine, [prompt], short, preparer=prep) == [expected[:SINGLE_TOKENS]]
            half = (len(prompt) + 1) // 2
            got = generate(engine, [prompt], short, chunk_size=half, preparer=prep)
            assert got == [expected[:SINGLE_TOKENS]]
    assert prep.pages.num_used == 0
    engine.shutdown()
