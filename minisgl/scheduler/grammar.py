"""Structured output through xgrammar: a request's grammar (`SamplingParams.grammar`) is compiled once
per distinct grammar (`Grammars.check`, so an invalid one raises a ValueError before anything is
queued; an LRU of `GRAMMAR_CACHE_SIZE`); each constrained request's matcher (`GrammarState`) accepts its
tokens and fills its row of the step's token mask (`Grammars.token_mask`), which the sampler applies
first. Whitespace, special tokens, min_tokens: docs/structured-output.md.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

import numpy as np
import torch

from minisgl.core import SamplingParams
from minisgl.engine.token_mask import BITS, mask_words

logger = logging.getLogger(__name__)

GRAMMAR_CACHE_SIZE = 128  # distinct compiled grammars kept (least recently used out first)
JSON_OBJECT_SCHEMA = '{"type":"object"}'  # json_object: any JSON object
# from this many constrained rows on, their masks are filled in one call to xgrammar (a one-thread
# `BatchGrammarMatcher`, without the per-row Python calls; a chunk of them on each thread of the pool);
# below it one after the other
BATCH_FILL_ROWS = 4
# the pool's rows a chunk, at least: a step's accepts or fills go to the pool from two chunks (8 rows) on,
# in at most `Grammars.threads` chunks; fewer rows run in the calling thread (a hand-off costs more)
CHUNK_ROWS = 4
# "[12:00:00] /project/cpp/regex_converter.cc:94: " before xgrammar's own words
_XGRAMMAR_PREFIX = re.compile(r"^\s*\[[^\]]*\]\s*\S+:\d+:\s*")


def xgrammar_reason(error: Exception) -> str:
    """xgrammar's message without its time and source location, on one line."""
    text = " ".join(str(error).split("\n"))
    return _XGRAMMAR_PREFIX.sub("", text).strip() or type(error).__name__


def _invalid(field: str, error: Exception) -> str:
    what = {"json_schema": "a JSON schema", "regex": "a regex", "ebnf": "an EBNF grammar"}.get(field, field)
    return f"{field} is not {what} xgrammar can compile: {xgrammar_reason(error)}"


DEAD_END = "allows no token after"  # in the message of every GrammarDeadEnd (the server tells them apart)


class GrammarDeadEnd(ValueError):
    """A request's grammar allows no token where its output stands (the request's own doing, not a
    fault of the engine: it finishes that request alone with "error", logged without a traceback)."""


class GrammarState:
    """One constrained request's matcher: its state after the output tokens processed so far (kept
    across a preemption, since the tokens are). `dead`: why no token may follow (set by
    `Grammars.token_mask`; the token that forward samples finishes the request with "error").
    `ahead`: (token, accepted) when `Grammars.accept_ahead` advanced the matcher before the token is
    processed."""

    __slots__ = ("matcher", "field", "dead", "ahead")

    def __init__(self, matcher: Any, field: str) -> None:
        self.matcher = matcher
        self.field = field
        self.dead: str | None = None
        self.ahead: tuple[int, bool] | None = None

    def accept(self, token: int) -> None:
        """Advances the matcher by one output token (or reports what `Grammars.accept_ahead` did with
        it); a ValueError when the grammar allows none here or refuses this one (the request then
        finishes with "error")."""
        ahead, self.ahead = self.ahead, None
        if ahead is not None and ahead[0] == token:  # accepted before the mask that found `dead` was made
            accepted = ahead[1]
        elif self.dead is not None:
            raise GrammarDeadEnd(self.dead)
        else:
            accepted = self.matcher.accept_token(token)
        if not accepted:
            raise ValueError(f"token {token} does not continue the output allowed by its {self.field}")


def tokenizer_info(xgr: Any, tokenizer: Any, vocab_size: int, stop_ids: Iterable[int]) -> Any:
    """xgrammar's view of the vocabulary: the model's `vocab_size` tokens, `stop_ids` (EOS) as its stop
    tokens, and the tokenizer's other special tokens blanked (xgrammar never allows an empty token, and
    would otherwise take ``<|im_start|>`` as text)."""
    stops = sorted(t for t in stop_ids if 0 <= t < vocab_size)
    base = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stops or None)
    vocab = [""] * vocab_size
    for token, index in tokenizer.get_vocab().items():
        if 0 <= index < vocab_size:
            vocab[index] = token
    special = set(getattr(tokenizer, "all_special_ids", ()))
    special.update(i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special)
    for index in special - set(stops):
        if 0 <= index < vocab_size:
            vocab[index] = ""
    return xgr.TokenizerInfo.from_vocab_and_metadata(vocab, base.dump_metadata())


class Grammars:
    """The scheduler's structured output: compiles and caches grammars, makes each constrained request's
    `GrammarState` and fills the token mask of each batch that has one (see the module docstring).
    `tokenizer`: the model's (a Hugging Face tokenizer; None: grammars are refused); `vocab_size`: the
    model's; `eos_token_ids`: the engine's, the grammars' stop tokens; `tensor_parallel`: the engine runs
    over several ranks (grammars are refused: the following ranks have no tokenizer). `threads`: how many
    threads accept a step's tokens and fill its masks (None: 1, everything in the calling thread: on the
    H100 host's 16 cores a pool of 8 made the step slower, docs/structured-output.md); with 2 or more, a
    pool of that many less one (the calling thread takes a chunk too), made at the first large batch. An
    attribute: a benchmark may change it between steps."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Iterable[int],
        cache_size: int = GRAMMAR_CACHE_SIZE,
        tensor_parallel: bool = False,
        threads: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.tensor_parallel = tensor_parallel
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.cache_size = cache_size
        self.words = mask_words(vocab_size)
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()  # compiled grammar or error str
        self._compiler: Any = None
        self.threads = 1 if threads is None else threads
        # the pool (made for `threads`) and a one-thread BatchGrammarMatcher per chunk (xgrammar's with
        # two or more threads starts them at every call), made at the first large batch
        self._pool: tuple[int, ThreadPoolExecutor] | None = None
        self._fillers: list[Any] = []
        self._lock = threading.Lock()  # the server's front end checks from several threads
        self.compiled = 0  # grammars compiled so far (cache misses)

    def check(self, params: SamplingParams) -> None:
        """Raises a ValueError naming the field if the request's grammar cannot be used: compiles it
        (or finds it in the cache), and makes sure its first token has a choice (a grammar whose
        language is empty, or holds only the empty text while min_tokens asks for more, has none)."""
        grammar = params.grammar
        if grammar is None:
            return
        field = grammar[0]
        if self.tensor_parallel:
            raise ValueError(
                f"{field}: structured output is not supported under tensor parallelism (tp_size > 1) yet; "
                "run the model on one GPU for it"
            )
        import xgrammar as xgr

        row = torch.empty((1, self.words), dtype=torch.int32)
        xgr.GrammarMatcher(self._compiled(*grammar)).fill_next_token_bitmask(row, 0)
        self._clear_tail(row)
        if not row.any():
            raise ValueError(
                f"{field} allows no output at all: no text of this vocabulary is in its language"
            )
        if params.min_tokens > 0:
            self._clear(row[0], self._held_back(params))
            if not row.any():
                raise ValueError(
                    f"{field} allows only the empty output, and min_tokens={params.min_tokens} holds its end "
                    "back: no token could be drawn; lower min_tokens"
                )

    def new_state(self, params: SamplingParams) -> GrammarState | None:
        """A fresh matcher for a request (None without a grammar); after `check`."""
        grammar = params.grammar
        if grammar is None:
            return None
        import xgrammar as xgr

        return GrammarState(xgr.GrammarMatcher(self._compiled(*grammar)), grammar[0])

    def _compiled(self, field: str, text: str) -> Any:
        with self._lock:
            return self._compiled_locked(field, text)

    def _compiled_locked(self, field: str, text: str) -> Any:
        key = (field, text)
        entry = self._cache.get(key)
        if entry is None:
            entry = self._compile(field, text)
            self._cache[key] = entry
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        if isinstance(entry, str):
            raise ValueError(entry)
        return entry

    def _compile(self, field: str, text: str) -> Any:
        """The compiled grammar, or the error message of an invalid one (cached as well)."""
        compiler = self._get_compiler(field)
        self.compiled += 1
        try:
            if field == "json_schema":
                return compiler.compile_json_schema(text, any_whitespace=False)
            if field == "json_object":
                return compiler.compile_json_schema(JSON_OBJECT_SCHEMA, any_whitespace=False)
            if field == "regex":
                return compiler.compile_regex(text)
            return compiler.compile_grammar(text)
        except Exception as e:  # xgrammar raises RuntimeError, ValueError, its own errors...
            return _invalid(field, e)

    # where `tokenizer` is None: a function that loads it at the first grammar (the server's scheduler
    # process loads none at its start: LLM.tokenizer)
    load_tokenizer: Callable[[], Any] | None = None

    def _get_compiler(self, field: str) -> Any:
        if self._compiler is None:
            if self.tokenizer is None and self.load_tokenizer is not None:
                self.tokenizer = self.load_tokenizer()
            if self.tokenizer is None:
                raise ValueError(f"{field} needs the model's tokenizer, and this model folder has none")
            import xgrammar as xgr

            info = tokenizer_info(xgr, self.tokenizer, self.vocab_size, self.eos_token_ids)
            self._compiler = xgr.GrammarCompiler(
                info, max_threads=max(1, min(8, os.cpu_count() or 1)), cache_enabled=False
            )
            logger.info("structured output: xgrammar compiler ready (%d tokens)", self.vocab_size)
        return self._compiler

    def accept_ahead(self, pairs: Iterable[tuple[Any, int]]) -> None:
        """Advances the matchers of (`RequestState`, its new token) pairs in one call to xgrammar (with
        the pool, one a chunk: `_spread`), before the tokens are processed (the next step's masks need them
        first, see `Pipeline.deferred_mask`); `GrammarState.accept` reports the outcome when each token
        is processed. A dead grammar's matcher is left alone (its token fails the request)."""
        pairs = [(state.grammar, token) for state, token in pairs if state.grammar.dead is None]
        if not pairs:
            return
        import xgrammar as xgr

        matchers = [grammar.matcher for grammar, _ in pairs]
        tokens = [token for _, token in pairs]
        chunks = self._spread(
            len(pairs), lambda _, a, b: xgr.BatchGrammarMatcher.batch_accept_token(matchers[a:b], tokens[a:b])
        )
        for (grammar, token), ok in zip(pairs, (ok for chunk in chunks for ok in chunk)):
            grammar.ahead = (token, ok)

    def token_mask(self, states: Sequence[Any], device: torch.device) -> torch.Tensor | None:
        """The token mask of a batch (`states`: its `RequestState`s), (B, words) int32 packed bits
        copied to `device` without blocking, or None when no request of the batch has a grammar
        (nothing is made). Rows of requests without a grammar, and of prefill chunks whose token is
        dropped, allow every token; so do the rows of requests finished since the batch was made or
        whose matcher has accepted its end (they finish when that token is processed, and this forward's
        token is dropped). A request whose grammar allows no token here (min_tokens holds back
        the end it has reached: see the module docstring) is marked `dead` and its row allows every
        token: its token finishes it with "error" when processed."""
        rows = [
            i
            for i, s in enumerate(states)
            if s.grammar is not None
            and not s.req.is_partial
            and not s.finished
            and not s.grammar.matcher.is_terminated()
        ]
        if not rows:
            return None
        mask = torch.empty((len(states), self.words), dtype=torch.int32, pin_memory=device.type == "cuda")
        if len(rows) < len(states):  # written through numpy: torch's intra-op threads stay out of it
            constrained = set(rows)
            mask.numpy()[[i for i in range(len(states)) if i not in constrained]] = -1
        matchers = [states[i].grammar.matcher for i in rows]
        if len(rows) >= BATCH_FILL_ROWS:  # a one-thread BatchGrammarMatcher a chunk (chunk k: filler k)
            fillers = self._get_fillers()
            self._spread(
                len(rows),
                lambda k, a, b: fillers[k].batch_fill_next_token_bitmask(matchers[a:b], mask, rows[a:b]),
            )
        else:
            for i, matcher in zip(rows, matchers):
                matcher.fill_next_token_bitmask(mask, i)
        self._clear_tail(mask)
        for i in rows:
            state = states[i]
            if _accepted(state) < state.params.min_tokens:  # min_tokens holds the end back
                self._clear(mask[i], self._held_back(state.params))
        # rows that allow no token (never drawn from); the unconstrained rows allow every one
        for i in np.flatnonzero(~mask.numpy().any(axis=1)).tolist():
            state = states[i]
            mask[i] = -1
            state.grammar.dead = self._dead_message(state)
        return mask.to(device, non_blocking=True)

    def _spread(self, n: int, run: Callable[[int, int, int], Any]) -> list[Any]:
        """`run(k, start, stop)` over n rows in contiguous chunks, their results in order: one chunk
        (`run(0, 0, n)` in the calling thread, as without a pool) below two chunks of `CHUNK_ROWS` rows
        or with `threads` < 2; else up to `threads` chunks, chunk 0 in the calling thread and the others
        on the pool (xgrammar's calls release the GIL). Returns, or raises a chunk's exception, once
        every chunk has finished."""
        parts = max(1, min(self.threads, n // CHUNK_ROWS))
        if parts == 1:
            return [run(0, 0, n)]
        pool = self._get_pool()
        futures = [pool.submit(run, k, n * k // parts, n * (k + 1) // parts) for k in range(1, parts)]
        try:
            first = run(0, 0, n // parts)
        finally:
            wait(futures)  # no worker still writes when this returns or raises
        return [first, *(future.result() for future in futures)]

    def _get_pool(self) -> ThreadPoolExecutor:
        """The pool of `threads` - 1 workers, made again when `threads` changed."""
        if self._pool is None or self._pool[0] != self.threads:
            if self._pool is not None:
                self._pool[1].shutdown(wait=False)
            pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="minisgl-grammar")
            self._pool = (self.threads, pool)
        return self._pool[1]

    def _get_fillers(self) -> list[Any]:
        """A one-thread BatchGrammarMatcher a chunk (chunk k's is filler k: none fills in two threads)."""
        missing = max(1, self.threads) - len(self._fillers)
        if missing > 0:
            import xgrammar as xgr

            self._fillers += [xgr.BatchGrammarMatcher(1) for _ in range(missing)]
        return self._fillers

    def verify_mask(
        self, states: Sequence[Any], drafts: Sequence[Sequence[int]], device: torch.device
    ) -> torch.Tensor | None:
        """The token mask of a verify step (speculative decoding): a row per token row, request by
        request (its newest token's, then one per draft). A constrained request's row j is its
        matcher's mask after its first j drafts: the matcher walks them (`accept_token`) and rolls back.
        A draft the grammar refuses ends the walk, and the rows after it allow every token: the target's
        masked draw at the refused draft's row never equals it, so they are never accepted; so do the
        rows after the grammar's end. Row 0 is the mask `token_mask` makes (min_tokens, dead ends).
        None when no request has a grammar."""
        if not has_grammar(states):
            return None
        total = sum(len(draft) + 1 for draft in drafts)
        mask = torch.full((total, self.words), -1, dtype=torch.int32, pin_memory=device.type == "cuda")
        row = 0
        for state, draft in zip(states, drafts):
            grammar = state.grammar
            walked = 0
            for j in range(len(draft) + 1 if grammar is not None and not state.finished else 0):
                if grammar.matcher.is_terminated():
                    break
                grammar.matcher.fill_next_token_bitmask(mask, row + j)
                self._clear_tail(mask[row + j : row + j + 1])
                if _accepted(state) + j < state.params.min_tokens:
                    self._clear(mask[row + j], self._held_back(state.params))
                if not mask.numpy()[row + j].any():  # nothing allowed: never drawn from
                    mask[row + j] = -1
                    if j == 0:
                        grammar.dead = self._dead_message(state)
                    break
                if j == len(draft) or not grammar.matcher.accept_token(draft[j]):
                    break
                walked += 1
            if walked:
                grammar.matcher.rollback(walked)
            row += len(draft) + 1
        self._clear_tail(mask)
        return mask.to(device, non_blocking=True)

    def _clear_tail(self, mask: torch.Tensor) -> None:
        """Clears the bits past the vocabulary in the last word of each row (they never count)."""
        tail = self.vocab_size % BITS
        if tail:
            mask[:, -1] &= (1 << tail) - 1

    def _held_back(self, params: SamplingParams) -> set[int]:
        """The tokens min_tokens holds back: EOS and the stop tokens (as `OutputProcessor.suppressed`)."""
        return {t for t in self.eos_token_ids | set(params.stop_token_ids) if 0 <= t < self.vocab_size}

    @staticmethod
    def _clear(row: torch.Tensor, tokens: Iterable[int]) -> None:
        """Clears the bits of `tokens` in one packed int32 row."""
        for token in tokens:
            bit = token % BITS
            row[token // BITS] &= ~(1 << bit) if bit < BITS - 1 else (1 << (BITS - 1)) - 1

    @staticmethod
    def _dead_message(state: Any) -> str:
        done = _accepted(state)
        if done < state.params.min_tokens:
            return (
                f"its {state.grammar.field} {DEAD_END} {done} tokens but the end, which "
                f"min_tokens={state.params.min_tokens} holds back (EOS and stop_token_ids); lower min_tokens"
            )
        # a matcher that is not at its end allows some token, but only if a token of the vocabulary
        # continues its text: a grammar can lead where none does (seen with hypothesis' regexes)
        return (
            f"its {state.grammar.field} {DEAD_END} {done} tokens, not even the end: no token of "
            "this model's vocabulary continues the output there; simplify the grammar"
        )


def _accepted(state: Any) -> int:
    """The output tokens a request's matcher has accepted: those processed, and one accepted ahead."""
    ahead = state.grammar.ahead
    return len(state.output_ids) + (ahead is not None and ahead[1])


def has_grammar(states: Iterable[Any]) -> bool:
    """Whether any of `states` is constrained."""
    return any(state.grammar is not None for state in states)
