"""Speculative decoding on the GPU (issue 45's goals; docs/speculative.md).

    python -m perf.gpu.spec [--config YAML] [--model DIR] [--k 4] [--tokens 256] [--reps 3]
                            [--offline] [--check] [--out FILE]

- One request alone (128 random prompt tokens, `--tokens` greedy tokens, ignore_eos) without
  speculation and with every draft accepted: a test-only `ReplayProposer` (in this file, never a
  setting) proposes the tokens of the run without speculation, the ceiling of the mechanics (dummy
  weights accept nothing a real proposer offers). Alternating, `--reps` runs each, medians: the decode
  tokens per second (after the first token), their ratio, and the verify step's cost over a plain
  decode step's (decode seconds per verify step over decode seconds per plain step).
- `--offline`: the offline random workload (rate inf) with 'ngram' against without, alternating
  passes: speculation must switch itself off there (goal: at least 0.97x).
- `--check`: greedy outputs without speculation, with 'ngram' and with 'draft' (`--draft-model`, by
  default the preset's own folder: dummy weights drafting for themselves): how many tokens agree (on a
  GPU in bfloat16 a verify position's kernel differs from a decode step's, so a near-tie may flip),
  and the acceptance.

Both engines live in one process (memory_ratio 0.4 each), so the runs alternate without restarts.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Sequence

import torch

from minisgl.bench.offline import WorkloadShape, run_bench
from minisgl.core import SamplingParams
from minisgl.llm import LLM

PRESET = "configs/h200-qwen3-0.6b.yaml"


class ReplayProposer:
    """Proposes the continuation a run without speculation produced (`reference`: prompt + output by
    the prompt's first tokens): every draft is accepted. For measuring only."""

    def __init__(self) -> None:
        self.reference: dict[tuple[int, ...], list[int]] = {}

    def propose(
        self, requests: Sequence[tuple[int, Sequence[int]]], limits: Sequence[int]
    ) -> list[list[int]]:
        out = []
        for (_, tokens), limit in zip(requests, limits):
            full = self.reference.get(tuple(tokens[:16]), [])
            out.append(list(full[len(tokens) : len(tokens) + limit]))
        return out

    def forget(self, uid: int) -> None:
        return None


def _decode_rate(llm: LLM, prompt: list[int], tokens: int) -> tuple[float, float, list[int]]:
    """Decode tokens per second of one greedy request (after its first token), decode seconds, output."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    started = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(max_tokens=tokens, ignore_eos=True))[0]
    seconds = time.perf_counter() - started - out.time_to_first_token
    return (len(out.token_ids) - 1) / seconds, seconds, out.token_ids


def single(args: argparse.Namespace, base: dict) -> dict:
    off = LLM(**base)
    on = LLM(**base, speculative_method="ngram", speculative_num_tokens=args.k)
    replay = ReplayProposer()
    on.scheduler.spec.ngram = replay
    rng = random.Random(0)
    prompt = [rng.randrange(10, 10000) for _ in range(128)]
    _, _, ref = _decode_rate(off, prompt, args.tokens)  # warm-up, and the first reference
    # in bfloat16 a verify row's kernels differ from a decode step's, so the speculative run can leave
    # the reference at a near-tie (frequent with random weights): replay its own output until it is
    # stable, so that (nearly) every draft is accepted
    for _ in range(4):
        replay.reference[tuple(prompt[:16])] = prompt + ref
        _, _, out = _decode_rate(on, prompt, args.tokens)
        if out == ref:
            break
        ref = out
    result: dict = {"off": [], "replay": [], "verify_steps": [], "cost": [], "acceptance": []}
    for _ in range(args.reps):
        rate_off, s_off, _ = _decode_rate(off, prompt, args.tokens)
        spec = on.scheduler.spec
        steps, drafted, accepted = spec.verify_steps, spec.drafted, spec.accepted
        rate_on, s_on, _ = _decode_rate(on, prompt, args.tokens)
        steps = spec.verify_steps - steps
        acceptance = (spec.accepted - accepted) / max(1, spec.drafted - drafted)
        # seconds per verify step over seconds per plain decode step (whatever was accepted)
        cost = (s_on / steps) / (s_off / (args.tokens - 1))
        for key, value in (("off", rate_off), ("replay", rate_on), ("verify_steps", steps), ("cost", cost)):
            result[key].append(value)
        result["acceptance"].append(acceptance)
        print(
            f"single: off {rate_off:.1f} tok/s, replay {rate_on:.1f} tok/s, {steps} verify steps, "
            f"{acceptance:.0%} accepted, cost {cost:.3f}x"
        )
    on.shutdown()
    off.shutdown()
    return result


def offline(args: argparse.Namespace, base: dict) -> dict:
    llms = {
        "off": LLM(**base),
        "ngram": LLM(**base, speculative_method="ngram", speculative_num_tokens=args.k),
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
    parser.add_argument("--out", default=None)
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
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    print(f"\n--- speculative decoding, {args.config} {args.model or ''} k={args.k} ---")
    if "single" in results:
        r = results["single"]
        off, on = statistics.median(r["off"]), statistics.median(r["replay"])
        print(f"one request: off {off:.1f} tok/s, replay {on:.1f} tok/s = {on / off:.2f}x")
        print(f"verify step / decode step: {statistics.median(r['cost']):.3f}x (median of {len(r['cost'])})")
        print(f"drafts accepted: {statistics.median(r['acceptance']):.1%}")
    if "offline" in results:
        r = results["offline"]
        off, on = statistics.median(r["off"]), statistics.median(r["ngram"])
        print(
            f"offline rate inf: off {off:,.0f}, ngram {on:,.0f} tok/s = {on / off:.3f}x ({r['verify_steps']} verify steps)"
        )
    if "check" in results:
        print(f"check: {json.dumps(results['check'])}")


if __name__ == "__main__":
    main()
