"""The scheduler over one Engine: each `step()` admits what fits, chooses the step's requests, launches
one forward and processes the tokens of the forward it reads. The parts: `admission` (the queue,
fitting, preemption, the prefix look-up), `policy` (prefill/decode alternation, chunking), `pipeline`
(launch, read, collect, with overlap) and `verify` (speculative decoding's verify steps).
docs/scheduler.md describes the behaviour; the scheduler is driven by one thread at a time."""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from minisgl.core import FATAL_ERRORS, FatalEngineError, SamplingParams, as_token_ids
from minisgl.engine import Engine
from minisgl.lora import LoraAdapter
from minisgl.multimodal.inputs import ImageInputs, check_images
from minisgl.scheduler.admission import Admission
from minisgl.scheduler.batching import BatchPreparer
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.grammar import GrammarDeadEnd, Grammars
from minisgl.scheduler.lockstep import Follower, Leader, fatal_under_tp
from minisgl.scheduler.lora import Loaded, LoraManager
from minisgl.scheduler.output import OutputProcessor
from minisgl.scheduler.pipeline import Pipeline
from minisgl.scheduler.policy import StepPolicy
from minisgl.scheduler.radix import RadixCache
from minisgl.scheduler.request import FinishReason, RequestState, Update
from minisgl.scheduler.speculative import Speculator
from minisgl.scheduler.stats import SchedulerMetrics, StepRecord
from minisgl.scheduler.verify import Verifier

logger = logging.getLogger(__name__)


def _delegate(part: str, name: str, doc: str) -> property:
    """A read-only attribute of the scheduler that one of its parts holds."""
    return property(lambda self: getattr(getattr(self, part), name), doc=doc)


class Scheduler:
    def __init__(
        self,
        engine: Engine,
        config: SchedulerConfig | None = None,
        *,
        eos_token_ids: Sequence[int] = (),
        tokenizer: Any = None,
        grammar_tokenizer: Any = None,
        model_name: str | None = None,
        record_steps: int = 0,
        link: Leader | Follower | None = None,
        speculator: Speculator | None = None,
    ) -> None:
        """`config`: the scheduler's settings (checked there). `tokenizer` detokenizes (None: token ids
        only); `grammar_tokenizer` compiles structured output's grammars (default: `tokenizer`).
        `model_name` labels the metrics (default: the model folder's name). `record_steps`: keep a
        `StepRecord` of the last N forwards. `link`: this rank's side of the lockstep under tensor
        parallelism (`minisgl.scheduler.lockstep`). `speculator`: speculative decoding (None: off)."""
        self.config = config = SchedulerConfig() if config is None else config
        self.engine = engine
        vocab_size = engine.config.model_config.vocab_size
        cache = RadixCache(engine.config.page_size) if config.cache_type == "radix" else None
        self.prep = BatchPreparer(engine, cache)
        self.link = link
        self.follows = link is not None and not link.is_leader
        self.spec = speculator
        self.output = OutputProcessor(tokenizer, eos_token_ids)
        self.grammars = Grammars(
            tokenizer if grammar_tokenizer is None else grammar_tokenizer,
            vocab_size,
            eos_token_ids,
            tensor_parallel=link is not None,
        )
        self.metrics = SchedulerMetrics(model_name or Path(engine.config.model_path).name)
        # LoRA adapters (docs/lora.md): with an engine that has a pool of adapter slots
        pool = getattr(engine, "lora_pool", None)
        self.lora = None if pool is None else LoraManager(engine, config.lora_module_paths())
        self.metrics.lora_adapters(self.lora)
        # the parts
        self.admission = Admission(self.prep, self.metrics, speculator, link, self.lora)
        self.policy = StepPolicy(self.admission, config.prefill_tokens(engine.device.type), vocab_size)
        self.pipeline = Pipeline(self, config.overlap_scheduling)
        self.verifier = None if speculator is None else Verifier(self, speculator)

        self._by_uid: dict[int, RequestState] = {}  # a follower's unfinished requests
        self._seeds = random.Random()  # seeds of sampled requests that come without one
        self._uids = 0
        self.last_token_digest = 0  # under tensor parallelism, of the tokens read last (ranks compare it)
        self.step_records: deque[StepRecord] = deque()
        self.record_steps = record_steps
        # time.perf_counter() when the latest step's tokens reached the host (0: none yet); the
        # server stamps its messages with it (the clock is CLOCK_MONOTONIC, shared by the host's processes)
        self.tokens_time = 0.0

    # -- state, read by the front ends, metrics and tests ----------------------------------------

    waiting = _delegate("admission", "waiting", "Requests not admitted yet, first come first.")
    running = _delegate(
        "admission", "running", "Admitted requests, in the order of their (latest) admission."
    )
    preemptions = _delegate("admission", "preemptions", "Running requests preempted so far.")
    held_pages = _delegate(
        "admission",
        "held_pages",
        "The running requests' `held_pages` summed: pages in their page tables, a cached prefix counted "
        "once per request that uses it.",
    )
    prefix_lookup_tokens = _delegate(
        "admission", "prefix_lookup_tokens", "Prompt tokens as their prefill began."
    )
    prefix_cached_tokens = _delegate(
        "admission", "prefix_cached_tokens", "Of those, found in the prefix cache."
    )
    overlap = _delegate("pipeline", "overlap", "Whether step N+1 is launched before step N is read.")
    max_prefill_tokens = _delegate("policy", "max_prefill_tokens", "Prompt tokens per prefill step.")
    prefix_cache = _delegate(
        "prep", "cache", "The radix tree of cached prefixes (None with cache_type 'naive')."
    )
    prefix_evicted_pages = _delegate(
        "prep", "evicted_pages", "Pages evicted from the prefix cache to make room."
    )

    @property
    def record_steps(self) -> int:
        """How many `StepRecord`s `step_records` keeps (the latest); 0 records nothing. Settable."""
        return self.step_records.maxlen or 0

    @record_steps.setter
    def record_steps(self, n: int) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"record_steps must be an integer >= 0 (0: off), got record_steps={n!r}")
        self.step_records = deque(self.step_records, maxlen=n)

    def kv_cache_usage(self) -> float:
        """The pages requests hold (the prefix cache's unreferenced pages not counted), over the pool."""
        return self.prep.num_request_pages / self.engine.num_pages

    def has_work(self) -> bool:
        pending = self.verifier is not None and self.verifier.pending is not None
        return bool(self.waiting or self.running or self.pipeline.in_flight or pending)

    def clear_prefix_cache(self) -> int:
        """Evicts every cached prefix that no running request uses; returns the pages freed. Under
        tensor parallelism rank 0's clear reaches the other ranks with the next step."""
        if self.follows:
            raise RuntimeError("a following rank clears its prefix cache when rank 0 says so")
        if self.link is not None:
            self.link.cleared()
        return self.follow_clear()

    def follow_clear(self) -> int:
        """Clears the prefix cache (a following rank: when rank 0 said so)."""
        freed = self.prep.clear_cache()
        self.metrics.prefix_cache(self.prep)
        return freed

    # -- requests -------------------------------------------------------------------------------

    def check_request(self, prompt_ids: list[int], params: SamplingParams, stream: bool = False) -> None:
        """Raises a ValueError (a TypeError for a value of the wrong type) naming the problem if the
        request could never run; queues nothing. `prompt_ids`: a list of ints (`as_token_ids`)."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        model_config = self.engine.config.model_config
        if params.pooling is None and not model_config.has_lm_head:
            raise ValueError(
                f"the model has no LM head ({model_config.architecture}, a bare model's checkpoint): it "
                "serves embeddings only (POST /v1/embeddings, LLM.embed)"
            )
        self.prep.check_request(prompt_ids, params)
        self.output.check(params, stream, self.engine.config.model_config.vocab_size)
        self.grammars.check(params)

    def add_request(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        stream: bool = False,
        lora: str | None = None,
        images: ImageInputs | None = None,
    ) -> RequestState:
        """Queues a request, under LoRA adapter `lora` (its name; None: the base model); raises a
        ValueError or TypeError naming the problem if it could never run (see `check_request`; a
        KeyError for an adapter that is not loaded), queueing nothing. `images`: a vision-language
        prompt's (`minisgl.multimodal.inputs.ImageInputs`, built for this prompt)."""
        if self.follows:
            raise RuntimeError("a following rank takes its requests from rank 0 only")
        prompt = as_token_ids(prompt_ids)
        self.check_request(prompt, params, stream)
        check_images(self.engine.config.model_config, prompt, images)
        adapter = None if lora is None else self.lora_adapter(lora)
        if params.seed is None and not params.is_greedy:
            # drawn here, once: the tokens are a function of (seed, position), the same on every rank
            params = dataclasses.replace(params, seed=self._seeds.getrandbits(63))
        state = self._queue(prompt, params, self.output.detokenizer(params, stream))
        state.lora = adapter
        state.images = images
        if images is not None:
            self.metrics.images(images.num_images, len(images.token_positions))
        state.grammar = self.grammars.new_state(params)
        self.metrics.lora_request(lora)
        if self.link is not None:
            self.link.added(state)
        return state

    def _queue(self, prompt: list[int], params: SamplingParams, detokenizer: Any) -> RequestState:
        state = RequestState(self._uids, prompt, params, time.perf_counter(), detokenizer)
        self._uids += 1
        self.waiting.append(state)
        self.metrics.waiting(len(self.waiting))
        return state

    def lora_adapter(self, name: str) -> Loaded:
        """The loaded LoRA adapter `name`; a KeyError naming the loaded ones if there is none (a
        ValueError if this engine serves no adapters)."""
        if self.lora is None:
            raise ValueError(
                f"lora={name!r}: this engine serves no LoRA adapters; start it with lora_modules "
                "(--lora-modules NAME=PATH) or allow_runtime_lora"
            )
        try:
            return self.lora.get(name)
        except KeyError:
            loaded = ", ".join(sorted(self.lora.by_name)) or "none"
            raise KeyError(f"no LoRA adapter named {name!r} is loaded (loaded: {loaded})") from None

    def load_lora(self, name: str, path: str, adapter: LoraAdapter | None = None) -> None:
        """Loads the LoRA adapter at `path` (a PEFT folder or a hub id) under `name` (`adapter`: read
        from it already, by `engine.read_lora` on another thread); raises a LoraError (a ValueError)
        naming what is wrong. Under tensor parallelism the other ranks load their part of it with the
        next step."""
        self.check_new_lora(name)
        self.lora.load(name, path, adapter)
        if self.link is not None:
            self.link.lora_changed(name, path)

    def check_new_lora(self, name: str) -> None:
        """Raises unless `name` can name a new adapter here: a ValueError without adapter slots, a
        LoraError for an empty name or one already loaded (a RuntimeError on a following rank)."""
        if self.follows:
            raise RuntimeError("a following rank loads adapters when rank 0 says so")
        if self.lora is None:
            self.lora_adapter(name)  # raises: no adapter slots
        self.lora.check_name(name)

    def unload_lora(self, name: str) -> None:
        """Unloads adapter `name` (a KeyError if it is not loaded): requests running on it finish with
        it, new ones naming it are refused."""
        if self.follows:
            raise RuntimeError("a following rank unloads adapters when rank 0 says so")
        self.lora_adapter(name)
        self.lora.unload(name)
        self.metrics.lora_unloaded(name)
        if self.link is not None:
            self.link.lora_changed(name, None)

    def follow_lora(self, name: str, path: str | None) -> None:
        """A following rank: loads (from `path`) or unloads (None) adapter `name` as rank 0 did."""
        try:
            if path is None:
                self.lora.unload(name)
            else:
                self.lora.load(name, path)
        except Exception as e:  # rank 0 succeeded: this rank can no longer follow it
            action = "unload" if path is None else f"load (from {path})"
            raise FatalEngineError(
                f"a rank failed to {action} the LoRA adapter {name!r} that rank 0 did: {e}"
            ) from e

    def follow_add(
        self, uid: int, prompt: list[int], params: SamplingParams, lora: str | None = None
    ) -> None:
        """A following rank: queues the request rank 0 added (checked there) under the same uid, under
        adapter `lora` (its name, loaded on every rank by then)."""
        if uid != self._uids:
            raise FatalEngineError(f"rank 0 added request {uid} where this rank expected {self._uids}")
        state = self._queue(prompt, params, None)
        state.lora = None if lora is None else self.lora.get(lora)
        self._by_uid[uid] = state

    def follow_finish(self, uid: int, reason: FinishReason, error: str | None) -> None:
        """A following rank: finishes the request as rank 0 did (no-op if it already has, in the same
        failed step)."""
        state = self._by_uid.get(uid)
        if state is not None:
            state.error = error
            self.finish(state, reason, time.perf_counter())

    def abort(self, state: RequestState) -> None:
        """Finishes a request now with finish_reason 'abort', keeping its output so far: a waiting one
        leaves the queue, a running one frees its table_idx and KV pages at once (with overlap, its
        token in the forward in flight is dropped). Does nothing to a finished request."""
        if state.finished:
            return
        if state not in self.running and state not in self.waiting:
            raise ValueError(f"request {state.uid} is not one of this scheduler's requests")
        self.output.finish_text(state)
        self.finish(state, "abort", time.perf_counter())
        self.metrics.queues(len(self.running), len(self.waiting), self.kv_cache_usage())

    # -- one step -------------------------------------------------------------------------------

    def step(self) -> list[Update]:
        """Admits what fits, launches one forward (prefill chunk, decode or verify) and returns the
        updates of the forward it reads: this one, or with overlap the one launched before.

        A step that fails finishes its requests with finish_reason "error" (`state.error` says how),
        freeing what they hold, and returns their updates; a failure while processing one request's
        token fails that request alone. A failure after which no step can run (`FATAL_ERRORS`) is
        raised once the step's requests are finished (docs/failures.md)."""
        started = time.perf_counter()
        self.metrics.encoder(self.engine.take_encoder_seconds())  # image encodes completed since the last
        if self.link is not None:  # a following rank applies what rank 0 sent for this step
            self.link.begin(self)
        updates: list[Update] = []
        if self.verifier is not None and self.verifier.pending is not None:
            if self.verifier.step_pending(started, updates):
                return updates
        updates += self.admission.admit(self.fail)
        blocked = bool(self.waiting) and not self.running  # the queue's head did not fit an empty engine
        states, chunks = self.policy.schedule(self.pipeline.last_phase)
        if self.verifier is not None and chunks is None and states and self.spec.wanted(states):
            planned = self.verifier.speculate(started, updates)
            if planned is None:  # a verify step ran
                return updates
            states, chunks = planned
        updates += self.pipeline.run(states, chunks, started)
        # nothing ran, nothing runs: nobody may be stuck (a following rank waits for rank 0's verdict)
        if not states and self.pipeline.in_flight is None and not self.follows:
            updates += self._fail_unschedulable(blocked)
        return updates

    def _fail_unschedulable(self, blocked: bool) -> list[Update]:
        """Finishes what no step can ever serve (a scheduler bug, never a user's request): running
        requests that are neither prefilling nor decoding, or a queue head that did not fit an empty
        engine. Without it `has_work()` would stay true and a caller's loop would spin forever."""
        if self.running:
            return self.fail(list(self.running), "it could not be scheduled any more", "scheduling")
        if blocked and self.waiting:
            return self.fail([self.waiting[0]], "it does not fit the empty engine", "admitting it")
        return []

    # -- ending requests (asked for by the parts) -------------------------------------------------

    def finish(self, state: RequestState, reason: FinishReason, now: float) -> None:
        """Ends a request whose text is complete: frees what it holds."""
        state.finish_reason, state.finish_time = reason, now
        self.admission.release(state)
        self.metrics.finished(state, reason, now)
        if self.link is not None:
            self.link.finished(state)
            self._by_uid.pop(state.uid, None)

    def fail(self, states: Sequence[RequestState], error: Exception | str, stage: str) -> list[Update]:
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
            self.finish(state, "error", now)
            updates.append(Update(state, [], self.output.take_delta(state), True))
        self.metrics.queues(len(self.running), len(self.waiting), self.kv_cache_usage())
        return updates

    def fail_step(
        self, states: Sequence[RequestState], error: Exception, stage: str = "running a step"
    ) -> list[Update]:
        """`fail` for a step that failed; raises `error` when no later step can run either."""
        updates = self.fail(states, error, stage)
        if isinstance(error, FATAL_ERRORS):
            raise error
        return updates

    def under_tp(self, error: Exception) -> Exception:
        """Under tensor parallelism a failed forward is fatal (`lockstep.fatal_under_tp`); alone, as it is."""
        return error if self.link is None else fatal_under_tp(self.link, error)
