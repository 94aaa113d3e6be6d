"""Prometheus metrics of the forward loop and the scheduler.

Everything is recorded from host-side facts the loop already has (token counts, batch sizes, and wall
times taken when the step's token copy has completed, the one wait the Engine API defines), so recording
never synchronizes the device. `serve(port)` exposes them at http://127.0.0.1:PORT/metrics.
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

logger = logging.getLogger(__name__)

REGISTRY = CollectorRegistry()
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
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


def serve(port: int, addr: str = "127.0.0.1") -> None:
    """Serves /metrics on addr:port (loopback unless told otherwise) from a daemon thread."""
    start_http_server(port, addr=addr, registry=REGISTRY)
    logger.info("metrics at http://%s:%d/metrics", addr, port)
