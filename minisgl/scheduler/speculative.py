"""Speculative decoding's proposals and policy (docs/speculative.md); the verify step is the scheduler's.

A decode step of a small batch reads every weight to make one token per request. A verify step makes up
to k + 1: each speculating request proposes k draft tokens (`propose`), the target computes its newest
token and the drafts in one forward, and samples every position as a decode step there would (the same
transforms, the same (seed, position) draw). The drafts are accepted while they equal those draws, and
the draw after the last accepted draft is the bonus token. The drafts are greedy or copied (a one-hot
proposal q), for which this is the standard rejection test (Leviathan et al. 2023: accept d with
probability min(1, p(d) / q(d)) = p(d), else draw from the residual, p without d): the output is the
target's distribution exactly, and with a seed the very tokens of a run without speculation.

Methods: 'ngram' (`minisgl.scheduler.ngram`: the continuation of the latest earlier occurrence of the
request's last tokens) and 'draft' (`minisgl.scheduler.draft`: a smaller model's greedy tokens).

The policy (`Speculator.wanted`, `Speculator.limits`): a verify step computes k + 1 tokens per request;
where a batch is large enough that the forward is bound by compute rather than by reading the weights,
those tokens cost nearly their full price and speculation loses. So a decode step speculates only while
batch size x (k + 1) <= `MAX_VERIFY_TOKENS` (by device). A request that proposed nothing, or whose
drafts were all rejected, sits out 1, 3, 7, 15, then `MAX_BACKOFF` decode steps (reset by an accepted
draft), so a workload that never matches pays for almost no verify steps. Verify steps keep overlap
scheduling ('ngram'): the next one is launched on a guess of the one in flight (`propose_after`) and
moved on the device by what it accepted (`Scheduler._pipeline`, docs/speculative.md).
Requests with fewer outputs than min_tokens decode without drafts (they can still share a verify step,
with one row). Each row sees the drafts before it: a constrained request's rows take its grammar's mask
after them (`Grammars.verify_mask`), a penalised request's its counts with them (`PenaltyArgs.extra`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from minisgl import metrics
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
        self,
        method: str,
        num_tokens: int,
        *,
        ngram_max: int = 4,
        device_type: str = "cpu",
        draft: Any = None,
        model_name: str = "",
    ) -> None:
        if method not in ("ngram", "draft"):
            raise ValueError(f"speculative_method={method!r} is not valid here: use 'ngram' or 'draft'")
        if num_tokens < 1:
            raise ValueError(f"speculative_num_tokens={num_tokens} must be at least 1")
        if method == "draft" and draft is None:
            raise ValueError("speculative_method='draft' needs a draft proposer (speculative_draft_model)")
        self.method = method
        self.k = num_tokens
        self.max_batch = max_verify_batch(device_type, num_tokens)
        self.ngram = NgramProposer(ngram_max) if method == "ngram" else None
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
