"""The offline throughput benchmark (`minisgl-run bench`, also `python -m minisgl bench`): a workload run
on an `LLM` in this process, timed pass by pass. The random workload Mini-SGLang and nano-vllm publish
(`make_workload`), and the two prefix-cache workloads of `minisgl.bench.workloads` (`--workload
shared-prefix|multi-turn`; multi-turn driven by `drive_conversations`). Each pass reports its
throughput (output tokens / wall time), time-to-first-token percentiles and the prefix cache's hit
rate; the cache is emptied before each pass unless `keep_cache`. The workloads and options:
docs/performance.md#the-workload and docs/bench-workloads.md.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from minisgl.bench.workloads import (
    MULTI_TURN_CPU_SHAPE,
    SHARED_PREFIX_CPU_SHAPE,
    TOKEN_ID_MAX,
    MultiTurnShape,
    SharedPrefixShape,
    multi_turn_workload,
    next_turn_prompt,
    shared_prefix_workload,
)
from minisgl.core import SamplingParams
from minisgl.llm import LLM
from minisgl.scheduler import RequestState

WORKLOADS = ("random", "shared-prefix", "multi-turn")


@dataclass(frozen=True)
class WorkloadShape:
    num_seqs: int = 256
    min_input: int = 100
    max_input: int = 1024
    min_output: int = 100
    max_output: int = 1024
    temperature: float = 0.6
    seed: int = 0


# the default shape scaled down for a CPU
CPU_SHAPE = WorkloadShape(num_seqs=32, min_input=16, max_input=128, min_output=16, max_output=128)

Shape = WorkloadShape | SharedPrefixShape | MultiTurnShape
# workload -> (the default shape, the CPU's)
SHAPES: dict[str, tuple[Shape, Shape]] = {
    "random": (WorkloadShape(), CPU_SHAPE),
    "shared-prefix": (SharedPrefixShape(), SHARED_PREFIX_CPU_SHAPE),
    "multi-turn": (MultiTurnShape(), MULTI_TURN_CPU_SHAPE),
}


def default_shape(workload: str, device_type: str) -> Shape:
    """The workload's shape on a device of `device_type` ('cpu': scaled down; else the full one)."""
    full, cpu = SHAPES[workload]
    return cpu if device_type == "cpu" else full


def workload_name(shape: Shape) -> str:
    return next(name for name, (full, _) in SHAPES.items() if type(shape) is type(full))


def make_workload(shape: WorkloadShape, vocab_size: int) -> tuple[list[list[int]], list[int]]:
    """(prompts, max_tokens per request). Token ids above the vocabulary wrap around it."""
    rng = random.Random(shape.seed)
    prompts = [
        [
            rng.randint(0, TOKEN_ID_MAX) % vocab_size
            for _ in range(rng.randint(shape.min_input, shape.max_input))
        ]
        for _ in range(shape.num_seqs)
    ]
    max_tokens = [rng.randint(shape.min_output, shape.max_output) for _ in range(shape.num_seqs)]
    return prompts, max_tokens


@dataclass
class PassResult:
    output_tokens: int
    input_tokens: int
    seconds: float
    tokens_per_s: float
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    requests: int = 0
    # the scheduler's prefix-cache counters over the pass: prompt tokens looked up as their prefill
    # began, and those found cached; hit_rate = cached / looked up (None when nothing was looked up)
    prefix_lookup_tokens: int = 0
    prefix_cached_tokens: int = 0
    hit_rate: float | None = None


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def prefix_counters(llm: LLM) -> tuple[int, int]:
    """(prompt tokens looked up in the prefix cache so far, those found cached)."""
    return llm.scheduler.prefix_lookup_tokens, llm.scheduler.prefix_cached_tokens


def _pass_result(
    produced: int,
    input_tokens: int,
    seconds: float,
    ttfts: list[float],
    counters: tuple[tuple[int, int], tuple[int, int]],
) -> PassResult:
    (lookup0, cached0), (lookup1, cached1) = counters
    lookup, cached = lookup1 - lookup0, cached1 - cached0
    return PassResult(
        output_tokens=produced,
        input_tokens=input_tokens,
        seconds=seconds,
        tokens_per_s=produced / seconds,
        ttft_p50=_percentile(ttfts, 0.5),
        ttft_p90=_percentile(ttfts, 0.9),
        ttft_p99=_percentile(ttfts, 0.99),
        requests=len(ttfts),
        prefix_lookup_tokens=lookup,
        prefix_cached_tokens=cached,
        hit_rate=cached / lookup if lookup else None,
    )


def run_pass(llm: LLM, prompts: list[list[int]], max_tokens: list[int], temperature: float) -> PassResult:
    """All requests at once (one `generate` call); TTFT from the call."""
    params = [SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True) for n in max_tokens]
    before = prefix_counters(llm)
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, progress=True)
    seconds = time.perf_counter() - started
    after = prefix_counters(llm)
    produced = sum(len(o.token_ids) for o in outputs)
    if produced != sum(max_tokens):
        raise RuntimeError(f"the workload asked for {sum(max_tokens)} tokens, {produced} were generated")
    ttfts = [o.time_to_first_token for o in outputs]
    return _pass_result(produced, sum(map(len, prompts)), seconds, ttfts, (before, after))


# -- multi-turn --------------------------------------------------------------------------------------


@dataclass
class TurnRecord:
    """One turn of a conversation as `drive_conversations` ran it; times are `time.perf_counter()`."""

    conversation: int
    turn: int
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: str
    sent: float  # when the request was queued (its turn before it had finished)
    first_token: float | None
    finished: float

    @property
    def ttft(self) -> float | None:
        """Time to first token, from when the turn was sent."""
        return None if self.first_token is None else self.first_token - self.sent


def step_bound(conversations: Sequence[Sequence[tuple[Sequence[int], int]]]) -> int:
    """More scheduler steps than the conversations can need: twice the tokens their turns could compute
    if each step computed a single one (the longest outputs assumed), plus 1,000."""
    tokens = 0
    for turns in conversations:
        length = 0
        for user, max_tokens in turns:
            length += len(user)
            tokens += length + max_tokens
            length += max_tokens
    return 2 * tokens + 1000


def drive_conversations(
    llm: LLM,
    conversations: Sequence[Sequence[tuple[Sequence[int], int]]],
    temperature: float,
    max_steps: int | None = None,
    on_turn: Callable[[TurnRecord], None] | None = None,
) -> list[list[TurnRecord]]:
    """Runs multi-turn conversations with every conversation in flight at once: each conversation's
    first turn is queued at the start; after each scheduler step the turns that finished are recorded
    and their conversations' next turns queued, each prompt the whole conversation so far (the previous
    prompt and the tokens actually generated for it) and the turn's user ids. `conversations`: per
    conversation, per turn, (user ids, max_tokens), as `multi_turn_workload` gives them.

    Steps the scheduler itself, one step per hold of the LLM's lock, as `LLM.generate` does (other
    callers' requests share the steps). Returns the records of each conversation's turns, in order.
    Stops when every conversation has ended (a turn that fails or is aborted ends its conversation), or
    raises a RuntimeError after `max_steps` steps (default `step_bound`), aborting what is unfinished;
    on any exception its unfinished requests are aborted before it leaves."""
    scheduler = llm.scheduler
    if max_steps is None:
        max_steps = step_bound(conversations)
    records: list[list[TurnRecord]] = [[] for _ in conversations]
    in_flight: dict[int, RequestState] = {}

    def send(c: int, prompt: list[int]) -> None:  # the caller holds the lock
        max_tokens = conversations[c][len(records[c])][1]
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True)
        in_flight[c] = scheduler.add_request(prompt, params)

    steps = 0
    try:
        with llm._lock:
            for c, turns in enumerate(conversations):
                if turns:
                    send(c, list(turns[0][0]))
        while in_flight:
            if steps >= max_steps:
                raise RuntimeError(
                    f"the multi-turn driver stopped after {steps} steps with {len(in_flight)} "
                    "conversation(s) unfinished"
                )
            with llm._lock:
                llm._step()
                steps += 1
                for c in sorted(in_flight):
                    state = in_flight[c]
                    if not state.finished:
                        continue
                    del in_flight[c]
                    record = TurnRecord(
                        conversation=c,
                        turn=len(records[c]),
                        prompt_ids=state.prompt_ids,
                        output_ids=list(state.output_ids),
                        finish_reason=state.finish_reason,
                        sent=state.arrival_time,
                        first_token=state.first_token_time,
                        finished=state.finish_time,
                    )
                    records[c].append(record)
                    if on_turn is not None:
                        on_turn(record)
                    if state.finish_reason in ("stop", "length") and len(records[c]) < len(conversations[c]):
                        user = conversations[c][len(records[c])][0]
                        send(c, next_turn_prompt(state.prompt_ids, record.output_ids, list(user)))
        with llm._lock:  # nothing else to do: collect the forward still in flight (overlap), if any
            while not (scheduler.waiting or scheduler.running) and scheduler.has_work() and steps < max_steps:
                llm._step()
                steps += 1
    finally:
        unfinished = [state for state in in_flight.values() if not state.finished]
        if unfinished:
            with llm._lock:
                if not llm._closed:
                    for state in unfinished:
                        scheduler.abort(state)
    return records


def run_multi_turn_pass(
    llm: LLM, conversations: list[list[tuple[list[int], int]]], temperature: float
) -> PassResult:
    """All conversations in flight at once (`drive_conversations`); TTFT of each turn from when it was
    sent; input tokens = the prompts as sent (each the whole conversation so far)."""
    before = prefix_counters(llm)
    started = time.perf_counter()
    records = drive_conversations(llm, conversations, temperature)
    seconds = time.perf_counter() - started
    after = prefix_counters(llm)
    turns = [record for conversation in records for record in conversation]
    asked = sum(n for conversation in conversations for _, n in conversation)
    produced = sum(len(record.output_ids) for record in turns)
    if produced != asked or len(turns) != sum(map(len, conversations)):
        raise RuntimeError(
            f"the workload asked for {asked} tokens in {sum(map(len, conversations))} turns, "
            f"{produced} were generated in {len(turns)}"
        )
    input_tokens = sum(len(record.prompt_ids) for record in turns)
    return _pass_result(produced, input_tokens, seconds, [r.ttft for r in turns], (before, after))


# -- the benchmark -----------------------------------------------------------------------------------


def run_single(llm: LLM, prompt_len: int = 128, new_tokens: int = 1024) -> dict:
    """Decode speed of one request alone: `prompt_len` random tokens, `new_tokens` greedy tokens."""
    vocab = llm.engine.config.model_config.vocab_size
    rng = random.Random(1)
    prompt = [rng.randint(0, TOKEN_ID_MAX) % vocab for _ in range(prompt_len)]
    started = time.perf_counter()
    [out] = llm.generate([prompt], SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    seconds = time.perf_counter() - started
    return {
        "prompt_tokens": prompt_len,
        "new_tokens": len(out.token_ids),
        "seconds": seconds,
        "tokens_per_s": len(out.token_ids) / seconds,
    }


def run_bench(
    llm: LLM, shape: Shape, passes: int = 2, single: bool = False, keep_cache: bool = False
) -> dict:
    """Warm-up, then `passes` timed passes of the workload `shape` names (a `WorkloadShape`: random;
    `SharedPrefixShape`; `MultiTurnShape`) and, if asked, one request alone; returns a JSON-able report.
    The prefix cache is emptied before each pass (every pass starts cold), or with `keep_cache` only
    before the first (the warm-up's prefix never counts)."""
    vocab = llm.engine.config.model_config.vocab_size
    workload = workload_name(shape)
    # the warm-up prompt: ids 10001..10016, which the prefix workloads never draw
    warm_up = [(TOKEN_ID_MAX + 1 + i) % vocab for i in range(16)]
    if isinstance(shape, MultiTurnShape):
        conversations = multi_turn_workload(shape, vocab)

        def run() -> PassResult:
            return run_multi_turn_pass(llm, conversations, shape.temperature)

    else:
        if isinstance(shape, SharedPrefixShape):
            prompts, max_tokens = shared_prefix_workload(shape, vocab)
        else:
            prompts, max_tokens = make_workload(shape, vocab)
            warm_up = prompts[0][:16]

        def run() -> PassResult:
            return run_pass(llm, prompts, max_tokens, shape.temperature)

    llm.generate([warm_up], SamplingParams(max_tokens=8, ignore_eos=True))
    engine = llm.engine
    if engine.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(engine.device)
    results = []
    for i in range(passes):
        if i == 0 or not keep_cache:
            llm.flush_cache()
        results.append(run())
    extra: dict = {"single_request": run_single(llm)} if single else {}
    if engine.device.type == "cuda":
        extra["peak_memory_gib"] = torch.cuda.max_memory_allocated(engine.device) / 2**30
    cache_type = llm.scheduler.config.cache_type
    return {
        **extra,
        "model": llm.model_name,
        "device": str(engine.device),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "attention_backend": engine.config.attention_backend,
        "page_size": engine.config.page_size,
        # seconds of each start phase of (rank 0's) engine, in order
        "start_phases": {name: round(s, 2) for name, s in engine.start_phases.items()},
        "workload": workload,
        "cache_type": cache_type,
        # "each pass": emptied before every pass; "first pass": only before the first (--keep-cache);
        "cache_flushed_before": "first pass" if keep_cache else "each pass",
        "shape": asdict(shape),
        "passes": [asdict(r) for r in results],
    }


def _describe(report: dict) -> str:
    shape, workload = report["shape"], report.get("workload", "random")
    common = f"temperature {shape['temperature']}, seed {shape['seed']}, ignore_eos"
    if workload == "shared-prefix":
        return (
            f"workload shared-prefix: {shape['groups']} groups x {shape['per_group']} requests (interleaved), "
            f"shared prefix {shape['prefix_len']}, own {shape['min_own']}..{shape['max_own']}, output "
            f"{shape['min_output']}..{shape['max_output']}, {common}"
        )
    if workload == "multi-turn":
        return (
            f"workload multi-turn: {shape['conversations']} conversations x {shape['turns']} turns (all in "
            f"flight, each turn sent when the previous one ends), user {shape['min_user']}..{shape['max_user']}, "
            f"output {shape['min_output']}..{shape['max_output']}, {common}"
        )
    return (
        f"workload: {shape['num_seqs']} requests, input {shape['min_input']}..{shape['max_input']}, output "
        f"{shape['min_output']}..{shape['max_output']}, {common}"
    )


def format_report(report: dict) -> str:
    flushed = report.get("cache_flushed_before")
    lines = [
        f"model {report['model']} on {report['device']} ({report['dtype']}, attention {report['attention_backend']}, "
        f"page size {report['page_size']})",
        _describe(report),
        f"prefix cache {report.get('cache_type')}, " + f"emptied before {flushed}",
        f"{'pass':>4} {'output tok':>10} {'input tok':>10} {'time s':>8} {'tok/s':>10} "
        f"{'TTFT p50':>9} {'p90':>8} {'p99':>8} {'hit':>6}",
    ]
    for i, p in enumerate(report["passes"], 1):
        hit = p.get("hit_rate")
        lines.append(
            f"{i:>4} {p['output_tokens']:>10} {p['input_tokens']:>10} {p['seconds']:>8.2f} {p['tokens_per_s']:>10.1f} "
            f"{p['ttft_p50']:>8.3f}s {p['ttft_p90']:>7.3f}s {p['ttft_p99']:>7.3f}s "
            + (f"{100 * hit:>5.1f}%" if hit is not None else f"{'-':>6}")
        )
    if "single_request" in report:
        single = report["single_request"]
        lines.append(
            f"single request: {single['prompt_tokens']} prompt + {single['new_tokens']} new tokens (greedy) in "
            f"{single['seconds']:.2f} s = {single['tokens_per_s']:.1f} tokens/s"
        )
    if "startup_seconds" in report:
        lines.append(f"startup: {report['startup_seconds']:.1f} s")
    if "peak_memory_gib" in report:
        lines.append(f"peak memory allocated by torch: {report['peak_memory_gib']:.1f} GiB")
    return "\n".join(lines)


def dumps(report: dict) -> str:
    return json.dumps(report, indent=2)
