"""The offline `LLM` API: prompts in, text out, over one Engine and the scheduler.

from minisgl.llm import LLM
from minisgl.core import SamplingParams

llm = LLM()  # the embedded SmolLM2-135M-Instruct
[out] = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16))
print(out.text, out.finish_reason, out.time_to_first_token)
for delta in llm.stream("Tell me a story.", SamplingParams(max_tokens=64)):
    print(delta, end="", flush=True)
llm.shutdown()
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from minisgl.core import SamplingParams
from minisgl.engine import Engine
from minisgl.launch import RankZeroEngine, launched_rank, start_workers
from minisgl.models import DEFAULT_MODEL_ALIAS
from minisgl.scheduler import RequestState, Scheduler
from minisgl.settings import EngineSettings

logger = logging.getLogger(__name__)

Prompt = str | Sequence[int]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass
class RequestOutput:
    """One finished request. Times are in seconds from the request's arrival."""

    index: int  # position in the input list
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS, stop token, stop string) or "length" (max_tokens)
    time_to_first_token: float
    total_time: float

    @classmethod
    def from_state(cls, index: int, prompt: str | None, state: RequestState) -> RequestOutput:
        assert state.finish_reason is not None and state.first_token_time is not None
        return cls(
            index=index,
            prompt=prompt,
            prompt_token_ids=state.prompt_ids,
            text=state.text,
            token_ids=list(state.output_ids),
            finish_reason=state.finish_reason,
            time_to_first_token=state.first_token_time - state.arrival_time,
            total_time=state.finish_time - state.arrival_time,
        )


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
        self, model: str | None = None, *, config: str | Path | None = None, **settings: Any
    ) -> None:
        """`model`: a local folder, 'smollm2-135m' (also what None means), or a hub id. `config`: a
        YAML settings file; other keyword arguments are settings of the engine and the scheduler (see
        `minisgl.settings`, docs/settings.md). `tp=N` (or `tp_size`) runs N tensor-parallel ranks: this
        process is rank 0 and schedules, N-1 spawned processes follow."""
        import transformers

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
        scheduler_config = self.settings.to_scheduler_config()
        self.engine = self._start_engine(settings, config, launched)
        model_path = self.engine.config.model_path
        self.model_name = Path(model_path).name
        has_tokenizer = any((Path(model_path) / name).is_file() for name in TOKENIZER_FILES)
        # dummy-weight folders hold only config.json: token-id prompts still work, texts are empty
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(model_path) if has_tokenizer else None
        self.scheduler = Scheduler(
            self.engine,
            max_prefill_tokens=scheduler_config.prefill_tokens(self.engine.device.type),
            overlap=scheduler_config.overlap_scheduling,
            eos_token_ids=_eos_token_ids(model_path, self.engine, self.tokenizer),
            tokenizer=self.tokenizer,
            model_name=self.model_name,
        )

    def _start_engine(
        self, settings: dict[str, Any], config: str | Path | None, launched: tuple[int, int] | None
    ) -> Engine | RankZeroEngine:
        """This process's engine: alone, or rank 0 of a tensor-parallel group whose other ranks a
        launcher started (`launched`) or that are spawned here."""
        if launched is not None and launched[1] > 1:
            return RankZeroEngine(Engine(self.settings.to_engine_config(rank=0)), workers=[])
        if self.settings.tp_size == 1:
            return Engine(self.settings.to_engine_config())
        # rank 0 here, ranks 1..N-1 in processes of their own
        settings["model_path"] = self.settings.resolved_model_path()  # prepared once, here
        workers = start_workers(self.settings.tp_size, settings, None if config is None else str(config))
        try:
            return RankZeroEngine(Engine(self.settings.to_engine_config(rank=0)), workers)
        except BaseException:
            for proc in workers:
                proc.kill()
            raise

    def _encode(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    f"the model folder {self.engine.config.model_path!r} has no tokenizer: give token ids"
                )
            return prompt, self.tokenizer(prompt)["input_ids"]
        return None, [int(t) for t in prompt]

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        progress: bool = False,
    ) -> list[RequestOutput]:
        """Runs every prompt (text, or a list of token ids) to completion; outputs in input order.
        All requests are checked before any runs, so a bad one raises without side effects."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(sampling_params)} sampling params")
        encoded = [self._encode(p) for p in prompts]
        for (_, ids), params in zip(encoded, sampling_params):
            self.scheduler.prep.check_request(ids, params)
        states = [
            self.scheduler.add_request(ids, params) for (_, ids), params in zip(encoded, sampling_params)
        ]
        with tqdm(total=len(states), desc="generating", unit="req", disable=not progress) as bar:
            while self.scheduler.has_work():
                bar.update(sum(update.finished for update in self.scheduler.step()))
        return [
            RequestOutput.from_state(i, text, state)
            for i, ((text, _), state) in enumerate(zip(encoded, states))
        ]

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yields text deltas of one request as its tokens are produced. The request is checked (and
        queued) at the call, so a bad one raises here, before any iteration."""
        _, ids = self._encode(prompt)
        state = self.scheduler.add_request(ids, sampling_params or SamplingParams(), stream=True)
        return self._deltas(state)

    def _deltas(self, state: RequestState) -> Iterator[str]:
        while not state.finished:
            for update in self.scheduler.step():
                if update.state is state and update.text:
                    yield update.text

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a conversation under the tokenizer's chat template, ready for the reply."""
        if self.tokenizer is None or not self.tokenizer.chat_template:
            raise ValueError(f"the model folder {self.engine.config.model_path!r} has no chat template")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def chat(
        self, messages: list[dict[str, str]] | str, sampling_params: SamplingParams | None = None
    ) -> RequestOutput:
        """One reply to a conversation ([{"role": "user", "content": ...}, ...]) or a single user message."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        return self.generate([self.chat_prompt(messages)], sampling_params)[0]

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _eos_token_ids(model_path: str, engine: Engine, tokenizer: Any) -> set[int]:
    """EOS ids from config.json, generation_config.json and the tokenizer together."""
    ids = set(engine.config.model_config.eos_token_ids)
    gen_config = Path(model_path) / "generation_config.json"
    if gen_config.is_file():
        eos = json.loads(gen_config.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
