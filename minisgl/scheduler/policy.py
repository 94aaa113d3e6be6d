"""The step policy: which requests the next forward runs, a prefill step of prompt chunks or a decode
step, alternating while both have work (docs/scheduler.md#continuous-batching-with-chunked-prefill)."""

from __future__ import annotations

from minisgl.scheduler.admission import Admission
from minisgl.scheduler.request import RequestState

# what the logits of a prefill chunk scored for prompt log probabilities may take (about three copies
# of rows x vocabulary float32): such a request's chunks are cut to fit
PROMPT_LOGPROB_BYTES = 512 << 20


class StepPolicy:
    """Chooses each step's requests and prefill chunks from the running ones, preempting
    (`Admission.preempt`) until the step's pages fit."""

    def __init__(self, admission: Admission, max_prefill_tokens: int, vocab_size: int) -> None:
        self.admission, self.prep = admission, admission.prep
        self.max_prefill_tokens = max_prefill_tokens
        # a chunk of a prompt scored for log probabilities: its logits fit PROMPT_LOGPROB_BYTES
        self.prompt_logprob_chunk = max(16, PROMPT_LOGPROB_BYTES // (12 * vocab_size))

    def schedule(self, last_phase: str) -> tuple[list[RequestState], list[int] | None]:
        """(requests, prefill chunk sizes) for a prefill step or (requests, None) for a decode step,
        whose pages the pool has. `last_phase`: the phase of the forward launched last ("" none)."""
        admission = self.admission
        while True:
            prefilling = [s for s in admission.running if not s.prefilled]
            # with overlap a request's last token may already be in flight: it needs no more steps
            decoding = [s for s in admission.running if s.prefilled and s.num_launched < s.params.max_tokens]
            if prefilling and (not decoding or last_phase != "prefill"):
                chosen, chunks = self.prefill_chunks(prefilling)
                if chosen:
                    return chosen, chunks
                if not decoding:  # not one prompt token fits: make room
                    if admission.preempt():
                        continue
                    # alone, it always fits: unreachable, but the step then fails instead of spinning
                    req = prefilling[0].req
                    return [prefilling[0]], [
                        min(req.num_prompt_tokens - req.cached_len, self.max_prefill_tokens)
                    ]
                # else decode instead; the decode step makes room if it must
            if not decoding:
                return [], None
            need = sum(self.prep.pages_needed(s.req.cached_len + 1) - s.held_pages for s in decoding)
            if need <= self.prep.available_pages or not admission.preempt():
                return decoding, None

    def prefill_chunks(self, prefilling: list[RequestState]) -> tuple[list[RequestState], list[int]]:
        """Prompt chunks first come, first served, up to `max_prefill_tokens` tokens in all and as many
        as the available pages hold (the last chunk is cut to fit). A request about to start its
        prefill first takes the longest prefix the cache holds now (`Admission.look_up`)."""
        page_size = self.prep.page_size
        budget, chosen, chunks, taken = self.max_prefill_tokens, [], [], 0
        for state in prefilling:
            if budget <= 0:
                break
            if state.prefix_found < 0:
                self.admission.look_up(state)
            free = self.prep.available_pages - taken  # after the look-up, which may lock some
            req = state.req
            room = (state.held_pages + free) * page_size - req.cached_len  # tokens its pages could hold
            chunk = min(req.num_prompt_tokens - req.cached_len, budget, room)
            if req.sampling_params.prompt_logprobs is not None:
                chunk = min(chunk, self.prompt_logprob_chunk)
            if chunk <= 0:
                break
            chosen.append(state)
            chunks.append(chunk)
            budget -= chunk
            taken += self.prep.pages_needed(req.cached_len + chunk) - state.held_pages
        return chosen, chunks
