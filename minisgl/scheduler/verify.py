"""The verify steps of speculative decoding: drafts proposed (`Speculator`), verified in one forward,
accepted while they equal the target's tokens, and with 'ngram' the next verify step launched before
this one is read, on the guess that it accepts every draft (docs/speculative.md). The verifier asks
the scheduler for what it needs: its pipeline, its batch preparer, and to fail or finish requests."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from minisgl.core import Req
from minisgl.engine.sampling_args import BatchSamplingArgs, PenaltyArgs
from minisgl.scheduler.pipeline import Coordinator, InFlight, Pipeline, Scored, takes
from minisgl.scheduler.request import RequestState, Update
from minisgl.scheduler.speculative import Speculator


@dataclass
class Verify:
    """A launched verify step: its forward, each request's draft limit and drafts; for a step built
    on a guess (`Verifier.pipeline`), the token each request's previous step was guessed to end with
    (None: no guess, no drafts), and whether its drafts still stand on true tokens (`valid`: False once
    the previous step is read and its guess failed; no step is then built on this one's drafts)."""

    launched: InFlight
    limits: list[int]
    drafts: list[list[int]]
    guessed: list[int | None]
    valid: list[bool]


class WithParts(Coordinator, Protocol):
    """The scheduler as the verifier sees it: also its launch pipeline and step policy."""

    pipeline: Pipeline
    policy: Any


class NotShiftable(Exception):
    """A pipelined verify batch the engine cannot move on the device (`Engine.can_shift`)."""


class Verifier:
    def __init__(self, sched: WithParts, spec: Speculator) -> None:
        self.sched, self.spec = sched, spec
        self.engine, self.prep = sched.engine, sched.prep
        self.pending: Verify | None = None  # overlap: the verify step in flight

    def step_pending(self, started: float, updates: list[Update]) -> bool:
        """With a verify step in flight: launches the next one on its guess where it can, then reads
        it. True when the next one was launched (the step is done)."""
        pending, self.pending = self.pending, None
        following = self.pipeline(pending, started, updates)
        updates += self.finish(pending, following)
        self.pending = following
        return following is not None

    def speculate(
        self, started: float, updates: list[Update]
    ) -> tuple[list[RequestState], list[int] | None] | None:
        """A verify step, if this decode step gets drafts: the forward in flight is read first (the
        proposals need every token on the host), the step is scheduled again, the drafts proposed and
        verified. Returns None when a verify step ran (its updates in `updates`), else the step's
        (states, chunks) to launch as usual."""
        sched, spec = self.sched, self.spec
        updates += sched.pipeline.drain()
        states, chunks = sched.policy.schedule(sched.pipeline.last_phase)
        if chunks is not None or not states:
            return states, chunks
        limits = self.fit_drafts(states, spec.limits(states, self.engine.max_seq_len))
        if not any(limits):
            return states, None
        try:
            if spec.draft is not None:  # the draft model writes its KV at the drafts' positions
                for state, limit in zip(states, limits):
                    self.prep.reserve(state.req, len(state.req.input_ids) + limit)
            drafts = [d[:limit] for d, limit in zip(spec.propose(states, limits), limits)]
        except Exception as e:
            updates += sched.fail_step(states, e, "proposing draft tokens")
            return None
        if not any(drafts):  # nothing to verify: a plain decode step, and the requests back off
            for state, limit in zip(states, limits):
                self.prep.truncate(state.req, len(state.req.input_ids))
                spec.verified(state, limit, 0, 0)
            return states, None
        try:
            verify = self.launch(states, limits, drafts, started, guesses=None)
        except Exception as e:
            updates += sched.fail_step(states, sched.under_tp(e))
            return None
        if sched.pipeline.overlap and spec.pipelines:  # read in the next step, after it launches the next
            self.pending = verify
        else:
            updates += self.finish(verify)
        return None

    def fit_drafts(self, states: list[RequestState], limits: list[int]) -> list[int]:
        """`limits` cut (from the last request back) to the pages the pool has: the step was scheduled
        with a page for each request's next token only."""
        prep = self.prep
        lens = [len(state.req.input_ids) for state in states]
        need = [prep.pages_needed(n + k) - prep.pages_needed(n) for n, k in zip(lens, limits)]
        spare = prep.available_pages - sum(
            max(0, prep.pages_needed(n) - s.held_pages) for n, s in zip(lens, states)
        )
        for i in reversed(range(len(states))):
            if sum(need) <= spare:
                break
            limits[i], need[i] = 0, 0
        return limits

    def launch(
        self,
        states: list[RequestState],
        limits: list[int],
        drafts: list[list[int]],
        started: float,
        guesses: list[list[int]] | None,
    ) -> Verify:
        """Runs the target over each request's newest token and its drafts, sampling every row (a row
        per token: the arguments a decode step at that position would have). `guesses` (a pipelined
        step): the tokens each request's verify step in flight is supposed to give (its drafts and the
        token after them), which the batch is built after; the device moves it to what that step
        accepted (`Engine.forward_verify(pending=True)`)."""
        sched, prep = self.sched, self.prep
        scheduled = time.perf_counter()
        reqs = [state.req for state in states]
        known = [len(req.input_ids) for req in reqs]
        ahead = [[] for _ in reqs] if guesses is None else guesses
        rows: list[Req] = []  # the sampling arguments' requests, one per token row
        row_states: list[RequestState] = []
        for state, req, n, guess, draft in zip(states, reqs, known, ahead, drafts):
            if not draft:
                rows.append(req)
            rows += [req.row_at(n + len(guess) - 1 + j) for j in range(len(draft) + 1 if draft else 0)]
            row_states += [state] * (len(draft) + 1)
        device = self.engine.device
        try:
            for req, guess, draft in zip(reqs, ahead, drafts):
                req.input_ids += guess + draft
            batch = prep.prefill(reqs, [len(draft) + 1 for draft in drafts])
            if guesses is not None and not self.engine.can_shift(batch):
                for req in reqs:
                    req.device_len = req.cached_len
                raise NotShiftable
            for state in states:
                state.held_pages = prep.pages_needed(state.req.device_len)
            args = BatchSamplingArgs.from_reqs(rows, device)
            args.suppress = sched.output.suppressed(
                row_states, self.engine.config.model_config.vocab_size, device
            )
            args.token_mask = sched.grammars.verify_mask(states, drafts, device)
            if args.penalties is not None:
                _draft_penalties(args.penalties, rows, drafts, device)
            timer = sched.pipeline.timer()
            output = self.engine.forward_verify(batch, args, pending=guesses is not None)
            if timer is not None:
                timer.stop()
        finally:
            for req, n in zip(reqs, known):
                del req.input_ids[n:]
        launched = InFlight(
            states=states,
            reqs=reqs,
            produces=[True] * len(states),
            output=output,
            phase="decode",
            num_tokens=len(rows),
            scheduled=scheduled,
            launch_s=time.perf_counter() - started,
            timer=timer,
            scoring=args.logprobs,
        )
        sched.pipeline.last_phase = "decode"
        return Verify(launched, limits, drafts, [None] * len(states), [True] * len(states))

    def pipeline(self, pending: Verify, started: float, updates: list[Update]) -> Verify | None:
        """Overlap for speculative decoding: launches the next verify step of `pending`'s requests before
        `pending` is read, as if it accepted every draft and its token after them is the proposer's
        guess. A request whose drafts in `pending` stood on a failed guess, that backs off, has no
        guess, or is a token from max_tokens, rides along without drafts (one row). None (and `pending`
        is read first) when its requests are not exactly the running ones, something waits, a request
        needs what only the host knows (a grammar, penalties, min_tokens) or may have ended, or no
        request gets drafts."""
        sched, spec = self.sched, self.spec
        states = pending.launched.states
        if not (
            sched.pipeline.overlap
            and spec.pipelines
            and not sched.waiting
            and len(sched.running) == len(states)
            and set(sched.running) == set(states)
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
            if state.spec_wait > 0:  # a step of its back-off (counted below, once launched)
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
            launched = self.launch(states, [len(d) for d in drafts], drafts, started, guesses)
        except NotShiftable:
            return None
        except Exception as e:
            updates += sched.fail_step(states, sched.under_tp(e))
            return None
        for state in states:  # this forward is a step of their back-off
            if state.spec_wait > 0:
                state.spec_wait -= 1
        launched.guessed = [p[0] if p else None for p in proposals]
        spec.pipelined_steps += 1
        return launched

    def finish(self, pending: Verify, following: Verify | None = None) -> list[Update]:
        """Reads a verify step and processes it: each request's drafts are accepted while they equal
        their row's token, and the token after them is taken; the accepted tokens are processed as
        decode steps would, one by one (stops, max_tokens and logprobs as without speculation).
        `following`: the verify step launched on a guess of this one (`pipeline`): its requests keep
        the pages it reaches, and a request whose guess failed is marked (`Verify.valid`)."""
        sched, spec, launched = self.sched, self.spec, pending.launched
        read = sched.pipeline.read(launched)
        if read.tokens is None:
            return read.failed
        spec.verify_steps += 1
        now = sched.tokens_time = read.read_at
        scored = Scored(launched) if launched.output.logprobs is not None else None
        after = {} if following is None else {s: i for i, s in enumerate(following.launched.states)}
        accepted: list[tuple[RequestState, list[int], list[int | None]]] = []
        row = 0
        for state, req, draft, limit in zip(launched.states, launched.reqs, pending.drafts, pending.limits):
            sampled = read.tokens[row : row + len(draft) + 1]
            lp_rows = [
                None if scored is None else scored.take(row + j, state, req) for j in range(len(sampled))
            ]
            row += len(sampled)
            if not takes(state, req, True):  # finished, aborted or preempted since the launch
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
                    spec.missed_guesses += 1
            req.cached_len = req.device_len = keep
            self.prep.truncate(req, keep)
            state.held_pages = self.prep.pages_needed(keep)
            spec.verified(state, limit, len(draft), a)
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
                    update = sched.pipeline.process(state, token, now, scored, lp_row)
                except Exception as e:
                    failed += sched.fail([state], e, "processing its token")
                    break
                if merged is None:
                    merged = update
                else:
                    merged.token_ids += update.token_ids
                    merged.text += update.text
                    merged.finished, merged.logprobs = update.finished, update.logprobs
            if merged is not None:
                updates.append(merged)
        sched.pipeline.record(launched, sum(len(u.token_ids) for u in updates), read)
        return updates + failed


def _draft_penalties(
    pen: PenaltyArgs, rows: list[Req], drafts: list[list[int]], device: torch.device
) -> None:
    """A verify step's penalties: each penalised row of a drafted request counts the drafts before it,
    and its token is counted only once accepted (by the verifier, `Sampler.count_tokens`)."""
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
