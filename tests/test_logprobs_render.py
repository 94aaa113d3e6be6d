"""Log probabilities' compact paths (no model run): `TokenLogprobs`' columns read back as the entries
they hold; a step's `LogprobFrames` read back exactly; the JSON that `completion_logprobs`,
`chat_logprobs`, `to_json` and `ChunkFormat` write against ``json.dumps`` of the OpenAI shapes built
the plain way from `TokenLogprob`s (byte-level BPE tokens, tokens holding part of a UTF-8 character,
k 0 and 5, a prompt's unscored first token, no tokenizer). Floats are compared within a tolerance."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import transformers

from minisgl.core import TokenLogprob, TokenLogprobs
from minisgl.server import responses
from minisgl.server.logprobs import TokenTexts, chat_logprobs, completion_logprobs
from minisgl.server.worker import LogprobFrames, read_logprobs

TEXT = "héllo wörld 日本語 🎉 naïve"


@pytest.fixture(scope="module")
def texts(smollm2_path):
    return TokenTexts(transformers.AutoTokenizer.from_pretrained(smollm2_path))


def _entries(ids: list[int], k: int, unscored: list[int] = ()) -> TokenLogprobs:
    """Entries of `ids` with k alternatives each, their values of a float's full precision, some
    alternatives repeating the token itself (a duplicate text in the completions' top_logprobs)."""
    entries = TokenLogprobs(k, unscored)
    for i, token in enumerate(ids):
        alts = [token if j == 1 else ids[(i + 3 * j + 1) % len(ids)] for j in range(k)]
        values = [-(i + 1) / 7 - j / 3 - 1e-9 * i for j in range(k)]
        entries.extend([token], [-(i + 2) / 11], alts, values)
    return entries


def _completion_reference(texts: TokenTexts, entries: list[TokenLogprob | None], ids: list[int], offset=0):
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for token, entry in zip(ids, entries):
        text = texts.text(token)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entry is None:
            token_logprobs.append(None)
            tops.append(None)
            continue
        token_logprobs.append(entry.logprob)
        top: dict[str, float] = {}
        for alt, logprob in entry.top:
            top.setdefault(texts.text(alt), logprob)
        top.setdefault(text, entry.logprob)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def _chat_reference(texts: TokenTexts, entries: list[TokenLogprob]) -> dict[str, Any]:
    def one(token: int, logprob: float) -> dict[str, Any]:
        text, data = texts.get(token)
        return {"token": text, "logprob": logprob, "bytes": data}

    content = [
        {**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries
    ]
    return {"content": content, "refusal": None}


def _same(got: Any, want: Any) -> None:
    """Equal JSON values, floats within 1e-12 (and both floats), dict keys in the same order."""
    if isinstance(want, float):
        assert isinstance(got, float) and math.isclose(got, want, rel_tol=1e-12, abs_tol=1e-12), (got, want)
    elif isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want)
        for key in want:
            _same(got[key], want[key])
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want)
        for a, b in zip(got, want):
            _same(a, b)
    else:
        assert got == want and type(got) is type(want)


def test_token_logprobs_read_back_as_entries() -> None:
    entries = _entries([5, 6, 7], 2, unscored=[9])
    assert len(entries) == 4 and entries.unscored == 1 and entries[0] is None
    assert entries[1] == TokenLogprob(5, -2 / 11, ((6, -1 / 7), (5, -1 / 7 - 1 / 3)))
    assert entries[-1] == entries[3] and entries[-4] is None
    assert entries[1:3] == [entries[1], entries[2]] and list(entries)[0] is None
    with pytest.raises(IndexError):
        entries[4]
    with pytest.raises(IndexError):
        entries[-5]
    assert list(TokenLogprobs(0)) == [] and _entries([3], 0)[0] == TokenLogprob(3, -2 / 11, ())


def test_logprob_frames_read_back_exactly() -> None:
    """Blocks of rows with and without log probabilities, a prompt's (n 0 too), different k."""
    prompt, scored, plain = _entries([4, 5, 6], 3, unscored=[1]), _entries([8, 9], 5), _entries([2], 0)
    frames = LogprobFrames()
    frames.add(0, False, prompt, 3)
    frames.add(0, True, scored, 1)  # the last entry only
    frames.add(2, False, TokenLogprobs(2, [7]), 0)
    frames.add(3, True, plain, 1)
    read = list(read_logprobs(list(frames.frames())))
    assert read == [
        (0, False, prompt.values, prompt.top_ids, prompt.top_values),
        (0, True, scored.values[1:], scored.top_ids[5:], scored.top_values[5:]),
        (2, False, [], [], []),
        (3, True, plain.values, [], []),
    ]


@pytest.mark.parametrize("k", [0, 5])
def test_completion_logprobs_json_equals_the_plain_shape(texts, k) -> None:
    ids = texts.tokenizer(TEXT)["input_ids"]
    assert any("\ufffd" in texts.text(t) for t in ids)  # tokens holding part of a character
    prompt, generated = _entries(ids[1:], k, unscored=ids[:1]), _entries(ids[::-1], k)
    # echo: the prompt (unscored first token) and the generated tokens, in one object
    written, offset = completion_logprobs(texts, [(prompt, 0, len(prompt)), (generated, 0, len(generated))])
    want = _completion_reference(texts, [*prompt, *generated], [*ids, *ids[::-1]])
    _same(json.loads(written), want)
    assert offset == sum(len(t) for t in want["tokens"])
    # streamed: a middle run, offsets from where the text stands
    written, end = completion_logprobs(texts, [(generated, 2, 5)], 17)
    want = _completion_reference(texts, generated[2:5], ids[::-1][2:5], 17)
    _same(json.loads(written), want)
    assert end == 17 + sum(len(t) for t in want["tokens"])
    written, _ = completion_logprobs(texts, [(prompt, 0, 1)])  # the unscored token alone
    _same(json.loads(written), _completion_reference(texts, [None], ids[:1]))
    assert completion_logprobs(texts, [(generated, 3, 3)], 4) == (
        '{"tokens":[],"token_logprobs":[],"top_logprobs":[],"text_offset":[]}',
        4,
    )


@pytest.mark.parametrize("k", [0, 5])
def test_chat_logprobs_json_equals_the_plain_shape(texts, k) -> None:
    ids = texts.tokenizer(TEXT)["input_ids"]
    entries = _entries(ids, k)
    _same(json.loads(chat_logprobs(texts, entries, 0, len(ids))), _chat_reference(texts, list(entries)))
    _same(json.loads(chat_logprobs(texts, entries, 3, 6)), _chat_reference(texts, entries[3:6]))
    assert json.loads(chat_logprobs(texts, entries, 2, 2)) == {"content": [], "refusal": None}
    assert bytes(json.loads(chat_logprobs(texts, entries, 0, len(ids)))["content"][0]["bytes"])


def test_without_a_tokenizer_tokens_are_named_by_id_with_no_bytes() -> None:
    texts, entries = TokenTexts(None), _entries([3, 4], 2)
    _same(json.loads(chat_logprobs(texts, entries, 0, 2)), _chat_reference(texts, list(entries)))
    _same(
        json.loads(completion_logprobs(texts, [(entries, 0, 2)])[0]),
        _completion_reference(texts, list(entries), [3, 4]),
    )


def test_numbers_are_written_as_json_dumps_writes_them(texts) -> None:
    entries = TokenLogprobs(2)
    entries.extend([5, 6], [-0.1, float("-inf")], [7, 8, 9, 10], [1e-20, float("nan"), -123456.789, 0.0])
    written = chat_logprobs(texts, entries, 0, 2)
    assert written == json.dumps(
        _chat_reference(texts, list(entries)), ensure_ascii=False, separators=(",", ":")
    )


def test_raw_json_goes_in_as_it_is_and_chunks_carry_logprobs(texts) -> None:
    ids = texts.tokenizer(TEXT)["input_ids"]
    entries = _entries(ids, 5)
    raw = responses.RawJSON(chat_logprobs(texts, entries, 0, 4))
    payload = {"a": [raw, "x\x00raw-y"], "b": raw, "c": None}
    want = {"a": [json.loads(raw.text), "x\x00raw-y"], "b": json.loads(raw.text), "c": None}
    assert responses.to_json(payload) == json.dumps(want, ensure_ascii=False, separators=(",", ":"))
    with pytest.raises(TypeError):
        responses.to_json({"a": object()})
    for kind, with_ids in (("completion", False), ("chat", True)):
        fmt = responses.ChunkFormat(kind, "cmpl-1", "m", 1, with_ids, 1700000000, with_logprobs=True)
        ids_or_none = [5, 6] if with_ids else None
        if kind == "chat":
            chunk = responses.chat_chunk(
                "cmpl-1", "m", 1, content="é\n", token_ids=ids_or_none, created=1700000000, logprobs=raw
            )
        else:
            chunk = responses.completion_chunk(
                "cmpl-1", "m", 1, "é\n", token_ids=ids_or_none, created=1700000000, logprobs=raw
            )
        assert fmt.event("é\n", [5, 6], raw) == responses.sse(chunk)
        assert json.loads(responses.sse(chunk)[6:])["choices"][0]["logprobs"] == json.loads(raw.text)
