"""Launch, read, collect: one forward of the scheduler's choice is launched per step and its tokens
processed, with overlap one step later (the host prepares step N+1 while the device runs step N).
docs/scheduler.md#overlap-scheduling says why and what it costs."""

from __future__ import annotations

import functools
import time
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from minisgl.core import Batch, Phase, Req, TokenLogprobs
from minisgl.engine import ForwardMode, ForwardOutput
from minisgl.engine.sampling_args import BatchSamplingArgs, LogprobArgs
from minisgl.scheduler.grammar import has_grammar
from minisgl.scheduler.lockstep import step_plan, token_digest
from minisgl.scheduler.request import FinishReason, RequestState, Update
from minisgl.scheduler.stats import DeviceTimer, StepRecord


class Coordinator(Protocol):
    """What the parts ask of the scheduler that coordinates them (`minisgl.scheduler.Scheduler`)."""

    engine: Any
    prep: Any
    link: Any  # under tensor parallelism, this rank's side of the lockstep
    follows: bool
    output: Any
    grammars: Any
    metrics: Any
    running: list[RequestState]
    waiting: Any
    record_steps: int
    step_records: Any
    tokens_time: float
    last_token_digest: int

    def fail(self, states: Sequence[RequestState], error: Exception | str, stage: str) -> list[Update]: ...

    def fail_step(
        self, states: Sequence[RequestState], error: Exception, stage: str = ...
    ) -> list[Update]: ...

    def finish(self, state: RequestState, reason: FinishReason, now: float) -> None: ...

    def under_tp(self, error: Exception) -> Exception: ...

    def kv_cache_usage(self) -> float: ...


@dataclass(kw_only=True)
class InFlight:
    """A forward that was launched and whose tokens have not been processed yet."""

    states: list[RequestState]
    reqs: list[Req]  # each state's `req` at launch: a state preempted since then has another (or None)
    produces: list[bool]  # False for a prefill chunk that leaves prompt tokens for later
    output: ForwardOutput
    phase: Phase
    num_tokens: int
    scheduled: float  # when scheduling was done: the step-seconds metric counts from here
    launch_s: float
    timer: DeviceTimer | None
    scoring: LogprobArgs | None = None  # what its log probabilities are of

    @property
    def mode(self) -> ForwardMode:
        return self.output.mode


@dataclass
class Read:
    """A forward's tokens on the host (None when it failed: then `failed` holds its requests' final
    updates), when the wait for them began and when they arrived."""

    tokens: list[int] | None
    failed: list[Update]
    waiting_since: float
    read_at: float


def takes(state: RequestState, req: Req, produces: bool) -> bool:
    """Whether a forward's token goes to its request: the row produces one (not a chunk that leaves
    prompt tokens for later), and the request has not finished (stopped one step earlier with overlap,
    aborted or failed) or been preempted (a new `Req`) since the launch."""
    return produces and not state.finished and state.req is req


class Pipeline:
    """Launches the scheduled forward and collects the tokens of the one before it (overlap) or of
    itself. It asks the scheduler (`sched`) to fail or finish requests; the rest is its own."""

    def __init__(self, sched: Coordinator, overlap: bool) -> None:
        self.sched = sched
        self.engine, self.prep = sched.engine, sched.prep
        self.overlap = overlap
        self.in_flight: InFlight | None = None  # overlap: the forward whose tokens come next
        # a forward whose tokens `deferred_mask` read early (its constrained requests' tokens accepted),
        # and what `read` gave: processed by the step's own collect
        self.early: tuple[InFlight, Read] | None = None
        self.last_phase = ""

    def run(self, states: list[RequestState], chunks: list[int] | None, started: float) -> list[Update]:
        """Launches the forward of `states` and returns the updates of the forward it reads: this one,
        or with overlap the one launched by the previous step."""
        updates: list[Update] = []
        launched = self.launch(states, chunks, started, updates)
        if self.overlap:
            launched, self.in_flight = self.in_flight, launched
        if launched is not None:
            updates += self.collect(launched)
        self.early = None
        return updates

    def drain(self) -> list[Update]:
        """Reads and processes the forward in flight, if any (a step that needs every token on the host)."""
        launched, self.in_flight = self.in_flight, None
        return [] if launched is None else self.collect(launched)

    def launch(
        self, states: list[RequestState], chunks: list[int] | None, started: float, updates: list[Update]
    ) -> InFlight | None:
        """Prepares and launches the forward of `states` (under tensor parallelism, once the ranks
        agree on it); if that fails, finishes them with "error" (their updates go to `updates`) and
        returns None. Failures after which no step can run are raised."""
        sched = self.sched
        scheduled = time.perf_counter()
        plan = None if sched.link is None else step_plan(sched, states, chunks)  # before any page is taken
        prepared, error = None, None
        if states:
            try:
                prepared = self.prepare(states, chunks)
            except Exception as e:
                error = e
        if sched.link is not None:  # every rank fails a step that failed on rank 0
            try:
                error = sched.link.agree(plan, error)
            except Exception as e:  # a rank failed or diverged
                updates += sched.fail(states, e, "running a step")
                raise
        if error is not None:
            updates += sched.fail_step(states, error)
            return None
        if prepared is None:
            return None
        try:
            return self.forward(states, *prepared, scheduled, started)
        except Exception as e:
            updates += sched.fail_step(states, sched.under_tp(e))
            return None

    def prepare(
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
        sched, device = self.sched, self.engine.device
        args.suppress = sched.output.suppressed(states, self.engine.config.model_config.vocab_size, device)
        if self.overlap and self.in_flight is not None and has_grammar(states):
            args.token_mask = functools.partial(self.deferred_mask, states)  # the engine asks for it later
        else:
            args.token_mask = sched.grammars.token_mask(states, device)
        return batch, args

    def deferred_mask(self, states: list[RequestState]) -> torch.Tensor | None:
        """The token mask of a batch whose forward runs now (overlap): the tokens of the forward in
        flight before it are read first and its constrained requests' matchers accept theirs in one call
        (`Grammars.accept_ahead`), then the masks are filled. The rest of that forward's collect waits
        for the step's own, after the sampler is launched: it is off the path from a token to the next
        mask (docs/scheduler.md#overlap-scheduling)."""
        grammars, previous = self.sched.grammars, self.in_flight
        if previous is not None and self.early is None:
            read = self.read(previous)
            self.early = (previous, read)
            if read.tokens is not None:
                grammars.accept_ahead(
                    (state, token)
                    for state, req, token, produces in zip(
                        previous.states, previous.reqs, read.tokens, previous.produces
                    )
                    if takes(state, req, produces)
                    and state.grammar is not None
                    and state.params.max_tokens > 0
                )
        return grammars.token_mask(states, self.engine.device)

    def forward(
        self,
        states: list[RequestState],
        batch: Batch,
        args: BatchSamplingArgs,
        scheduled: float,
        started: float,
    ) -> InFlight:
        produces = [not state.req.is_partial for state in states]
        num_tokens = batch.num_tokens  # before the forward marks the tokens cached
        timer = self.timer()
        output = self.engine.forward_batch(batch, args)
        if timer is not None:
            timer.stop()
        if batch.phase == "prefill" and self.prep.cache is not None:  # shared from now on
            for state in states:
                self.prep.cache_prefix(state.req)
        self.last_phase = batch.phase
        return InFlight(
            states=states,
            reqs=[state.req for state in states],
            produces=produces,
            output=output,
            phase=batch.phase,
            num_tokens=num_tokens,
            scheduled=scheduled,
            launch_s=time.perf_counter() - started,
            timer=timer,
            scoring=args.logprobs,
        )

    def timer(self) -> DeviceTimer | None:
        """A device timer for the forward about to launch, when steps are recorded on a GPU."""
        return DeviceTimer() if self.sched.record_steps and self.engine.device.type == "cuda" else None

    def read(self, launched: InFlight) -> Read:
        """Waits for a forward's tokens on the host (the one wait); a forward that failed on the device
        fails its requests (their updates in `failed`; a `FATAL_ERRORS` failure is raised)."""
        sched = self.sched
        waiting_since = time.perf_counter()
        try:
            if sched.link is None:
                launched.output.copy_done_event.synchronize()  # the one wait: the tokens' copy to the host
            else:  # the same wait, watching for a rank that fails meanwhile (its peers would wait forever)
                sched.link.wait(launched.output.copy_done_event)
            tokens = launched.output.next_tokens_cpu.tolist()
        except Exception as e:  # the forward failed on the device
            # a request preempted since the launch lost nothing: it is recomputed anyway
            states = [s for s, req in zip(launched.states, launched.reqs) if s.req is req]
            failed = sched.fail_step(states, sched.under_tp(e))
            return Read(None, failed, waiting_since, time.perf_counter())
        if sched.link is not None:  # checked by the following ranks
            sched.last_token_digest = token_digest(tokens)
        return Read(tokens, [], waiting_since, time.perf_counter())

    def collect(self, launched: InFlight) -> list[Update]:
        """A forward's updates: its tokens (read early by `deferred_mask`, or now) processed request by
        request."""
        early, self.early = self.early, None
        read = early[1] if early is not None and early[0] is launched else self.read(launched)
        if read.tokens is None:
            return read.failed
        now = self.sched.tokens_time = read.read_at
        scored = Scored(launched) if launched.output.logprobs is not None else None
        pooled = iter(()) if launched.output.pooled is None else float32_rows(launched.output.pooled)
        updates, failed = [], []
        for i, (state, req, token, produces) in enumerate(
            zip(launched.states, launched.reqs, read.tokens, launched.produces)
        ):
            row = None if scored is None else scored.take(i, state, req)
            if produces and state.params.pooling is not None:  # its vector, in batch order
                vector = next(pooled)
                if takes(state, req, produces):
                    state.embedding = vector
            if takes(state, req, produces):
                try:
                    updates.append(self.process(state, token, now, scored, row))
                except Exception as e:  # this request's own output processing: it alone fails
                    failed += self.sched.fail([state], e, "processing its token")
        self.record(launched, sum(len(update.token_ids) for update in updates), read)  # embeddings: none
        return updates + failed

    def record(self, launched: InFlight, num_generated: int, read: Read) -> None:
        """A read forward's step metrics and (when recorded) its `StepRecord`."""
        sched, batch_size, now = self.sched, len(launched.states), read.read_at
        metrics = sched.metrics
        metrics.step(
            launched.phase,
            launched.mode,
            batch_size,
            launched.num_tokens,
            num_generated,
            now - launched.scheduled,
        )
        metrics.queues(len(sched.running), len(sched.waiting), sched.kv_cache_usage())
        metrics.prefix_cache(self.prep)
        if sched.record_steps:
            device_ms = None if launched.timer is None else launched.timer.elapsed_ms()
            sched.step_records.append(
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

    def process(
        self, state: RequestState, token: int, now: float, scored: Scored | None, row: int | None
    ) -> Update:
        """One request's token (and its log probability, `scored`'s row `row`, when it has one)."""
        sched = self.sched
        if sched.follows:  # rank 0 decides when a request stops, and says so in the next step's message
            state.req.input_ids.append(token)
            state.output_ids.append(token)
            sched.metrics.token(state, now)
            return Update(state, [token], "", False)
        prompt_logprobs = state.prompt_logprobs if state.output_ids == [] else None
        if state.params.max_tokens == 0:  # the prompt was all it asked for (scored): no output token
            sched.finish(state, "length" if state.params.pooling is None else "stop", now)
            return Update(state, [], "", True, None, prompt_logprobs)
        if state.grammar is not None:  # raises when the grammar refuses it: the request fails alone
            state.grammar.accept(token)
        state.req.input_ids.append(token)
        state.output_ids.append(token)
        sched.metrics.token(state, now)
        logprobs = state.logprobs if row is not None else None
        if logprobs is not None:
            scored.write(logprobs, row, token)
        reason = sched.output.check_stop(state, token)
        if reason is not None:
            sched.finish(state, reason, now)
        return Update(
            state, [token], sched.output.take_delta(state), state.finished, logprobs, prompt_logprobs
        )


def float32_rows(host: torch.Tensor) -> Iterator[array]:
    """Each row of a float32 host tensor as an array("f") of its bytes (the pooled vectors of a step:
    no Python float made per value)."""
    return (array("f", row.tobytes()) for row in host.numpy())


class Scored:
    """A forward's log probabilities on the host, read request by request in batch order: prompt
    entries go to the request's `prompt_logprobs` (those it has not got yet: a chunk recomputed after a
    preemption scores its positions again), the sampled token's row is handed back (`take`) for
    `write`. Entries are written as columns, only where they are kept."""

    def __init__(self, launched: InFlight) -> None:
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
