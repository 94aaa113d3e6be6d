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
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from minisgl.metrics import HotHistogram
from minisgl.models.default import DEFAULT_MODEL_ALIAS, prepared_default_model_path
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
        self.media = (
            settings.to_media_config()
        )  # image inputs (docs/vision.md): read by the tokenizer workers
        self.explicit, self.config = explicit, config
        self.model_path = settings.model_path
        # the tokenizers' load: (model folder, its future), started with the engine where the folder is known
        self._tokenizing: tuple[str, asyncio.Future] | None = None
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
        # the tokenizers load while the engine starts, where its model folder is known before it is up
        folder = self._known_model_folder()
        if folder is not None:
            self._tokenizing = (folder, asyncio.ensure_future(self._load_tokenizers(folder)))
        asyncio.create_task(self._when_ready())

    def _known_model_folder(self) -> str | None:
        """The folder the engine will load its model from, where that is known now: a local folder,
        or the default model's prepared already (None: a hub id, or the default model to prepare)."""
        model = self.model_path
        if model is None or model == DEFAULT_MODEL_ALIAS:
            folder = prepared_default_model_path()
            return None if folder is None else str(folder)
        return model if Path(model).is_dir() else None

    async def _load_tokenizers(self, path: str) -> tuple[Any, Any, TokenizerPool] | None:
        """The tokenizers of the model folder `path` (None: it has none): the encoder (with the
        setting chat_template's template, or a chat_template.json's), the decoder and the prompts'
        pool, started."""
        if not any((Path(path) / name).is_file() for name in TOKENIZER_FILES):
            return None
        load = load_tokenizer
        encoder, decoder = await asyncio.to_thread(lambda: (load(path), load(path)))
        if self.chat_template is not None:
            encoder.chat_template = self.chat_template
        workers = self.server.tokenizer_workers or default_workers()
        pool = TokenizerPool(path, workers, self.chat_template, self.media)
        try:
            await pool.warm()
        except BaseException:
            pool.shutdown()
            raise
        return encoder, decoder, pool

    async def _when_ready(self) -> None:
        client = self.client
        await client.ready.wait()
        info = client.info
        if self.served_model is None:
            self.served_model = info["model_name"]
        path = info["model_path"]
        if self._tokenizing is None or not os.path.samefile(self._tokenizing[0], path):
            self._close_tokenizing()  # loaded for a folder other than the engine's
            self._tokenizing = (path, asyncio.ensure_future(self._load_tokenizers(path)))
        loaded = await self._tokenizing[1]
        if loaded is not None:
            self.encoder, self.decoder, self.tokenizers = loaded
            self.tokenizers.limit(info["max_context"])
            if self.server.tool_call_parser and "tools" not in str(self.encoder.chat_template or ""):
                logger.warning(
                    "tool_call_parser is set but the chat template never reads `tools`: the model will "
                    "not see them (configs/templates/hermes-tools.jinja renders them; docs/tools.md)"
                )
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

    def _close_tokenizing(self) -> None:
        """Shuts the pool of the tokenizers being loaded down once they are (where they were not used)."""

        def done(future: asyncio.Future) -> None:
            loaded = None if future.cancelled() or future.exception() else future.result()
            if loaded is not None and loaded[2] is not self.tokenizers:
                loaded[2].shutdown()

        if self._tokenizing is not None:
            self._tokenizing[1].add_done_callback(done)

    async def close(self) -> None:
        """At the server's end: stops the scheduler process(es), the tokenizers, the request trace."""
        if self.client is not None:
            await self.client.close()
        if self.tokenizers is not None:
            self.tokenizers.shutdown()
        self._close_tokenizing()
        if self.trace is not None:
            self.trace.close()

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
