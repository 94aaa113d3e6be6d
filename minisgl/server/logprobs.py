"""Log probabilities in OpenAI's shapes: each token's text and bytes, the completions object
(`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`) and the chat one (`content`: token, logprob,
bytes, top_logprobs). The numbers are the engine's (`minisgl.core.TokenLogprob`: the model's own
distribution, before logit_bias, penalties and temperature)."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from minisgl.core import TokenLogprob

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


def completion_logprobs(
    texts: TokenTexts, entries: Sequence[TokenLogprob | None], ids: Sequence[int], offset: int = 0
) -> dict[str, Any]:
    """The completions `logprobs` object of tokens `ids` (entry None: a first prompt token, which has
    none): `top_logprobs` holds the asked alternatives and the token itself (OpenAI: up to k + 1); the
    `text_offset`s count characters from `offset`."""
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


def chat_logprobs(texts: TokenTexts, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    """The chat `logprobs` object: per token its text, log probability, bytes and `top_logprobs`."""

    def one(token: int, logprob: float) -> dict[str, Any]:
        text, data = texts.get(token)
        return {"token": text, "logprob": logprob, "bytes": data}

    content = [
        {**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries
    ]
    return {"content": content, "refusal": None}
