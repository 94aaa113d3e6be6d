"""The offline `LLM` API: prompts in, text out, over one Engine and the scheduler.

`LLM().generate(prompts, SamplingParams(...))`, `stream`, `chat`: docs/usage.md#the-llm-api.
"""

from __future__ import annotations

import contextlib
import json
import logging
import numbers
import shutil
import signal
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from minisgl import embeddings
from minisgl.core import SamplingParams, TokenLogprob, as_token_ids
from minisgl.embeddings import resolve_pooling
from minisgl.engine import Engine, check_tensor_parallel
from minisgl.launch import TPGroup, launched_rank, start_workers
from minisgl.models import DEFAULT_MODEL_ALIAS
from minisgl.multimodal.chat import VisionPrompter
from minisgl.multimodal.inputs import ImageInputs, ImagePrompt, check_images
from minisgl.scheduler import RequestState, Scheduler
from minisgl.scheduler.speculative import Speculator, max_verify_batch
from minisgl.settings import EngineSettings
from minisgl.templates import eos_token_id_from_files, load_tokenizer, render_chat

logger = logging.getLogger(__name__)

# a text, token ids, or a vision-language model's token ids with their images (`LLM.chat_inputs`)
Prompt = str | Sequence[int] | ImagePrompt
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass
class RequestOutput:
    """One finished request. Times are in seconds from the request's arrival."""

    index: int  # position in the input list
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    # "stop" (EOS, stop token, stop string), "length" (max_tokens), "abort" (the call was interrupted
    # or the LLM shut down) or "error" (a step failed for this request: `error` says how)
    finish_reason: str
    time_to_first_token: float | None  # None when no token came
    total_time: float
    error: str | None = None
    # with SamplingParams.logprobs: one TokenLogprob per token of token_ids (its log probability and
    # the most likely alternatives); with prompt_logprobs: one per prompt token, None for the first
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @classmethod
    def from_state(cls, index: int, prompt: str | None, state: RequestState) -> RequestOutput:
        assert state.finish_reason is not None and state.finish_time is not None
        first = state.first_token_time
        return cls(
            index=index,
            prompt=prompt,
            prompt_token_ids=state.prompt_ids,
            text=state.text,
            token_ids=list(state.output_ids),
            finish_reason=state.finish_reason,
            time_to_first_token=None if first is None else first - state.arrival_time,
            total_time=state.finish_time - state.arrival_time,
            error=state.error,
            logprobs=None if state.logprobs is None else list(state.logprobs),
            prompt_logprobs=None if state.prompt_logprobs is None else list(state.prompt_logprobs),
        )


class RequestError(RuntimeError):
    """A streamed request failed inside the engine (finish_reason "error"); the engine goes on."""


def resolve_model(model: str | None) -> str | None:
    """A local folder stays; None or the default alias stays for the settings layer; a hub id is
    downloaded (config, tokenizer and safetensors only) when the hub can be reached."""
    if model is None or model == DEFAULT_MODEL_ALIAS or Path(model).is_dir():
        return model
    if model.count("/") != 1 or model.startswith((".", "/", "~")):
        raise FileNotFoundError(
            f"model {model!r} is neither a local folder nor a hub id like 'Qwen/Qwen3-0.6B'; "
            f"pass a folder with config.json and *.safetensors, or {DEFAULT_MODEL_ALIAS!r}"
        )
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(
            model, allow_patterns=["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.txt", "*.model"]
        )
    except Exception as e:  # offline, unknown repository, gated model...
        raise FileNotFoundError(
            f"could not download {model!r} from the Hugging Face hub ({type(e).__name__}: {e}). "
            "Offline, download it elsewhere and pass its local folder."
        ) from e


class LLM:
    """An engine, a tokenizer and a scheduler in one process (rank 0 of a single-rank group)."""

    def __init__(
        self,
        model: str | None = None,
        *,
        config: str | Path | None = None,
        detokenize: bool = True,
        **settings: Any,
    ) -> None:
        """`model`: a local folder, 'smollm2-135m' (also what None means), or a hub id. `config`: a
        YAML settings file; other keyword arguments are settings of the engine and the scheduler (see
        `minisgl.settings`, docs/settings.md). `tp=N` (or `tp_size`) runs N tensor-parallel ranks: this
        process is rank 0 and leads, N-1 spawned processes run their schedulers in lockstep.
        `detokenize=False`: the scheduler makes no text (the server's scheduler process: its front end
        detokenizes and applies stop strings); requests then take token ids and give token ids."""
        if "tp" in settings:
            settings["tp_size"] = settings.pop("tp")
        if model is not None:
            settings["model_path"] = resolve_model(model)
        launched = launched_rank()
        if launched is not None and launched[1] > 1:  # started by torchrun & co: the other ranks exist
            if launched[0] != 0:
                raise RuntimeError(
                    f"LLM runs on rank 0 only; rank {launched[0]} runs minisgl.launch.worker_main"
                )
            settings = {"tp_size": launched[1], "distributed_addr": "env://", **settings}
        self.settings = EngineSettings.load(config, **settings)
        if self.settings.dp_size != 1:
            raise ValueError(
                f"dp_size={self.settings.dp_size} (from {self.settings.sources()['dp_size']}): data-parallel "
                "replicas are `minisgl-run serve --dp N`'s; an LLM is one replica (make one LLM per device, "
                "or leave dp_size at 1)"
            )
        self._rendezvous_dir: str | None = None
        if launched is None and self.settings.tp_size > 1 and self.settings.distributed_addr == "auto":
            # the ranks meet at a new file in a private folder: no port to collide, nothing listening
            self._rendezvous_dir = tempfile.mkdtemp(prefix="minisgl-tp-")
            settings["distributed_addr"] = f"file://{self._rendezvous_dir}/rendezvous"
            self.settings = EngineSettings.load(config, **settings)
        scheduler_config = self.settings.to_scheduler_config()  # checked before any engine starts
        self.group: TPGroup | None = None  # rank 0's side of a tensor-parallel group
        try:
            self.engine = self._start_engine(settings, config, launched)
        except BaseException:
            if self._rendezvous_dir is not None:
                shutil.rmtree(self._rendezvous_dir, ignore_errors=True)
            raise
        model_path = self.engine.config.model_path
        self.model_name = Path(model_path).name
        has_tokenizer = any((Path(model_path) / name).is_file() for name in TOKENIZER_FILES)
        # dummy-weight folders hold only config.json: token-id prompts still work, texts are empty
        self._tokenizer: Any = None
        self._tokenizer_path = model_path if has_tokenizer else None
        self._tokenizer_lock = threading.Lock()
        # detokenize=False (the server's scheduler process) needs the tokenizer for structured output's
        # grammars only: it loads at the first use (transformers' imports take seconds of a start)
        # unless the EOS id can only be had from it
        eos_id = eos_token_id_from_files(model_path) if has_tokenizer and not detokenize else None
        tokenizer = self.tokenizer if has_tokenizer and eos_id is None else None
        if tokenizer is not None:
            eos_id = tokenizer.eos_token_id
        self.scheduler = Scheduler(
            self.engine,
            scheduler_config,
            eos_token_ids=_eos_token_ids(model_path, self.engine, eos_id),
            tokenizer=tokenizer if detokenize else None,
            grammar_tokenizer=tokenizer,
            model_name=self.model_name,
            link=None if self.group is None else self.group.link,
            speculator=self._speculator(scheduler_config),
        )
        if tokenizer is None and has_tokenizer:
            self.scheduler.grammars.load_tokenizer = lambda: self.tokenizer
        if self.group is not None:
            self.group.start(self.scheduler)
        # embeddings (docs/embeddings.md): the pooling and normalization served; pooling files minisgl
        # cannot follow leave generation served and embeddings refused with the reason
        self.pooling_error: str | None = None
        try:
            self.pooling, self.normalize_embeddings = resolve_pooling(
                model_path, scheduler_config.pooling, scheduler_config.normalize_embeddings
            )
        except ValueError as e:
            self.pooling, self.normalize_embeddings, self.pooling_error = None, True, str(e)
            logger.warning("embeddings are off: %s", e)
        # one thread steps the scheduler at a time; a step serves the requests of every caller
        self._lock = threading.Lock()
        # streams dropped unfinished (their __del__ may run in any thread, even inside a step): aborted
        # by the next step
        self._abandoned: deque[RequestState] = deque()
        self._closed = False
        self._closing = False  # a shutdown waits for the lock: stepping threads let it have it
        self._prompter: VisionPrompter | None = None  # messages with images (`vision_prompter`)

    @property
    def tokenizer(self) -> Any:
        """The model's Hugging Face tokenizer (None: the model folder has none); with detokenize=False
        loaded at the first use."""
        if self._tokenizer is None and self._tokenizer_path is not None:
            with self._tokenizer_lock:
                if self._tokenizer is None:
                    self._tokenizer = load_tokenizer(self._tokenizer_path)
        return self._tokenizer

    def _draft_footprint(self, engine_config: Any) -> Any:
        """With speculative_method 'draft': the draft model's weights and KV bytes per page, which the
        target's KV pool makes room for (its pages shared by page id); else None."""
        config = self.settings.to_scheduler_config()
        if config.speculative_method != "draft":
            return None
        from minisgl.scheduler.draft import draft_footprint

        self._footprint = draft_footprint(engine_config, resolve_model(config.speculative_draft_model))
        return self._footprint

    def _speculator(self, config: Any) -> Speculator | None:
        """Speculative decoding's proposer and policy as the settings ask (None: off)."""
        method = config.speculative_method
        if method == "none":
            return None
        draft = None
        if method == "draft":
            from minisgl.scheduler.draft import DraftProposer

            draft = DraftProposer(
                self.engine,
                resolve_model(config.speculative_draft_model),
                config.speculative_num_tokens,
                footprint=self._footprint,
            )
        logger.info(
            "speculative decoding: %s, %d draft tokens per step%s",
            method,
            config.speculative_num_tokens,
            f" (n-grams up to {config.speculative_ngram_max})" if method == "ngram" else "",
        )
        # a verify step of up to the policy's batch replays a CUDA graph (none on the CPU)
        max_batch = max_verify_batch(self.engine.device.type, config.speculative_num_tokens)
        self.engine.graph_runner.capture_verify(config.speculative_num_tokens + 1, max_batch)
        return Speculator(
            config, device_type=self.engine.device.type, draft=draft, model_name=self.model_name
        )

    def _start_engine(
        self, settings: dict[str, Any], config: str | Path | None, launched: tuple[int, int] | None
    ) -> Engine:
        """This process's engine: alone, or rank 0 of a tensor-parallel group (`self.group`) whose
        other ranks a launcher started (`launched`) or that are spawned here."""
        workers = []
        if launched is None or launched[1] == 1:
            if self.settings.tp_size == 1:
                config = self.settings.to_engine_config()
                return Engine(config, companion=self._draft_footprint(config))
            # rank 0 here, ranks 1..N-1 in processes of their own, once the model is known to split
            check_tensor_parallel(self.settings.to_engine_config(rank=0))
            settings["model_path"] = self.settings.resolved_model_path()  # prepared once, here
            workers = start_workers(self.settings.tp_size, settings, None if config is None else str(config))
        engine = None
        try:
            engine = Engine(self.settings.to_engine_config(rank=0))
            self.group = TPGroup(engine, workers)
            return engine
        except BaseException:
            for proc in workers:
                proc.kill()
            if engine is not None:
                engine.shutdown()
            raise

    def _encode(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, ImagePrompt):
            return None, prompt.token_ids
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    f"the model folder {self.engine.config.model_path!r} has no tokenizer: give token ids"
                )
            return prompt, self.tokenizer(prompt)["input_ids"]
        return None, as_token_ids(prompt)

    def _prepare(
        self, prompts: Any, sampling_params: Any
    ) -> tuple[list[tuple[str | None, list[int]]], list[SamplingParams], list[ImageInputs | None]]:
        """Encoded prompts, one SamplingParams each and their images (None: text); TypeError or
        ValueError for anything else."""
        if isinstance(prompts, str | ImagePrompt) or (
            isinstance(prompts, list | tuple) and prompts and isinstance(prompts[0], numbers.Integral)
        ):
            prompts = [prompts]  # one prompt: a text or a list of token ids
        if not isinstance(prompts, list | tuple):
            raise TypeError(
                "prompts must be a str, a list of token ids, or a list of those; got "
                f"{type(prompts).__name__}" + ("; pass tensor.tolist()" if hasattr(prompts, "tolist") else "")
            )
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if not isinstance(sampling_params, list | tuple):
            raise TypeError(
                "sampling_params must be a SamplingParams or a list of them (one per prompt), got "
                f"{type(sampling_params).__name__}"
                + ("; use SamplingParams(**params)" if isinstance(sampling_params, dict) else "")
            )
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(sampling_params)} sampling params")
        images = [p.images if isinstance(p, ImagePrompt) else None for p in prompts]
        return [self._encode(p) for p in prompts], list(sampling_params), images

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this LLM was shut down; create a new LLM")

    def _step(self) -> None:
        """One scheduler step (the caller holds `_lock`), after aborting the streams dropped unfinished."""
        self._check_open()
        while self._abandoned:
            self.scheduler.abort(self._abandoned.popleft())
        self.scheduler.step()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        progress: bool = False,
        lora: str | Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Runs every prompt (text, or a list of token ids) to completion; outputs in input order.
        `lora`: the LoRA adapter of every prompt (its name), or one per prompt (None: the base model).
        A vision-language model's prompt with images is an `ImagePrompt` (`chat_inputs`).

        All requests are checked before any is queued, so a bad one raises (ValueError, TypeError)
        without side effects. A request that fails inside the engine gets finish_reason "error" and
        the message in `error`; the others go on. If the call is interrupted (Ctrl-C, which takes effect
        between two steps, or any exception) its unfinished requests are aborted and free their pages
        before the exception leaves. Safe to call from several threads: their requests share the batch."""
        with self._lock:
            self._check_open()
            encoded, params, images = self._prepare(prompts, sampling_params)
            loras = self._loras(lora, len(encoded))
            for (_, ids), p, image in zip(encoded, params, images):
                self.scheduler.check_request(ids, p)
                check_images(self.engine.config.model_config, ids, image)
            states = [
                self.scheduler.add_request(ids, p, lora=name, images=image)
                for (_, ids), p, name, image in zip(encoded, params, loras, images)
            ]
        try:
            self._run_until_finished(states, progress)
        finally:
            self._abort_unfinished(states)
        return [
            RequestOutput.from_state(i, text, state)
            for i, ((text, _), state) in enumerate(zip(encoded, states))
        ]

    def _run_until_finished(self, states: list[RequestState], progress: bool) -> None:
        """Steps the scheduler (a step serves every request, whichever thread runs it) until `states`
        have finished."""
        pending, total = deque(states), len(states)
        with (
            tqdm(total=total, desc="generating", unit="req", disable=not progress) as bar,
            _interrupts_between_steps() as interrupted,
        ):
            while pending:
                with self._lock:
                    while pending and pending[0].finished:
                        pending.popleft()
                    if pending and not self._closing:
                        self._step()
                if self._closing:  # the lock is not fair: without a pause this loop could keep it
                    time.sleep(0.001)
                if interrupted():
                    raise KeyboardInterrupt
                if progress:  # finished ones behind an unfinished head count once it finishes
                    bar.update(total - len(pending) - bar.n)
        with self._lock:  # nothing else to do: collect the forward still in flight (overlap), if any
            if not (self.scheduler.waiting or self.scheduler.running or self._closed):
                while self.scheduler.has_work():
                    self._step()

    def _abort_unfinished(self, states: Sequence[RequestState]) -> None:
        unfinished = [state for state in states if not state.finished]
        if unfinished:
            with self._lock:
                for state in unfinished:
                    self.scheduler.abort(state)

    def stream(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        lora: str | None = None,
    ) -> Stream:
        """Text deltas of one request as its tokens are produced (a `Stream`). The request is checked
        and queued at the call, so a bad one raises here, before any iteration. Closing the stream
        (`close()`, the end of a `with` block, or dropping it) aborts the request if it is unfinished."""
        with self._lock:
            self._check_open()
            [(_, ids)], [params], [images] = self._prepare([prompt], sampling_params)
            [lora] = self._loras(lora, 1)
            state = self.scheduler.add_request(ids, params, stream=True, lora=lora, images=images)
        return Stream(self, state)

    def chat_prompt(
        self, messages: list[dict[str, str]], chat_template_kwargs: dict[str, Any] | None = None
    ) -> list[int]:
        """Token ids of a conversation under the tokenizer's chat template, ready for the reply;
        `chat_template_kwargs`: the template's own variables (Qwen3's `enable_thinking`, ...)."""
        if self.tokenizer is None or not self.tokenizer.chat_template:
            raise ValueError(f"the model folder {self.engine.config.model_path!r} has no chat template")
        text = render_chat(self.tokenizer, messages, chat_template_kwargs)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def chat(
        self,
        messages: list[dict[str, Any]] | str,
        sampling_params: SamplingParams | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora: str | None = None,
    ) -> RequestOutput:
        """One reply to a conversation ([{"role": "user", "content": ...}, ...]) or a single user message
        (`chat_template_kwargs`: as in `chat_prompt`; `lora`: as in `generate`). A content may be a list
        of OpenAI parts, text and images (`minisgl.multimodal.chat`: an image_url part's URL, or
        {"type": "image", "image": <PIL image or path>}) for a vision-language model."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        return self.generate([self.chat_inputs(messages, chat_template_kwargs)], sampling_params, lora=lora)[
            0
        ]

    def chat_inputs(
        self, messages: list[dict[str, Any]], chat_template_kwargs: dict[str, Any] | None = None
    ) -> list[int] | ImagePrompt:
        """`chat_prompt` of messages whose contents may be lists of parts (text and images): token ids,
        or with images an `ImagePrompt` (its token ids and images), a prompt of `generate` and `stream`."""
        if not _has_parts(messages):
            return self.chat_prompt(messages, chat_template_kwargs)
        if self.tokenizer is None or not self.tokenizer.chat_template:
            raise ValueError(f"the model folder {self.engine.config.model_path!r} has no chat template")
        ids, images = self.vision_prompter().prompt(self.tokenizer, messages, chat_template_kwargs)
        return ids if images is None else ImagePrompt(ids, images)

    def vision_prompter(self) -> VisionPrompter:
        """Builds the prompts of messages with images (`minisgl.multimodal.chat`) for this model."""
        if self._prompter is None:
            config = self.engine.config
            media = self.settings.to_media_config()
            self._prompter = VisionPrompter(config.model_path, config.model_config, media, trust_paths=True)
        return self._prompter

    def _loras(self, lora: str | Sequence[str | None] | None, n: int) -> list[str | None]:
        """One adapter name (or None) per prompt, each checked to be loaded (KeyError otherwise)."""
        names = [lora] * n if lora is None or isinstance(lora, str) else list(lora)
        if len(names) != n:
            raise ValueError(
                f"lora has {len(names)} entries for {n} prompts: give one per prompt, or one name"
            )
        for name in names:
            if name is not None:
                self.scheduler.lora_adapter(name)
        return names

    def embedding_requests(self, inputs: Any) -> tuple[list[list[int]], SamplingParams]:
        """The token ids of each input of an embeddings request (`embeddings.split_inputs`'s forms;
        strings tokenized as the tokenizer does by default) and their SamplingParams; a ValueError
        naming a bad input."""
        if self.pooling is None:
            raise ValueError(f"this model serves no embeddings: {self.pooling_error}")
        items = embeddings.split_inputs(inputs)
        config = self.engine.config.model_config
        ids = [self._encode(item)[1] if isinstance(item, str) else item for item in items]
        for i, item_ids in enumerate(ids):
            if not item_ids:
                raise ValueError(f"input[{i}] has no tokens once tokenized: give some text")
            embeddings.check_ids(item_ids, i, config.vocab_size, self.engine.max_seq_len)
        return ids, SamplingParams(max_tokens=0, pooling=self.pooling)

    def embed(self, inputs: str | Sequence[Any], dimensions: int | None = None) -> list[list[float]]:
        """Embeddings of `inputs` (a string, a list of strings, a list of token ids or a list of those),
        in order: the final hidden states pooled as the model folder says (docs/embeddings.md), the
        first `dimensions` values when given, normalized when the model normalizes. A ValueError names
        a bad input; a RuntimeError an input that failed in the engine."""
        with self._lock:
            self._check_open()
            embeddings.check_options("float", dimensions, self.engine.config.model_config.hidden_size)
            ids, params = self.embedding_requests(inputs)
            for item in ids:
                self.scheduler.check_request(item, params)
            states = [self.scheduler.add_request(item, params) for item in ids]
        try:
            self._run_until_finished(states, progress=False)
        finally:
            self._abort_unfinished(states)
        failed = next((state for state in states if state.embedding is None), None)
        if failed is not None:
            raise RuntimeError(
                f"embedding input {states.index(failed)} failed: {failed.error or failed.finish_reason}"
            )
        vectors = [state.embedding for state in states]
        return embeddings.finish_all(vectors, self.normalize_embeddings, dimensions)

    def load_lora(self, name: str, path: str) -> None:
        """Loads the LoRA adapter at `path` (a PEFT folder or a hub id) under `name`, for requests that
        name it; raises a ValueError (`minisgl.lora.LoraError`) naming what is wrong. Needs an engine
        with adapter slots: started with lora_modules or allow_runtime_lora."""
        with self._lock:
            self._check_open()
            self.scheduler.load_lora(name, path)

    def unload_lora(self, name: str) -> None:
        """Unloads adapter `name` (a KeyError if it is not loaded): requests running on it finish with it;
        new ones naming it are refused."""
        with self._lock:
            self._check_open()
            self.scheduler.unload_lora(name)

    @property
    def lora_adapters(self) -> list[str]:
        """The names of the loaded LoRA adapters, in the order they were loaded."""
        return [] if self.scheduler.lora is None else list(self.scheduler.lora.by_name)

    def flush_cache(self) -> int:
        """Empties the prefix cache of every prefix no running request uses (under tensor
        parallelism, on every rank); returns the KV pages freed (0 with cache_type 'naive')."""
        with self._lock:
            self._check_open()
            return self.scheduler.clear_prefix_cache()

    def shutdown(self) -> None:
        """Aborts every unfinished request (a `generate` in another thread returns them with
        finish_reason "abort") and releases the engine. Later calls raise a RuntimeError. Idempotent."""
        self._closing = True  # before the lock: a `generate` stepping in another thread yields it
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                for state in [*self.scheduler.waiting, *self.scheduler.running]:
                    self.scheduler.abort(state)
                self._abandoned.clear()
            finally:  # the engine and its process group go in any case: a new LLM may follow
                try:
                    # before joining the followers: they leave the NCCL group together with rank 0
                    if self.scheduler.spec is not None:
                        self.scheduler.spec.shutdown()
                    self.engine.shutdown(abort=self.group is not None and self.group.stop())
                finally:
                    if self.group is not None:
                        self.group.shutdown()
                    if self._rendezvous_dir is not None:
                        shutil.rmtree(self._rendezvous_dir, ignore_errors=True)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


class Stream(Iterator[str]):
    """The text deltas of one request (from `LLM.stream`). Each `next()` runs scheduler steps (serving
    every request) until new text is there. If the request fails in the engine, the text produced so
    far is yielded and then `RequestError` raised. `close()`, leaving a `with` block, or dropping the
    stream aborts the request if it is unfinished, freeing its pages."""

    def __init__(self, llm: LLM, state: RequestState) -> None:
        self._llm, self.state = llm, state
        self._sent = 0  # characters of state.text yielded

    @property
    def finish_reason(self) -> str | None:
        return self.state.finish_reason

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> str:
        state = self.state
        with _interrupts_between_steps() as interrupted:
            while True:
                # text up to emitted_len is final (the scheduler holds back a possible stop string)
                end = len(state.text) if state.finished else state.emitted_len
                if end > self._sent:
                    delta, self._sent = state.text[self._sent : end], end
                    return delta
                if state.finished:
                    if state.finish_reason == "error":
                        raise RequestError(f"request {state.uid} {state.error}")
                    raise StopIteration
                try:
                    with self._llm._lock:
                        if not state.finished:
                            self._llm._step()
                except BaseException:
                    self.close()
                    raise
                if interrupted():
                    self.close()
                    raise KeyboardInterrupt

    def close(self) -> None:
        """Aborts the request if it is unfinished."""
        if not self.state.finished:
            with self._llm._lock:
                if not self._llm._closed:
                    self._llm.scheduler.abort(self.state)

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if self.state.finished:
            return
        llm = self._llm
        # garbage collection may run this inside a step (the lock is held, by this thread or another):
        # then the abort waits for the next step; otherwise it happens now
        if llm._lock.acquire(blocking=False):
            try:
                if not llm._closed:
                    llm.scheduler.abort(self.state)
            finally:
                llm._lock.release()
        else:
            llm._abandoned.append(self.state)


@contextlib.contextmanager
def _interrupts_between_steps() -> Iterator[Callable[[], bool]]:
    """In the main thread, a Ctrl-C (SIGINT) during the block is held until the running step is done:
    the block asks `interrupted()` between steps and raises KeyboardInterrupt itself, so a step is never
    cut in half. A second Ctrl-C raises at once. Elsewhere (other threads, a handler of the
    application's own), nothing changes."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield lambda: False
        return
    hits = []

    def hold(signum: int, frame: Any) -> None:
        if hits:
            raise KeyboardInterrupt
        hits.append(signum)

    signal.signal(signal.SIGINT, hold)
    try:
        yield lambda: bool(hits)
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _has_parts(messages: list[dict[str, Any]]) -> bool:
    """Whether a message's content is a list of parts (text and images) rather than a string."""
    return any(isinstance(m, dict) and isinstance(m.get("content"), list) for m in messages)


def _eos_token_ids(model_path: str, engine: Engine, tokenizer_eos: int | None) -> set[int]:
    """EOS ids from config.json, generation_config.json and the tokenizer's (`tokenizer_eos`) together."""
    ids = set(engine.config.model_config.eos_token_ids)
    gen_config = Path(model_path) / "generation_config.json"
    if gen_config.is_file():
        eos = json.loads(gen_config.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer_eos is not None:
        ids.add(tokenizer_eos)
    return ids
