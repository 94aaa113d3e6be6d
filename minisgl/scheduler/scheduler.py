"""The offline scheduler: continuous batching with chunked prefill over one Engine.

Each `step()` runs one forward:
- Admission by need: waiting requests are admitted first come, first served while a table_idx is free
  and the KV pool has the pages of the request's prompt, plus those that admitted requests still need
  for the rest of their prompts, plus one page of headroom per running request (for their next decode
  tokens); an empty engine admits the queue's head. Nothing is reserved for max_tokens: a request's
  pages grow with its sequence, one step at a time (`BatchPreparer` allocates what each batch reaches).
  A request that could never fit (longer than max_seq_len, which never exceeds the pool) is refused
  when it is added.
- Preemption: when a step cannot get the pages it needs (a decode step, or a prefill step that cannot
  take one token), the most recently admitted running request is preempted: its pages and table_idx
  are freed and it goes back to the *front* of the queue; re-admitted, it recomputes its prompt and its
  output so far as one prompt and continues its output where it stopped (the tokens are kept, not
  re-emitted; the sampler's draws are a function of seed and position, so the outputs are those of a
  run without preemption). The decision is a function of the scheduler's state, the same on every
  tensor-parallel rank. Counted in `preemptions` and the `minisgl_preemptions` metric.
- Prefix cache (`cache_type`, radix by default; docs/prefix-cache.md): admission matches the longest
  cached prefix of the prompt in whole pages (short of its last token) and the request prefills only
  the rest; as its prefill begins it matches again (`_look_up`: a request prefilled meanwhile may have
  cached more). Launched prefill chunks and ended requests hand their whole pages to the tree;
  unreferenced tree pages count as available and are evicted, least recently used first, as pages are
  needed.
- Prefill and decode alternate: while admitted requests still have prompt tokens to prefill, every other
  step is a prefill step (a prefill step is never followed by another one while requests wait to
  decode), so running requests wait at most one prefill chunk, and a newly admitted request starts its
  prefill within two steps. A prefill step takes prompt chunks first come, first served, up to
  `max_prefill_tokens` tokens in all; a prompt longer than what is left is cut and continues next time.
- Prompt log probabilities (`SamplingParams.prompt_logprobs`) need the logits of every prompt position:
  such a request takes no cached prefix (a hit has no logits), and its chunks are cut to
  `prompt_logprob_chunk` tokens so that their logits fit `PROMPT_LOGPROB_BYTES` (docs/gpu.md#log-probabilities).
- A decode step runs every request whose prefill is complete, one token each.
- Finished requests (EOS, a stop token, a stop string, max_tokens) leave at once and free their pages;
  so does a request given to `abort()`, and one whose step failed (finish reason "error", see `step`;
  docs/failures.md). The scheduler is driven by one thread at a time (`LLM` holds a lock).

Overlap scheduling (the `overlap_scheduling` setting, on by default; MINISGL_OVERLAP_SCHEDULING=0 or
`Scheduler(overlap=False)` turns it off for ablation; also on under tensor parallelism): a step
launches forward N+1 before it reads the tokens of forward N, so the host's work (scheduling, batch
tensors, attention planning, then N's tokens: stop checks, detokenizing, metrics) runs while the GPU
computes. Decode batches then take their input tokens from the device
(`BatchPreparer.decode(pending=True)`). A request that stops at EOS or a stop string in step N has
already been put in step N+1: that one token is computed and dropped; max_tokens is known ahead and
wastes nothing. A request preempted while its token is in flight loses that token (dropped when the
forward is read, recomputed after its re-admission); freeing its pages and table_idx at once is safe
as an abort's is: the device runs the forwards in order.

Speculative decoding keeps overlap too: verify step N+1 is launched before step N is read, built as
if N accepted every draft and moved on the device by what it did accept (`_pipeline`,
docs/speculative.md).

Structured output (`minisgl.scheduler.grammar`, docs/structured-output.md) keeps overlap: a
constrained request's token mask for step N depends on its token of step N-1, which is still in flight
when step N is prepared. So a batch with a constrained request gets its mask late (`_deferred_mask`):
the engine launches step N's forward, then asks for the mask before it samples; the scheduler then
reads step N-1's tokens (`_read`, early), the constrained requests' matchers accept theirs in one
call, and the masks are filled while the device runs the forward; the rest of step N-1's collect
(detokenizing, stop checks) follows once the sampler is launched. The sampler waits for the mask's
copy, the forward does not wait for the host.

`Scheduler(record_steps=N)` (or setting `scheduler.record_steps = N` later) keeps a `StepRecord` of each
of the last N forwards in `scheduler.step_records`: phase, mode, sizes, host and device times.

The scheduler's parts: `request` (RequestState, Update, FinishReason), `output` (stop conditions and
text), `stats` (metrics and StepRecords), and this module: admission, the prefill/decode policy,
launching forwards and collecting their tokens, abort.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import random
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from minisgl.core import (
    FATAL_ERRORS,
    Batch,
    FatalEngineError,
    Phase,
    Req,
    SamplingParams,
    TokenLogprobs,
    as_token_ids,
)
from minisgl.engine import BatchPreparer, Engine, ForwardMode, ForwardOutput
from minisgl.engine.sample import BatchSamplingArgs, LogprobArgs, PenaltyArgs
from minisgl.kvcache import RadixCache
from minisgl.kvcache.radix import Match
from minisgl.scheduler.config import CACHE_TYPES
from minisgl.scheduler.grammar import GrammarDeadEnd, Grammars, has_grammar
from minisgl.scheduler.lockstep import Follower, Leader, step_plan, token_digest
from minisgl.scheduler.output import OutputProcessor
from minisgl.scheduler.request import FinishReason, RequestState, Update
from minisgl.scheduler.speculative import Speculator
from minisgl.scheduler.stats import DeviceTimer, SchedulerMetrics, StepRecord

logger = logging.getLogger(__name__)

# what the logits of a prefill chunk scored for prompt log probabilities may take (about three copies
# of rows x vocabulary float32): such a request's chunks are cut to fit
PROMPT_LOGPROB_BYTES = 512 << 20

# how long rank 0, after a collective failed, looks for the rank that caused it (its report or exit)
RANK_FAILURE_GRACE_S = 2.0


@dataclass
class _InFlight:
    """A forward that was launched and whose tokens have not been processed yet."""

    states: list[RequestState]
    reqs: list[Req]  # each state's `req` at launch: a state preempted since then has another (or None)
    produces: list[bool]  # False for a prefill chunk that leaves prompt tokens for later
    output: ForwardOutput
    phase: Phase
    mode: ForwardMode
    num_tokens: int
    scheduled: float  # when scheduling was done: the step-seconds metric counts from here
    launch_s: float
    timer: DeviceTimer | None
    scoring: LogprobArgs | None = None  # what its log probabilities are of


class Scheduler:
    def __init__(
        self,
        engine: Engine,
        *,
        max_prefill_tokens: int = 8192,
        eos_token_ids: Sequence[int] = (),
        tokenizer: Any = None,
        model_name: str | None = None,
        overlap: bool | None = None,
        record_steps: int = 0,
        link: Leader | Follower | None = None,
        cache_type: str = "radix",
        grammar_tokenizer: Any = None,
        speculator: Speculator | None = None,
    ) -> None:
        """`record_steps`: keep a `StepRecord` of each of the last N forwards in `step_records` (0: off).
        `model_name` labels the metrics (default: the model folder's name). `link`: under tensor
        parallelism, this rank's side of the lockstep (`minisgl.scheduler.lockstep`): rank 0 leads,
        the others follow (they take requests and finishes from rank 0 only). `cache_type`: 'radix'
        (a prefix cache over the KV pages, docs/prefix-cache.md) or 'naive' (every prompt computed).
        `grammar_tokenizer`: the tokenizer structured output compiles its grammars against (default:
        `tokenizer`; `LLM(detokenize=False)` gives one without detokenizing). `speculator`: speculative
        decoding's proposer and policy (`minisgl.scheduler.speculative`; None: off)."""
        if max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got max_prefill_tokens={max_prefill_tokens}")
        if cache_type not in CACHE_TYPES:
            raise ValueError(f"cache_type={cache_type!r} is not valid: use one of {', '.join(CACHE_TYPES)}")
        if speculator is not None and link is not None:
            raise ValueError(
                f"speculative_method={speculator.method!r} is not supported under tensor parallelism yet: "
                "leave speculative_method at 'none' or use tp_size 1"
            )
        self.engine = engine
        self.spec = speculator
        self.cache_type = cache_type
        cache = RadixCache(engine.config.page_size) if cache_type == "radix" else None
        self.prep = BatchPreparer(engine, cache)
        self.prefix_lookup_tokens = 0  # prompt tokens of requests as their prefill began
        self.prefix_cached_tokens = 0  # of those, the tokens found in the prefix cache
        self.max_prefill_tokens = max_prefill_tokens
        # a chunk of a prompt scored for log probabilities: its logits fit PROMPT_LOGPROB_BYTES
        vocab = engine.config.model_config.vocab_size
        self.prompt_logprob_chunk = max(16, PROMPT_LOGPROB_BYTES // (12 * vocab))
        self.output = OutputProcessor(tokenizer, eos_token_ids)
        self.grammars = Grammars(
            tokenizer if grammar_tokenizer is None else grammar_tokenizer,
            engine.config.model_config.vocab_size,
            eos_token_ids,
            tensor_parallel=link is not None,
        )
        self.metrics = SchedulerMetrics(model_name or Path(engine.config.model_path).name)
        self.overlap = overlap is not False  # None: on (the overlap_scheduling setting)
        self.link = link
        self.follows = link is not None and not link.is_leader
        self._by_uid: dict[int, RequestState] = {}  # a follower's unfinished requests
        self._seeds = random.Random()  # seeds of sampled requests that come without one
        self.last_token_digest = 0  # under tensor parallelism, of the tokens read last (ranks compare it)
        self.step_records: deque[StepRecord] = deque()
        self.record_steps = record_steps
        self._in_flight: _InFlight | None = None  # overlap: the forward whose tokens come next
        self._verifying: _Verify | None = None  # overlap with speculation: the verify step in flight
        # a forward whose tokens `_deferred_mask` read early (its constrained requests' tokens accepted),
        # and what `_read` gave: processed by the step's own collect
        self._early: tuple[_InFlight, _Read] | None = None
        self.waiting: deque[RequestState] = deque()
        self.running: list[RequestState] = []  # in the order of their (latest) admission
        self.preemptions = 0  # running requests preempted so far
        self._last_phase = ""
        self._uids = 0
        # time.perf_counter() when the latest step's tokens reached the host (0: none yet); the
        # server stamps its messages with it (the clock is CLOCK_MONOTONIC, shared by the host's processes)
        self.tokens_time = 0.0

    @property
    def held_pages(self) -> int:
        """The running requests' `held_pages` summed: pages in their page tables, a cached prefix
        counted once per request that uses it (without a prefix cache: the pool's pages in use)."""
        return sum(state.held_pages for state in self.running)

    @property
    def prefix_evicted_pages(self) -> int:
        """Pages evicted from the prefix cache so far to make room."""
        return self.prep.evicted_pages

    @property
    def prefix_cache(self) -> RadixCache | None:
        """The radix tree of cached prefixes (None with cache_type 'naive')."""
        return self.prep.cache

    def clear_prefix_cache(self) -> int:
        """Evicts every cached prefix that no running request uses; returns the pages freed. Under
        tensor parallelism rank 0's clear reaches the other ranks with the next step."""
        if self.follows:
            raise RuntimeError("a following rank clears its prefix cache when rank 0 says so")
        if self.link is not None:
            self.link.cleared()
        return self._clear_prefix_cache()

    def _clear_prefix_cache(self) -> int:
        freed = self.prep.clear_cache()
        self.metrics.prefix_cache(self.prep)
        return freed

    @property
    def reserved_pages(self) -> int:
        """`held_pages` (the name of the time when admission reserved each request's worst case)."""
        return self.held_pages

    @property
    def record_steps(self) -> int:
        """How many `StepRecord`s `step_records` keeps (the latest); 0 records nothing. Settable."""
        return self.step_records.maxlen or 0

    @record_steps.setter
    def record_steps(self, n: int) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"record_steps must be an integer >= 0 (0: off), got record_steps={n!r}")
        self.step_records = deque(self.step_records, maxlen=n)

    # -- requests -------------------------------------------------------------------------------

    def check_request(self, prompt_ids: list[int], params: SamplingParams, stream: bool = False) -> None:
        """Raises a ValueError (a TypeError for a value of the wrong type) naming the problem if the
        request could never run; queues nothing. `prompt_ids`: a list of ints (`as_token_ids`)."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        self.prep.check_request(prompt_ids, params)
        self.output.check(params, stream, self.engine.config.model_config.vocab_size)
        self.grammars.check(params)

    def add_request(
        self, prompt_ids: Sequence[int], params: SamplingParams, stream: bool = False
    ) -> RequestState:
        """Queues a request; raises a ValueError or TypeError naming the problem if it could never run
        (see `check_request`), queueing nothing."""
        if self.follows:
            raise RuntimeError("a following rank takes its requests from rank 0 only")
        prompt = as_token_ids(prompt_ids)
        self.check_request(prompt, params, stream)
        if params.seed is None and not params.is_greedy:
            # drawn here, once: the tokens are a function of (seed, position), the same on every rank
            params = dataclasses.replace(params, seed=self._seeds.getrandbits(63))
        state = self._queue(prompt, params, self.output.detokenizer(params, stream))
        state.grammar = self.grammars.new_state(params)
        if self.link is not None:
            self.link.added(state)
        return state

    def _queue(self, prompt: list[int], params: SamplingParams, detokenizer: Any) -> RequestState:
        # max_seq_len never exceeds the pool, so a request that passed the check fits the pool alone
        state = RequestState(self._uids, prompt, params, time.perf_counter(), detokenizer)
        self._uids += 1
        self.waiting.append(state)
        self.metrics.waiting(len(self.waiting))
        return state

    def follow_add(self, uid: int, prompt: list[int], params: SamplingParams) -> None:
        """A following rank: queues the request rank 0 added (checked there) under the same uid."""
        if uid != self._uids:
            raise FatalEngineError(f"rank 0 added request {uid} where this rank expected {self._uids}")
        self._by_uid[uid] = self._queue(prompt, params, None)

    def follow_finish(self, uid: int, reason: FinishReason, error: str | None) -> None:
        """A following rank: finishes the request as rank 0 did (no-op if it already has, in the same
        failed step)."""
        state = self._by_uid.get(uid)
        if state is not None:
            state.error = error
            self._finish(state, reason, time.perf_counter())

    def abort(self, state: RequestState) -> None:
        """Finishes a request now with finish_reason 'abort', keeping its output so far: a waiting one
        leaves the queue, a running one frees its table_idx and KV pages at once (with overlap, its
        token in the forward in flight is dropped). Does nothing to a finished request."""
        if state.finished:
            return
        if state not in self.running and state not in self.waiting:
            raise ValueError(f"request {state.uid} is not one of this scheduler's requests")
        self.output.finish_text(state)
        self._finish(state, "abort", time.perf_counter())
        self.metrics.queues(len(self.running), len(self.waiting), self._kv_cache_usage())

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._in_flight or self._verifying)

    def _admit(self) -> list[Update]:
        """Admits waiting requests while they fit; returns the updates of any that failed to."""
        while self.waiting and self.prep.table_idxs.num_free > 0:
            state = self.waiting[0]
            tokens, params = self._admission_tokens(state)
            # a prompt scored for log probabilities is computed whole: it needs every position's logits
            prefix = self.prep.match_prefix(tokens if params.prompt_logprobs is None else [])
            if not self._fits(state, prefix):
                self.prep.unlock_prefix(prefix)
                break  # first come, first served: later requests wait behind it
            leader_error = None if self.link is None else self.link.admission_error(state)
            try:
                if leader_error is not None:  # a following rank fails it as rank 0 did
                    raise RuntimeError(f"on rank 0: {leader_error}")
                state.req = self.prep.add_request(tokens, params, prefix)
                state.req.output_start = len(state.prompt_ids)
                state.held_pages = len(prefix.pages) if prefix is not None else 0
                state.prefix_found = -1
            except Exception as e:
                self.prep.unlock_prefix(prefix)
                if self.follows and leader_error is None:
                    raise FatalEngineError(
                        f"admitting request {state.uid} failed on this rank only: {e}"
                    ) from e
                return self._fail([state], e, "admitting it")
            self.waiting.popleft()
            self.running.append(state)
            if state.admit_time is None:
                state.admit_time = time.perf_counter()
        return []

    def _fits(self, state: RequestState, prefix: Match | None) -> bool:
        """Whether the pool has the pages of `state`'s prompt (with its output so far, after a
        preemption) beyond its cached `prefix`, the rest of the prompts of admitted requests still
        prefilling, and one page of headroom per running request and this one. Pages the prefix
        cache holds unreferenced count as available (they are evicted as needed). An empty engine
        admits anything that passed `check_request` (its sequence never exceeds the pool)."""
        cached = 0 if prefix is None else len(prefix.pages)
        need = self.prep.pages_needed(len(state.prompt_ids) + len(state.output_ids)) - cached
        promised = sum(
            self.prep.pages_needed(s.req.num_prompt_tokens) - s.held_pages
            for s in self.running
            if not s.prefilled
        )
        headroom = len(self.running) + 1
        available = self.prep.available_pages  # the prefix is locked: not counted in it
        return available - promised >= min(need + headroom, self.engine.num_pages - cached)

    def _admission_tokens(self, state: RequestState) -> tuple[list[int], SamplingParams]:
        """The engine request's tokens and parameters: the prompt, or after a preemption the prompt and
        the output so far, with what is left of max_tokens and min_tokens (the seed and the positions
        stay: the sampler draws the same tokens)."""
        done = len(state.output_ids)
        if done == 0:
            return state.prompt_ids, state.params
        params = dataclasses.replace(
            state.params,
            max_tokens=state.params.max_tokens - done,
            min_tokens=max(0, state.params.min_tokens - done),
            # the prompt's log probabilities are in: its recomputation needs no more than the last row
            prompt_logprobs=None if state.prompt_logprobs_done else state.params.prompt_logprobs,
        )
        return state.prompt_ids + state.output_ids, params

    def _preempt(self) -> bool:
        """Preempts the most recently admitted running request (never the only one, which fits the
        pool alone): frees its pages and table_idx, requeues it at the front to be recomputed. With
        overlap its token in the forward in flight, if any, is dropped when that forward is read
        (`_collect`). Returns False when there is nothing to preempt."""
        if len(self.running) < 2:
            return False
        state = self.running.pop()
        if self.spec is not None:
            self.spec.forget(state, state.req)
        self.prep.release(state.req)
        state.req, state.held_pages, state.prefix_found = None, 0, -1
        state.num_preemptions += 1
        self.waiting.appendleft(state)
        self.preemptions += 1
        self.metrics.preempted()
        logger.debug("preempted request %d (%d tokens so far)", state.uid, len(state.output_ids))
        return True

    def _finish(self, state: RequestState, reason: FinishReason, now: float) -> None:
        """Ends a request whose text is complete: frees what it holds."""
        state.finish_reason, state.finish_time = reason, now
        if state.req is None:  # aborted before admission
            self.waiting.remove(state)
        else:
            if self.spec is not None:
                self.spec.forget(state, state.req)
            self.prep.release(state.req)
            state.held_pages = 0
            self.running.remove(state)
        self.metrics.finished(state, reason, now)
        if self.link is not None:
            self.link.finished(state)
            self._by_uid.pop(state.uid, None)

    def _kv_cache_usage(self) -> float:
        """The pages requests hold (the prefix cache's unreferenced pages not counted), over the pool."""
        return self.prep.num_request_pages / self.engine.num_pages

    # -- one step -------------------------------------------------------------------------------

    def step(self) -> list[Update]:
        """Admits what fits, launches one forward (prefill chunk or decode) and returns the updates of
        the forward it reads: this one, or with overlap the one launched by the previous step.

        A step that fails (an exception while preparing, running or sampling its forward, or reading its
        tokens) finishes its requests with finish_reason "error" and the message in `state.error`,
        freeing what they hold; an exception while processing one request's token finishes that request
        alone. Their updates are returned (finished, with what is left of their text) and the scheduler
        goes on with the others. A request that can no longer be scheduled is finished the same way.
        A failure after which no step can run (`FATAL_ERRORS`: a dead tensor-parallel rank, a CUDA
        error, a shut-down engine) finishes the step's requests and is raised."""
        started = time.perf_counter()
        if self.link is not None:  # a following rank applies what rank 0 sent for this step
            self.link.begin(self)
        updates: list[Update] = []
        if self._verifying is not None:  # a verify step in flight: launch the next one, then read it
            pending, self._verifying = self._verifying, None
            following = self._pipeline(pending, started, updates)
            updates += self._finish_verify(pending, following)
            if following is not None:
                self._verifying = following
                return updates
        updates += self._admit()
        blocked = bool(self.waiting) and not self.running  # the queue's head did not fit an empty engine
        states, chunks = self._schedule()
        if self.spec is not None and chunks is None and states and self.spec.wanted(states):
            planned = self._speculate(started, updates)
            if planned is None:  # a verify step ran and its tokens are processed
                return updates
            states, chunks = planned
        launched = self._launch(states, chunks, started, updates)
        if self.overlap:
            launched, self._in_flight = self._in_flight, launched
        if launched is not None:
            early, self._early = self._early, None
            updates += self._collect(
                launched, early[1] if early is not None and early[0] is launched else None
            )
        self._early = None
        # nothing ran, nothing runs: nobody may be stuck (a following rank waits for rank 0's verdict)
        if not states and self._in_flight is None and not self.follows:
            updates += self._fail_unschedulable(blocked)
        return updates

    def _fail_unschedulable(self, blocked: bool) -> list[Update]:
        """Finishes what no step can ever serve (a scheduler bug, never a user's request): running
        requests that are neither prefilling nor decoding, or a queue head that did not fit an empty
        engine. Without it `has_work()` would stay true and a caller's loop would spin forever."""
        if self.running:
            return self._fail(list(self.running), "it could not be scheduled any more", "scheduling")
        if blocked and self.waiting:
            return self._fail([self.waiting[0]], "it does not fit the empty engine", "admitting it")
        return []

    # -- speculative decoding (minisgl.scheduler.speculative, docs/speculative.md) -----------------

    def _speculate(
        self, started: float, updates: list[Update]
    ) -> tuple[list[RequestState], list[int] | None] | None:
        """A verify step, if this decode step gets drafts: the forward in flight is read first (the
        proposals need every token on the host), the step is scheduled again, the drafts proposed and
        verified. Returns None when a verify step ran (its updates in `updates`), else the step's
        (states, chunks) to launch as usual."""
        assert self.spec is not None
        if self._in_flight is not None:
            launched, self._in_flight = self._in_flight, None
            early, self._early = self._early, None
            updates += self._collect(
                launched, early[1] if early is not None and early[0] is launched else None
            )
        states, chunks = self._schedule()
        if chunks is not None or not states:
            return states, chunks
        limits = self._fit_drafts(states, self.spec.limits(states, self.engine.max_seq_len))
        if not any(limits):
            return states, None
        try:
            if self.spec.draft is not None:  # the draft model writes its KV at the drafts' positions
                for state, limit in zip(states, limits):
                    self.prep.reserve(state.req, len(state.req.input_ids) + limit)
            drafts = [d[:limit] for d, limit in zip(self.spec.propose(states, limits), limits)]
        except Exception as e:
            updates += self._fail(states, e, "proposing draft tokens")
            if isinstance(e, FATAL_ERRORS):
                raise
            return None
        if not any(drafts):  # nothing to verify: a plain decode step, and the requests back off
            for state, limit in zip(states, limits):
                self.prep.truncate(state.req, len(state.req.input_ids))
                self.spec.verified(state, limit, 0, 0)
            return states, None
        verify = self._verify(states, limits, drafts, started)
        if isinstance(verify, list):
            updates += verify
        elif self.overlap and self.spec.pipelines:  # read in the next step, after it launches the next
            self._verifying = verify
        else:
            updates += self._finish_verify(verify)
        return None

    def _fit_drafts(self, states: list[RequestState], limits: list[int]) -> list[int]:
        """`limits` cut (from the last request back) to the pages the pool has: the step was scheduled
        with a page for each request's next token only."""
        lens = [len(state.req.input_ids) for state in states]
        need = [self.prep.pages_needed(n + k) - self.prep.pages_needed(n) for n, k in zip(lens, limits)]
        spare = self.prep.available_pages - sum(
            max(0, self.prep.pages_needed(n) - s.held_pages) for n, s in zip(lens, states)
        )
        for i in reversed(range(len(states))):
            if sum(need) <= spare:
                break
            limits[i], need[i] = 0, 0
        return limits

    def _verify(
        self, states: list[RequestState], limits: list[int], drafts: list[list[int]], started: float
    ) -> _Verify | list[Update]:
        """Launches the target over each request's newest token and its drafts (`_launch_verify`);
        returns the verify step in flight, or the failed requests' updates."""
        try:
            return self._launch_verify(states, limits, drafts, started, guesses=None)
        except Exception as e:
            e = self._under_tp(e)
            failed = self._fail(states, e, "running a step")
            if isinstance(e, FATAL_ERRORS):
                raise e
            return failed

    def _launch_verify(
        self,
        states: list[RequestState],
        limits: list[int],
        drafts: list[list[int]],
        started: float,
        guesses: list[list[int]] | None,
    ) -> _Verify:
        """Runs the target over each request's newest token and its drafts, sampling every row (a row
        per token: the arguments a decode step at that position would have). `guesses` (a pipelined
        step, `_pipeline`): the tokens each request's verify step in flight is supposed to give (its
        drafts and the token after them), which the batch is built after; the device moves it to what
        that step accepted (`Engine.forward_verify(pending=True)`)."""
        scheduled = time.perf_counter()
        reqs = [state.req for state in states]
        known = [len(req.input_ids) for req in reqs]
        ahead = [[] for _ in reqs] if guesses is None else guesses
        rows: list[Req] = []  # the sampling arguments' requests, one per token row
        row_states: list[RequestState] = []
        for state, req, n, guess, draft in zip(states, reqs, known, ahead, drafts):
            if not draft:
                rows.append(req)
            for j in range(len(draft) + 1 if draft else 0):
                pos = n + len(guess) - 1 + j
                params, start, ready = req.sampling_params, req.output_start, req.penalties_ready
                rows.append(
                    Req(
                        [],
                        req.table_idx,
                        pos,
                        0,
                        req.uid,
                        params,
                        pos + 1,
                        output_start=start,
                        penalties_ready=ready,
                    )
                )
            row_states += [state] * (len(draft) + 1)
        device = self.engine.device
        try:
            for req, guess, draft in zip(reqs, ahead, drafts):
                req.input_ids += guess + draft
            batch = self.prep.prefill(reqs, [len(draft) + 1 for draft in drafts])
            if guesses is not None and not self.engine.can_shift(batch):
                for req in reqs:
                    req.device_len = req.cached_len
                raise _NotShiftable
            for state in states:
                state.held_pages = self.prep.pages_needed(state.req.device_len)
            args = BatchSamplingArgs.from_reqs(rows, device)
            args.suppress = self.output.suppressed(
                row_states, self.engine.config.model_config.vocab_size, device
            )
            args.token_mask = self.grammars.verify_mask(states, drafts, device)
            if args.penalties is not None:
                _draft_penalties(args.penalties, rows, drafts, device)
            mode = self.engine.forward_mode(batch, all_rows=True, verify=True)
            timer = DeviceTimer() if self.record_steps and device.type == "cuda" else None
            output = self.engine.forward_verify(batch, args, pending=guesses is not None)
            if timer is not None:
                timer.stop()
        finally:
            for req, n in zip(reqs, known):
                del req.input_ids[n:]
        launched = _InFlight(
            states,
            reqs,
            [True] * len(states),
            output,
            "decode",
            mode,
            len(rows),
            scheduled,
            time.perf_counter() - started,
            timer,
            args.logprobs,
        )
        self._last_phase = "decode"
        return _Verify(launched, limits, drafts, [None] * len(states), [True] * len(states))

    def _pipeline(self, pending: _Verify, started: float, updates: list[Update]) -> _Verify | None:
        """Overlap for speculative decoding: launches the next verify step of `pending`'s requests before
        `pending` is read, as if it accepted every draft and its token after them is the proposer's
        guess: the proposals go on from there (`Speculator.propose_after`), the pages are reserved for
        that, and the device moves each request's positions back by the drafts it rejected. A request
        whose drafts in `pending` were made on a guess that failed, that backs off, has no guess, or is
        a token from max_tokens, rides along without drafts (one row: its next token). None (and
        `pending` is read first) when its requests are not exactly the running ones, something waits,
        a request needs what only the host knows (a grammar, penalties, min_tokens) or may have ended
        (max_tokens, max_seq_len), or no request gets drafts."""
        spec = self.spec
        assert spec is not None
        states = pending.launched.states
        if not (
            self.overlap
            and spec.pipelines
            and not self.waiting
            and len(self.running) == len(states)
            and set(self.running) == set(states)
            and all(state.req is req for state, req in zip(states, pending.launched.reqs))
        ):
            return None
        ks = []
        for state, draft, valid in zip(states, pending.drafts, pending.valid):
            params, done = state.params, len(state.output_ids) + len(draft) + 1
            ahead = len(state.req.input_ids) + len(draft) + 1
            limit = min(spec.k, params.max_tokens - done - 1, self.engine.max_seq_len - ahead)
            # min_tokens: the rows' EOS ban needs the count of tokens so far, which only the host knows
            short = len(state.output_ids) < params.min_tokens
            if state.grammar is not None or params.has_penalties or short or limit < 0:
                return None
            if state.spec_wait > 0:  # a step of its back-off
                state.spec_wait -= 1
                limit = 0
            ks.append(limit + 1 if valid else 0)
        proposals = spec.propose_after(states, pending.drafts, ks)
        drafts = [p[1:] for p in proposals]
        if not any(drafts):
            return None
        # the tokens `pending` is supposed to give: its drafts, then the guess (a rider without one: any)
        guesses = [draft + (p[:1] or [0]) for draft, p in zip(pending.drafts, proposals)]
        reqs = [state.req for state in states]
        reach = [len(req.input_ids) + len(g) + len(d) for req, g, d in zip(reqs, guesses, drafts)]
        need = sum(max(0, self.prep.pages_needed(n) - s.held_pages) for n, s in zip(reach, states))
        if need > self.prep.available_pages:
            return None
        try:
            launched = self._launch_verify(states, [len(d) for d in drafts], drafts, started, guesses)
        except _NotShiftable:
            return None
        except Exception as e:
            updates += self._fail(states, e, "running a step")
            if isinstance(e, FATAL_ERRORS):
                raise
            return None
        launched.guessed = [p[0] if p else None for p in proposals]
        spec.pipelined_steps += 1
        return launched

    def _finish_verify(self, pending: _Verify, following: _Verify | None = None) -> list[Update]:
        """Reads a verify step and processes it: each request's drafts are accepted while they equal
        their row's token, and the token after them is taken; the accepted tokens are processed as
        decode steps would, one by one (stops, max_tokens and logprobs as without speculation).
        `following`: the verify step launched on a guess of this one (`_pipeline`): its requests keep
        the pages it reaches, and a request whose guess failed is marked (`_Verify.valid`)."""
        launched = pending.launched
        read = self._read(launched)
        if read.tokens is None:
            return read.failed
        assert self.spec is not None
        self.spec.verify_steps += 1
        self.tokens_time = now = read.read_at
        scored = _Scored(launched) if launched.output.logprobs is not None else None
        after = {} if following is None else {s: i for i, s in enumerate(following.launched.states)}
        accepted: list[tuple[RequestState, list[int], list[int | None]]] = []
        row = 0
        for state, req, draft, limit in zip(launched.states, launched.reqs, pending.drafts, pending.limits):
            sampled = read.tokens[row : row + len(draft) + 1]
            lp_rows = [
                None if scored is None else scored.take(row + j, state, req) for j in range(len(sampled))
            ]
            row += len(sampled)
            if not _takes(state, req, True):  # finished, aborted or preempted since the launch
                continue
            n = len(req.input_ids)
            a = 0
            while a < len(draft) and sampled[a] == draft[a]:
                a += 1
            # the KV of the newest token and the accepted drafts stays, and what the following step
            # computes; the rest of the rows' pages go
            keep = n + a
            i = after.get(state)
            if i is not None:
                keep += 1 + len(following.drafts[i])
                guessed = following.guessed[i]
                if guessed is not None and (a < len(draft) or sampled[a] != guessed):
                    following.valid[i] = False  # its drafts were made after tokens that are not its own
                    self.spec.missed_guesses += 1
            req.cached_len = req.device_len = keep
            self.prep.truncate(req, keep)
            state.held_pages = self.prep.pages_needed(keep)
            self.spec.verified(state, limit, len(draft), a)
            accepted.append((state, sampled[: a + 1], lp_rows[: a + 1]))
            if draft and state.params.has_penalties:  # its rows' tokens were not counted: the accepted are
                self.engine.sampler.count_tokens([req.table_idx] * (a + 1), sampled[: a + 1])
        updates, failed = [], []
        for state, tokens, lp_rows in accepted:
            merged: Update | None = None
            for token, lp_row in zip(tokens, lp_rows):
                if state.finished:  # a stop inside the accepted run: the rest is dropped
                    break
                try:
                    update = self._process(state, token, now, scored, lp_row)
                except Exception as e:
                    failed += self._fail([state], e, "processing its token")
                    break
                if merged is None:
                    merged = update
                else:
                    merged.token_ids += update.token_ids
                    merged.text += update.text
                    merged.finished, merged.logprobs = update.finished, update.logprobs
            if merged is not None:
                updates.append(merged)
        self._record(launched, sum(len(u.token_ids) for u in updates), read)
        return updates + failed

    def _fail(self, states: Sequence[RequestState], error: Exception | str, stage: str) -> list[Update]:
        """Finishes `states` with finish_reason "error" (`state.error` = what failed while `stage`),
        freeing their table_idxs and pages; returns their final updates."""
        detail = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        message = f"failed while {stage}: {detail}"
        states = [state for state in states if not state.finished]
        own_doing = isinstance(error, GrammarDeadEnd)  # the request's, not the engine's: no traceback
        logger.log(
            logging.WARNING if own_doing else logging.ERROR,
            "%d request(s) %s %s",
            len(states),
            [state.uid for state in states],
            message,
            exc_info=error if isinstance(error, Exception) and not own_doing else None,
        )
        now, updates = time.perf_counter(), []
        for state in states:
            state.error = message
            try:
                self.output.finish_text(state)
            except Exception:  # the detokenizer may be what failed: the text stays as it was
                pass
            self._finish(state, "error", now)
            updates.append(Update(state, [], self.output.take_delta(state), True))
        self.metrics.queues(len(self.running), len(self.waiting), self._kv_cache_usage())
        return updates

    def _schedule(self) -> tuple[list[RequestState], list[int] | None]:
        """(requests, prefill chunk sizes) for a prefill step or (requests, None) for a decode step,
        whose pages the pool has: preempts (`_preempt`) until it does."""
        while True:
            prefilling = [s for s in self.running if not s.prefilled]
            # with overlap a request's last token may already be in flight: it needs no more steps
            decoding = [s for s in self.running if s.prefilled and s.num_launched < s.params.max_tokens]
            if prefilling and (not decoding or self._last_phase != "prefill"):
                chosen, chunks = self._prefill_chunks(prefilling)
                if chosen:
                    return chosen, chunks
                if not decoding:  # not one prompt token fits: make room
                    if self._preempt():
                        continue
                    # alone, it always fits: unreachable, but the step then fails instead of spinning
                    state = prefilling[0]
                    return [state], [
                        min(state.req.num_prompt_tokens - state.req.cached_len, self.max_prefill_tokens)
                    ]
                # else decode instead; the decode step makes room if it must
            if not decoding:
                return [], None
            need = sum(self.prep.pages_needed(s.req.cached_len + 1) - s.held_pages for s in decoding)
            if need <= self.prep.available_pages or not self._preempt():
                return decoding, None

    def _prefill_chunks(self, prefilling: list[RequestState]) -> tuple[list[RequestState], list[int]]:
        """Prompt chunks first come, first served, up to `max_prefill_tokens` tokens in all and as many
        as the available pages hold (the last chunk is cut to fit). A request about to start its
        prefill first takes the longest prefix the cache holds now (`_look_up`)."""
        page_size = self.prep.page_size
        budget, chosen, chunks, taken = self.max_prefill_tokens, [], [], 0
        for state in prefilling:
            if budget <= 0:
                break
            if state.prefix_found < 0:
                self._look_up(state)
            free = self.prep.available_pages - taken  # after the look-up, which may lock some
            req = state.req
            room = (state.held_pages + free) * page_size - req.cached_len  # tokens its pages could hold
            chunk = min(req.num_prompt_tokens - req.cached_len, budget, room)
            if req.sampling_params.prompt_logprobs is not None:
                chunk = min(chunk, self.prompt_logprob_chunk)
            if chunk <= 0:
                break
            chosen.append(state)
            chunks.append(chunk)
            budget -= chunk
            taken += self.prep.pages_needed(req.cached_len + chunk) - state.held_pages
        return chosen, chunks

    def _look_up(self, state: RequestState) -> None:
        """As a request's prefill begins: a longer cached prefix than at its admission, if requests
        prefilled since then put one in the tree; counts the prompt tokens looked up and found."""
        if self.prep.cache is not None and state.req.sampling_params.prompt_logprobs is None:
            self.prep.rematch(state.req)
            state.held_pages = self.prep.pages_needed(state.req.cached_len)
        state.prefix_found = state.req.cached_len
        self.prefix_lookup_tokens += state.req.num_prompt_tokens
        self.prefix_cached_tokens += state.req.cached_len
        self.metrics.prefix_lookup(state.req.num_prompt_tokens, state.req.cached_len)

    def _launch(
        self, states: list[RequestState], chunks: list[int] | None, started: float, updates: list[Update]
    ) -> _InFlight | None:
        """Prepares and launches the forward of `states` (under tensor parallelism, once the ranks
        agree on it); if that fails, finishes them with "error" (their updates go to `updates`) and
        returns None. Failures after which no step can run are raised."""
        scheduled = time.perf_counter()
        plan = None if self.link is None else step_plan(self, states, chunks)  # before any page is taken
        prepared, error = None, None
        if states:
            try:
                prepared = self._prepare(states, chunks)
            except Exception as e:
                error = e
        try:
            if self.link is not None:  # every rank fails a step that failed on rank 0
                error = self.link.agree(plan, error)
        except Exception as e:  # a rank failed or diverged
            updates += self._fail(states, e, "running a step")
            raise
        if error is not None:
            updates += self._fail(states, error, "running a step")
            if isinstance(error, FATAL_ERRORS):  # no later step can run either
                raise error
            return None
        if prepared is None:
            return None
        batch, args = prepared
        try:
            return self._forward(states, batch, args, scheduled, started)
        except Exception as e:
            e = self._under_tp(e)
            updates += self._fail(states, e, "running a step")
            if isinstance(e, FATAL_ERRORS):
                raise e
            return None

    def _under_tp(self, error: Exception) -> Exception:
        """Under tensor parallelism a forward that failed on one rank leaves the others inside its
        collectives: every such failure is fatal, and a rank that reported its own failure (or exited)
        is named as the cause."""
        if self.link is None or isinstance(error, FatalEngineError):
            return error
        if self.follows:  # reported to rank 0 as it is
            fatal = FatalEngineError(f"{type(error).__name__}: {error}")
            fatal.__cause__ = error
            return fatal
        try:
            self.link.check_ranks(grace_s=RANK_FAILURE_GRACE_S)
        except FatalEngineError as rank_error:
            rank_error.__cause__ = error
            return rank_error
        fatal = FatalEngineError(
            "a forward failed under tensor parallelism, so the ranks no longer run the same collectives: "
            f"{type(error).__name__}: {error}"
        )
        fatal.__cause__ = error
        return fatal

    def _prepare(
        self, states: list[RequestState], chunks: list[int] | None
    ) -> tuple[Batch, BatchSamplingArgs]:
        """The batch of `states` (a prefill chunk each, or one decode token each) and its sampling
        arguments, on the device."""
        reqs = [state.req for state in states]
        if chunks is None:
            batch = self.prep.decode(reqs, pending=self.overlap)
        else:
            batch = self.prep.prefill(reqs, chunks)
        for state in states:  # the batch took the pages its tokens reach
            state.held_pages = self.prep.pages_needed(state.req.device_len)
        args = self.prep.sampling_args(batch)
        args.suppress = self.output.suppressed(
            states, self.engine.config.model_config.vocab_size, self.engine.device
        )
        if self.overlap and self._in_flight is not None and has_grammar(states):
            args.token_mask = functools.partial(self._deferred_mask, states)  # the engine asks for it later
        else:
            args.token_mask = self.grammars.token_mask(states, self.engine.device)
        return batch, args

    def _deferred_mask(self, states: list[RequestState]) -> torch.Tensor | None:
        """The token mask of a batch whose forward runs now (overlap): the tokens of the forward in
        flight before it are read first and its constrained requests' matchers accept theirs in one call
        (`Grammars.accept_ahead`), then the masks are filled from the matchers. The rest of that forward's
        collect (detokenizing, stop checks, metrics) waits for the step's own `_collect`, after the
        sampler is launched: it is off the path from a token to the next mask."""
        previous = self._in_flight
        if previous is not None and self._early is None:
            read = self._read(previous)
            self._early = (previous, read)
            if read.tokens is not None:
                self.grammars.accept_ahead(
                    (state, token)
                    for state, req, token, produces in zip(
                        previous.states, previous.reqs, read.tokens, previous.produces
                    )
                    if _takes(state, req, produces)
                    and state.grammar is not None
                    and state.params.max_tokens > 0
                )
        return self.grammars.token_mask(states, self.engine.device)

    def _forward(
        self,
        states: list[RequestState],
        batch: Batch,
        args: BatchSamplingArgs,
        scheduled: float,
        started: float,
    ) -> _InFlight:
        produces = [not state.req.is_partial for state in states]
        mode = self.engine.forward_mode(
            batch, all_rows=args.logprobs is not None and args.logprobs.rows is not None
        )
        num_tokens = batch.num_tokens  # before the forward marks the tokens cached
        timer = DeviceTimer() if self.record_steps and self.engine.device.type == "cuda" else None
        output = self.engine.forward_batch(batch, args)
        if timer is not None:
            timer.stop()
        if batch.phase == "prefill" and self.prep.cache is not None:  # shared from now on
            for state in states:
                self.prep.cache_prefix(state.req)
        self._last_phase = batch.phase
        launch_s = time.perf_counter() - started
        reqs = [state.req for state in states]
        return _InFlight(
            states,
            reqs,
            produces,
            output,
            batch.phase,
            mode,
            num_tokens,
            scheduled,
            launch_s,
            timer,
            args.logprobs,
        )

    def _read(self, launched: _InFlight) -> _Read:
        """Waits for a forward's tokens on the host (the one wait); a forward that failed on the device
        fails its requests (their updates in `failed`; a `FATAL_ERRORS` failure is raised)."""
        waiting_since = time.perf_counter()
        try:
            if self.link is None:
                launched.output.copy_done_event.synchronize()  # the one wait: the tokens' copy to the host
            else:  # the same wait, watching for a rank that fails meanwhile (its peers would wait forever)
                self.link.wait(launched.output.copy_done_event)
            tokens = launched.output.next_tokens_cpu.tolist()
        except Exception as e:  # the forward failed on the device
            e = self._under_tp(e)
            # a request preempted since the launch lost nothing: it is recomputed anyway
            states = [s for s, req in zip(launched.states, launched.reqs) if s.req is req]
            failed = self._fail(states, e, "running a step")
            if isinstance(e, FATAL_ERRORS):
                raise e
            return _Read(None, failed, waiting_since, time.perf_counter())
        if self.link is not None:  # checked by the following ranks
            self.last_token_digest = token_digest(tokens)
        return _Read(tokens, [], waiting_since, time.perf_counter())

    def _collect(self, launched: _InFlight, read: _Read | None = None) -> list[Update]:
        """A forward's updates: its tokens (`read`, or read now) processed request by request."""
        read = self._read(launched) if read is None else read
        if read.tokens is None:
            return read.failed
        tokens, now = read.tokens, read.read_at
        self.tokens_time = now
        scored = _Scored(launched) if launched.output.logprobs is not None else None
        updates, failed = [], []
        for i, (state, req, token, produces) in enumerate(
            zip(launched.states, launched.reqs, tokens, launched.produces)
        ):
            row = None if scored is None else scored.take(i, state, req)
            if _takes(state, req, produces):
                try:
                    updates.append(self._process(state, token, now, scored, row))
                except Exception as e:  # this request's own output processing: it alone fails
                    failed += self._fail([state], e, "processing its token")
        self._record(launched, len(updates), read)
        return updates + failed

    def _record(self, launched: _InFlight, num_generated: int, read: _Read) -> None:
        """A read forward's step metrics and (when recorded) its `StepRecord`."""
        batch_size, now = len(launched.states), read.read_at
        self.metrics.step(
            launched.phase,
            launched.mode,
            batch_size,
            launched.num_tokens,
            num_generated,
            now - launched.scheduled,
        )
        self.metrics.queues(len(self.running), len(self.waiting), self._kv_cache_usage())
        self.metrics.prefix_cache(self.prep)
        if self.record_steps:
            device_ms = None if launched.timer is None else launched.timer.elapsed_ms()
            self.step_records.append(
                StepRecord(
                    launched.phase,
                    launched.mode,
                    batch_size,
                    launched.num_tokens,
                    num_generated,
                    launch_s=launched.launch_s,
                    wait_s=now - read.waiting_since,
                    process_s=time.perf_counter() - now,
                    device_ms=device_ms,
                )
            )

    def _process(
        self, state: RequestState, token: int, now: float, scored: _Scored | None, row: int | None
    ) -> Update:
        """One request's token (and its log probability, `scored`'s row `row`, when it has one)."""
        if self.follows:  # rank 0 decides when a request stops, and says so in the next step's message
            state.req.input_ids.append(token)
            state.output_ids.append(token)
            self.metrics.token(state, now)
            return Update(state, [token], "", False)
        prompt_logprobs = state.prompt_logprobs if state.output_ids == [] else None
        if state.params.max_tokens == 0:  # the prompt was all it asked for (scored): no output token
            self._finish(state, "length", now)
            return Update(state, [], "", True, None, prompt_logprobs)
        if state.grammar is not None:  # raises when the grammar refuses it: the request fails alone
            state.grammar.accept(token)
        state.req.input_ids.append(token)
        state.output_ids.append(token)
        self.metrics.token(state, now)
        logprobs = state.logprobs if row is not None else None
        if logprobs is not None:
            scored.write(logprobs, row, token)
        reason = self.output.check_stop(state, token)
        if reason is not None:
            self._finish(state, reason, now)
        return Update(
            state, [token], self.output.take_delta(state), state.finished, logprobs, prompt_logprobs
        )


def _draft_penalties(
    pen: PenaltyArgs, rows: list[Req], drafts: list[list[int]], device: torch.device
) -> None:
    """A verify step's penalties: each penalised row of a drafted request counts the drafts before it,
    and its token is counted only once accepted (by the scheduler, `Sampler.count_tokens`)."""
    penalised = (i for i, row in enumerate(rows) if row.sampling_params.has_penalties)
    index = {row: p for p, row in enumerate(penalised)}
    extra, silent, offset = [], [], 0
    for draft in drafts:
        for j in range(len(draft) + 1 if draft else 0):
            p = index.get(offset + j)
            if p is not None:
                silent.append(p)
                extra += [(p, token) for token in draft[:j]]
        offset += len(draft) + 1
    pen.add_drafts(extra, silent, device)


def _takes(state: RequestState, req: Req, produces: bool) -> bool:
    """Whether a forward's token goes to its request: the row produces one (not a chunk that leaves
    prompt tokens for later), and the request has not finished (stopped one step earlier with overlap,
    aborted or failed) or been preempted (a new `Req`) since the launch."""
    return produces and not state.finished and state.req is req


@dataclass
class _Verify:
    """A launched verify step: its forward, each request's draft limit and drafts; for a step built
    on a guess (`Scheduler._pipeline`), the token each request's previous step was guessed to end with
    (None: no guess, no drafts), and whether its drafts still stand on true tokens (`valid`: False once
    the previous step is read and its guess failed; no step is then built on this one's drafts)."""

    launched: _InFlight
    limits: list[int]
    drafts: list[list[int]]
    guessed: list[int | None]
    valid: list[bool]


class _NotShiftable(Exception):
    """A pipelined verify batch the engine cannot move on the device (`Engine.can_shift`)."""


@dataclass
class _Read:
    """A forward's tokens on the host (None when it failed: then `failed` holds its requests' final
    updates), when the wait for them began and when they arrived."""

    tokens: list[int] | None
    failed: list[Update]
    waiting_since: float
    read_at: float


class _Scored:
    """A forward's log probabilities on the host, read request by request in batch order: prompt
    entries go to the request's `prompt_logprobs` (those it has not got yet: a chunk recomputed after a
    preemption scores its positions again), the sampled token's row is handed back (`take`) for
    `write`. Entries are written as columns, only where they are kept."""

    def __init__(self, launched: _InFlight) -> None:
        assert launched.scoring is not None and launched.output.logprobs is not None
        self.plan = launched.scoring.plan
        chosen, ids, values = launched.output.logprobs
        self.top = ids.shape[1]  # the alternatives of each row, flattened below
        self.chosen, self.ids, self.values = (
            chosen.tolist(),
            ids.flatten().tolist(),
            values.flatten().tolist(),
        )
        self.at = 0  # the row of the next request's first entry

    def write(self, entries: TokenLogprobs, row: int, token: int) -> None:
        """Row `row`'s log probability of `token` and its first `entries.k` alternatives, added."""
        start = row * self.top
        end = start + entries.k
        entries.extend((token,), (self.chosen[row],), self.ids[start:end], self.values[start:end])

    def take(self, i: int, state: RequestState, req: Req) -> int | None:
        """The `i`-th request's rows: its prompt's written, the row of its sampled token (None: none)."""
        start, prompt_rows, sampled, _, _ = self.plan[i]
        row = self.at
        self.at += prompt_rows + sampled
        prompt = state.prompt_logprobs
        if prompt_rows and prompt is not None:
            for p in range(start, start + prompt_rows):
                if p + 1 == len(prompt):
                    self.write(prompt, row + p - start, req.input_ids[p + 1])
        return row + prompt_rows if sampled else None
