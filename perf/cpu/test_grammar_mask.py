"""Structured output's host cost per step at 64 constrained requests (`minisgl.scheduler.grammar`): filling
the batch's token mask (`Grammars.token_mask`: xgrammar's matchers write 64 rows of packed bits, over
`Grammars`' pool where the host has one, then the min_tokens and dead-row checks) and accepting each request's sampled token. The
matchers stand at different places of their outputs (each has accepted a different prefix of a valid
document). The default model's tokenizer (49,152 tokens); no model runs.

`test_grammar_step`: a decode step's whole host work (the batch's accepts, then its mask) at batch 1 / 16
/ 64, for the JSON schema and for a forced tool call's grammar (`minisgl.server.tool_grammar`).

Run with `nox -s perf -- -k grammar_mask` (or `python -m pytest perf/cpu/test_grammar_mask.py
--benchmark-only`); the microseconds per request are in extra_info.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from minisgl.core import Req, SamplingParams
from minisgl.engine.token_mask import unpack_mask
from minisgl.models import default_model_path
from minisgl.scheduler import RequestState
from minisgl.scheduler.grammar import Grammars

BATCH = 64
VOCAB = 49152
EOS = 2
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "tags", "address"],
}
# a valid output of each grammar: request i's matcher accepts a prefix of it
DOCUMENTS = {
    "json_schema": json.dumps(
        {
            "name": "Ada Lovelace of London",
            "age": 36,
            "tags": ["math", "engines", "poetry"],
            "address": {"city": "London", "zip": "12345"},
        }
    ),
    "json_object": json.dumps({"title": "A note", "items": [1, 2, 3], "done": False, "by": {"who": "me"}}),
    "regex": "2024-05-17T10:30:00Z, 1999-12-31T23:59:59Z, 2000-01-01T00:00:00Z",
}
PARAMS = {
    "json_schema": SamplingParams(json_schema=SCHEMA, max_tokens=512),
    "json_object": SamplingParams(json_object=True, max_tokens=512),
    "regex": SamplingParams(
        regex=r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z(, \d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z)*"
    ),
}


@pytest.fixture(scope="module")
def grammars() -> Grammars:
    tokenizer = transformers.AutoTokenizer.from_pretrained(default_model_path())
    return Grammars(tokenizer, VOCAB, [EOS])


def _states(grammars: Grammars, kind: str) -> list[RequestState]:
    params, document = PARAMS[kind], DOCUMENTS[kind]
    grammars.check(params)
    states = []
    for i in range(BATCH):
        state = RequestState(i, [1] * 16, params, 0.0)
        state.grammar = grammars.new_state(params)
        cut = (i * 7) % (len(document) - 1)
        assert state.grammar.matcher.accept_string(document[:cut])
        state.req = Req(
            input_ids=[1] * 16,
            table_idx=i,
            cached_len=16,
            output_len=params.max_tokens,
            uid=i,
            sampling_params=params,
        )  # a decode step's request
        state.req.device_len = 17
        states.append(state)
    return states


@pytest.mark.parametrize("kind", sorted(PARAMS))
def test_grammar_mask_fill_64(benchmark, grammars, kind: str) -> None:
    states = _states(grammars, kind)
    cpu = torch.device("cpu")
    mask = grammars.token_mask(states, cpu)
    assert mask.shape == (BATCH, VOCAB // 32) and all(s.grammar.dead is None for s in states)
    benchmark.pedantic(grammars.token_mask, args=(states, cpu), rounds=50, warmup_rounds=3)
    benchmark.extra_info["us_per_request"] = benchmark.stats.stats.median / BATCH * 1e6


@pytest.mark.parametrize("kind", sorted(PARAMS))
def test_grammar_accept_64(benchmark, grammars, kind: str) -> None:
    """Accepting one token per request (a token its mask allows), rolled back after each round."""
    states = _states(grammars, kind)
    allowed = unpack_mask(grammars.token_mask(states, torch.device("cpu")), VOCAB)
    tokens = [int(row.nonzero()[-1]) for row in allowed]  # the last token each mask allows

    def accept() -> None:
        for state, token in zip(states, tokens):
            state.grammar.accept(token)
        for state in states:
            state.grammar.matcher.rollback(1)

    benchmark.pedantic(accept, rounds=50, warmup_rounds=3)
    benchmark.extra_info["us_per_request"] = benchmark.stats.stats.median / BATCH * 1e6


# the per-step host work of a decode step at batch 1 / 16 / 64: each request's matcher accepts its newest
# token (`Grammars.accept_ahead`, one xgrammar call, as the overlapped scheduler does) and the batch's
# mask is filled (`Grammars.token_mask`); the tokens are the real tokenization of a valid output, EOS last
TOOL_PARAMETERS = json.dumps(
    {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"],
    }
)
TOOL_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'


def _step_case(kind: str) -> tuple[SamplingParams, str]:
    if kind == "json_schema":
        return PARAMS[kind], DOCUMENTS[kind]
    from minisgl.server.tool_grammar import forced_grammar
    from minisgl.server.tool_parsers import FORMATS

    ebnf = forced_grammar(FORMATS["hermes"], (("get_weather", TOOL_PARAMETERS),), False)
    return SamplingParams(ebnf=ebnf, max_tokens=512), TOOL_CALL


@pytest.mark.parametrize("batch", [1, 16, 64])
@pytest.mark.parametrize("kind", ["json_schema", "tool_call"])
def test_grammar_step(benchmark, grammars, kind: str, batch: int) -> None:
    """A forced tool call's (hermes, one function) or the JSON schema's step: accepting B tokens then
    filling the (B, words) mask, rolled back after each round. Request i stands 7 * i tokens into the
    output (modulo its length), so the batch mixes free strings, fixed keys and punctuation."""
    params, document = _step_case(kind)
    ids = grammars.tokenizer.encode(document, add_special_tokens=False) + [EOS]
    grammars.check(params)
    states, tokens = [], []
    for i in range(batch):
        state = RequestState(i, [1] * 16, params, 0.0)
        state.grammar = grammars.new_state(params)
        cut = (i * 7) % (len(ids) - 1)
        for token in ids[:cut]:
            assert state.grammar.matcher.accept_token(token)
        state.req = Req(
            input_ids=[1] * 16, table_idx=i, cached_len=16, output_len=512, uid=i, sampling_params=params
        )
        state.req.device_len = 17
        states.append(state)
        tokens.append(ids[cut])
    cpu = torch.device("cpu")

    def step() -> torch.Tensor | None:
        grammars.accept_ahead(zip(states, tokens))
        mask = grammars.token_mask(states, cpu)
        for state in states:
            state.grammar.ahead = None
            state.grammar.matcher.rollback(1)
        return mask

    mask = step()
    assert mask is not None and all(s.grammar.dead is None for s in states)
    allowed = unpack_mask(mask, VOCAB).sum(dim=1)
    benchmark.pedantic(step, rounds=50, warmup_rounds=3)
    benchmark.extra_info["us_per_request"] = benchmark.stats.stats.median / batch * 1e6
    benchmark.extra_info["single_token_rows"] = int((allowed == 1).sum())
