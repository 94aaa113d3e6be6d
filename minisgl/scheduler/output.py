"""Output processing: what a sampled token does to its request's output. Stop conditions (EOS, stop
token ids, stop strings, max_tokens, and min_tokens holding EOS and stop tokens back), the text
(incrementally detokenized, or decoded once at the finish) and the text deltas handed out."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from minisgl.core import SamplingParams
from minisgl.scheduler.detokenizer import IncrementalDetokenizer
from minisgl.scheduler.request import FinishReason, RequestState
from minisgl.scheduler.stops import stop_strings


class OutputProcessor:
    def __init__(self, tokenizer: Any, eos_token_ids: Iterable[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)

    def check(self, params: SamplingParams, stream: bool, vocab_size: int) -> None:
        """Raises a ValueError if the request's output could not be produced: stop strings or streamed
        text without a tokenizer, or min_tokens with every token id banned (stop ids and EOS)."""
        if (params.stop or stream) and self.tokenizer is None:
            raise ValueError("stop strings and streaming text need a tokenizer; this model folder has none")
        outside = [t for t, _ in params.logit_bias if t >= vocab_size]
        if outside:
            raise ValueError(f"logit_bias token id {outside[0]} is outside the vocabulary [0, {vocab_size})")
        if params.min_tokens > 0:
            banned = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
            if sum(1 for t in banned if 0 <= t < vocab_size) == vocab_size:
                raise ValueError(
                    f"stop_token_ids{'' if params.ignore_eos else ' and the EOS ids'} cover the whole "
                    f"vocabulary ({vocab_size} ids), all banned until min_tokens={params.min_tokens}: no "
                    "token could be drawn; stop on fewer ids or set min_tokens=0"
                )

    def detokenizer(self, params: SamplingParams, stream: bool) -> IncrementalDetokenizer | None:
        """The incremental detokenizer a request needs (stop strings, streamed text), or None (after
        `check`)."""
        return IncrementalDetokenizer(self.tokenizer) if params.stop or stream else None

    def suppressed(
        self, states: Sequence[RequestState], vocab_size: int, device: torch.device
    ) -> torch.Tensor | None:
        """(B, width) token ids each request may not draw in this forward (padded with `vocab_size`):
        EOS and stop tokens before a request has min_tokens tokens. None when no request has any."""
        rows = []
        for state in states:
            params, banned = state.params, []
            # index among the outputs of the token this forward samples (the forward set device_len)
            if state.req.device_len - len(state.prompt_ids) < params.min_tokens:
                banned = list(params.stop_token_ids) + ([] if params.ignore_eos else list(self.eos_token_ids))
            rows.append(banned)
        width = max(map(len, rows))
        if width == 0:
            return None
        padded = [row + [vocab_size] * (width - len(row)) for row in rows]
        host = torch.tensor(padded, dtype=torch.int64, pin_memory=device.type == "cuda")
        return host.to(device, non_blocking=True)

    def check_stop(self, state: RequestState, token: int) -> FinishReason | None:
        """Called with each new token (already in `state.output_ids`): updates the text and returns
        why the request finishes now, if it does; a finishing request's text is then complete."""
        params, num_out = state.params, len(state.output_ids)
        if num_out > params.min_tokens and (
            token in params.stop_token_ids or (token in self.eos_token_ids and not params.ignore_eos)
        ):
            self.finish_text(state, drop_last=True)  # the stop token stays in output_ids, out of the text
            return "stop"
        if state.detokenizer is not None:
            state.detokenizer.add(token)
            state.text = state.detokenizer.text
            if params.stop and num_out > params.min_tokens:
                if state.stops is None:
                    state.stops = stop_strings(params.stop).scanner()
                cut = state.stops.search(state.text, state.emitted_len)
                if cut is not None:
                    state.text = state.text[:cut]
                    return "stop"
        if num_out >= params.max_tokens:
            self.finish_text(state)
            return "length"
        return None

    def finish_text(self, state: RequestState, drop_last: bool = False) -> None:
        """Completes the text of a finishing request (without its last token if `drop_last`)."""
        if state.detokenizer is not None:
            state.detokenizer.flush()
            state.text = state.detokenizer.text
        elif self.tokenizer is not None:
            kept = state.output_ids[:-1] if drop_last else state.output_ids
            state.text = self.tokenizer.decode(kept, skip_special_tokens=True)

    @staticmethod
    def take_delta(state: RequestState) -> str:
        """The text not handed out yet, except (while running) what may be the start of a stop string."""
        params = state.params
        emit_upto = len(state.text)
        if not state.finished and params.stop:
            emit_upto = max(state.emitted_len, emit_upto - stop_strings(params.stop).max_len + 1)
        delta = state.text[state.emitted_len : emit_upto]
        state.emitted_len = emit_upto
        return delta
