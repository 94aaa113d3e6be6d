"""What each forward step cost: the Prometheus metrics (always) and `StepRecord`s (when asked for).

Both are recorded from host-side facts the loop already has, once the step's token copy has completed,
so recording never synchronizes the device. A record's `device_ms` comes from a pair of CUDA timing
events around the forward, read after the copy event completed: the end event directly follows the
copy on the stream, so reading it waits for no work.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from minisgl import metrics
from minisgl.core import Phase
from minisgl.engine import ForwardMode
from minisgl.scheduler.request import FinishReason, RequestState


@dataclass(frozen=True)
class StepRecord:
    """One forward as the scheduler ran it. Host times in seconds: `launch_s` admitting, scheduling,
    preparing the batch and launching the forward; `wait_s` blocked on the copy of its tokens to the
    host; `process_s` handling them (stop checks, detokenizing, metrics). With overlap scheduling the
    wait and the processing happen in the step after the launch. `device_ms`: GPU time from the
    forward's start to its tokens' copy (CUDA only, else None)."""

    phase: Phase
    mode: ForwardMode
    batch_size: int
    num_tokens: int  # tokens computed
    num_generated: int  # output tokens kept (not the partial prefill chunks, not finished requests)
    launch_s: float
    wait_s: float
    process_s: float
    device_ms: float | None


class DeviceTimer:
    """CUDA timing events around one forward (created only when steps are recorded on CUDA)."""

    def __init__(self) -> None:
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)
        self.start.record()

    def stop(self) -> None:
        self.end.record()

    def elapsed_ms(self) -> float:
        """Call only after the forward's copy event completed (see the module docstring)."""
        self.end.synchronize()
        return self.start.elapsed_time(self.end)


class SchedulerMetrics:
    """The scheduler's Prometheus metrics (minisgl.metrics), labelled with its model name."""

    def __init__(self, model_name: str) -> None:
        self.labels = {"model_name": model_name}
        self._ttft = metrics.TIME_TO_FIRST_TOKEN.labels(**self.labels)
        self._itl = metrics.INTER_TOKEN_LATENCY.labels(**self.labels)
        self._queue = metrics.REQUEST_QUEUE_TIME.labels(**self.labels)
        self._prefill = metrics.REQUEST_PREFILL_TIME.labels(**self.labels)
        self._decode = metrics.REQUEST_DECODE_TIME.labels(**self.labels)
        self._inference = metrics.REQUEST_INFERENCE_TIME.labels(**self.labels)
        self._preemptions = metrics.PREEMPTIONS.labels(**self.labels)  # a sample (0) from the start
        self._hit_tokens = metrics.PREFIX_CACHED_TOKENS.labels(**self.labels)
        self._lookup_tokens = metrics.PREFIX_LOOKUP_TOKENS.labels(**self.labels)
        self._cache_pages = metrics.PREFIX_CACHE_PAGES.labels(**self.labels)
        self._evicted = metrics.PREFIX_EVICTED_PAGES.labels(**self.labels)
        self._evicted_seen = 0
        self._embedding_tokens = metrics.EMBEDDING_TOKENS.labels(**self.labels)
        metrics.EMBEDDING_REQUESTS.labels(reason="stop", **self.labels)
        # speculative decoding's series (minisgl.scheduler.speculative counts into them): a sample (0)
        # from the start, with or without speculation
        for series in (
            metrics.SPEC_DRAFT_TOKENS,
            metrics.SPEC_ACCEPTED_TOKENS,
            metrics.SPEC_ACCEPTED_PER_STEP,
            metrics.IMAGES,  # and the image inputs' (docs/vision.md), for text models too
            metrics.IMAGE_TOKENS,
            metrics.VISION_ENCODER_SECONDS,
        ):
            series.labels(**self.labels)

    def images(self, count: int, tokens: int) -> None:
        """A request with `count` images, `tokens` placeholder tokens of its prompt, was added."""
        metrics.IMAGES.labels(**self.labels).inc(count)
        metrics.IMAGE_TOKENS.labels(**self.labels).inc(tokens)

    def encoder(self, seconds: list[float]) -> None:
        """The vision encoder's runs that completed (`Engine.take_encoder_seconds`)."""
        for value in seconds:
            metrics.VISION_ENCODER_SECONDS.labels(**self.labels).observe(value)

    def token(self, state: RequestState, now: float) -> None:
        """A request got a token at `now`: its first (time to first token) or a later one."""
        if state.first_token_time is None:
            state.first_token_time = now
            self._ttft.observe(now - state.arrival_time)
        else:
            self._itl.observe(now - state.last_token_time)
        state.last_token_time = now

    def finished(self, state: RequestState, reason: FinishReason, now: float) -> None:
        if state.params.pooling is not None:  # an embedding input: counted apart from generation
            metrics.EMBEDDING_REQUESTS.labels(
                reason="error" if reason == "error" else "stop", **self.labels
            ).inc()
            if state.embedding is not None:
                self._embedding_tokens.inc(len(state.prompt_ids))
            return
        metrics.REQUESTS_FINISHED.labels(reason=reason, **self.labels).inc()
        metrics.E2E_LATENCY.labels(**self.labels).observe(now - state.arrival_time)
        admitted, first = state.admit_time, state.first_token_time
        if admitted is not None and first is not None:  # served: the stages, as vLLM splits them
            self._queue.observe(admitted - state.arrival_time)
            self._prefill.observe(first - admitted)
            self._decode.observe(now - first)
            self._inference.observe(now - admitted)

    def step(
        self,
        phase: Phase,
        mode: ForwardMode,
        batch_size: int,
        num_tokens: int,
        num_generated: int,
        seconds: float,
    ) -> None:
        labels = {"phase": phase, **self.labels}
        metrics.BATCH_SIZE.labels(**labels).observe(batch_size)
        metrics.BATCH_TOKENS.labels(**labels).observe(num_tokens)
        metrics.STEP_SECONDS.labels(**labels).observe(seconds)
        # the label keeps two values: a compiled forward without a graph counts as eager
        metrics.FORWARD_STEPS.labels(mode="cuda_graph" if mode == "cuda_graph" else "eager", **labels).inc()
        if phase == "prefill":
            metrics.PROMPT_TOKENS.labels(**self.labels).inc(num_tokens)
        metrics.GENERATION_TOKENS.labels(**self.labels).inc(num_generated)

    def preempted(self) -> None:
        """A running request was preempted (its pages freed, requeued to be recomputed)."""
        self._preemptions.inc()

    def prefix_lookup(self, looked_up: int, found: int) -> None:
        """A request's prefill began: `looked_up` prompt tokens, `found` of them in the prefix cache."""
        self._lookup_tokens.inc(looked_up)
        self._hit_tokens.inc(found)

    def prefix_cache(self, prep: Any) -> None:
        """The prefix cache's pages that no request uses, and the evictions since the last call
        (`prep`: the scheduler's BatchPreparer)."""
        self._cache_pages.set(0 if prep.cache is None else prep.cache.num_evictable_pages)
        if prep.evicted_pages > self._evicted_seen:
            self._evicted.inc(prep.evicted_pages - self._evicted_seen)
            self._evicted_seen = prep.evicted_pages

    def queues(self, running: int, waiting: int, kv_cache_usage: float) -> None:
        metrics.REQUESTS_RUNNING.labels(**self.labels).set(running)
        metrics.REQUESTS_WAITING.labels(**self.labels).set(waiting)
        metrics.KV_CACHE_USAGE.labels(**self.labels).set(kv_cache_usage)

    def waiting(self, waiting: int) -> None:
        metrics.REQUESTS_WAITING.labels(**self.labels).set(waiting)

    def lora_adapters(self, manager: Any) -> None:
        """The gauges of adapters loaded and resident read `manager` (the scheduler's LoraManager, or
        None: 0) when scraped; the base model's requests get their series (lora_name '')."""
        loaded = metrics.LORA_ADAPTERS_LOADED.labels(**self.labels)
        resident = metrics.LORA_ADAPTERS_RESIDENT.labels(**self.labels)
        loaded.set_function(lambda: 0 if manager is None else len(manager.by_name))
        resident.set_function(lambda: 0 if manager is None else manager.resident)
        metrics.LORA_REQUESTS.labels(lora_name="", **self.labels)

    def lora_request(self, name: str | None) -> None:
        """A request was added under adapter `name` (None: the base model)."""
        metrics.LORA_REQUESTS.labels(lora_name=name or "", **self.labels).inc()

    def lora_unloaded(self, name: str) -> None:
        """Adapter `name` was unloaded: its requests' series goes (the label values stay bounded)."""
        with contextlib.suppress(KeyError):
            metrics.LORA_REQUESTS.remove(self.labels["model_name"], name)
