"""The offline scheduler: continuous batching with chunked prefill over one Engine.

Each `step()` runs one forward:
- Admission: waiting requests are admitted first come, first served while a request slot is free and
  the KV pool can *reserve* the request's worst case (prompt + max_tokens). Reserving at admission means
  a running request never runs out of pages and nothing is ever preempted; a request that could never
  fit (longer than max_seq_len, which never exceeds the pool) is refused when it is added.
- Prefill and decode alternate: while admitted requests still have prompt tokens to prefill, every other
  step is a prefill step (a prefill step is never followed by another one while requests wait to
  decode), so running requests wait at most one prefill chunk, and a newly admitted request starts its
  prefill within two steps. A prefill step takes prompt chunks first come, first served, up to
  `max_prefill_tokens` tokens in all; a prompt longer than what is left is cut and continues next time.
- A decode step runs every request whose prefill is complete, one token each.
- Finished requests (EOS, a stop token, a stop string, max_tokens) leave at once and free their pages.

Overlap scheduling (the `overlap_scheduling` setting, on by default; MINISGL_OVERLAP_SCHEDULING=0 or
`Scheduler(overlap=False)` turns it off for ablation; always off under tensor parallelism): a step
launches forward N+1 before it reads the tokens of forward N, so the host's work (scheduling, batch
tensors, attention planning, then N's tokens: stop checks, detokenizing, metrics) runs while the GPU
computes. Decode batches then take their input tokens from the device
(`BatchPreparer.decode(pending=True)`). A request that stops at EOS or a stop string in step N has
already been put in step N+1: that one token is computed and dropped (the request's reserved pages
cover it); max_tokens is known ahead and wastes nothing.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from minisgl import metrics
from minisgl.core import Req, SamplingParams
from minisgl.engine import BatchPreparer, Engine, ForwardOutput
from minisgl.scheduler.detokenizer import IncrementalDetokenizer

FinishReason = Literal["stop", "length"]


@dataclass(eq=False)
class Request:
    """A request from arrival to finish, as the scheduler tracks it."""

    uid: int
    prompt_ids: list[int]
    params: SamplingParams
    arrival_time: float
    detokenizer: IncrementalDetokenizer | None = None
    req: Req | None = None  # the engine-side request, once admitted
    reserved_pages: int = 0
    output_ids: list[int] = field(default_factory=list)
    text: str = ""  # text so far (complete once finished)
    emitted_len: int = 0  # characters of `text` already handed out by `updates`
    finish_reason: FinishReason | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prefilled(self) -> bool:
        return self.req is not None and self.req.cached_len >= len(self.prompt_ids)

    @property
    def num_launched(self) -> int:
        """Output tokens sampled or being sampled by a launched forward (0 before prefill completes)."""
        if not self.prefilled:
            return 0
        return self.req.cached_len - len(self.prompt_ids) + 1


@dataclass
class _Launched:
    """A forward that was launched and whose tokens have not been processed yet."""

    chosen: list[Request]
    produces: list[bool]  # False for a prefill chunk that leaves prompt tokens for later
    output: ForwardOutput
    phase: str
    mode: str
    num_tokens: int
    started: float


@dataclass
class Update:
    """What one step did for one request: new token ids, new text (when detokenizing), finished or not."""

    request: Request
    token_ids: list[int]
    text: str
    finished: bool


class Scheduler:
    def __init__(
        self,
        engine: Engine,
        *,
        max_prefill_tokens: int = 8192,
        eos_token_ids: Sequence[int] = (),
        tokenizer: Any = None,
        model_name: str = "",
        overlap: bool | None = None,
    ) -> None:
        if max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got max_prefill_tokens={max_prefill_tokens}")
        self.engine = engine
        self.prep = BatchPreparer(engine)
        self.max_prefill_tokens = max_prefill_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        self.tokenizer = tokenizer
        self.model_name = model_name
        # None: on (the overlap_scheduling setting). Under tensor parallelism the other ranks replay
        # batches from host tokens, so there is no overlap
        self.overlap = overlap is not False and engine.config.tp_info.size == 1
        self._launched: _Launched | None = None  # overlap: the forward whose tokens come next
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.reserved_pages = 0
        self._last_phase = ""
        self._uids = 0
        self._labels = {"model_name": model_name}
        self._ttft = metrics.TIME_TO_FIRST_TOKEN.labels(**self._labels)
        self._itl = metrics.INTER_TOKEN_LATENCY.labels(**self._labels)

    # -- requests -------------------------------------------------------------------------------

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams, stream: bool = False) -> Request:
        """Queues a request; raises a ValueError naming the problem if it could never run."""
        prompt = [int(t) for t in prompt_ids]
        self.prep.check_request(prompt, params)
        # max_seq_len never exceeds the pool, so a request that passed the check can always be reserved
        need = self.prep.pages_needed(len(prompt) + params.max_tokens)
        if (params.stop or stream) and self.tokenizer is None:
            raise ValueError("stop strings and streaming text need a tokenizer")
        detok = IncrementalDetokenizer(self.tokenizer) if (params.stop or stream) else None
        request = Request(self._uids, prompt, params, time.perf_counter(), detokenizer=detok)
        request.reserved_pages = need
        self._uids += 1
        self.waiting.append(request)
        metrics.REQUESTS_WAITING.labels(**self._labels).set(len(self.waiting))
        return request

    @property
    def last_phase(self) -> str:
        """'prefill' or 'decode': the kind of the forward launched last ('' before the first)."""
        return self._last_phase

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._launched)

    def _admit(self) -> None:
        while self.waiting and self.prep.slots.num_free > 0:
            request = self.waiting[0]
            if self.reserved_pages + request.reserved_pages > self.engine.num_pages:
                break  # first come, first served: later requests wait behind it
            self.waiting.popleft()
            request.req = self.prep.add_request(request.prompt_ids, request.params)
            self.reserved_pages += request.reserved_pages
            self.running.append(request)

    # -- one step -------------------------------------------------------------------------------

    def step(self) -> list[Update]:
        """Admits what fits, launches one forward (prefill chunk or decode) and returns the updates of
        the forward it reads: this one, or with overlap the one launched by the previous step."""
        self._admit()
        launched = self._launch()
        if self.overlap:
            launched, self._launched = self._launched, launched
        return [] if launched is None else self._collect(launched)

    def _launch(self) -> _Launched | None:
        chosen, chunks = self._schedule()
        if not chosen:
            return None
        started = time.perf_counter()
        reqs = [request.req for request in chosen]
        assert all(req is not None for req in reqs)
        phase = "decode" if chunks is None else "prefill"
        if chunks is None:
            batch = self.prep.decode(reqs, pending=self.overlap)
        else:
            batch = self.prep.prefill(reqs, chunks)
        produces = [not req.is_partial for req in reqs]
        args = self.prep.sampling_args(batch)
        args.suppress = self._suppressed(chosen)
        mode = "cuda_graph" if self.engine.graph_runner.can_use_cuda_graph(batch) else "eager"
        num_tokens = batch.num_tokens
        output = self.engine.forward_batch(batch, args)
        self._last_phase = phase
        return _Launched(chosen, produces, output, phase, mode, num_tokens, started)

    def _collect(self, launched: _Launched) -> list[Update]:
        launched.output.copy_done_event.synchronize()  # the one wait: the tokens' copy to the host
        now = time.perf_counter()
        tokens = launched.output.next_tokens_cpu.tolist()
        updates = [
            self._process(request, token, now)
            for request, token, produces in zip(launched.chosen, tokens, launched.produces)
            if produces and not request.finished  # finished: stopped one step earlier (overlap)
        ]
        self._record_step(
            launched.phase,
            launched.mode,
            len(launched.chosen),
            launched.num_tokens,
            len(updates),
            now - launched.started,
        )
        return updates

    def _schedule(self) -> tuple[list[Request], list[int] | None]:
        """(requests, prefill chunk sizes) for a prefill step or (requests, None) for a decode step."""
        prefilling = [r for r in self.running if not r.prefilled]
        # with overlap a request's last token may already be in flight: it needs no more steps
        decoding = [r for r in self.running if r.prefilled and r.num_launched < r.params.max_tokens]
        if prefilling and (not decoding or self._last_phase != "prefill"):
            budget, chosen, chunks = self.max_prefill_tokens, [], []
            for request in prefilling:
                if budget == 0:
                    break
                chunk = min(len(request.prompt_ids) - request.req.cached_len, budget)
                chosen.append(request)
                chunks.append(chunk)
                budget -= chunk
            return chosen, chunks
        return decoding, None

    def _suppressed(self, chosen: list[Request]) -> torch.Tensor | None:
        """EOS and stop tokens may not be drawn before a request has min_tokens tokens."""
        rows = []
        for request in chosen:
            params, banned = request.params, []
            # index among the outputs of the token this forward samples (the forward set device_len)
            if request.req.device_len - len(request.prompt_ids) < params.min_tokens:
                banned = list(params.stop_token_ids) + ([] if params.ignore_eos else list(self.eos_token_ids))
            rows.append(banned)
        width = max(map(len, rows))
        if width == 0:
            return None
        vocab = self.engine.config.model_config.vocab_size
        padded = [row + [vocab] * (width - len(row)) for row in rows]
        return torch.tensor(padded, dtype=torch.int64).to(self.engine.device, non_blocking=True)

    def _process(self, request: Request, token: int, now: float) -> Update:
        params, req = request.params, request.req
        req.input_ids.append(token)
        request.output_ids.append(token)
        if request.first_token_time is None:
            request.first_token_time = now
            self._ttft.observe(now - request.arrival_time)
        else:
            self._itl.observe(now - request.last_token_time)
        request.last_token_time = now

        num_out, reason, text_done = len(request.output_ids), None, False
        stop_token = num_out > params.min_tokens and (
            token in params.stop_token_ids or (token in self.eos_token_ids and not params.ignore_eos)
        )
        if stop_token:
            reason = "stop"  # the stop token stays in output_ids, out of the text
        elif request.detokenizer is not None:
            request.detokenizer.add(token)
            request.text = request.detokenizer.text
            if params.stop and num_out > params.min_tokens:
                cut = _find_stop(request.text, params.stop, request.emitted_len)
                if cut is not None:
                    request.text, reason, text_done = request.text[:cut], "stop", True
        if reason is None and num_out >= params.max_tokens:
            reason = "length"
        if reason is not None:
            self._finish(request, reason, now, text_done, stop_token)
        emit_upto = len(request.text)
        if not request.finished and params.stop:  # hold back what may be the start of a stop string
            emit_upto = max(request.emitted_len, emit_upto - max(map(len, params.stop)) + 1)
        delta = request.text[request.emitted_len : emit_upto]
        request.emitted_len = emit_upto
        return Update(request, [token], delta, request.finished)

    def _finish(
        self, request: Request, reason: FinishReason, now: float, text_done: bool, stop_token: bool
    ) -> None:
        request.finish_reason, request.finish_time = reason, now
        if text_done:
            pass
        elif request.detokenizer is not None:
            request.detokenizer.flush()
            request.text = request.detokenizer.text
        elif self.tokenizer is not None:
            kept = request.output_ids[:-1] if stop_token else request.output_ids
            request.text = self.tokenizer.decode(kept, skip_special_tokens=True)
        self.prep.release(request.req)
        self.reserved_pages -= request.reserved_pages
        self.running.remove(request)
        metrics.REQUESTS_FINISHED.labels(reason=reason, **self._labels).inc()
        metrics.E2E_LATENCY.labels(**self._labels).observe(now - request.arrival_time)

    def _record_step(
        self, phase: str, mode: str, batch_size: int, num_tokens: int, num_generated: int, seconds: float
    ) -> None:
        labels = {"phase": phase, **self._labels}
        metrics.BATCH_SIZE.labels(**labels).observe(batch_size)
        metrics.BATCH_TOKENS.labels(**labels).observe(num_tokens)
        metrics.STEP_SECONDS.labels(**labels).observe(seconds)
        metrics.FORWARD_STEPS.labels(mode=mode, **labels).inc()
        if phase == "prefill":
            metrics.PROMPT_TOKENS.labels(**self._labels).inc(num_tokens)
        metrics.GENERATION_TOKENS.labels(**self._labels).inc(num_generated)
        metrics.REQUESTS_RUNNING.labels(**self._labels).set(len(self.running))
        metrics.REQUESTS_WAITING.labels(**self._labels).set(len(self.waiting))
        metrics.KV_CACHE_USAGE.labels(**self._labels).set(self.prep.pages.num_used / self.engine.num_pages)

    def run_until_done(self) -> None:
        while self.has_work():
            self.step()


def _find_stop(text: str, stops: Sequence[str], searched_upto: int) -> int | None:
    """Index of the earliest stop string in `text` that ends after `searched_upto` (new text only)."""
    best = None
    for stop in stops:
        idx = text.find(stop, max(0, searched_upto - len(stop) + 1))
        if idx != -1 and (best is None or idx < best):
            best = idx
    return best
