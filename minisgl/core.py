"""The objects that travel between the scheduler side and the engine: requests, batches, context.

Data only, at the bottom of the import layers (see tests/test_layers.py): this module imports nothing
from minisgl. What it needs of the attention backend and the KV pool above it is declared here as small
protocols, which `minisgl.attention.BaseAttnBackend` and `minisgl.kvcache.BaseKVCachePool` meet.
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, Protocol, runtime_checkable

import torch

Phase = Literal["prefill", "decode"]

INT64_MAX = 2**63 - 1
FLOAT32_MAX = float(torch.finfo(torch.float32).max)


class FatalEngineError(RuntimeError):
    """The engine cannot run steps any more: a tensor-parallel rank died, or the engine was shut down.
    The scheduler finishes the failed step's requests with "error" and raises it."""


# failures after which no step can succeed: the scheduler raises them (a CUDA error such as an illegal
# memory access breaks the process's CUDA context; torch >= 2.8 raises it as AcceleratorError)
FATAL_ERRORS: tuple[type[BaseException], ...] = (FatalEngineError,) + (
    (torch.AcceleratorError,) if hasattr(torch, "AcceleratorError") else ()
)


def as_token_ids(value: Any, what: str = "prompt") -> list[int]:
    """``value`` as a list of token ids: a list or tuple of integers >= 0 (numpy integers too). A float,
    a bool, bytes, a string or a tensor is refused with a TypeError naming ``what``, never converted."""
    if isinstance(value, str | bytes | bytearray) or not isinstance(value, list | tuple):
        hint = ""
        if isinstance(value, bytes | bytearray):
            hint = "; decode bytes to a str first"
        elif isinstance(value, torch.Tensor):
            hint = "; pass tensor.tolist()"
        raise TypeError(f"{what} must be a list of integer token ids, got {type(value).__name__}{hint}")
    if set(map(type, value)) <= {int}:  # the common case, checked at C speed
        ids = list(value)
    else:
        ids = []
        for t in value:
            if isinstance(t, bool) or not isinstance(t, numbers.Integral):
                raise TypeError(f"{what} must hold integer token ids, got {t!r} ({type(t).__name__})")
            ids.append(int(t))
    if ids and not (0 <= min(ids) and max(ids) <= INT64_MAX):
        bad = next(t for t in ids if not 0 <= t <= INT64_MAX)
        raise ValueError(f"{what} holds token id {bad}: token ids are integers in [0, 2**63)")
    return ids


@runtime_checkable
class AttnMetadata(Protocol):
    """A batch's attention plan as the engine reads it (`minisgl.attention.BaseAttnMetadata`)."""

    last_indices: torch.Tensor | None


@runtime_checkable
class AttnBackend(Protocol):
    """The attention backend as the context holds it (`minisgl.attention.BaseAttnBackend`)."""

    def prepare_metadata(self, batch: Batch, graph_bs: int = 0) -> None: ...

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: Batch
    ) -> torch.Tensor: ...


@runtime_checkable
class KVCachePool(Protocol):
    """The paged KV pool as the context holds it (`minisgl.kvcache.BaseKVCachePool`)."""

    num_pages: int
    page_size: int

    @property
    def dummy_page(self) -> int: ...


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its next tokens.

    ``temperature`` 0 is greedy (argmax); above 0 the softmax of logits / temperature is filtered:
    ``top_k`` keeps the k most likely tokens (-1 or 0: all), ``top_p`` the smallest most-likely set whose
    probability reaches ``top_p``, ``min_p`` drops tokens below ``min_p`` times the largest probability.
    A token survives only if every filter, judging the unfiltered softmax, keeps it. ``seed`` makes the
    draws a function of (seed, position): the same tokens alone or inside any batch.

    Generation stops after ``max_tokens`` tokens, or earlier at the model's EOS (unless ``ignore_eos``),
    a token of ``stop_token_ids`` or a string of ``stop`` in the text (cut before it); none of those
    before ``min_tokens`` tokens.

    Structured output (docs/structured-output.md), at most one of: ``json_schema`` (a dict or JSON text;
    kept as compact JSON text), ``json_object`` (any JSON object), ``regex`` (matched by the whole
    output), ``ebnf`` (xgrammar's EBNF, from rule ``root``). The scheduler (`LLM`, the server) compiles
    it and masks the logits with it; EOS is allowed only where the grammar may end, so ``ignore_eos``
    cannot be combined with one.
    """

    temperature: float = 0.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 1024
    ignore_eos: bool = False
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    # added to the logits of those token ids before anything else (OpenAI's logit_bias): -100 bans a
    # token, 100 all but forces it; given as a dict {token id: bias}, kept as sorted (id, bias) pairs
    logit_bias: tuple[tuple[int, float], ...] = ()
    # OpenAI's penalties over the generated tokens: logit -= presence * (count > 0) + frequency * count
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # transformers' and vLLM's, over prompt and generated tokens: a seen token's logit is divided by it
    # when positive, multiplied by it when negative (1: off)
    repetition_penalty: float = 1.0
    # structured output: at most one (see the class docstring)
    json_schema: str | None = None
    json_object: bool = False
    regex: str | None = None
    ebnf: str | None = None
    # log probabilities (of the model's own distribution: before logit_bias, penalties, a grammar's mask
    # and temperature): `logprobs` k gives each generated token's and the k most likely alternatives;
    # `prompt_logprobs` k the same for every prompt token after the first (0..20; None: none)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # an embedding request (docs/embeddings.md): the prompt's final hidden states pooled as "last",
    # "mean" or "cls" (its first token); with max_tokens 0, nothing is generated
    pooling: str | None = None

    def __post_init__(self) -> None:
        # Python values are checked, not coerced: True is no token count, 2.0 no token id
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"{name} must be a number, got {name}={value!r}")
            object.__setattr__(self, name, float(value))
        for name in ("top_k", "max_tokens", "min_tokens", "seed", "logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is None and name in ("seed", "logprobs", "prompt_logprobs"):
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"{name} must be an integer, got {name}={value!r}")
            object.__setattr__(self, name, int(value))
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be True or False, got ignore_eos={self.ignore_eos!r}")
        stop = () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, list | tuple) or any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop must be a string or a list of non-empty strings, got stop={self.stop!r}")
        object.__setattr__(self, "stop", tuple(stop))
        stop_ids = () if self.stop_token_ids is None else self.stop_token_ids
        if not isinstance(stop_ids, list | tuple):
            raise TypeError(f"stop_token_ids must be a list of token ids, got stop_token_ids={stop_ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(as_token_ids(stop_ids, "stop_token_ids")))
        object.__setattr__(self, "logit_bias", _as_logit_bias(self.logit_bias))
        object.__setattr__(self, "json_schema", _as_json_schema(self.json_schema))
        self._check_grammar()
        self._check_ranges()
        if self.pooling is not None and (self.pooling not in POOLING_MODES or self.max_tokens != 0):
            raise ValueError(
                f"pooling must be one of {', '.join(POOLING_MODES)} with max_tokens=0 (an embedding "
                f"request generates nothing), got pooling={self.pooling!r}, max_tokens={self.max_tokens}"
            )

    def _check_grammar(self) -> None:
        if not isinstance(self.json_object, bool):
            raise TypeError(f"json_object must be True or False, got json_object={self.json_object!r}")
        for name in ("regex", "ebnf"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise TypeError(f"{name} must be a string or None, got {name}={short_repr(value)}")
        given = [name for name in GRAMMAR_FIELDS if getattr(self, name) not in (None, False)]
        if len(given) > 1:
            raise ValueError(
                f"{given[0]} and {given[1]} were both given: structured output takes at most one of "
                f"{', '.join(GRAMMAR_FIELDS)}"
            )
        if given and self.ignore_eos:
            raise ValueError(
                f"{given[0]} cannot be combined with ignore_eos=True: a structured output ends where its "
                "grammar does (EOS is allowed there only); leave ignore_eos out"
            )

    def _check_ranges(self) -> None:
        t = self.temperature
        if not (math.isfinite(t) and 0.0 <= t <= FLOAT32_MAX):
            raise ValueError(
                f"temperature must be a finite number in [0, {FLOAT32_MAX:.3g}] (0 means greedy; the "
                f"sampler computes in float32), got temperature={t!r}"
            )
        if not -1 <= self.top_k <= INT64_MAX:
            raise ValueError(
                f"top_k must be an integer in [-1, 2**63) (-1 or 0: no limit), got top_k={self.top_k!r}"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1 keeps every token), got top_p={self.top_p!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1] (0 disables it), got min_p={self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(
                    f"{name} must be in [-2, 2] (OpenAI's range), got {name}={getattr(self, name)!r}"
                )
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise ValueError(
                f"repetition_penalty must be in (0, 10] (1 is off), got repetition_penalty={self.repetition_penalty!r}"
            )
        if self.seed is not None and not 0 <= self.seed <= INT64_MAX:
            raise ValueError(f"seed must be None or an integer in [0, 2**63), got seed={self.seed!r}")
        if not 0 <= self.max_tokens <= INT64_MAX:
            raise ValueError(
                f"max_tokens must be an integer in [0, 2**63) (0: no output, to score a prompt with "
                f"prompt_logprobs), got max_tokens={self.max_tokens!r}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(
                    f"{name} must be None or an integer in [0, {MAX_LOGPROBS}] (the alternatives given "
                    f"per token), got {name}={value!r}"
                )
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got min_tokens={self.min_tokens!r}"
            )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def grammar(self) -> tuple[str, str] | None:
        """The structured output asked for, as (field, text): ("json_schema", its JSON text),
        ("json_object", ""), ("regex", the regex) or ("ebnf", the grammar); None when there is none."""
        if self.json_schema is not None:
            return "json_schema", self.json_schema
        if self.json_object:
            return "json_object", ""
        if self.regex is not None:
            return "regex", self.regex
        if self.ebnf is not None:
            return "ebnf", self.ebnf
        return None


MAX_LOGIT_BIAS = 100.0
POOLING_MODES = ("last", "mean", "cls")  # SamplingParams.pooling's values
# the structured-output fields of SamplingParams, in the order of `SamplingParams.grammar`
GRAMMAR_FIELDS = ("json_schema", "json_object", "regex", "ebnf")


def short_repr(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters, for an error message."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _as_json_schema(value: Any) -> str | None:
    """A JSON schema as compact JSON text (key order kept: it is the order the properties are
    generated in): from a dict, or from JSON text holding an object."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError) as e:
            raise ValueError(f"json_schema is not valid JSON text ({e}); give a JSON schema object") from None
    if not isinstance(value, dict):
        raise TypeError(
            f"json_schema must be a JSON schema: a dict or its JSON text, got {type(value).__name__} "
            f"{short_repr(value)}"
        )
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError, RecursionError) as e:
        raise ValueError(
            f"json_schema must hold JSON values only (dicts with string keys, lists, strings, finite "
            f"numbers, booleans, None): {e}"
        ) from None


MAX_LOGPROBS = 20  # alternatives per token, at most (OpenAI's limit)


class TokenLogprob(NamedTuple):
    """One token's log probability under the model's own distribution, and the ``len(top)`` most likely
    tokens at its position as (token id, log probability), most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class TokenLogprobs(Sequence[TokenLogprob | None]):
    """A run of tokens' log probabilities in flat columns, cheap to add to and to send: every token's id
    (`token_ids`), the log probability of each but the first few (`values`: the `unscored` ids given
    first have none, as a prompt's first token), and each scored token's `k` alternatives, k after k
    (`top_ids`, `top_values`, most likely first). Reading an entry makes its `TokenLogprob` (None for
    an unscored token)."""

    __slots__ = ("k", "token_ids", "values", "top_ids", "top_values")

    def __init__(self, k: int, unscored: Sequence[int] = ()) -> None:
        self.k = k
        self.token_ids: list[int] = list(unscored)
        self.values: list[float] = []
        self.top_ids: list[int] = []
        self.top_values: list[float] = []

    @property
    def unscored(self) -> int:
        return len(self.token_ids) - len(self.values)

    def extend(
        self,
        token_ids: Sequence[int],
        values: Sequence[float],
        top_ids: Sequence[int],
        top_values: Sequence[float],
    ) -> None:
        """Adds scored tokens: their ids, log probabilities and k alternatives each (ids, log probabilities)."""
        self.token_ids += token_ids
        self.values += values
        self.top_ids += top_ids
        self.top_values += top_values

    def __len__(self) -> int:
        return len(self.token_ids)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        j = range(-self.unscored, len(self.values))[i]  # raises IndexError as a list does
        if j < 0:
            return None
        k = self.k
        top = zip(self.top_ids[j * k : j * k + k], self.top_values[j * k : j * k + k])
        return TokenLogprob(self.token_ids[j + self.unscored], self.values[j], tuple(top))


def _as_logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """A logit bias as sorted (token id, bias) pairs: from a dict {id: bias} (or pairs); ids integers
    >= 0, biases finite numbers in [-100, 100] (OpenAI's range)."""
    if value is None:
        return ()
    pairs = value.items() if isinstance(value, dict) else value
    if not isinstance(pairs, list | tuple | type({}.items())) or not all(
        isinstance(p, list | tuple) and len(p) == 2 for p in pairs
    ):
        raise TypeError(f"logit_bias must be a dict {{token id: bias}}, got {type(value).__name__}")
    ids = as_token_ids([p[0] for p in pairs], "logit_bias")
    out = {}
    for token, (_, bias) in zip(ids, pairs):
        if isinstance(bias, bool) or not isinstance(bias, numbers.Real):
            raise TypeError(f"logit_bias values must be numbers, got {bias!r} for token {token}")
        if not (math.isfinite(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
            raise ValueError(f"logit_bias values must be in [-100, 100], got {bias!r} for token {token}")
        out[token] = float(bias)
    return tuple(sorted(out.items()))


@dataclass(eq=False, kw_only=True)
class Req:
    """One request as the engine sees it.

    ``input_ids`` holds every token known on the host (prompt, then generated tokens). The KV of the
    first ``cached_len`` tokens is in the cache. A forward computes tokens ``[cached_len, device_len)``
    (the scheduler side sets ``device_len``; by default all known tokens) and then ``complete_one``
    marks them cached. If ``device_len`` stops short of ``len(input_ids)`` the forward is one chunk of a
    chunked prefill and the token it samples is not part of the output.
    """

    input_ids: list[int]
    table_idx: int
    cached_len: int
    output_len: int
    uid: int
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    device_len: int = -1
    num_prompt_tokens: int = field(init=False)
    # where the generated tokens start in input_ids (after a preemption, the scheduler recomputes the
    # prompt and the output so far as this request's "prompt"; the penalties count only the output)
    output_start: int = -1
    penalties_ready: bool = False  # the sampler's per-slot counts hold this request's tokens
    # its LoRA adapter (docs/lora.md): the engine's pool slot (-1: the base model), set by the scheduler
    # at admission and read by each forward; and the adapter's identity for the prefix cache (0: the
    # base model), which the engine ignores
    lora_slot: int = -1
    lora_id: int = 0
    # an embedding request's pooled state so far on the device (mean: the sum of its rows; cls: its
    # first row), kept by the engine across the chunks of its prefill
    pooled: torch.Tensor | None = None
    # a vision-language request's images (`minisgl.multimodal.inputs.ImageInputs`: pixel rows, M-RoPE
    # positions, prefix-cache keys), and their encoder output while its prefill consumes it (set by the
    # scheduler side at the first chunk that reaches an image, dropped after the last); None: text only
    images: Any = None
    image_embeds: tuple[torch.Tensor, list[torch.Tensor]] | None = None

    def __post_init__(self) -> None:
        if self.device_len < 0:
            self.device_len = len(self.input_ids)
        self.num_prompt_tokens = len(self.input_ids)
        if self.output_start < 0:
            self.output_start = self.num_prompt_tokens

    @property
    def extend_len(self) -> int:
        """Tokens this forward computes."""
        return self.device_len - self.cached_len

    @property
    def is_partial(self) -> bool:
        """True while a chunked prefill has prompt tokens left after this forward."""
        return self.device_len < len(self.input_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.input_ids) - self.num_prompt_tokens

    def row_at(self, pos: int) -> Req:
        """The one-token request of its token at position `pos` (its page-table row, its sampling
        parameters): what a decode step at `pos` would compute. A verify step's rows are these."""
        return Req(
            input_ids=[],
            table_idx=self.table_idx,
            cached_len=pos,
            output_len=0,
            uid=self.uid,
            sampling_params=self.sampling_params,
            device_len=pos + 1,
            output_start=self.output_start,
            penalties_ready=self.penalties_ready,
            lora_slot=self.lora_slot,
            lora_id=self.lora_id,
        )

    def complete_one(self) -> None:
        """Called by the engine after a forward: the computed tokens are now in the KV cache."""
        self.cached_len = self.device_len


class ImageBatch(NamedTuple):
    """The image embeddings of a prefill batch: `rows` (N,) int64, the batch rows of image placeholder
    tokens, whose embeddings `embeds` (N, hidden) replace; `deepstack` (Qwen3-VL) one (N, hidden) tensor
    per DeepStack layer, added to those rows after the first text layers."""

    rows: torch.Tensor
    embeds: torch.Tensor
    deepstack: list[torch.Tensor]


@dataclass(eq=False)
class Batch:
    """Requests that run through one forward, with the tensors the scheduler side prepared.

    ``input_ids`` (int32), ``positions`` (int64) and ``out_loc`` (int64, where each token's K and V are
    stored in the flat KV pool) have one row per computed token, requests in order. ``attn_metadata`` is
    filled by the attention backend's ``prepare_metadata``.
    """

    reqs: list[Req]
    phase: Phase
    input_ids: torch.Tensor = field(init=False)
    positions: torch.Tensor = field(init=False)
    out_loc: torch.Tensor = field(init=False)
    attn_metadata: AttnMetadata | None = field(default=None, init=False)
    # (B,) int64 page-table rows of the requests on the device (the engine builds it when unset)
    table_idx: torch.Tensor | None = field(default=None, init=False)
    # host lists the tensors above were made from, when the preparer kept them (tensor-parallel rank 0
    # sends them to the other ranks without reading the device); input_ids is None in a pending decode
    # batch, whose tokens are only on the device
    host_inputs: tuple[list[int] | None, list[int], list[int]] | None = field(default=None, init=False)
    # a pending verify batch (`Engine.forward_verify(pending=True)`): (B,) each request's shift of its
    # positions and (T,) each token's, on the device; the attention plan adds them to its lengths
    shift: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, init=False)
    # a vision-language prefill: the image embeddings of its chunk (None: no image token in it)
    images: ImageBatch | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.phase not in ("prefill", "decode"):
            raise ValueError(f"phase must be 'prefill' or 'decode', got phase={self.phase!r}")

    @property
    def is_prefill(self) -> bool:
        return self.phase == "prefill"

    @property
    def is_decode(self) -> bool:
        return self.phase == "decode"

    @property
    def size(self) -> int:
        return len(self.reqs)

    @property
    def num_tokens(self) -> int:
        return sum(req.extend_len for req in self.reqs)


@dataclass(eq=False)
class Context:
    """Shared state of one engine: the KV pool, the backends, and the batch being run."""

    page_size: int
    kv_cache: KVCachePool
    page_table: torch.Tensor
    attn_backend: AttnBackend
    moe_backend: Any = None
    # kernel choices may not depend on the batch's shape (see EngineConfig.batch_invariant)
    batch_invariant: bool = False
    # one-row linear layers may run the Triton GEMV kernel (see EngineConfig.use_gemv_kernel)
    use_gemv_kernel: bool = True
    # the fused Triton kernels may run (see EngineConfig.use_fused_kernels)
    use_fused_kernels: bool = True
    # the decode step's Triton kernels launch with programmatic dependent launch (EngineConfig.use_pdl)
    use_pdl: bool = False
    _batch: Batch | None = field(default=None, init=False)

    @property
    def batch(self) -> Batch:
        if self._batch is None:
            raise RuntimeError("no batch is running: the model forward must run inside Engine.forward_batch")
        return self._batch

    @contextmanager
    def forward_batch(self, batch: Batch) -> Iterator[None]:
        """Makes ``batch`` the running batch and this context the current one while the model runs."""
        global _current_ctx
        previous, self._batch = _current_ctx, batch
        _current_ctx = self
        try:
            yield
        finally:
            self._batch = None
            _current_ctx = previous


_current_ctx: Context | None = None


def current_ctx() -> Context | None:
    """The context of the engine whose forward is running, or None outside a forward."""
    return _current_ctx


def get_global_ctx() -> Context:
    """The context of the engine whose forward is running (read by the attention op)."""
    if _current_ctx is None:
        raise RuntimeError("no engine forward is running: use Engine.forward_batch")
    return _current_ctx
