"""The scheduler side's batch preparation, small enough to drive an Engine without a scheduler.

`BatchPreparer` allocates table_idxs and KV pages, writes the page table and fills a `Batch`'s tensors,
checking everything before it allocates anything; with a `RadixCache` it also keeps the prefix cache's
books. Usage: docs/architecture.md#the-engine-api; the prefix cache: docs/prefix-cache.md.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from minisgl.core import Batch, Phase, Req, SamplingParams, as_token_ids
from minisgl.engine.engine import Engine
from minisgl.engine.sampling_args import BatchSamplingArgs
from minisgl.kvcache import PageAllocator, TableIdxAllocator
from minisgl.multimodal.inputs import ImageInputs, batch_positions, chunk_images
from minisgl.scheduler.radix import Match, RadixCache, RadixNode

LORA_KEY_BITS = 32  # prefix_key: an adapter's tokens are keyed as id + (its load's id << 32)


class BatchPreparer:
    def __init__(self, engine: Engine, cache: RadixCache | None = None) -> None:
        """`cache`: a prefix cache over this engine's pages (its page_size must be the engine's)."""
        self.engine = engine
        self.page_size = engine.config.page_size
        if cache is not None and cache.page_size != self.page_size:
            raise ValueError(
                f"the prefix cache's page_size {cache.page_size} is not the engine's {self.page_size}"
            )
        self.cache = cache
        self.pages = PageAllocator(engine.num_pages)
        self.table_idxs = TableIdxAllocator(engine.config.max_running_req)
        self._req_pages: dict[int, list[int]] = {}
        # with a cache: each request's locked node in the tree, and the tokens its path spells
        self._handles: dict[int, tuple[RadixNode, int]] = {}
        self.evicted_pages = 0  # tree pages evicted so far to make room
        self._uids = itertools.count()

    @property
    def available_pages(self) -> int:
        """Pages an allocation can get: the free ones and those the tree holds unreferenced."""
        return self.pages.num_free + (0 if self.cache is None else self.cache.num_evictable_pages)

    @property
    def num_request_pages(self) -> int:
        """Pages that requests hold: their own and the tree's pages they reference."""
        return self.pages.num_used - (0 if self.cache is None else self.cache.num_evictable_pages)

    @staticmethod
    def prefix_key(
        tokens: Sequence[int], num_tokens: int, lora_id: int = 0, images: ImageInputs | None = None
    ) -> Sequence[int]:
        """The identity under which the prefix cache stores the KV of the first `num_tokens` of
        `tokens` computed under LoRA adapter load `lora_id` (0: the base model): every look-up and
        insertion goes through here. The tokens and the adapter decide the KV: under an adapter each
        token id is moved past the vocabulary by the load's id (a prompt's ids are below its vocabulary
        size, under 2**32), so the same tokens under two adapters are two paths of the tree. With
        `images` (a vision-language prompt's) their placeholder tokens are keyed by a hash of their
        image (`ImageInputs.prefix_key`, keys in [2**31, 2**32))."""
        key = tokens[:num_tokens] if images is None else images.prefix_key(list(tokens[:num_tokens]))
        if lora_id == 0:
            return key
        shift = lora_id << LORA_KEY_BITS
        return [t + shift for t in key]

    def match_prefix(
        self, token_ids: Sequence[int], lora_id: int = 0, images: ImageInputs | None = None
    ) -> Match | None:
        """The longest cached prefix of a prompt in whole pages, short of its last token (which must be
        computed to sample from it), locked until `add_request` takes it over or `unlock_prefix`
        drops it. None without a cache."""
        if self.cache is None:
            return None
        return self.cache.match(self.prefix_key(token_ids, len(token_ids) - 1, lora_id, images), lock=True)

    def unlock_prefix(self, prefix: Match | None) -> None:
        """Drops a `match_prefix` that no request took."""
        if prefix is not None:
            self.cache.unlock(prefix.handle)

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

    def add_request(
        self,
        token_ids: Sequence[int],
        sampling_params: SamplingParams | None = None,
        prefix: Match | None = None,
        lora: tuple[int, int] = (-1, 0),
        images: ImageInputs | None = None,
    ) -> Req:
        """Checks the prompt and takes a table_idx for it (no KV pages of its own yet). `prefix`: a
        `match_prefix` of this prompt, whose pages start its page table and whose tokens count as
        cached; the request takes over its lock (if this raises, the lock stays the caller's). `lora`:
        its adapter's (device slot, load id), (-1, 0) for the base model. `images`: a vision-language
        prompt's (`minisgl.multimodal.inputs`)."""
        params = sampling_params or SamplingParams()
        tokens = as_token_ids(token_ids)
        self.check_request(tokens, params)
        if prefix is not None and prefix.num_tokens >= len(tokens):
            raise ValueError(
                f"a cached prefix of {prefix.num_tokens} tokens leaves nothing to compute of a "
                f"{len(tokens)}-token prompt (match_prefix leaves its last token out)"
            )
        table_idx = self.table_idxs.alloc()
        pages = [] if prefix is None else list(prefix.pages)
        req = Req(
            input_ids=tokens,
            table_idx=table_idx,
            cached_len=len(pages) * self.page_size,
            output_len=params.max_tokens,
            uid=next(self._uids),
            sampling_params=params,
            lora_slot=lora[0],
            lora_id=lora[1],
            images=images,
        )
        self._req_pages[req.uid] = pages
        if prefix is not None:
            self._handles[req.uid] = (prefix.handle, prefix.num_tokens)
            if pages:
                self.engine.write_page_table(table_idx, 0, pages)
        return req

    def rematch(self, req: Req) -> int:
        """Before a request computes its first token: takes a longer cached prefix if the tree has one
        now (a request admitted with it, whose prefill ran since). Returns the tokens gained."""
        pages = self._req_pages[req.uid]
        if self.cache is None or req.cached_len != len(pages) * self.page_size:
            return 0
        handle, length = self._handles[req.uid]
        if req.cached_len != length:  # it computed tokens of its own
            return 0
        prefix = self.match_prefix(req.input_ids[: req.num_prompt_tokens], req.lora_id, req.images)
        if prefix.num_tokens <= length:
            self.cache.unlock(prefix.handle)
            return 0
        self.cache.unlock(handle)
        self._handles[req.uid] = (prefix.handle, prefix.num_tokens)
        self._req_pages[req.uid] = list(prefix.pages)
        self.engine.write_page_table(req.table_idx, 0, prefix.pages)
        req.cached_len = prefix.num_tokens
        return prefix.num_tokens - length

    def cache_prefix(self, req: Req) -> None:
        """Hands the whole pages of a request's computed tokens to the tree (once a prefill chunk is
        launched: a later forward that reads them runs after it), so that requests admitted from now
        on can share them; the request references them from now on. Where the tree already held some
        of those tokens (another request computed them meanwhile), the request switches to the tree's
        pages and its own copies are freed at once (safe as an abort's: the device runs the forwards
        in order), so that it never holds a page nobody reads."""
        if self.cache is None:
            return
        handle, length = self._handles[req.uid]
        num = min(req.cached_len, len(req.input_ids)) // self.page_size
        if num * self.page_size <= length:
            return
        pages = self._req_pages[req.uid]
        key = self.prefix_key(req.input_ids, num * self.page_size, req.lora_id, req.images)
        result = self.cache.insert(key, pages[:num], lock=True)
        self.cache.unlock(handle)
        self._handles[req.uid] = (result.handle, num * self.page_size)
        if result.duplicate_pages:
            pages[:num] = _path_pages(result.handle)
            self.engine.write_page_table(req.table_idx, 0, pages[:num])
            self.pages.free(result.duplicate_pages)

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
        if sum(wanted) > self.available_pages:
            self.pages.alloc(sum(wanted))  # raises the out-of-pages error, allocating nothing
        self._make_room(sum(wanted))
        input_ids: list[int] = []
        positions: list[int] = []
        out_loc: list[int] = []
        starts = [req.cached_len for req in reqs]
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
        device = self.engine.device
        if any(req.images is not None for req in reqs):
            # vision-language requests (minisgl.multimodal.inputs): M-RoPE positions, (3, n) flattened
            # where the batch computes prompt tokens of one, else index + delta; the chunk's image embeddings
            positions = batch_positions(reqs, starts, ends)
            if phase == "prefill":
                batch.images = chunk_images(reqs, starts, ends, self.engine.encode_images, device)
        batch.host_inputs = (None if pending else input_ids, positions, out_loc)
        # one host-to-device copy (from pinned memory on CUDA) for positions, out_loc and the table_idxs
        n, m = len(out_loc), len(positions)
        packed = torch.tensor(
            positions + out_loc + [req.table_idx for req in reqs],
            dtype=torch.int64,
            pin_memory=device.type == "cuda",
        ).to(device, non_blocking=True)
        batch.positions = packed[:n] if m == n else packed[:m].view(3, n)
        batch.out_loc, batch.table_idx = packed[m : m + n], packed[m + n :]
        if pending:  # the tokens the previous forward sampled, still on the device
            batch.input_ids = self.engine.last_tokens[batch.table_idx]
        else:
            # pinned: a copy from pageable memory would wait for the forwards in flight
            host = torch.tensor(input_ids, dtype=torch.int32, pin_memory=device.type == "cuda")
            batch.input_ids = host.to(device, non_blocking=True)
        return batch

    def reserve(self, req: Req, num_tokens: int) -> None:
        """Gives a request the pages of its first `num_tokens` positions now (speculative decoding: the
        draft tokens' KV is written before the verify batch is built); raises, taking nothing, when the
        pool cannot give them."""
        pages = self._req_pages[req.uid]
        wanted = self.pages_needed(num_tokens) - len(pages)
        if wanted <= 0:
            return
        if wanted > self.available_pages:
            self.pages.alloc(wanted)  # raises the out-of-pages error, allocating nothing
        self._make_room(wanted)
        first = len(pages)
        pages.extend(self.pages.alloc(wanted))
        self.engine.write_page_table(req.table_idx, first * self.page_size, pages[first:])

    def truncate(self, req: Req, num_tokens: int) -> None:
        """Frees a request's pages past its first `num_tokens` positions (speculative decoding: the
        pages only rejected draft tokens reached). Its page table keeps stale entries there, which no
        batch reads before a new allocation rewrites them."""
        pages = self._req_pages[req.uid]
        keep = self.pages_needed(num_tokens)
        if self.cache is not None:  # the tree's pages stay (they hold whole prompt pages only)
            keep = max(keep, self._handles[req.uid][1] // self.page_size)
        if keep < len(pages):
            self.pages.free(pages[keep:])
            del pages[keep:]

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

    def _make_room(self, num_pages: int) -> None:
        """Evicts unreferenced tree pages (least recently used first) until `num_pages` are free."""
        if self.cache is not None and num_pages > self.pages.num_free:
            evicted = self.cache.evict(num_pages - self.pages.num_free)
            self.pages.free(evicted)
            self.evicted_pages += len(evicted)

    def release(self, reqs: Req | Sequence[Req]) -> None:
        """Returns the requests' KV pages and table_idxs. With a prefix cache, the whole pages of each
        request's computed tokens go to the tree instead (where it already held them, its own pages
        stay and the request's copies are freed) and the request's reference is dropped."""
        for req in [reqs] if isinstance(reqs, Req) else reqs:
            pages = self._req_pages.pop(req.uid, None)
            if pages is None:
                continue
            if self.cache is not None:
                handle, _ = self._handles.pop(req.uid)
                num = min(min(req.cached_len, len(req.input_ids)) // self.page_size, len(pages))
                key = self.prefix_key(req.input_ids, num * self.page_size, req.lora_id, req.images)
                result = self.cache.insert(key, pages[:num])
                self.cache.unlock(handle)
                pages = result.duplicate_pages + pages[num:]
            self.pages.free(pages)
            self.table_idxs.free(req.table_idx)

    def clear_cache(self) -> int:
        """Evicts every unreferenced page of the prefix cache; returns how many were freed."""
        if self.cache is None:
            return 0
        freed = self.cache.clear()
        self.pages.free(freed)
        return len(freed)

    def check_pages(self) -> None:
        """Raises AssertionError unless every page in use is held by a request or by the tree (pages
        shared by both are the tree's), no page is held twice, and the tree references exactly what
        running requests use (for tests)."""
        owned = [page for pages in self._req_pages.values() for page in pages]
        tree = set() if self.cache is None else set(self.cache.held_pages())
        own = [page for page in owned if page not in tree]
        assert len(own) == len(set(own)), "a page is held by two requests"
        used = set(own) | tree
        assert len(used) == self.pages.num_used and all(0 <= p < self.engine.num_pages for p in used), (
            f"{self.pages.num_used} pages in use, {len(used)} held by requests and the tree"
        )
        if self.cache is not None:
            locked = {page for uid, (handle, _) in self._handles.items() for page in _path_pages(handle)}
            assert self.cache.num_referenced_pages == len(locked), "the tree references pages no request uses"


def _path_pages(handle: RadixNode) -> list[int]:
    """The page ids from the root down to `handle`, in token order."""
    nodes: list[RadixNode] = []
    node: RadixNode | None = handle
    while node is not None:
        nodes.append(node)
        node = node.parent
    return [page for node in reversed(nodes) for page in node.pages]


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
