"""Token sampling: greedy, temperature, top-k / top-p / min-p, with counter-based (seedable) randomness.

A sampled token is drawn by inverse transform over integer weights. A token's weight is its softmax
numerator ``exp((logit - max logit) / T)`` in fixed point, rounded to a multiple of ``2**-WEIGHT_BITS``
(the most likely token weighs exactly ``2**WEIGHT_BITS``); with ``u`` uniform in (0, 1) and ``total`` the
sum of the weights the filters keep, the token is the first one (in vocabulary order) whose cumulative
weight exceeds ``floor(u * total)``: a draw from the filtered, renormalised softmax, exact up to that
rounding (a token less likely than the top one by a factor of 2**41 gets weight 0). Integer sums do not
depend on the order of the additions, so no reduction strategy, batch size, kernel choice or compiler can
change a row's token: a request's draw depends only on its own logits, parameters, seed and position.
``u`` does not come from torch's global RNG: it is a hash of ``(seed, offset)``, integer arithmetic that
gives the same value on any device.

On CUDA the whole step after the logits (argmax, weights, filters, hash, search) runs as one
``torch.compile``d function with a dynamic batch dimension: a few fused kernels instead of the many small
ops it launches eagerly (``python -m perf.gpu.sampler_ops`` counts them; see docs/performance.md); on CPU,
and with ``Sampler(..., compile=False)`` (the ``compile_sampler`` setting), the same function runs eagerly.

Launching the compiled function costs the host about 0.6 ms a step (1.2 ms with filters; H200, torch
2.11), more than a small batch's forward: a decode step of up to `GRAPH_MAX_BS` requests whose forward
replayed a CUDA graph samples by replaying a graph of the compiled function too (`capture_graphs`: one
per decode graph size and `need_filter`, reading that decode graph's static logits; the padding columns
of its arguments hold valid parameters, their tokens are dropped), when nothing transforms the logits
first (no mask, bias, penalty or suppressed token in the batch).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch._dynamo.decorators import mark_unbacked

from minisgl.compile import raise_recompile_limit
from minisgl.core import Batch, Req, SamplingParams
from minisgl.engine.token_mask import apply_token_mask

# top_k value stored for requests without a top-k limit (larger than any vocabulary)
TOP_K_ALL = 2**62

_MASK32 = 0xFFFFFFFF

# fixed point of the token weights: the most likely token weighs 2**WEIGHT_BITS; a vocabulary of up to
# 2**21 tokens sums to less than 2**62
WEIGHT_BITS = 40
# tokens per block of the two-level search and cumulative sums (no scan is longer than this)
SAMPLE_BLOCK = 1024

# the largest decode batch whose sampling replays a CUDA graph (the host's launch cost matters where the
# forward is short)
GRAPH_MAX_BS = 64

# seeds for requests without one, when from_reqs is given no generator
_default_rng = random.Random()


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(x * c) mod 2**32`` for int64 ``x`` in [0, 2**32) and a 32-bit constant ``c``.

    A constant of 2**31 or more is replaced by ``c - 2**32`` (the same residue mod 2**32), so the int64
    product stays inside (-2**63, 2**63): nothing overflows, and the mask takes the residue exactly.
    """
    return (x * (c if c < 2**31 else c - 2**32)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """The "lowbias32" integer finaliser (xorshift-multiply rounds, a bijection on 32-bit values).

    ``x`` is int64 with values in [0, 2**32); so is the result. Values stay non-negative, so the
    right shifts are logical shifts.
    """
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    x = x ^ (x >> 16)
    return x


def _absorb(h: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Chains a non-negative int64 ``value`` (both 32-bit halves) into the 32-bit hash state ``h``."""
    h = _mix32(h ^ (value & _MASK32))
    return _mix32(h ^ ((value >> 32) & _MASK32))


def uniform_from_hash(seeds: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """One uniform number in (0, 1) per row, float64, a pure function of (seed, offset).

    ``seeds`` and ``offsets`` are int64 (B,) tensors with non-negative values; the row's 32-bit state is
    the chained hash of both, mixed once more, and ``u = (k + 0.5) / 2**32`` (never 0 or 1).
    """
    h = torch.full_like(seeds, 0x9E3779B9)
    h = _mix32(_absorb(_absorb(h, seeds), offsets))
    return h.to(torch.float64).add_(0.5).mul_(1.0 / 2**32)


def token_weights(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """int64 (B, V): ``round(exp((logit - max) / T) * 2**WEIGHT_BITS)`` per row; ``T`` > 0 (B,) float32.

    The top token weighs ``2**WEIGHT_BITS``; -inf logits (suppressed tokens) weigh 0.
    """
    logits = logits.float()
    top = logits.amax(dim=-1, keepdim=True)
    weights = torch.exp((logits - top) / temperatures[:, None]) * float(2**WEIGHT_BITS)
    return torch.round(weights).to(torch.int64)


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """(B, V) -> (B, ceil(V / SAMPLE_BLOCK), SAMPLE_BLOCK), padded with zeros."""
    batch, width = x.shape
    if width % SAMPLE_BLOCK:
        x = F.pad(x, (0, SAMPLE_BLOCK - width % SAMPLE_BLOCK))
    return x.view(batch, -1, SAMPLE_BLOCK)


def blocked_cumsum(x: torch.Tensor) -> torch.Tensor:
    """The inclusive cumulative sum of int64 (B, V) along V, as cumulative sums inside blocks of
    ``SAMPLE_BLOCK`` plus the sums of the blocks before: integers, so equal to one long scan (which
    inductor cannot split on a 151,936-wide row)."""
    blocks = _blocks(x)
    inner = blocks.cumsum(dim=-1)
    before = inner[:, :, -1].cumsum(dim=-1) - inner[:, :, -1]
    return (inner + before[:, :, None]).flatten(1)[:, : x.shape[1]]


def draw(weights: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per row, the first token whose inclusive cumulative weight exceeds the target: int64 (B,).

    ``weights`` is int64 (B, V), non-negative; ``targets`` int64 (B,) in [0, row total). Two levels, so no
    scan covers the whole vocabulary: the cumulative sums of the block totals locate the block (the
    number of blocks whose cumulative total is <= target), one cumulative sum inside that block locates
    the token. Tokens of weight 0 are never drawn; a row that weighs 0 in all (NaN logits) still gets an
    id inside the vocabulary.
    """
    blocks = _blocks(weights)
    cdf = blocks.sum(dim=-1).cumsum(dim=-1)
    # clamped: a row of zero weights (NaN logits) must not index past the vocabulary
    block = (cdf <= targets[:, None]).sum(dim=-1, keepdim=True).clamp_(max=cdf.shape[1] - 1)
    local = blocks.gather(1, block[:, :, None].expand(-1, -1, SAMPLE_BLOCK)).squeeze(1)
    local_target = targets[:, None] - (cdf.gather(1, block) - local.sum(dim=-1, keepdim=True))
    token = (local.cumsum(dim=-1) <= local_target).sum(dim=-1, keepdim=True)
    return (block * SAMPLE_BLOCK + token).squeeze(1).clamp_(max=weights.shape[1] - 1)


def keep_mask(
    weights: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Boolean (B, V): the tokens that top-k, top-p and min-p all keep, judged on the unfiltered weights.

    Top-k keeps the k heaviest tokens; top-p keeps a token if the weight of the tokens sorted before it
    (descending, stable sort, so ties go to the lower token id) is below ``top_p`` times the total (so
    the heaviest token is always kept); min-p keeps tokens of weight >= ``min_p`` times the heaviest.
    """
    ordered, order = torch.sort(weights, dim=-1, descending=True, stable=True)
    rank = torch.arange(weights.shape[1], device=weights.device)[None, :]
    keep = rank < top_k[:, None]
    before = (blocked_cumsum(ordered) - ordered).double()
    total = ordered.sum(dim=-1, keepdim=True).double()
    # the heaviest token always stays, however small top_p is (1e-50 is 0 in float32)
    keep &= (before < top_p.double()[:, None] * total) | (top_p[:, None] >= 1.0) | (rank == 0)
    keep &= ordered.double() >= min_p.double()[:, None] * ordered[:, :1].double()
    return torch.zeros_like(keep).scatter_(1, order, keep)


def mark_batch_unbacked(logits: torch.Tensor, floats: torch.Tensor, ints: torch.Tensor) -> None:
    """Marks the batch dimension of `sample_rows`' arguments unbacked before a compiled call: dynamo
    then compiles one graph for every batch size, one row included (a dynamic but backed size would get
    a graph of its own at 1)."""
    for tensor, dim in ((logits, 0), (floats, 1), (ints, 1)):
        mark_unbacked(tensor, dim)


def sample_rows(
    logits: torch.Tensor, floats: torch.Tensor, ints: torch.Tensor, need_filter: bool
) -> torch.Tensor:
    """Next tokens, int32 (B,), of logits (B, V) for the arguments of `BatchSamplingArgs`: ``floats``
    (3, B) float32 = temperature, top_p, min_p; ``ints`` (3, B) int64 = top_k, seed, offset. Rows with
    temperature 0 take the argmax. The function `Sampler` compiles on CUDA."""
    temperatures, top_p, min_p = floats.unbind(0)
    top_k, seeds, offsets = ints.unbind(0)
    greedy = logits.argmax(dim=-1)
    is_greedy = temperatures == 0
    weights = token_weights(logits, torch.where(is_greedy, torch.ones_like(temperatures), temperatures))
    if need_filter:
        weights = weights * keep_mask(weights, top_k, top_p, min_p)
    total = weights.sum(dim=-1)
    # u <= 1 - 2**-33 and total >= 1, so the target stays below the total
    targets = (uniform_from_hash(seeds, offsets) * total.double()).floor().to(torch.int64)
    return torch.where(is_greedy, greedy, draw(weights, targets)).to(torch.int32)


def _packed_row(field: str, row: int) -> property:
    """A read-only named view of row `row` of the packed (3, B) `field` of `BatchSamplingArgs` (None
    when the field is None)."""

    def get(args: BatchSamplingArgs) -> torch.Tensor | None:
        packed = getattr(args, field)
        return None if packed is None else packed[row]

    return property(get, doc=f"row {row} of ``{field}``, or None")


@dataclass
class BatchSamplingArgs:
    """Per-request sampling parameters of one batch, as tensors on the device.

    ``floats`` is (3, B) float32: temperature (0 = greedy), top_p, min_p; ``ints`` is (3, B) int64: top_k
    (``TOP_K_ALL`` when unlimited), seed (a fresh random seed for requests without one) and offset (the
    position of the token being sampled, ``req.device_len``). Two copies to the device per step; the
    named fields are views of them. All are None when every request is greedy. ``all_greedy`` and
    ``need_filter`` (some sampled request uses top-k, top-p or min-p) are host booleans, so
    ``Sampler.sample`` can pick its path without a device sync.
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


class Sampler:
    """Turns the last-position logits of a batch into next tokens (see the module docstring).

    ``compile``: on CUDA, run the sampled path as one compiled function (False: the same function
    eagerly, for ablation; the ``compile_sampler`` setting). CPU always runs it eagerly.
    """

    def __init__(self, device: torch.device, vocab_size: int, compile: bool = True, slots: int = 1) -> None:
        self.device = device
        self.vocab_size = vocab_size
        self.slots = slots  # table rows: the per-slot token counts of the penalties have as many
        self._counts: torch.Tensor | None = None  # (slots, V) int32: each generated token's count
        self._seen: torch.Tensor | None = None  # (slots, V) bool: prompt and generated tokens
        self._rng = random.Random()
        # (decode graph size, need_filter) -> (graph, its floats and ints arguments, its tokens)
        self._graphs: dict[
            tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, torch.Tensor]
        ] = {}
        self._compiled = None
        if device.type == "cuda" and compile:
            # one graph per need_filter value (for every batch size: `mark_batch_unbacked`), per vocabulary
            raise_recompile_limit()
            self._compiled = torch.compile(sample_rows, fullgraph=True, dynamic=False)

    @property
    def compiled(self) -> bool:
        """True when the sampled path runs compiled (CUDA, ``compile`` on)."""
        return self._compiled is not None

    def prepare(self, batch: Batch) -> BatchSamplingArgs:
        """The sampling arguments of ``batch``; call it before the forward so the copy overlaps."""
        return BatchSamplingArgs.from_reqs(batch.reqs, self.device, self._rng)

    def sample(self, logits: torch.Tensor, args: BatchSamplingArgs, graph_bs: int = 0) -> torch.Tensor:
        """Next token ids, int32 of shape (B,), on the device of ``logits``.

        ``graph_bs``: the logits are the first B rows of the static output of the decode graph of that
        size (its sampler graph, if captured, then runs the sampled path; see the module docstring).

        ``logits`` is (B, V) with V >= ``vocab_size``; columns past ``vocab_size`` (padding) are
        ignored. The transforms, in order: the structured-output mask (`token_mask`), logit_bias, the
        penalties, the suppressed tokens (min_tokens); then rows with temperature 0 take the argmax of
        the logits and the other rows draw from ``softmax(logits / T)`` restricted to the tokens that
        every active filter keeps, each filter judged on the unfiltered weights (`keep_mask`). Nothing
        here syncs with the host.
        """
        if logits.dim() != 2 or logits.shape[1] < self.vocab_size:
            raise ValueError(
                f"logits must be (batch, >= vocab_size={self.vocab_size}), got shape {tuple(logits.shape)}"
            )
        logits = logits[:, : self.vocab_size]
        mask = args.token_mask() if callable(args.token_mask) else args.token_mask
        plain = mask is None and args.bias_ids is None and args.penalties is None and args.suppress is None
        graph = self._graphs.get((graph_bs, args.need_filter)) if plain and not args.all_greedy else None
        if graph is not None:
            graph, floats, ints, tokens = graph
            floats[:, : logits.shape[0]].copy_(args.floats, non_blocking=True)
            ints[:, : logits.shape[0]].copy_(args.ints, non_blocking=True)
            graph.replay()
            return tokens[: logits.shape[0]]
        if mask is not None:  # structured output first: what follows sees the masked logits
            logits = apply_token_mask(logits, mask)
        if args.bias_ids is not None:  # then logit_bias; padding (-1) goes to an extra column
            ids = torch.where(args.bias_ids < 0, self.vocab_size, args.bias_ids)
            logits = torch.cat(
                [logits.float(), logits.new_zeros(logits.shape[0], 1, dtype=torch.float32)], dim=1
            )
            logits = logits.scatter_add_(1, ids, args.bias_values)[:, : self.vocab_size]
        if args.penalties is not None:
            logits = self._penalize(logits, args.penalties)
        if args.suppress is not None:  # an extra column takes the padding entries
            logits = torch.cat([logits, logits.new_zeros(logits.shape[0], 1)], dim=1)
            logits = logits.scatter_(1, args.suppress, float("-inf"))[:, : self.vocab_size]
        if args.all_greedy:
            tokens = logits.argmax(dim=-1).to(torch.int32)
        else:
            assert args.floats is not None and args.ints is not None
            if self._compiled is None:
                tokens = sample_rows(logits, args.floats, args.ints, args.need_filter)
            else:
                mark_batch_unbacked(logits, args.floats, args.ints)
                tokens = self._compiled(logits, args.floats, args.ints, args.need_filter)
        if args.penalties is not None:
            self._count(tokens, args.penalties)
        return tokens

    def logprobs(
        self, logits: torch.Tensor, tokens: torch.Tensor, args: LogprobArgs
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(R,) float32 log probabilities of the scored rows' targets and their ``args.top`` most likely
        tokens, (R, top) int64 ids and (R, top) float32 log probabilities, most likely first, under
        ``log_softmax`` of the model's ``logits`` as they are (before bias, penalties and temperature).
        ``tokens``: the batch's sampled tokens (the targets -1 take theirs). Nothing syncs."""
        x = logits[args.lp_rows, : self.vocab_size].float()
        norm = torch.logsumexp(x, dim=-1, keepdim=True)
        sampled = tokens.long()[args.sampled_of.clamp(min=0)]
        targets = torch.where(args.targets < 0, sampled, args.targets)
        chosen = (x.gather(1, targets[:, None]) - norm).squeeze(1)
        if args.top == 0:
            return chosen, targets.new_empty(len(targets), 0), x.new_empty(len(targets), 0)
        values, ids = x.topk(args.top, dim=-1, sorted=True)
        return chosen, ids, values - norm

    def _penalize(self, logits: torch.Tensor, pen: PenaltyArgs) -> torch.Tensor:
        """The penalised rows' logits: a token seen in the prompt or the output divided by the
        repetition penalty when positive (multiplied when negative), then each generated token's
        logit lowered by frequency x its count and presence x (count > 0). The per-slot counts are
        made (zeroed, lazily allocated) for the requests that start in this batch."""
        if self._counts is None:
            self._counts = torch.zeros(self.slots, self.vocab_size, dtype=torch.int32, device=self.device)
            self._seen = torch.zeros(self.slots, self.vocab_size, dtype=torch.bool, device=self.device)
        pin = self.device.type == "cuda"
        for slot, tokens, generated in pen.fresh:
            self._counts[slot].zero_()
            self._seen[slot].zero_()
            seen = torch.tensor(tokens, pin_memory=pin).to(self.device, non_blocking=True)
            self._seen[slot].index_fill_(0, seen, True)
            if generated:
                ids = torch.tensor(generated, pin_memory=pin).to(self.device, non_blocking=True)
                self._counts[slot].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
        counts, seen = self._counts[pen.slots], self._seen[pen.slots]
        if pen.extra is not None:  # a verify step's drafts before each row
            ones = torch.ones_like(pen.extra[0], dtype=torch.int32)
            counts = counts.index_put(pen.extra, ones, accumulate=True)
            seen = seen.index_put(pen.extra, torch.ones_like(pen.extra[0], dtype=torch.bool))
        presence, frequency, repetition = pen.values[:, :, None].unbind(0)
        x = logits[pen.rows]
        x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
        x = x - frequency * counts - presence * (counts > 0)
        return logits.index_copy(0, pen.rows, x)

    @torch.inference_mode()
    def count_tokens(self, slots: list[int], tokens: list[int]) -> None:
        """Adds generated tokens to their slots' penalty counts (a verify step's accepted tokens, known
        on the host once the step is read); nothing before any request used penalties."""
        if self._counts is None or not slots:
            return
        pin = self.device.type == "cuda"
        host = torch.tensor([slots, tokens], dtype=torch.int64, pin_memory=pin)
        flat = host.to(self.device, non_blocking=True)
        flat = flat[0] * self.vocab_size + flat[1]
        self._counts.view(-1).scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        self._seen.view(-1).scatter_(0, flat, torch.ones_like(flat, dtype=torch.bool))

    def _count(self, tokens: torch.Tensor, pen: PenaltyArgs) -> None:
        """Adds each penalised row's new token (if it is an output) to its slot's counts."""
        assert self._counts is not None and self._seen is not None
        # flat scatters: index_put_ with a tensor index blocked the host for ~1.5 ms a call on an H200
        flat = pen.slots.long() * self.vocab_size + tokens[pen.rows].long()
        self._counts.view(-1).scatter_add_(0, flat, pen.emits.to(torch.int32))
        seen = self._seen.view(-1)
        seen.scatter_(0, flat, seen.gather(0, flat) | pen.emits)

    @torch.inference_mode()
    def capture_graphs(self, logits_by_bs: dict[int, torch.Tensor]) -> None:
        """Captures the compiled sampled path, with and without filters, on each decode graph's static
        logits (`logits_by_bs`: (bs, V) by graph size) up to `GRAPH_MAX_BS`, over arguments of greedy-free
        valid defaults (temperature 1, no filter). Nothing to do when the sampler runs eagerly."""
        if self._compiled is None:
            return
        stream = torch.cuda.Stream(self.device)
        pool = torch.cuda.graph_pool_handle()
        for bs, logits in sorted(logits_by_bs.items(), reverse=True):
            if bs > GRAPH_MAX_BS:
                continue
            with torch.inference_mode(False):  # normal tensors, as `BatchSamplingArgs` makes them
                floats = torch.tensor([[1.0] * bs, [1.0] * bs, [0.0] * bs], device=self.device)
                ints = torch.tensor([[TOP_K_ALL] * bs, [0] * bs, [0] * bs], device=self.device)
            for need_filter in (False, True):
                args = BatchSamplingArgs(all_greedy=False, need_filter=need_filter, floats=floats, ints=ints)
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    self.sample(logits, args)  # compiled already: a warm-up off the capture
                torch.cuda.current_stream(self.device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    tokens = self.sample(logits, args)
                self._graphs[(bs, need_filter)] = (graph, floats, ints, tokens)

    def destroy_graphs(self) -> None:
        self._graphs.clear()

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Compiles the sampled paths (with and without filters; one graph serves every batch size) at
        start, so the first requests do not pay for it. Nothing to do when the sampler runs eagerly (CPU,
        or ``compile`` off). In inference mode, as `Engine.forward_batch` samples: dynamo guards on the
        grad mode, and a warm-up outside it compiled every path again at the first requests. (The
        arguments' tensors are normal tensors whatever the mode, see `BatchSamplingArgs.from_reqs`.)"""
        if self._compiled is None:
            return
        logits = torch.zeros(2, self.vocab_size, device=self.device)
        reqs = [
            Req(
                input_ids=[0],
                table_idx=0,
                cached_len=0,
                output_len=1,
                uid=-1,
                sampling_params=SamplingParams(temperature=1.0, top_k=top_k, seed=0),
            )
            for top_k in (-1, 5)
        ]
        for need_filter in (False, True):
            args = BatchSamplingArgs.from_reqs(reqs, self.device)
            args.need_filter = need_filter
            self.sample(logits, args)
