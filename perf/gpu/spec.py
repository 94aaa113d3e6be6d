"""Speculative decoding on the GPU against its goals (docs/speculative.md gives them and the figures).

    python -m perf.gpu.spec [--config YAML] [--model DIR] [--k 4] [--tokens 256] [--reps 3]
                            [--single [--verify-graph]] [--offline] [--check] [--profile N [--trace-dir DIR]]
                            [--out FILE]

- `--single`: one request alone, without speculation and with 'ngram', every draft accepted (a logit
  bias on `BIAS_TOKEN`: the ceiling of the mechanics on dummy weights), alternating, `--reps` runs each:
  decode tokens/s, their ratio and the verify step's time over a plain decode step's (`StepTimes`);
  `--verify-graph` also runs 'ngram' on the verify graph (16-row blocks) instead of the decode graph
  of its rows.
- `--offline`: the offline random workload (rate inf), 'ngram' against none: speculation must switch
  itself off there (goal: at least 0.97x).
- `--profile N`: one request's 64 tokens with 'ngram' and without under torch.profiler, the top N rows.
- `--check`: greedy outputs without speculation, with 'ngram' and with 'draft': how many tokens agree.

Both engines live in one process (memory_ratio 0.4 each), so the runs alternate without restarts.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time

from minisgl.bench.offline import WorkloadShape, run_bench
from minisgl.core import SamplingParams
from minisgl.llm import LLM
from perf.common import decode_rate, median

PRESET = "configs/h200-qwen3-0.6b.yaml"


# the token every output repeats in the one-request runs (a logit bias of BIAS on it, with and without
# speculation): random weights give nearly flat logits, where a verify row's bf16 kernels flip near-ties
# that a decode step's do not, so a replayed or copied continuation would soon leave the target's
BIAS_TOKEN, BIAS = 1000, 100.0


class StepTimes:
    """Wall seconds of an LLM's scheduler steps, plain and verify (a step that ran a verify forward), and
    of the parts of its verify steps: proposing, preparing the batch, launching the forward, reading its
    tokens (the wait for the device)."""

    PARTS = (
        ("spec", "propose"),
        ("spec", "propose_after"),
        ("prep", "prefill"),
        ("engine", "forward_verify"),
        ("pipeline", "read"),
    )

    def __init__(self, llm: LLM) -> None:
        self.steps: dict[str, list[float]] = {"plain": [], "verify": []}
        self.parts: dict[str, float] = {name: 0.0 for _, name in self.PARTS}
        self._inside = False
        sched = llm.scheduler
        step = sched.step

        def timed_step():
            before = sched.spec.verify_steps if sched.spec is not None else 0
            started = time.perf_counter()
            self._inside = sched.spec is not None
            try:
                out = step()
            finally:
                self._inside = False
            verified = sched.spec is not None and sched.spec.verify_steps > before
            self.steps["verify" if verified else "plain"].append(time.perf_counter() - started)
            return out

        sched.step = timed_step
        for owner, name in self.PARTS:
            if getattr(sched, owner) is not None:
                self._wrap(getattr(sched, owner), name)

    def _wrap(self, owner, name: str) -> None:
        fn = getattr(owner, name)

        def timed(*args, **kwargs):
            if not self._inside:
                return fn(*args, **kwargs)
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.parts[name] += time.perf_counter() - started

        setattr(owner, name, timed)

    def reset(self) -> None:
        self.steps = {"plain": [], "verify": []}
        self.parts = dict.fromkeys(self.parts, 0.0)


def _ms(seconds: list[float]) -> float:
    return 1e3 * median(seconds, math.nan)


def _decode_rate(llm: LLM, prompt: list[int], tokens: int) -> tuple[float, list[int]]:
    """Decode tokens per second of one greedy request biased to `BIAS_TOKEN` (after its first token),
    and its output."""
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, logit_bias={BIAS_TOKEN: BIAS})
    rate, [out] = decode_rate(llm, [prompt], params)
    return rate, out


STARTS: list[dict] = []  # each LLM's start: seconds and the compiles (dynamo graphs) it added


def _start(**kwargs) -> LLM:
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    started = time.perf_counter()
    llm = LLM(**kwargs)
    seconds = time.perf_counter() - started
    method = kwargs.get("speculative_method", "none")
    STARTS.append(
        {"method": method, "seconds": seconds, "compiles": counters["stats"]["unique_graphs"] - graphs}
    )
    print(f"start {method}: {seconds:.1f} s, {STARTS[-1]['compiles']} compiles")
    return llm


def single(args: argparse.Namespace, base: dict) -> dict:
    off = _start(**base)
    on = _start(**base, speculative_method="ngram", speculative_num_tokens=args.k)
    times = {"off": StepTimes(off), "ngram": StepTimes(on)}
    rng = random.Random(0)
    prompt = [rng.randrange(10, 10000) for _ in range(128)]
    for llm in (off, on):  # warm-up
        _decode_rate(llm, prompt, args.tokens)
    keys = ("off", "ngram", "plain_ms", "verify_ms", "cost", "acceptance", "parts_ms")
    result: dict = {key: [] for key in keys}
    for _ in range(args.reps):
        for t in times.values():
            t.reset()
        rate_off, ref = _decode_rate(off, prompt, args.tokens)
        spec = on.scheduler.spec
        steps, drafted, accepted, pipelined = (
            spec.verify_steps,
            spec.drafted,
            spec.accepted,
            spec.pipelined_steps,
        )
        rate_on, out = _decode_rate(on, prompt, args.tokens)
        if out != ref:
            raise AssertionError("speculation changed the output of a greedy request")
        steps = spec.verify_steps - steps
        acceptance = (spec.accepted - accepted) / max(1, spec.drafted - drafted)
        plain, verify = _ms(times["off"].steps["plain"]), _ms(times["ngram"].steps["verify"])
        parts = {name: round(1e3 * v / max(1, steps), 3) for name, v in times["ngram"].parts.items()}
        values = (rate_off, rate_on, plain, verify, verify / plain, acceptance, parts)
        for key, value in zip(keys, values):
            result[key].append(value)
        if args.verify_graph:  # the same request on the verify graph (16-row blocks), in the same rep
            runner = on.engine.graph_runner
            times["ngram"].reset()
            runner.verify_as_decode = False
            try:
                rate_block, out = _decode_rate(on, prompt, args.tokens)
            finally:
                runner.verify_as_decode = True
            if out != ref:
                raise AssertionError("speculation on the verify graph changed the output of a greedy request")
            block = _ms(times["ngram"].steps["verify"])
            result.setdefault("ngram_verify_graph", []).append(rate_block)
            result.setdefault("verify_graph_ms", []).append(block)
            print(f"single, verify graph: ngram {rate_block:.1f} tok/s, verify step {block:.3f} ms")
        print(
            f"single: off {rate_off:.1f} tok/s, ngram {rate_on:.1f} tok/s, {steps} verify steps "
            f"({spec.pipelined_steps - pipelined} launched before the one before was read), "
            f"{acceptance:.0%} accepted; decode step {plain:.3f} ms, verify step {verify:.3f} ms "
            f"({verify / plain:.3f}x); verify parts, ms a step: {json.dumps(parts)}"
        )
    on.shutdown()
    off.shutdown()
    return result


def offline(args: argparse.Namespace, base: dict) -> dict:
    llms = {
        "off": _start(**base),
        "ngram": _start(**base, speculative_method="ngram", speculative_num_tokens=args.k),
    }
    result: dict = {name: [] for name in llms}
    for _ in range(args.reps):
        for name, llm in llms.items():
            report = run_bench(llm, WorkloadShape(), passes=1)
            rate = report["passes"][-1]["tokens_per_s"]
            result[name].append(rate)
            print(f"offline {name}: {rate:,.0f} tok/s")
    result["verify_steps"] = llms["ngram"].scheduler.spec.verify_steps
    for llm in llms.values():
        llm.shutdown()
    return result


def check(base: dict, draft_model: str) -> dict:
    """Greedy outputs of 4 requests (random prompts, 96 tokens) without speculation, with 'ngram' and
    with 'draft' (`draft_model`: the preset's own folder, drafting for itself): how many agree."""
    rng = random.Random(1)
    prompts = [[rng.randrange(10, 10000) for _ in range(64)] for _ in range(4)]
    result, outs = {}, {}
    for method in ("none", "ngram", "draft"):
        extra = {"speculative_draft_model": draft_model} if method == "draft" else {}
        with LLM(**{**base, "memory_ratio": 0.3}, speculative_method=method, **extra) as llm:
            outs[method] = llm.generate(prompts, SamplingParams(max_tokens=96, ignore_eos=True))
            spec = llm.scheduler.spec
            result[method] = {"accepted": spec and spec.accepted, "drafted": spec and spec.drafted}
    for method in ("ngram", "draft"):
        same = sum(a.token_ids == b.token_ids for a, b in zip(outs["none"], outs[method]))
        agree = sum(
            x == y for a, b in zip(outs["none"], outs[method]) for x, y in zip(a.token_ids, b.token_ids)
        )
        result[method]["identical_outputs"] = f"{same}/4"
        result[method]["agreeing_tokens"] = f"{agree}/{4 * 96}"
        print(f"check {method}: {result[method]}")
    return result


def profile(args: argparse.Namespace, base: dict) -> dict:
    """One request's decode with 'ngram' (every draft accepted) and without, each under torch.profiler:
    the device time by kernel (graph replays' kernels included where CUPTI traces them), the top
    `--profile` rows of each; the traces go to `--trace-dir` when given."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    result = {}
    rng = random.Random(0)
    prompt = [rng.randrange(10, 10000) for _ in range(128)]
    for method in ("none", "ngram"):
        extra = {"speculative_num_tokens": args.k} if method != "none" else {}
        with _start(**base, speculative_method=method, **extra) as llm:
            _decode_rate(llm, prompt, 64)
            with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                _decode_rate(llm, prompt, 64)
            if args.trace_dir:
                prof.export_chrome_trace(f"{args.trace_dir}/spec-{method}.json")
            events = prof.key_averages()
            for key in ("self_device_time_total", "self_cuda_time_total"):
                try:
                    table = events.table(sort_by=key, row_limit=args.profile)
                    break
                except (AttributeError, KeyError, ValueError):
                    continue
            print(f"--- profile, {method}: 64 tokens ---\n{table}")
            result[method] = table
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default=PRESET)
    parser.add_argument("--model", default=None, help="model folder (default: the preset's)")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--offline", action="store_true")
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--single", action="store_true")
    parser.add_argument(
        "--verify-graph",
        action="store_true",
        help="--single: also each rep on the verify graph (16-row blocks) instead of the decode graph of the rows",
    )
    parser.add_argument("--out", default=None)
    parser.add_argument("--profile", type=int, default=0, help="profile: the top N kernels by device time")
    parser.add_argument("--trace-dir", default=None, help="--profile's chrome traces go here")
    parser.add_argument("--draft-model", default="configs/models/qwen3-0.6b", help="--check's draft")
    args = parser.parse_args()
    base = {"config": args.config, "memory_ratio": 0.4}
    if args.model:
        base["model"] = args.model
    results: dict = {"config": args.config, "model": args.model, "k": args.k}
    if args.check:
        results["check"] = check(base, args.draft_model)
    if args.single:
        results["single"] = single(args, base)
    if args.offline:
        results["offline"] = offline(args, base)
    if args.profile:
        results["profile"] = profile(args, base)
    results["starts"] = STARTS
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    print(f"\n--- speculative decoding, {args.config} {args.model or ''} k={args.k} ---")
    if "single" in results:
        r = results["single"]
        off, on = statistics.median(r["off"]), statistics.median(r["ngram"])
        print(f"one request: off {off:.1f} tok/s, ngram {on:.1f} tok/s = {on / off:.2f}x")
        verify, plain = statistics.median(r["verify_ms"]), statistics.median(r["plain_ms"])
        print(
            f"verify step {verify:.3f} ms / decode step {plain:.3f} ms: "
            f"{statistics.median(r['cost']):.3f}x (median of {len(r['cost'])})"
        )
        print(f"drafts accepted: {statistics.median(r['acceptance']):.1%}")
    if "offline" in results:
        r = results["offline"]
        off, on = statistics.median(r["off"]), statistics.median(r["ngram"])
        print(
            f"offline rate inf: off {off:,.0f}, ngram {on:,.0f} tok/s = {on / off:.3f}x ({r['verify_steps']} verify steps)"
        )
    for start in STARTS:
        print(f"start {start['method']}: {start['seconds']:.1f} s, {start['compiles']} compiles")
    if "check" in results:
        print(f"check: {json.dumps(results['check'])}")


if __name__ == "__main__":
    main()
