"""What the scheduler knows of one request (`RequestState`, holding the engine's `Req` once admitted),
what a step did for it (`Update`), and why it finished (`FinishReason`)."""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from minisgl.core import Req, SamplingParams, TokenLogprobs
from minisgl.scheduler.detokenizer import IncrementalDetokenizer
from minisgl.scheduler.grammar import GrammarState
from minisgl.scheduler.stops import StopScanner

if TYPE_CHECKING:
    from minisgl.multimodal.inputs import ImageInputs
    from minisgl.scheduler.lora import Loaded

# "stop": EOS, a stop token or a stop string; "length": max_tokens; "abort": `Scheduler.abort`;
# "error": a step failed for it (`RequestState.error` says how)
FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass(eq=False)
class RequestState:
    """One request from arrival to finish, as the scheduler tracks it. `req` is the engine-side request
    (its table_idx, tokens and cached length), created at admission; a preempted request loses it
    (None again, back in the queue) and gets a new one at its re-admission, whose prompt is
    `prompt_ids + output_ids` (the tokens so far, recomputed)."""

    uid: int
    prompt_ids: list[int]
    params: SamplingParams
    arrival_time: float
    detokenizer: IncrementalDetokenizer | None = None
    req: Req | None = None
    held_pages: int = 0  # KV pages the request holds now (0 while waiting)
    num_preemptions: int = 0  # times it was preempted and requeued
    prefix_found: int = -1  # prompt tokens found in the prefix cache as its prefill began (-1: not yet)
    output_ids: list[int] = field(default_factory=list)
    text: str = ""  # text so far (complete once finished)
    emitted_len: int = 0  # characters of `text` already handed out by `Update`s
    stops: StopScanner | None = None  # where the search for its stop strings stands in `text`
    grammar: GrammarState | None = None  # structured output: its matcher (`minisgl.scheduler.grammar`)
    # with SamplingParams.logprobs: one entry per output token; with prompt_logprobs: one per prompt
    # token, None for the first (nothing scores it), filled as the prefill's chunks run
    logprobs: TokenLogprobs | None = None
    prompt_logprobs: TokenLogprobs | None = None
    finish_reason: FinishReason | None = None
    error: str | None = None  # with finish_reason "error": what failed
    # speculative decoding: draft tokens verified for it and accepted; its back-off (steps it still sits
    # out, and the length of its latest back-off)
    spec_drafted: int = 0
    spec_accepted: int = 0
    spec_wait: int = 0
    spec_backoff: int = 0
    # its LoRA adapter (`minisgl.scheduler.lora`), None for the base model; pinned while it is admitted
    lora: Loaded | None = None
    # an embedding request's pooled vector (SamplingParams.pooling), an array("f") on the host, once done
    embedding: array | None = None
    # a vision-language prompt's images (`minisgl.multimodal.inputs.ImageInputs`), None for text
    images: ImageInputs | None = None
    admit_time: float | None = None  # first admission (not moved by a preemption)
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None

    def __post_init__(self) -> None:
        if self.params.logprobs is not None:
            self.logprobs = TokenLogprobs(self.params.logprobs)
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = TokenLogprobs(self.params.prompt_logprobs, self.prompt_ids[:1])

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prompt_logprobs_done(self) -> bool:
        """Every prompt token's log probability is in (or none was asked for)."""
        return self.prompt_logprobs is None or len(self.prompt_logprobs) == len(self.prompt_ids)

    @property
    def prefilled(self) -> bool:
        """Admitted and its prompt computed (after a preemption: the prompt and the outputs so far)."""
        return self.req is not None and self.req.cached_len >= self.req.num_prompt_tokens

    @property
    def num_launched(self) -> int:
        """Output tokens sampled or being sampled by a launched forward (0 before prefill completes)."""
        if not self.prefilled:
            return 0
        return self.req.cached_len - len(self.prompt_ids) + 1


@dataclass
class Update:
    """What one step did for one request: new token ids, new text (when detokenizing), finished or not;
    with log probabilities asked, the request's so far (`RequestState.logprobs`, whose last
    ``len(token_ids)`` entries are the new tokens'), and with the first update (once the prefill is
    done) the prompt's, whole."""

    state: RequestState
    token_ids: list[int]
    text: str = ""
    finished: bool = False
    logprobs: TokenLogprobs | None = None
    prompt_logprobs: TokenLogprobs | None = None
