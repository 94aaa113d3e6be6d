"""Admission and preemption: the queue of waiting requests, the running ones, and the KV pages they
need. Rules and their reasons: docs/scheduler.md#admission-by-need-and-preemption."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable

from minisgl.core import FatalEngineError, SamplingParams
from minisgl.scheduler.batching import BatchPreparer
from minisgl.scheduler.lockstep import Follower, Leader
from minisgl.scheduler.lora import LoraManager
from minisgl.scheduler.radix import Match
from minisgl.scheduler.request import RequestState, Update
from minisgl.scheduler.speculative import Speculator
from minisgl.scheduler.stats import SchedulerMetrics

logger = logging.getLogger(__name__)

# fails requests at a stage and returns their updates (`Scheduler.fail`)
Fail = Callable[[list[RequestState], Exception, str], list[Update]]


def computes_prefix(params: SamplingParams) -> bool:
    """Whether a request may take its prompt's prefix from the prefix cache: it needs no logits or
    hidden states of those positions (prompt log probabilities, mean or CLS pooling do)."""
    return params.prompt_logprobs is None and params.pooling in (None, "last")


class Admission:
    """Who waits and who runs: first come, first served admission while a request's prompt fits the
    pool, and preemption of the latest admitted when a step does not fit."""

    def __init__(
        self,
        prep: BatchPreparer,
        metrics: SchedulerMetrics,
        spec: Speculator | None,
        link: Leader | Follower | None,
        lora: LoraManager | None = None,
    ) -> None:
        self.prep, self.metrics, self.spec, self.link, self.lora = prep, metrics, spec, link, lora
        self.waiting: deque[RequestState] = deque()
        self.running: list[RequestState] = []  # in the order of their (latest) admission
        self.preemptions = 0  # running requests preempted so far
        self.prefix_lookup_tokens = 0  # prompt tokens of requests as their prefill began
        self.prefix_cached_tokens = 0  # of those, the tokens found in the prefix cache

    @property
    def held_pages(self) -> int:
        return sum(state.held_pages for state in self.running)

    def admit(self, fail: Fail) -> list[Update]:
        """Admits waiting requests while they fit; returns the updates of any that failed to."""
        follows = self.link is not None and not self.link.is_leader
        while self.waiting and self.prep.table_idxs.num_free > 0:
            state = self.waiting[0]
            tokens, params = self.tokens(state)
            # its adapter's slot: None while running requests pin every slot (it waits, and first come,
            # first served, so do the requests behind it: none starves)
            lora = (-1, 0) if state.lora is None else (self.lora.acquire(state.lora), state.lora.id)
            if lora[0] is None:
                break
            # a prompt scored for log probabilities, or pooled over its positions (mean, CLS), is
            # computed whole: it needs every position's logits or hidden state
            prefix = self.prep.match_prefix(tokens if computes_prefix(params) else [], lora[1], state.images)
            if not self.fits(state, prefix):
                self.prep.unlock_prefix(prefix)
                self._unpin(state)
                break  # first come, first served: later requests wait behind it
            leader_error = None if self.link is None else self.link.admission_error(state)
            try:
                if leader_error is not None:  # a following rank fails it as rank 0 did
                    raise RuntimeError(f"on rank 0: {leader_error}")
                state.req = self.prep.add_request(tokens, params, prefix, lora, state.images)
                state.req.output_start = len(state.prompt_ids)
                state.held_pages = len(prefix.pages) if prefix is not None else 0
                state.prefix_found = -1
            except Exception as e:
                self.prep.unlock_prefix(prefix)
                self._unpin(state)
                if follows and leader_error is None:
                    raise FatalEngineError(
                        f"admitting request {state.uid} failed on this rank only: {e}"
                    ) from e
                return fail([state], e, "admitting it")
            self.waiting.popleft()
            self.running.append(state)
            if state.admit_time is None:
                state.admit_time = time.perf_counter()
        return []

    def fits(self, state: RequestState, prefix: Match | None) -> bool:
        """Whether the pool has the pages of `state`'s tokens beyond its cached `prefix`, the rest of
        the prompts of admitted requests still prefilling, and a page of headroom per running request
        and this one. Unreferenced prefix-cache pages count as available; an empty engine admits
        anything that passed `check_request`."""
        cached = 0 if prefix is None else len(prefix.pages)
        need = self.prep.pages_needed(len(state.prompt_ids) + len(state.output_ids)) - cached
        promised = sum(
            self.prep.pages_needed(s.req.num_prompt_tokens) - s.held_pages
            for s in self.running
            if not s.prefilled
        )
        headroom = len(self.running) + 1
        available = self.prep.available_pages  # the prefix is locked: not counted in it
        return available - promised >= min(need + headroom, self.prep.engine.num_pages - cached)

    @staticmethod
    def tokens(state: RequestState) -> tuple[list[int], SamplingParams]:
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

    def preempt(self) -> bool:
        """Preempts the most recently admitted running request (never the only one, which fits the
        pool alone): frees its pages and table_idx, requeues it at the front to be recomputed. With
        overlap its token in the forward in flight is dropped when that forward is read. Returns False
        when there is nothing to preempt."""
        if len(self.running) < 2:
            return False
        state = self.running.pop()
        if self.spec is not None:
            self.spec.forget(state, state.req)
        self.prep.release(state.req)
        self._unpin(state)
        state.req, state.held_pages, state.prefix_found = None, 0, -1
        state.num_preemptions += 1
        self.waiting.appendleft(state)
        self.preemptions += 1
        self.metrics.preempted()
        logger.debug("preempted request %d (%d tokens so far)", state.uid, len(state.output_ids))
        return True

    def release(self, state: RequestState) -> None:
        """A finished request leaves the queue, or the running requests with its pages and table_idx."""
        if state.req is None:  # finished before admission
            self.waiting.remove(state)
            return
        if self.spec is not None:
            self.spec.forget(state, state.req)
        self.prep.release(state.req)
        self._unpin(state)
        state.held_pages = 0
        self.running.remove(state)

    def _unpin(self, state: RequestState) -> None:
        """`state` no longer holds its adapter's slot (released, preempted, or not admitted after all)."""
        if state.lora is not None:
            self.lora.release(state.lora)

    def look_up(self, state: RequestState) -> None:
        """As a request's prefill begins: a longer cached prefix than at its admission, if requests
        prefilled since then put one in the tree; counts the prompt tokens looked up and found."""
        req = state.req
        if self.prep.cache is not None and computes_prefix(req.sampling_params):
            self.prep.rematch(req)
            state.held_pages = self.prep.pages_needed(req.cached_len)
        state.prefix_found = req.cached_len
        self.prefix_lookup_tokens += req.num_prompt_tokens
        self.prefix_cached_tokens += req.cached_len
        self.metrics.prefix_lookup(req.num_prompt_tokens, req.cached_len)
