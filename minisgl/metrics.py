"""Prometheus metrics of the forward loop and the scheduler.

Everything is recorded from host-side facts the loop already has (token counts, batch sizes, and wall
times taken when the step's token copy has completed, the one wait the Engine API defines), so recording
never synchronizes the device. `serve(port)` exposes them at http://127.0.0.1:PORT/metrics.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import HistogramMetricFamily

logger = logging.getLogger(__name__)

REGISTRY = CollectorRegistry()
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# vLLM's buckets of its per-request stage histograms (request_latency_buckets)
_REQUEST_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1,
    1.5,
    2,
    2.5,
    5,
    10,
    15,
    20,
    30,
    40,
    50,
    60,
    120,
    240,
    480,
    960,
    1920,
    7680,
)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)

PROMPT_TOKENS = Counter(
    "minisgl_prompt_tokens", "Prompt tokens prefilled.", ["model_name"], registry=REGISTRY
)
GENERATION_TOKENS = Counter(
    "minisgl_generation_tokens", "Tokens generated (sampled and kept).", ["model_name"], registry=REGISTRY
)
REQUESTS_FINISHED = Counter(
    "minisgl_requests_finished", "Requests finished, by reason.", ["model_name", "reason"], registry=REGISTRY
)
EMBEDDING_REQUESTS = Counter(
    "minisgl_embedding_requests",
    "Embedding inputs finished (each pooled prompt; not in minisgl_requests_finished), by reason.",
    ["model_name", "reason"],
    registry=REGISTRY,
)
EMBEDDING_TOKENS = Counter(
    "minisgl_embedding_tokens",
    "Prompt tokens of the embedding inputs served.",
    ["model_name"],
    registry=REGISTRY,
)
REQUESTS_RUNNING = Gauge(
    "minisgl_requests_running",
    "Requests admitted (holding a table_idx and KV pages).",
    ["model_name"],
    registry=REGISTRY,
)
REQUESTS_WAITING = Gauge(
    "minisgl_requests_waiting", "Requests waiting for admission.", ["model_name"], registry=REGISTRY
)
KV_CACHE_USAGE = Gauge(
    "minisgl_kv_cache_usage_ratio",
    "Share of KV cache pages held by requests (0 to 1); the prefix cache's unreferenced pages are not counted.",
    ["model_name"],
    registry=REGISTRY,
)
BATCH_SIZE = Histogram(
    "minisgl_batch_size",
    "Requests per forward step.",
    ["model_name", "phase"],
    buckets=_BATCH_BUCKETS,
    registry=REGISTRY,
)
BATCH_TOKENS = Histogram(
    "minisgl_batch_tokens",
    "Tokens computed per forward step.",
    ["model_name", "phase"],
    buckets=_BATCH_BUCKETS,
    registry=REGISTRY,
)
STEP_SECONDS = Histogram(
    "minisgl_forward_step_seconds",
    "Wall time of a forward step, until its tokens reached the host.",
    ["model_name", "phase"],
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
FORWARD_STEPS = Counter(
    "minisgl_forward_steps",
    "Forward steps, by phase and by mode (cuda_graph replay or eager).",
    ["model_name", "phase", "mode"],
    registry=REGISTRY,
)
PREEMPTIONS = Counter(
    "minisgl_preemptions",
    "Running requests preempted when the KV pool ran out (pages freed, recomputed on re-admission).",
    ["model_name"],
    registry=REGISTRY,
)
SPEC_DRAFT_TOKENS = Counter(
    "minisgl_spec_draft_tokens",
    "Draft tokens proposed by speculative decoding and verified by the target.",
    ["model_name"],
    registry=REGISTRY,
)
SPEC_ACCEPTED_TOKENS = Counter(
    "minisgl_spec_accepted_tokens",
    "Draft tokens the target accepted (acceptance rate: this / minisgl_spec_draft_tokens_total).",
    ["model_name"],
    registry=REGISTRY,
)
SPEC_ACCEPTED_PER_STEP = Histogram(
    "minisgl_spec_accepted_per_verify",
    "Draft tokens accepted per request and verify step (requests that proposed at least one); each such "
    "step also yields the target's own next token.",
    ["model_name"],
    buckets=(0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16),
    registry=REGISTRY,
)
PREFIX_CACHED_TOKENS = Counter(
    "minisgl_prefix_cache_hit_tokens",
    "Prompt tokens found in the prefix cache as their request's prefill began (not computed).",
    ["model_name"],
    registry=REGISTRY,
)
PREFIX_LOOKUP_TOKENS = Counter(
    "minisgl_prefix_cache_lookup_tokens",
    "Prompt tokens looked up in the prefix cache as their request's prefill began (hit rate: hits / this).",
    ["model_name"],
    registry=REGISTRY,
)
PREFIX_CACHE_PAGES = Gauge(
    "minisgl_prefix_cache_pages",
    "KV pages held by the prefix cache alone (no running request uses them; evicted when needed).",
    ["model_name"],
    registry=REGISTRY,
)
PREFIX_EVICTED_PAGES = Counter(
    "minisgl_prefix_cache_evicted_pages",
    "KV pages evicted from the prefix cache to make room (least recently used first).",
    ["model_name"],
    registry=REGISTRY,
)
LORA_REQUESTS = Counter(
    "minisgl_lora_requests",
    "Requests added, by LoRA adapter (lora_name '' = the base model); an adapter's series goes when it is unloaded.",
    ["model_name", "lora_name"],
    registry=REGISTRY,
)
LORA_ADAPTERS_LOADED = Gauge(
    "minisgl_lora_adapters_loaded",
    "LoRA adapters loaded (their weights in host memory).",
    ["model_name"],
    registry=REGISTRY,
)
LORA_ADAPTERS_RESIDENT = Gauge(
    "minisgl_lora_adapters_resident",
    "LoRA adapters in the device's adapter slots (at most max_loras).",
    ["model_name"],
    registry=REGISTRY,
)
IMAGES = Counter(
    "minisgl_images",
    "Images of the requests added (vision-language models; docs/vision.md).",
    ["model_name"],
    registry=REGISTRY,
)
IMAGE_TOKENS = Counter(
    "minisgl_image_tokens",
    "Prompt tokens of the requests added that stand for images (their placeholder tokens).",
    ["model_name"],
    registry=REGISTRY,
)
VISION_ENCODER_SECONDS = Histogram(
    "minisgl_vision_encoder_seconds",
    "Time of the vision encoder over one request's images (device time on CUDA).",
    ["model_name"],
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
TIME_TO_FIRST_TOKEN = Histogram(
    "minisgl_time_to_first_token_seconds",
    "From arrival to the first generated token.",
    ["model_name"],
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
INTER_TOKEN_LATENCY = Histogram(
    "minisgl_inter_token_latency_seconds",
    "Between two consecutive tokens of a request.",
    ["model_name"],
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
E2E_LATENCY = Histogram(
    "minisgl_e2e_request_latency_seconds",
    "From arrival to the last token of a request.",
    ["model_name"],
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)

# the stages of a request in the scheduler, named and bucketed as vLLM's: observed once per request that
# got its first token, when it finishes (queue + inference = E2E; prefill + decode = inference)
REQUEST_QUEUE_TIME = Histogram(
    "minisgl_request_queue_time_seconds",
    "From arrival in the scheduler to admission (waiting for a slot and KV pages).",
    ["model_name"],
    buckets=_REQUEST_BUCKETS,
    registry=REGISTRY,
)
REQUEST_PREFILL_TIME = Histogram(
    "minisgl_request_prefill_time_seconds",
    "From admission to the first generated token.",
    ["model_name"],
    buckets=_REQUEST_BUCKETS,
    registry=REGISTRY,
)
REQUEST_DECODE_TIME = Histogram(
    "minisgl_request_decode_time_seconds",
    "From the first generated token to the finish.",
    ["model_name"],
    buckets=_REQUEST_BUCKETS,
    registry=REGISTRY,
)
REQUEST_INFERENCE_TIME = Histogram(
    "minisgl_request_inference_time_seconds",
    "From admission to the finish (prefill + decode).",
    ["model_name"],
    buckets=_REQUEST_BUCKETS,
    registry=REGISTRY,
)


class HotHistogram:
    """A histogram for a hot path of one thread: `observe` is a bisect and an increment (no lock, no
    label lookup), about a fifth of prometheus_client's Histogram.observe. Register it in a registry
    (`registry.register(h)`): it is exported as an ordinary Prometheus histogram."""

    def __init__(
        self, name: str, documentation: str, buckets: Sequence[float], labels: dict[str, str]
    ) -> None:
        self.name, self.documentation, self.labels = name, documentation, labels
        self.bounds = sorted(buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # the last: above every bound
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def describe(self) -> list[HistogramMetricFamily]:
        return [HistogramMetricFamily(self.name, self.documentation, labels=list(self.labels))]

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=list(self.labels))
        cumulative, buckets = 0, []
        for bound, count in zip([*map(str, self.bounds), "+Inf"], self.counts):
            cumulative += count
            buckets.append((bound, cumulative))
        family.add_metric(list(self.labels.values()), buckets, self.sum)
        yield family


def serve(port: int, addr: str = "127.0.0.1") -> None:
    """Serves /metrics on addr:port (loopback unless told otherwise) from a daemon thread."""
    start_http_server(port, addr=addr, registry=REGISTRY)
    logger.info("metrics at http://%s:%d/metrics", addr, port)
