"""The sampler's per-batch arguments, built on the host: `BatchSamplingArgs` (temperature, filters, seeds,
logit_bias, suppressed tokens, grammar mask), `PenaltyArgs` (presence, frequency, repetition) and
`LogprobArgs` (which rows' log probabilities a forward computes). Made before the forward and copied to
the device without blocking, so the copies overlap it. Details: docs/gpu.md#the-sampler.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

from minisgl.core import Req, SamplingParams
from minisgl.engine.draw import TOP_K_ALL

# seeds for requests without one, when from_reqs is given no generator
_default_rng = random.Random()


def _packed_row(field: str, row: int) -> property:
    """A read-only named view of row `row` of the packed (3, B) `field` of `BatchSamplingArgs` (None
    when the field is None)."""

    def get(args: BatchSamplingArgs) -> torch.Tensor | None:
        packed = getattr(args, field)
        return None if packed is None else packed[row]

    return property(get, doc=f"row {row} of ``{field}``, or None")


@dataclass
class BatchSamplingArgs:
    """Per-request sampling parameters of one batch, as tensors on the device (two copies a step).

    ``floats`` (3, B) float32: temperature (0 = greedy), top_p, min_p; ``ints`` (3, B) int64: top_k
    (``TOP_K_ALL``: unlimited), seed (fresh when the request has none), offset (``req.device_len``, the
    position sampled); the named fields are views of them, all None when every request is greedy.
    ``all_greedy`` and ``need_filter`` (some sampled request uses top-k, top-p or min-p) are host
    booleans, so ``Sampler.sample`` picks its path without a device sync.
    """

    all_greedy: bool
    need_filter: bool
    floats: torch.Tensor | None = None
    ints: torch.Tensor | None = None
    # (B, K) int64 token ids that must not be drawn (e.g. EOS before min_tokens), padded with vocab_size
    suppress: torch.Tensor | None = None
    # logit_bias: (B, K) int64 token ids (padded with vocab_size) and (B, K) float32 biases; None when no
    # request of the batch has one
    bias_ids: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    # presence, frequency and repetition penalties: None when no request of the batch has one
    penalties: PenaltyArgs | None = None
    # structured output: (B, ceil(V / 32)) int32 packed allowed tokens, on the device (every bit set in
    # the rows of requests without a grammar); None when no request of the batch has one
    # or a function that gives it (the scheduler's, under overlap: called after the forward is launched)
    token_mask: torch.Tensor | Callable[[], torch.Tensor | None] | None = None
    # log probabilities: None when no request of the batch asks for any in this forward
    logprobs: LogprobArgs | None = None

    temperatures = _packed_row("floats", 0)
    top_p = _packed_row("floats", 1)
    min_p = _packed_row("floats", 2)
    top_k = _packed_row("ints", 0)
    seeds = _packed_row("ints", 1)
    offsets = _packed_row("ints", 2)

    @classmethod
    def from_reqs(
        cls, reqs: list[Req], device: torch.device, rng: random.Random | None = None
    ) -> BatchSamplingArgs:
        """Builds the arguments on the host and copies them to ``device`` without blocking.

        Requests without a seed draw a new 63-bit seed from ``rng`` (default: a module-level
        ``random.Random``) on every call, so their tokens vary between steps and runs.
        """
        params = [req.sampling_params for req in reqs]
        args = cls._from_params(reqs, params, device, rng)
        if any(p.logit_bias for p in params):
            args.bias_ids, args.bias_values = _padded_bias(params, device)
        if any(p.has_penalties for p in params):
            args.penalties = PenaltyArgs.from_reqs(reqs, device)
        if any(p.logprobs is not None or p.prompt_logprobs is not None for p in params):
            args.logprobs = LogprobArgs.from_reqs(reqs, device)
        return args

    @classmethod
    def _from_params(
        cls, reqs: list[Req], params: list[SamplingParams], device: torch.device, rng: random.Random | None
    ) -> BatchSamplingArgs:
        if all(p.is_greedy for p in params):
            return cls(all_greedy=True, need_filter=False)
        rng = rng if rng is not None else _default_rng
        need_filter = any(not p.is_greedy and (p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0) for p in params)
        pin = device.type == "cuda"
        # normal tensors, also when made in inference mode (the sampler's warm-up): the compiled sampler's
        # guards include the dispatch keys, which differ
        with torch.inference_mode(False):
            floats = torch.tensor(
                [[p.temperature for p in params], [p.top_p for p in params], [p.min_p for p in params]],
                dtype=torch.float32,
                pin_memory=pin,
            )
            ints = torch.tensor(
                [
                    [min(p.top_k, TOP_K_ALL) if p.top_k > 0 else TOP_K_ALL for p in params],
                    [p.seed if p.seed is not None else rng.getrandbits(63) for p in params],
                    [req.device_len for req in reqs],
                ],
                dtype=torch.int64,
                pin_memory=pin,
            )
            return cls(
                all_greedy=False,
                need_filter=need_filter,
                floats=floats.to(device, non_blocking=True),
                ints=ints.to(device, non_blocking=True),
            )


@dataclass
class PenaltyArgs:
    """The penalised rows of a batch: ``rows`` (P,) their indices in the batch, ``slots`` (P,) their
    table_idx (the row of the sampler's per-slot token counts), ``values`` (3, P) float32 presence,
    frequency and repetition penalties, ``emits`` (P,) whether the row's token is an output (not the
    token of a chunk that leaves prompt tokens for later), all on the device; ``fresh``: host lists
    (slot, every token so far, the generated ones) of the requests whose counts start in this batch
    (their first forward in that slot, after an admission or a re-admission)."""

    rows: torch.Tensor
    slots: torch.Tensor
    values: torch.Tensor
    emits: torch.Tensor
    fresh: list[tuple[int, list[int], list[int]]]
    # a verify step's (speculative decoding) draft tokens before each penalised row: (E,) indices into
    # the penalised rows and (E,) token ids, counted on top of the slot's counts for that row only
    extra: tuple[torch.Tensor, torch.Tensor] | None = None

    def add_drafts(self, extra: list[tuple[int, int]], silent: list[int], device: torch.device) -> None:
        """A verify step's penalised rows: `extra` (penalised row, draft token before it) pairs, and the
        penalised rows whose token is not counted now (`silent`: the scheduler counts the accepted
        tokens once it knows them, `Sampler.count_tokens`)."""
        pin = device.type == "cuda"
        if extra:
            with torch.inference_mode(False):
                host = torch.tensor(extra, dtype=torch.int64, pin_memory=pin).T.contiguous()
            packed = host.to(device, non_blocking=True)
            self.extra = (packed[0], packed[1])
        if silent:
            keep = torch.ones(len(self.emits), dtype=torch.bool)
            keep[silent] = False
            self.emits = self.emits & keep.to(device, non_blocking=True)

    @classmethod
    def from_reqs(cls, reqs: list[Req], device: torch.device) -> PenaltyArgs:
        rows = [i for i, req in enumerate(reqs) if req.sampling_params.has_penalties]
        fresh = []
        for i in rows:
            req = reqs[i]
            if not req.penalties_ready:
                req.penalties_ready = True
                fresh.append((req.table_idx, list(req.input_ids), req.input_ids[req.output_start :]))
        params = [reqs[i].sampling_params for i in rows]
        pin = device.type == "cuda"  # pinned, as the other arguments: the copies do not wait
        with torch.inference_mode(False):
            ints = torch.tensor(
                [rows, [reqs[i].table_idx for i in rows], [not reqs[i].is_partial for i in rows]],
                pin_memory=pin,
            )
            values = torch.tensor(
                [
                    [p.presence_penalty for p in params],
                    [p.frequency_penalty for p in params],
                    [p.repetition_penalty for p in params],
                ],
                dtype=torch.float32,
                pin_memory=pin,
            )
        ints, values = ints.to(device, non_blocking=True), values.to(device, non_blocking=True)
        return cls(rows=ints[0], slots=ints[1], values=values, emits=ints[2].bool(), fresh=fresh)


def prompt_logprob_span(req: Req) -> tuple[int, int]:
    """The positions [start, end) of `req`'s forward whose logits give prompt log probabilities (the
    logits at position p score token p + 1, a prompt token while p + 1 < `output_start`); empty
    without `prompt_logprobs`."""
    if req.sampling_params.prompt_logprobs is None:
        return req.cached_len, req.cached_len
    start = req.cached_len
    return start, max(start, min(req.device_len, req.output_start - 1))


@dataclass
class LogprobArgs:
    """What a forward computes log probabilities of. ``rows``: the token rows whose logits the model
    gives (every computed row of the requests scored over their prompt, the last of the others; None:
    each request's last, as without log probabilities) and ``last`` (B,) each request's last row among
    them; ``lp_rows`` (R,) the logits rows scored, ``targets`` (R,) the token each scores (-1: the token
    sampled for request ``sampled_of``); ``top`` the most alternatives a row asks for. ``plan``: on the
    host, per request (first prompt position scored, prompt rows, 1 if its sampled token is scored, k, k),
    in the order of ``lp_rows``, and the alternatives each asks for (prompt entries, sampled token)."""

    rows: torch.Tensor | None
    last: torch.Tensor | None
    lp_rows: torch.Tensor
    targets: torch.Tensor
    sampled_of: torch.Tensor
    top: int
    plan: list[tuple[int, int, int, int, int]]

    @classmethod
    def from_reqs(cls, reqs: list[Req], device: torch.device) -> LogprobArgs | None:
        if all(req.sampling_params.prompt_logprobs is None for req in reqs):
            return cls._sampled_only(reqs, device)
        return cls._with_prompts(reqs, device)

    @classmethod
    def _with_prompts(cls, reqs: list[Req], device: torch.device) -> LogprobArgs | None:
        """`from_reqs` in general: prompt rows scored for the requests that ask, sampled tokens for the
        others (`_sampled_only` gives the same, faster, where none asks for the prompt's)."""
        spans = [prompt_logprob_span(req) for req in reqs]
        prompt_rows = any(end > start for start, end in spans)
        rows, last, lp_rows, targets, sampled_of, plan = [], [], [], [], [], []
        top, token_row = 0, 0  # token_row: the request's first row in the batch
        for i, (req, (start, end)) in enumerate(zip(reqs, spans)):
            params = req.sampling_params
            if prompt_rows:  # a row per scored prompt position, then the last row (if not among them)
                first = len(rows)
                rows += range(token_row + start - req.cached_len, token_row + end - req.cached_len)
                lp_rows += range(first, len(rows))
                targets += req.input_ids[start + 1 : end + 1]
                sampled_of += [-1] * (end - start)
                if end < req.device_len:
                    rows.append(token_row + req.extend_len - 1)
                last.append(len(rows) - 1)
            else:
                last.append(i)
            scored = int(params.logprobs is not None and not req.is_partial)
            if scored:
                lp_rows.append(last[-1])
                targets.append(-1)
                sampled_of.append(i)
            k_prompt = params.prompt_logprobs or 0 if end > start else 0
            k_sampled = params.logprobs or 0 if scored else 0
            top = max(top, k_prompt, k_sampled)
            plan.append((start, end - start, scored, k_prompt, k_sampled))
            token_row += req.extend_len
        if not lp_rows:
            return None
        return cls._made(
            lp_rows, targets, sampled_of, top, plan, device, (rows, last) if prompt_rows else None
        )

    @classmethod
    def _sampled_only(cls, reqs: list[Req], device: torch.device) -> LogprobArgs | None:
        """`from_reqs` where no request asks for prompt log probabilities (every decode step): each
        scored request's last row, which is its index, scores its sampled token."""
        lp_rows, plan, top = [], [], 0
        for i, req in enumerate(reqs):
            k = req.sampling_params.logprobs
            if k is not None and not req.is_partial:
                lp_rows.append(i)
                top = max(top, k)
                plan.append((req.cached_len, 0, 1, 0, k))
            else:
                plan.append((req.cached_len, 0, 0, 0, 0))
        if not lp_rows:
            return None
        return cls._made(lp_rows, [-1] * len(lp_rows), lp_rows, top, plan, device, None)

    @classmethod
    def _made(cls, lp_rows, targets, sampled_of, top, plan, device, picked) -> LogprobArgs:
        """The arguments, their index lists copied to `device` without blocking; `picked`: the (rows,
        last) lists when prompt rows are scored, else None."""
        pin = device.type == "cuda"
        with torch.inference_mode(False):
            host = torch.tensor([lp_rows, targets, sampled_of], dtype=torch.int64, pin_memory=pin)
            picks = None if picked is None else torch.tensor(picked[0], dtype=torch.int64, pin_memory=pin)
            lasts = None if picked is None else torch.tensor(picked[1], dtype=torch.int64, pin_memory=pin)
        host = host.to(device, non_blocking=True)
        return cls(
            rows=None if picks is None else picks.to(device, non_blocking=True),
            last=None if lasts is None else lasts.to(device, non_blocking=True),
            lp_rows=host[0],
            targets=host[1],
            sampled_of=host[2],
            top=top,
            plan=plan,
        )


def _padded_bias(params: list[SamplingParams], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's logit biases as (B, K) ids (padded with a column past the vocabulary: `Sampler.sample`
    adds one) and (B, K) values, copied to ``device`` without blocking."""
    width = max(len(p.logit_bias) for p in params)
    ids = [[t for t, _ in p.logit_bias] + [-1] * (width - len(p.logit_bias)) for p in params]
    values = [[b for _, b in p.logit_bias] + [0.0] * (width - len(p.logit_bias)) for p in params]
    pin = device.type == "cuda"
    with torch.inference_mode(False):
        ids_t = torch.tensor(ids, dtype=torch.int64, pin_memory=pin)
        values_t = torch.tensor(values, dtype=torch.float32, pin_memory=pin)
    return ids_t.to(device, non_blocking=True), values_t.to(device, non_blocking=True)
