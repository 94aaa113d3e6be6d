"""Speculative decoding's draft-model proposer (minisgl.scheduler.draft), on the CPU in float32: the
default model drafts for itself, so its proposals are the target's own greedy continuation; the pool
sized for both models; the shared page table; a draft with another vocabulary refused."""

import dataclasses
import json
import logging

import pytest
import torch

from minisgl.core import SamplingParams
from minisgl.engine import Engine, EngineConfig
from minisgl.kvcache import bytes_per_page
from minisgl.scheduler import BatchPreparer, generate
from minisgl.scheduler.draft import DraftProposer, draft_footprint

K = 4
PAGE_SIZE = 16
MAX_RUNNING_REQ = 5
MAX_SEQ_LEN = 256
BUDGET_PAGES = 100  # of the target's KV alone: more than the 80 five requests of 256 tokens can use
# token ids of the default model's tokenizer: natural text of 1 to 21 tokens
PROMPTS = [
    [504, 3575, 282, 4649, 314],  # The capital of France is
    [1604, 3987, 46477, 24, 94, 727, 2367],  # def fibonacci(n):\n
    [6403, 1980, 253, 655, 28, 281, 253, 1165, 6560, 411, 260, 3426, 28, 665, 4161, 354, 1573, 43663, 617]
    + [897, 5738],  # Once upon a time, in a small village by the sea, ...
    [19556],  # Hello
    [504, 2365, 6354, 16438, 27003, 690, 260, 23790, 2767, 30, 378, 2365, 6354, 16438],  # The quick brown ...
]
OUTPUT = 3 * K + 3  # tokens of each greedy continuation the rounds below read


class _Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture(scope="module")
def target_config(smollm2_path):
    config = EngineConfig(model_path=str(smollm2_path), device="cpu", dtype=torch.float32)
    mc = config.model_config
    page_bytes = bytes_per_page(mc.num_layers, PAGE_SIZE, mc.num_kv_heads, mc.head_dim, torch.float32)
    return dataclasses.replace(
        config,
        page_size=PAGE_SIZE,
        max_running_req=MAX_RUNNING_REQ,
        max_seq_len_override=MAX_SEQ_LEN,
        cpu_kv_budget_gib=BUDGET_PAGES * page_bytes / 2**30,
    )


@pytest.fixture(scope="module")
def spec(target_config, smollm2_path):
    """(the target sized with the draft, the proposer, the pages the target has alone, the greedy
    continuations of PROMPTS, the start's log messages)."""
    plain = Engine(target_config)
    reference = generate(plain, PROMPTS, SamplingParams(max_tokens=OUTPUT))
    plain_pages = plain.num_pages
    plain.shutdown()
    log = _Messages()
    loggers = [logging.getLogger(name) for name in ("minisgl.engine.start", "minisgl.scheduler.draft")]
    for logger in loggers:
        logger.addHandler(log)
    try:
        footprint = draft_footprint(target_config, str(smollm2_path))
        target = Engine(target_config, companion=footprint)
        proposer = DraftProposer(target, str(smollm2_path), K, footprint=footprint)
    finally:
        for logger in loggers:
            logger.removeHandler(log)
    yield target, proposer, plain_pages, reference, log.messages
    proposer.shutdown()
    target.shutdown()


def _verify(req, continuation, accepted):
    """What the target's verify step leaves: `accepted` drafts (the greedy continuation's tokens) and
    the token after them appended, every token but the newest in the target's KV."""
    newest = len(req.input_ids)
    done = req.num_output_tokens
    req.input_ids += continuation[done : done + accepted + 1]
    req.cached_len = newest + accepted


def test_proposals_are_the_greedy_continuation(spec, monkeypatch):
    target, proposer, _, reference, _ = spec
    forwards = []  # each draft forward's phase and tokens per request
    forward_logits = proposer.engine.forward_logits

    def record(batch):
        forwards.append((batch.phase, [req.extend_len for req in batch.reqs]))
        return forward_logits(batch)

    monkeypatch.setattr(proposer.engine, "forward_logits", record)
    prep = BatchPreparer(target)
    reqs = [prep.add_request(p, SamplingParams(max_tokens=OUTPUT)) for p in PROMPTS]
    try:
        batch = prep.prefill(reqs)
        prep.append_tokens(batch, target.forward_batch(batch, prep.sampling_args(batch)).next_tokens_cpu)
        assert [req.input_ids[-1] for req in reqs] == [c[0] for c in reference]

        def round_(limits, accepted):
            for req, limit in zip(reqs, limits):
                assert req.cached_len == len(req.input_ids) - 1
                prep.reserve(req, len(req.input_ids) + limit)  # pages up to position len - 1 + limit
            done = [req.num_output_tokens for req in reqs]
            drafts = proposer.propose(reqs, limits)
            assert drafts == [c[n : n + limit] for c, n, limit in zip(reference, done, limits)]
            for req, c, a in zip(reqs, reference, accepted):
                _verify(req, c, a)
                proposer.accepted(req)

        # first proposals: each request's whole sequence, limits from 0 to k (the 0 decodes plainly);
        # the requests in the order of their limits, the k - 1 decode steps shedding those done
        round_([K, 0, 2, 1, K], accepted=[K, 0, 1, 0, 2])
        lens = [len(p) + 1 for p in PROMPTS]
        assert forwards == [
            ("prefill", [lens[0], lens[4], lens[2], lens[3]]),
            ("decode", [1, 1, 1]),
            ("decode", [1, 1]),
            ("decode", [1, 1]),
        ]
        # after full, partial and no acceptance (2 new tokens, or 1), and a request never drafted
        # (its whole sequence), in forwards of at most 8 tokens
        forwards.clear()
        proposer.max_prefill_tokens = 8
        try:
            round_([K, K, 3, 2, 1], accepted=[1, 2, 0, 1, 0])
        finally:
            proposer.max_prefill_tokens = 8192
        assert forwards[:2] == [("prefill", [8]), ("prefill", [2, 1, 1, 1, 1])]
        # one new token each: the first forward is a decode batch too
        forwards.clear()
        round_([K, 3, K, 1, 2], accepted=[0, 0, 0, 0, 0])
        assert forwards[0] == ("decode", [1] * 5) and len(forwards) == K
    finally:
        prep.release(reqs)
        for req in reqs:
            proposer.forget(req)
    assert proposer._draft_len == {}


def test_limits_are_checked(spec):
    target, proposer, _, _, _ = spec
    prep = BatchPreparer(target)
    req = prep.add_request(PROMPTS[0], SamplingParams(max_tokens=4))
    try:
        with pytest.raises(ValueError, match="outside"):
            proposer.propose([req], [K + 1])
        with pytest.raises(ValueError, match="1 requests but 2 limits"):
            proposer.propose([req], [1, 1])
        assert proposer.propose([req], [0]) == [[]]
    finally:
        prep.release(req)


def test_pool_sized_for_both_models_and_page_table_shared(spec, target_config):
    target, proposer, plain_pages, _, messages = spec
    draft = proposer.engine
    assert plain_pages == MAX_RUNNING_REQ * MAX_SEQ_LEN // PAGE_SIZE  # alone: capped at what is useful
    assert target.num_pages == BUDGET_PAGES // 2 < plain_pages  # the same page bytes twice
    assert draft.num_pages == target.num_pages
    assert draft.kv_cache.k_cache(0).shape == target.kv_cache.k_cache(0).shape
    assert draft.page_table is target.page_table
    assert draft.last_tokens is not target.last_tokens
    assert draft.max_seq_len == target.max_seq_len == MAX_SEQ_LEN
    # the footprint the pool was sized with is what the draft engine holds
    footprint = target.companion
    assert footprint.weight_bytes == sum(p.numel() * p.element_size() for p in draft.model.parameters())
    mc = draft.config.model_config
    assert footprint.page_bytes == bytes_per_page(
        mc.num_layers, PAGE_SIZE, mc.num_kv_heads, mc.head_dim, torch.float32
    )
    ready = [m for m in messages if m.startswith("engine ready")]
    assert f"{target.num_pages} KV pages at the same page ids" in ready[0]
    assert "the target's page table" in ready[1]
    assert any(
        f"draft model {draft.config.model_path}" in m and f"{draft.num_pages} KV pages" in m for m in messages
    )


def test_footprint_reads_the_default_model_alias(target_config, smollm2_path):
    footprint = draft_footprint(target_config, "smollm2-135m")
    assert footprint.config.model_path == str(smollm2_path)
    assert footprint.config.page_size == PAGE_SIZE and footprint.config.device == "cpu"
    assert footprint.weight_bytes == draft_footprint(target_config, str(smollm2_path)).weight_bytes


def test_draft_with_another_vocabulary_is_refused(target_config, smollm2_path, tmp_path):
    raw = json.loads((smollm2_path / "config.json").read_text())
    vocab = raw["vocab_size"]
    raw["vocab_size"] = 320
    raw.pop("eos_token_id", None)
    raw.pop("bos_token_id", None)
    raw.pop("pad_token_id", None)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=rf"speculative_draft_model=.* vocab_size=320.* vocab_size={vocab}"):
        draft_footprint(target_config, str(tmp_path))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="speculative_draft_model=.*has no config.json"):
        draft_footprint(target_config, str(empty))
    with pytest.raises(ValueError, match="speculative_draft_model=.*is not a folder"):
        draft_footprint(target_config, str(tmp_path / "missing"))
    # the same vocabulary without weights: refused before the target loads, unless dummy weights
    raw["vocab_size"] = vocab
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="speculative_draft_model=.*no \\*.safetensors"):
        draft_footprint(target_config, str(tmp_path))
    dummy = dataclasses.replace(target_config, use_dummy_weight=True)
    assert draft_footprint(dummy, str(tmp_path)).weight_bytes > 0
