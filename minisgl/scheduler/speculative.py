"""Speculative decoding's proposers and policy: which decode steps speculate, how many drafts each
request may take, and the back-off of requests whose drafts fail. Drafts are accepted while they equal
the target's own draws, so the output is the target's (docs/speculative.md); the verify steps themselves
are `minisgl.scheduler.verify`'s."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from minisgl import metrics
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.ngram import NgramProposer
from minisgl.scheduler.request import RequestState

logger = logging.getLogger(__name__)

# speculation runs while batch size x (k + 1) tokens stay at most this (by device type): below it a
# forward is bound by reading the weights, so the drafts' rows come almost free
MAX_VERIFY_TOKENS = {"cuda": 64, "cpu": 32}
# a request whose proposals fail sits out 1, 3, 7, 15 (2 x the last + 1) decode steps, at most this many
MAX_BACKOFF = 16


def max_verify_batch(device_type: str, num_tokens: int) -> int:
    """The largest decode batch that speculates with `num_tokens` drafts per request (the policy)."""
    return max(1, MAX_VERIFY_TOKENS.get(device_type, MAX_VERIFY_TOKENS["cpu"]) // (num_tokens + 1))


class Speculator:
    """One scheduler's speculative decoding: the proposer, the policy, and the counters."""

    def __init__(
        self, config: SchedulerConfig, *, device_type: str = "cpu", draft: Any = None, model_name: str = ""
    ) -> None:
        """`config`: its method and k (checked there); `draft`: the proposer of method 'draft'."""
        self.method = config.speculative_method
        self.k = config.speculative_num_tokens
        self.max_batch = max_verify_batch(device_type, self.k)
        self.ngram = NgramProposer(config.speculative_ngram_max) if self.method == "ngram" else None
        self.draft = draft
        self.drafted = 0  # draft tokens proposed so far
        self.accepted = 0  # of those, accepted
        self.verify_steps = 0
        # verify steps launched before the previous one was read (overlap), and of those, the ones whose
        # guess of the previous step failed (moved back on the device, their drafts made on that guess)
        self.pipelined_steps = 0
        self.missed_guesses = 0
        labels = {"model_name": model_name}
        self._drafted = metrics.SPEC_DRAFT_TOKENS.labels(**labels)
        self._accepted = metrics.SPEC_ACCEPTED_TOKENS.labels(**labels)
        self._per_step = metrics.SPEC_ACCEPTED_PER_STEP.labels(**labels)

    def wanted(self, states: Sequence[RequestState]) -> bool:
        """Whether this decode step should speculate: the batch is small enough and some request is due
        (its back-off over). Counts a step of every request's back-off. Cheap: no proposal is made, and
        a batch too large to speculate returns at once (its steps count towards no back-off)."""
        if len(states) > self.max_batch:
            return False
        due = False
        for state in states:
            if state.spec_wait > 0:
                state.spec_wait -= 1
            elif self._may_draft(state):
                due = True
        return due

    @staticmethod
    def _may_draft(state: RequestState) -> bool:
        """Past min_tokens and at least two tokens from max_tokens, counting a token in flight."""
        launched, params = state.num_launched, state.params
        return launched >= params.min_tokens and params.max_tokens - launched >= 2

    def limits(self, states: Sequence[RequestState], max_seq_len: int) -> list[int]:
        """The most drafts each request may take this step (0: none): k, within max_tokens (the last
        token is always the target's), max_seq_len, and after min_tokens; 0 while backing off. The
        requests' tokens are all on the host (the scheduler drained the forward in flight)."""
        out = []
        for state in states:
            req, params = state.req, state.params
            done = len(state.output_ids)
            limit = min(self.k, params.max_tokens - done - 1, max_seq_len - len(req.input_ids))
            if state.spec_wait > 0 or done < params.min_tokens:
                limit = 0
            out.append(max(0, limit))
        return out

    def propose(self, states: Sequence[RequestState], limits: Sequence[int]) -> list[list[int]]:
        """Up to `limits[i]` draft tokens for each request (`limits[i]` 0: none). For 'draft' the pages
        of the drafts' positions must be reserved first (the draft writes its KV there)."""
        if self.ngram is not None:
            return self.ngram.propose([(s.uid, s.req.input_ids) for s in states], limits)
        return self.draft.propose([s.req for s in states], limits)

    @property
    def pipelines(self) -> bool:
        """Whether a verify step can be launched before the previous one is read (overlap): its
        proposals can be made on a guess of the tokens in flight (`propose_after`). 'ngram' only: the
        draft model proposes from its KV, which holds the accepted tokens only."""
        return self.ngram is not None

    def propose_after(
        self, states: Sequence[RequestState], ahead: Sequence[Sequence[int]], ks: Sequence[int]
    ) -> list[list[int]]:
        """Up to `ks[i]` tokens for each request as `propose` would give them once the tokens
        `ahead[i]` (in flight, supposed accepted) follow its own: its guess of the next token, then
        drafts ('ngram' only)."""
        assert self.ngram is not None
        return self.ngram.propose_after([(s.uid, s.req.input_ids) for s in states], ahead, ks)

    def verified(self, state: RequestState, limit: int, drafted: int, accepted: int) -> None:
        """After a verify step: the request could take `limit` drafts, proposed `drafted` and `accepted`
        of them were accepted (its KV and `req.cached_len` already cut to them)."""
        if self.draft is not None and state.req is not None:
            self.draft.accepted(state.req)
        if limit == 0:
            return
        if drafted == 0:  # nothing to propose: back off
            state.spec_backoff = min(2 * state.spec_backoff + 1, MAX_BACKOFF)
            state.spec_wait = state.spec_backoff
            return
        state.spec_drafted += drafted
        state.spec_accepted += accepted
        self.drafted += drafted
        self.accepted += accepted
        self._drafted.inc(drafted)
        self._accepted.inc(accepted)
        self._per_step.observe(accepted)
        if accepted == 0:
            state.spec_backoff = min(2 * state.spec_backoff + 1, MAX_BACKOFF)
            state.spec_wait = state.spec_backoff
        else:
            state.spec_backoff = state.spec_wait = 0

    def forget(self, state: RequestState, req: Any) -> None:
        """The request finished (or, `req` only, was preempted: its engine request is gone)."""
        if self.ngram is not None and state.finished:
            self.ngram.forget(state.uid)
        if self.draft is not None and req is not None:
            self.draft.forget(req)

    def shutdown(self) -> None:
        if self.draft is not None:
            self.draft.shutdown()
