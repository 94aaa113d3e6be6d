"""What the front end's routes share: `ServerState`, made once per server. It holds the scheduler
client (one, or the replicas of `--dp N`), the tokenizers (a pool for prompts, one on the event loop for
detokenizing; the setting chat_template's template in place of the model's), structured output's
grammars, the request limits, the counts the guards and routes keep
(choices outstanding, request-body bytes being read, draining), the front end's own Prometheus series
and the request trace's file.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from minisgl.metrics import HotHistogram
from minisgl.scheduler.grammar import Grammars
from minisgl.server import protocol
from minisgl.server.jobs import Job, trace_record
from minisgl.server.logprobs import TokenTexts
from minisgl.server.replicas import Replicas, replica_settings
from minisgl.server.scheduler_client import SchedulerClient
from minisgl.server.tokenize import TokenizerPool, default_workers
from minisgl.templates import load_tokenizer

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# minisgl_token_delivery_seconds: fine below a millisecond, where a step-to-socket delay should be
DELIVERY_BUCKETS = (
    1e-4,
    2e-4,
    3e-4,
    5e-4,
    7.5e-4,
    1e-3,
    2e-3,
    5e-3,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
)


class ServerState:
    """What the endpoints share: the scheduler client, the tokenizers, the limits."""

    def __init__(self, settings: Any, explicit: dict[str, Any], config: str | None) -> None:
        self.server = settings.to_server_config()
        self.explicit, self.config = explicit, config
        self.tp_size, self.dp_size = settings.tp_size, settings.dp_size
        self.allow_runtime_lora = settings.allow_runtime_lora  # POST /v1/load_lora_adapter and unload
        self.replicas = replica_settings(settings, explicit)  # per replica: settings, GPUs
        self.client: SchedulerClient | Replicas | None = None
        self.served_model = self.server.served_model_name
        self.limits = protocol.Limits(self.server.max_stop_strings, self.server.max_stop_string_length)
        self.encoder: Any = None  # the model's tokenizer, for its chat template (None: the model has none)
        self.tokenizers: TokenizerPool | None = None  # where prompts are tokenized
        self.decoder: Any = None  # tokenizer used on the event loop (detokenizing)
        self.grammars: Grammars | None = None  # structured output's grammars, checked before queueing
        self.tp_size = settings.tp_size
        self._token_texts: TokenTexts | None = None
        self.outstanding = 0  # choices admitted by the front end and not finished
        self.body_bytes = 0  # bytes of request bodies being read now
        self.draining = False
        self.limit = 0
        self.on_failure: Any = None
        # the front end's own series, served after the scheduler's at /metrics
        self.registry = CollectorRegistry()
        self.delivery: HotHistogram | None = None  # made once the model's name is known
        self.clock_offset = time.time() - time.perf_counter()  # perf_counter -> Unix time (traces)
        self.trace: Any = None  # the request trace's file (request_trace)
        # the setting chat_template: the text of the template that replaces the model's
        template = self.server.chat_template
        self.chat_template = None if template is None else Path(template).read_text(encoding="utf-8")
        if self.server.request_trace:
            self.trace = open(self.server.request_trace, "a", buffering=1, encoding="utf-8")  # noqa: SIM115

    async def start(self) -> None:
        server = self.server
        if self.dp_size == 1 and not server.engine_restart:  # its death ends the server
            self.client = self.client_class(self.explicit, self.config)
        else:
            limits = {
                "crash_limit": server.engine_restart_limit,
                "crash_window_s": server.engine_restart_window_s,
            }
            restart = server.engine_restart
            self.client = Replicas(self.replicas, self.config, self.client_class, restart=restart, **limits)
        self.client.on_failure = self.on_failure
        asyncio.create_task(self._when_ready())

    async def _when_ready(self) -> None:
        client = self.client
        await client.ready.wait()
        info = client.info
        if self.served_model is None:
            self.served_model = info["model_name"]
        path = info["model_path"]
        if any((Path(path) / name).is_file() for name in TOKENIZER_FILES):
            load = load_tokenizer  # with a chat_template.json's template
            self.encoder, self.decoder = await asyncio.to_thread(lambda: (load(path), load(path)))
            if self.chat_template is not None:
                self.encoder.chat_template = self.chat_template
            if self.server.tool_call_parser and "tools" not in str(self.encoder.chat_template or ""):
                logger.warning(
                    "tool_call_parser is set but the chat template never reads `tools`: the model will "
                    "not see them (configs/templates/hermes-tools.jinja renders them; docs/tools.md)"
                )
            workers = self.server.tokenizer_workers or default_workers()
            self.tokenizers = TokenizerPool(path, workers, self.chat_template)
            await self.tokenizers.warm(info["max_context"])
        self.limit = info["max_running_req"] + self.server.max_waiting_requests
        # structured output's check before a request is sent on (compiles lazily: nothing until used)
        self.grammars = Grammars(
            self.encoder, info["vocab_size"], info["eos_token_ids"], tensor_parallel=self.tp_size > 1
        )
        self.limits = replace(self.limits, max_context=info["max_context"])
        self.delivery = HotHistogram(
            "minisgl_token_delivery_seconds",
            "From the end of the step that made a streamed request's tokens (on the host, in the scheduler "
            "process) to their bytes handed to the request's socket; one observation per write.",
            DELIVERY_BUCKETS,
            {"model_name": info["model_name"]},
        )
        self.registry.register(self.delivery)
        self.ready = True
        logger.info("serving %s at http://%s:%d/v1", self.served_model, self.server.host, self.server.port)

    def served(self) -> protocol.Served:
        """The names the `model` field may take now: the served model's, then its LoRA adapters'."""
        return protocol.Served(self.served_model, tuple(getattr(self.client, "adapters", ())))

    ready = False
    client_class = SchedulerClient  # what `start` makes (perf/cpu/test_front_end.py puts a fake here)

    @property
    def token_texts(self) -> TokenTexts:
        """Each token's text and bytes (log probabilities), made at the first use."""
        if self._token_texts is None:
            self._token_texts = TokenTexts(self.decoder)
        return self._token_texts

    def write_trace(self, job: Job, request_id: str, prompt_tokens: int) -> None:
        if self.trace is not None:
            record = trace_record(job, request_id, prompt_tokens, self.clock_offset)
            self.trace.write(json.dumps(record, separators=(",", ":")) + "\n")
