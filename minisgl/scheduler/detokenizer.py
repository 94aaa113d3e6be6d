"""Incremental detokenization: text deltas as tokens arrive, without re-decoding the whole output."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

REPLACEMENT_CHAR = "\ufffd"


def decoder(tokenizer: Any, skip_special_tokens: bool = True) -> Callable[[list[int]], str]:
    """`tokenizer.decode(ids, skip_special_tokens=...)` as a function of `ids`: for a fast tokenizer
    that cleans up no spaces (transformers' decode then only forwards to its Rust backend) the backend's
    own decode, a quarter of the cost per call; else the tokenizer's."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", None) is False:
        return functools.partial(backend.decode, skip_special_tokens=skip_special_tokens)
    return functools.partial(tokenizer.decode, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Decodes a growing token list piece by piece.

    Each step decodes only a short window: the tokens from `prefix_offset` (a few tokens before the
    last emitted point, so that tokenizers which merge across tokens see context) to the end, and
    emits what the window's text has beyond the already-emitted part. A window whose text ends in an
    incomplete UTF-8 sequence (U+FFFD) is held back until the next token completes it.
    `skip_special_tokens=False` keeps special tokens in the text (a tool-call parser's markup).
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self._decode = decoder(tokenizer, skip_special_tokens)
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0
        self._read_offset = 0

    def add(self, token_id: int) -> str:
        """Appends a token; returns the new text it completes (possibly empty)."""
        self.token_ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """Emits whatever is held back (at the end of generation)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        prefix_text = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        window_text = self._decode(self.token_ids[self._prefix_offset :])
        if len(window_text) <= len(prefix_text) or (window_text.endswith(REPLACEMENT_CHAR) and not final):
            return ""
        delta = window_text[len(prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        self.text += delta
        return delta
