"""Log probabilities in OpenAI's shapes: each token's text and bytes, the completions object
(`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`) and the chat one (`content`: token, logprob,
bytes, top_logprobs). The numbers are the engine's (`minisgl.core.TokenLogprobs`: the model's own
distribution, before logit_bias, penalties and temperature).

The objects are written straight to JSON text (`responses.RawJSON`), as ``json.dumps`` would write them:
each token's JSON pieces are made once (`TokenTexts.pieces`) and the numbers of a whole run of entries
are written by one ``json.dumps``, so a response is joined from strings, not built from dicts."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from minisgl.core import TokenLogprobs

_HEX_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_chars() -> dict[str, int]:
    """Byte-level BPE's alphabet: each byte is written as one printable character (the printable
    Latin-1 bytes as themselves, the others as code points from 256 up, in byte order); the inverse."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenTexts:
    """Each token's bytes and text under a tokenizer, looked up once per token id (a cache). Byte-level
    BPE pieces map back to their bytes, SentencePiece's ``<0xNN>`` to its byte and ``▁`` to a space;
    other tokens are decoded. A text is its bytes as UTF-8 (a token holding part of a character shows
    U+FFFD). Without a tokenizer a token's text is ``token_id:N`` and it has no bytes."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int] | None]] = {}
        self._pieces: dict[int, tuple[str, int, str, str]] = {}
        self._byte_level: dict[str, int] | None = None
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None and '"ByteLevel"' in json.dumps(json.loads(backend.to_str()).get("decoder")):
            self._byte_level = _byte_level_chars()

    def get(self, token_id: int) -> tuple[str, list[int] | None]:
        """(text, bytes) of one token."""
        found = self._cache.get(token_id)
        if found is None:
            found = self._cache[token_id] = self._look_up(token_id)
        return found

    def _look_up(self, token_id: int) -> tuple[str, list[int] | None]:
        if self.tokenizer is None:
            return f"token_id:{token_id}", None
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        chars = self._byte_level
        hex_byte = _HEX_BYTE.fullmatch(piece) if isinstance(piece, str) else None
        if not isinstance(piece, str):
            data = self.tokenizer.decode([token_id]).encode()
        elif chars is not None and all(c in chars for c in piece):
            data = bytes(chars[c] for c in piece)
        elif hex_byte is not None:
            data = bytes([int(hex_byte.group(1), 16)])
        elif chars is None and "\u2581" in piece:
            data = piece.replace("\u2581", " ").encode()
        else:
            data = self.tokenizer.decode([token_id]).encode()
        return data.decode("utf-8", errors="replace"), list(data)

    def text(self, token_id: int) -> str:
        return self.get(token_id)[0]

    def pieces(self, token_id: int) -> tuple[str, int, str, str]:
        """One token's JSON pieces: its text as a JSON string, the text's length, and a chat entry's
        ``{"token":…,"logprob":`` and ``,"bytes":…`` (around its log probability)."""
        found = self._pieces.get(token_id)
        if found is None:
            text, data = self.get(token_id)
            quoted = _dumps(text)
            found = (quoted, len(text), f'{{"token":{quoted},"logprob":', f',"bytes":{_dumps(data)}')
            self._pieces[token_id] = found
        return found


def _dumps(value: object) -> str:
    """`value` as the responses write JSON (`responses.to_json`)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


_NON_FINITE = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}  # as json.dumps writes them


def _scored(entries: TokenLogprobs, start: int, end: int) -> tuple[list[str], list[str]]:
    """The log probabilities of entries [start, end) of `entries` (null for the unscored) and their k
    alternatives' each (k after k), as JSON numbers: a float's repr, as ``json.dumps`` writes it."""
    skip = entries.unscored
    first, last, k = max(start - skip, 0), max(end - skip, 0), entries.k
    written = [*map(repr, entries.values[first:last]), *map(repr, entries.top_values[first * k : last * k])]
    if not _NON_FINITE.keys().isdisjoint(written):
        written = [_NON_FINITE.get(number, number) for number in written]
    return ["null"] * (min(end, skip) - min(start, skip)) + written[: last - first], written[last - first :]


def completion_logprobs(
    texts: TokenTexts, runs: Sequence[tuple[TokenLogprobs, int, int]], offset: int = 0
) -> tuple[str, int]:
    """The completions `logprobs` object (JSON) of the entries [start, end) of each run, in order (an
    unscored entry, as a prompt's first token, has null log probabilities): `top_logprobs` holds the
    asked alternatives and the token itself (OpenAI: up to k + 1); the `text_offset`s count characters
    from `offset`. Returns it and the offset past its tokens' text."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for entries, start, end in runs:
        values, alternatives = _scored(entries, start, end)
        token_logprobs += values
        k, skip = entries.k, entries.unscored
        for i in range(start, end):
            quoted, length, _, _ = texts.pieces(entries.token_ids[i])
            tokens.append(quoted)
            offsets.append(str(offset))
            offset += length
            if i < skip:
                tops.append("null")
                continue
            j = i - skip
            at = (i - max(start, skip)) * k
            top: dict[str, str] = {}
            for alt, value in zip(entries.top_ids[j * k : j * k + k], alternatives[at : at + k]):
                top.setdefault(texts.pieces(alt)[0], value)
            top.setdefault(quoted, values[i - start])
            tops.append("{" + ",".join(f"{text}:{value}" for text, value in top.items()) + "}")
    lists = (",".join(part) for part in (tokens, token_logprobs, tops, offsets))
    body = '{{"tokens":[{}],"token_logprobs":[{}],"top_logprobs":[{}],"text_offset":[{}]}}'.format(*lists)
    return body, offset


def chat_logprobs(texts: TokenTexts, entries: TokenLogprobs, start: int, end: int) -> str:
    """The chat `logprobs` object (JSON) of entries [start, end) (generated tokens: all scored): per
    token its text, log probability, bytes and `top_logprobs`."""
    values, alternatives = _scored(entries, start, end)
    k, ids = entries.k, entries.top_ids

    def entry(token: int, value: str, rest: str = "}") -> str:
        _, _, head, tail = texts.pieces(token)
        return f"{head}{value}{tail}{rest}"

    content = []
    for n, i in enumerate(range(start, end)):
        top = ",".join(map(entry, ids[i * k : i * k + k], alternatives[n * k : n * k + k]))
        content.append(entry(entries.token_ids[i], values[n], f',"top_logprobs":[{top}]}}'))
    return '{"content":[' + ",".join(content) + '],"refusal":null}'
