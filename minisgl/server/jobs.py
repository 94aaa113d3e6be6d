"""One request in the server's front end (`Job`) and its choices (`Choice`): the token ids the
scheduler process sends in, the text (incremental detokenizer, stop strings) and log probabilities
handed out; the stage times each request records and its line in the request trace (`trace_record`,
`TRACE_STAGES`). No HTTP here: the routes (`openai_api`, `native`) read and stream these.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from minisgl.core import SamplingParams, TokenLogprobs
from minisgl.scheduler.detokenizer import IncrementalDetokenizer
from minisgl.scheduler.stops import StopScanner, stop_strings


@dataclass(eq=False)
class Choice:
    """One choice of one request as the front end makes it: token ids from the scheduler in, text out."""

    rid: int  # the scheduler process's name for it (the front end counts them)
    index: int
    params: SamplingParams  # the request's, with its stop strings
    detokenizer: IncrementalDetokenizer | None
    job: Job | None = None  # the request it belongs to (woken when this choice has news)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    emitted: int = 0
    emitted_ids: int = 0
    finish_reason: str | None = None
    error: str | None = None
    reported: bool = False  # its final chunk was handed out (streaming)
    times: list[float | None] | None = None  # the scheduler's [arrived, admitted, first token, finished]
    spec: list[int] | None = None  # speculative decoding: [draft tokens verified, accepted]
    stops: StopScanner | None = None  # the search for the stop strings (made with the first check)
    # with log probabilities asked: one per token of token_ids; the prompt's (None first) with echo
    logprobs: TokenLogprobs | None = None
    prompt_logprobs: TokenLogprobs | None = None
    prompt_ids: list[int] | None = None  # with prompt_logprobs
    emitted_logprobs: int = 0  # entries of `logprobs` already handed out (streaming)
    text_offset: int = 0  # characters of the text handed out with their logprobs (streamed completions)
    hidden_last: bool = False  # its last token (EOS or a stop token) is not part of the text
    rejected_status: int = 400  # the HTTP status of a "rejected" finish (404: its adapter was unloaded)
    cost: int = 0  # tokens it adds to its scheduler's load while the front end holds it (prompt + max)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def feed(self, ids: list[int], finished: bool, reason: str | None, error: str | None) -> bool:
        """Takes one step's tokens; returns True if a stop string ended the choice here (the scheduler,
        which does not know the stop strings, must then be told to abort the request)."""
        params = self.params
        for k, token in enumerate(ids):
            last = finished and k == len(ids) - 1
            self.token_ids.append(token)
            if last and reason == "stop":  # EOS or a stop token: kept in token_ids, out of the text
                self.hidden_last = True
                break
            if self.detokenizer is not None:
                self.detokenizer.add(token)
                self.text = self.detokenizer.text
                if params.stop and len(self.token_ids) > params.min_tokens:
                    if self.stops is None:
                        self.stops = stop_strings(params.stop).scanner()
                    cut = self.stops.search(self.text, self.emitted)
                    if cut is not None:
                        self.text = self.text[:cut]
                        self.finish_reason = "stop"
                        return not finished
        if finished:
            if self.detokenizer is not None:
                self.detokenizer.flush()
                self.text = self.detokenizer.text
            self.finish_reason, self.error = reason or "error", error
        return False

    def end(self, reason: str, error: str | None = None) -> None:
        """Finishes the choice here (the front end aborted it, or the scheduler failed)."""
        if not self.finished:
            self.finish_reason, self.error = reason, error

    def take(self) -> tuple[str, list[int]]:
        """The text and token ids not handed out yet (while running, minus what may start a stop string)."""
        upto = len(self.text)
        if not self.finished and self.params.stop:
            upto = max(self.emitted, upto - stop_strings(self.params.stop).max_len + 1)
        delta = self.text[self.emitted : upto]
        self.emitted = upto
        new_ids = self.token_ids[self.emitted_ids :]
        self.emitted_ids = len(self.token_ids)
        return delta, new_ids

    def text_logprobs(self) -> int:
        """How many entries of `logprobs` are of the tokens of its text (not a final EOS or stop token)."""
        assert self.logprobs is not None
        return len(self.logprobs) - self.hidden_last if self.finished else len(self.logprobs)

    def take_logprobs(self) -> tuple[int, int]:
        """The entries [start, end) of `text_logprobs` not handed out yet."""
        start = self.emitted_logprobs
        self.emitted_logprobs = max(start, self.text_logprobs())
        return start, self.emitted_logprobs


class Job:
    """One HTTP request in the front end: its choices, the event that wakes its response when any of
    them has news (set at most once per scheduler step, whatever the number of choices), and the times
    of its stages (`time.perf_counter()`, the clock the scheduler process stamps with too; written to
    the request trace, `trace_record`)."""

    def __init__(self, received: float) -> None:
        self.choices: list[Choice] = []
        self.wake = asyncio.Event()
        self.received = received
        self.tokenized = self.sent = 0.0
        self.first_received = self.last_received = 0.0  # tokens from the scheduler, first and last time
        self.first_written = self.done = 0.0  # the first token's bytes to the socket; the response's end
        # the latest step with news for it: its tokens on the host, its message sent, read here
        self.step_time = self.step_sent = self.step_read = 0.0
        self.chunks = 0  # writes of tokens to the socket
        self.delay_max = 0.0  # the largest delay from step_time to a write
        # the delays summed, split: in the scheduler, the hop (a Unix socket), here (they add up to it)
        self.parts_sum = [0.0, 0.0, 0.0]
        self.lora: str | None = None  # the LoRA adapter its choices run on (None: the base model)

    def news(self, step_time: float, sent: float, now: float) -> None:
        """A scheduler step (its tokens on the host at `step_time`, its message sent at `sent`)
        reached it at `now`."""
        if not self.first_received:
            self.first_received = now
        self.last_received = self.step_read = now
        self.step_time, self.step_sent = step_time, sent
        self.wake.set()

    def written(self, now: float) -> float:
        """Tokens were handed to the socket at `now`: returns the delay since their step ended."""
        if not self.first_written:
            self.first_written = now
        delay = now - self.step_time
        self.chunks += 1
        self.delay_max = max(self.delay_max, delay)
        parts = self.parts_sum
        parts[0] += self.step_sent - self.step_time
        parts[1] += self.step_read - self.step_sent
        parts[2] += now - self.step_read
        return delay


# stamps of a trace record, in order; their consecutive differences are its stages
TRACE_STAGES = (
    ("received", "parse_tokenize"),  # body read and parsed, prompt tokenized, limits checked
    ("tokenized", "to_scheduler"),  # sent over ZeroMQ and taken in by the scheduler process
    ("arrived", "queue"),  # waiting for admission (a slot and KV pages)
    ("admitted", "prefill"),  # prompt computed up to the first token (on the host)
    ("first_token", "decode"),  # the other tokens, to the last one on the host
    ("finished", "to_client"),  # the last tokens back to the front end, out to the socket
)


def trace_record(job: Job, request_id: str, prompt_tokens: int, clock_offset: float) -> dict[str, Any]:
    """The request trace's line for a finished `job`: its stamps in Unix seconds (perf_counter +
    `clock_offset`), its stages in seconds (consecutive, so they add up to `e2e_s`), the delay from
    the end of a step to its tokens on the socket (mean and largest over the writes), and counts.
    Stamps the request never reached (a request refused or aborted early) are null, as are the stages
    around them."""
    sched = [c.times for c in job.choices if c.times is not None]

    def over(i: int, pick: Any) -> float | None:
        values = [t[i] for t in sched if t[i] is not None]
        return pick(values) if values else None

    stamps: dict[str, float | None] = {
        "received": job.received,
        "tokenized": job.tokenized or None,
        "sent": job.sent or None,
        "arrived": over(0, min),
        "admitted": over(1, min),
        "first_token": over(2, min),
        "first_received": job.first_received or None,
        "first_written": job.first_written or None,
        "finished": over(3, max),
        "last_received": job.last_received or None,
        "done": job.done,
    }
    order = [name for name, _ in TRACE_STAGES] + ["done"]
    stages = {
        stage: None if stamps[a] is None or stamps[b] is None else stamps[b] - stamps[a]
        for (a, stage), b in zip(TRACE_STAGES, order[1:])
    }
    return {
        "id": request_id,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": sum(len(c.token_ids) for c in job.choices),
        "n": len(job.choices),
        "lora": job.lora,
        "finish_reasons": [c.finish_reason for c in job.choices],
        "e2e_s": job.done - job.received,
        "stages_s": stages,
        "delivery": {
            "writes": job.chunks,
            "mean_s": sum(job.parts_sum) / job.chunks if job.chunks else None,
            "max_s": job.delay_max if job.chunks else None,
            # the mean split: the scheduler's processing of the step, the hop (a Unix socket), this process
            "split_mean_s": [part / job.chunks for part in job.parts_sum] if job.chunks else None,
        },
        "stamps": {k: None if v is None else v + clock_offset for k, v in stamps.items()},
        # speculative decoding: draft tokens verified for the request's choices, and accepted
        "spec": {
            "drafted": sum(c.spec[0] for c in job.choices if c.spec),
            "accepted": sum(c.spec[1] for c in job.choices if c.spec),
        },
    }
