"""The scheduler side's batch preparation, small enough to drive an Engine without a scheduler.

`BatchPreparer` owns a table_idx allocator and a page allocator for one engine. It turns token
lists into `Req`s (a table_idx each: their row of the page table), allocates KV pages as sequences
grow, writes the page table, and fills a `Batch`'s `input_ids`, `positions` and `out_loc`. Everything
is checked before anything is allocated, so a refused request or batch leaves the engine and the pools
as they were.

    prep = BatchPreparer(engine)
    reqs = [prep.add_request(ids, SamplingParams(max_tokens=16)) for ids in prompts]
    batch = prep.prefill(reqs)
    out = engine.forward_batch(batch, prep.sampling_args(batch))
    out.copy_done_event.synchronize()
    prep.append_tokens(batch, out.next_tokens_cpu)
    batch = prep.decode(reqs)
    ...
    prep.release(reqs)
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from minisgl.core import Batch, Phase, Req, SamplingParams, as_token_ids
from minisgl.engine.engine import Engine
from minisgl.engine.sample import BatchSamplingArgs
from minisgl.kvcache import PageAllocator, TableIdxAllocator


class BatchPreparer:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.page_size = engine.config.page_size
        self.pages = PageAllocator(engine.num_pages)
        self.table_idxs = TableIdxAllocator(engine.config.max_running_req)
        self._req_pages: dict[int, list[int]] = {}
        self._uids = itertools.count()

    def check_request(self, tokens: list[int], params: SamplingParams) -> None:
        """Raises a ValueError if the request can never run on this engine (`tokens`: a list of ints,
        see `minisgl.core.as_token_ids`)."""
        vocab_size, max_seq_len = self.engine.config.model_config.vocab_size, self.engine.max_seq_len
        if not tokens:
            raise ValueError("the prompt is empty: give at least one token")
        if min(tokens) < 0 or max(tokens) >= vocab_size:
            bad = next(t for t in tokens if not 0 <= t < vocab_size)
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
        bad = next((t for t in params.stop_token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(f"stop token id {bad} is outside the vocabulary [0, {vocab_size})")
        if len(tokens) + params.max_tokens > max_seq_len:
            raise ValueError(
                f"prompt of {len(tokens)} tokens + max_tokens={params.max_tokens} exceeds max_seq_len="
                f"{max_seq_len}; shorten the prompt or lower max_tokens"
            )

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def add_request(self, token_ids: Sequence[int], sampling_params: SamplingParams | None = None) -> Req:
        """Checks the prompt and takes a table_idx for it (no KV pages yet)."""
        params = sampling_params or SamplingParams()
        tokens = as_token_ids(token_ids)
        self.check_request(tokens, params)
        table_idx = self.table_idxs.alloc()
        req = Req(
            input_ids=tokens,
            table_idx=table_idx,
            cached_len=0,
            output_len=params.max_tokens,
            uid=next(self._uids),
            sampling_params=params,
        )
        self._req_pages[req.uid] = []
        return req

    def prefill(self, reqs: Sequence[Req], chunk_size: int | Sequence[int] | None = None) -> Batch:
        """A prefill batch computing each request's uncached tokens, at most `chunk_size` per request
        (one number for all, or one per request)."""
        if chunk_size is None or isinstance(chunk_size, int):
            chunk_size = [chunk_size] * len(reqs)
        ends = []
        for req, chunk in zip(reqs, chunk_size, strict=True):
            end = len(req.input_ids)
            if chunk is not None:
                end = min(end, req.cached_len + chunk)
            if end <= req.cached_len:
                raise ValueError(f"request {req.uid} has no uncached tokens to prefill")
            ends.append(end)
        return self._build(reqs, ends, "prefill")

    def decode(self, reqs: Sequence[Req], pending: bool = False) -> Batch:
        """A decode batch computing each request's newest token.

        With `pending` (overlap scheduling) the batch reads each request's newest token from the
        engine's `last_tokens` (what the request's latest forward sampled) on the device, so the
        host need not have appended it yet."""
        for req in reqs:
            newest = len(req.input_ids) - 1
            if req.cached_len < req.num_prompt_tokens or not (
                req.cached_len == newest or (pending and req.cached_len == newest + 1)
            ):
                raise ValueError(
                    f"request {req.uid} cannot decode: {req.cached_len} of {len(req.input_ids)} tokens cached "
                    "(finish its prefill, then append the sampled token)"
                )
        return self._build(reqs, [req.cached_len + 1 for req in reqs], "decode", pending)

    def _build(self, reqs: Sequence[Req], ends: list[int], phase: Phase, pending: bool = False) -> Batch:
        if len(reqs) > self.engine.config.max_running_req:
            raise ValueError(
                f"batch of {len(reqs)} requests exceeds max_running_req={self.engine.config.max_running_req}"
            )
        for req, end in zip(reqs, ends):
            if req.uid not in self._req_pages:
                raise ValueError(f"request {req.uid} is not active in this BatchPreparer (released?)")
            if end > self.engine.max_seq_len:
                raise ValueError(
                    f"request {req.uid} would reach {end} tokens > max_seq_len={self.engine.max_seq_len}"
                )
        ps = self.page_size
        wanted = [self.pages_needed(end) - len(self._req_pages[req.uid]) for req, end in zip(reqs, ends)]
        if sum(wanted) > self.pages.num_free:
            self.pages.alloc(sum(wanted))  # raises the out-of-pages error, allocating nothing
        input_ids: list[int] = []
        positions: list[int] = []
        out_loc: list[int] = []
        for req, end, n_new in zip(reqs, ends, wanted):
            pages = self._req_pages[req.uid]
            if n_new > 0:
                first = len(pages)
                pages.extend(self.pages.alloc(n_new))
                self.engine.write_page_table(req.table_idx, first * ps, pages[first:])
            req.device_len = end
            if not pending:
                input_ids += req.input_ids[req.cached_len : end]
            span = range(req.cached_len, end)
            positions += span
            out_loc += [pages[p // ps] * ps + p % ps for p in span]
        batch = Batch(reqs=list(reqs), phase=phase)
        batch.host_inputs = (None if pending else input_ids, positions, out_loc)
        # one host-to-device copy (from pinned memory on CUDA) for positions, out_loc and the table_idxs
        device = self.engine.device
        n = len(positions)
        packed = torch.tensor(
            positions + out_loc + [req.table_idx for req in reqs],
            dtype=torch.int64,
            pin_memory=device.type == "cuda",
        ).to(device, non_blocking=True)
        batch.positions, batch.out_loc, batch.table_idx = packed[:n], packed[n : 2 * n], packed[2 * n :]
        if pending:  # the tokens the previous forward sampled, still on the device
            batch.input_ids = self.engine.last_tokens[batch.table_idx]
        else:
            batch.input_ids = torch.tensor(input_ids, dtype=torch.int32).to(device, non_blocking=True)
        return batch

    def sampling_args(self, batch: Batch) -> BatchSamplingArgs:
        return self.engine.sampler.prepare(batch)

    def append_tokens(self, batch: Batch, next_tokens_cpu: torch.Tensor) -> list[Req]:
        """Appends each sampled token to its request, except for unfinished prefill chunks.
        Returns the requests that got a token."""
        got = []
        for req, token in zip(batch.reqs, next_tokens_cpu.tolist()):
            if req.cached_len == len(req.input_ids):
                req.input_ids.append(token)
                got.append(req)
        return got

    def release(self, reqs: Req | Sequence[Req]) -> None:
        """Returns the requests' KV pages and table_idxs."""
        for req in [reqs] if isinstance(reqs, Req) else reqs:
            pages = self._req_pages.pop(req.uid, None)
            if pages is None:
                continue
            self.pages.free(pages)
            self.table_idxs.free(req.table_idx)


def generate(
    engine: Engine,
    prompts: Sequence[Sequence[int]],
    sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    chunk_size: int | None = None,
    preparer: BatchPreparer | None = None,
) -> list[list[int]]:
    """Runs all prompts as one batch (prefill, in chunks if asked, then decode) until each has produced
    `max_tokens` tokens; returns the new tokens of each. EOS is not special here: that is the scheduler's
    business. Pages and table_idxs are released even when a step fails."""
    prep = preparer or BatchPreparer(engine)
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        sampling_params = [sampling_params or SamplingParams()] * len(prompts)
    if len(sampling_params) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(sampling_params)} sampling params")
    reqs: list[Req] = []
    try:
        for tokens, params in zip(prompts, sampling_params):
            reqs.append(prep.add_request(tokens, params))
        running = list(reqs)
        while running:
            filling = [req for req in running if req.cached_len < req.num_prompt_tokens]
            if filling:
                batch = prep.prefill(filling, chunk_size)
            else:
                batch = prep.decode(running)
            out = engine.forward_batch(batch, prep.sampling_args(batch))
            out.copy_done_event.synchronize()
            prep.append_tokens(batch, out.next_tokens_cpu)
            running = [req for req in running if req.num_output_tokens < req.output_len]
        return [req.input_ids[req.num_prompt_tokens :] for req in reqs]
    finally:
        prep.release(reqs)
