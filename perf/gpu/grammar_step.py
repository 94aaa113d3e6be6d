"""A decode step with structured output on the GPU: 64 requests constrained by one JSON schema against the
same 64 requests unconstrained (goal: the constrained step at most 1.25x the unconstrained one); with
`--tools`, constrained by a forced tool call instead (`tool_choice` naming a function whose parameters
are that schema: hermes's format, the grammar the server builds, docs/tools.md; goal at most 1.5x).

    python -m perf.gpu.grammar_step [--model PATH | --config YAML] [--batch 64 [16 1 ...]] [--steps 32]
                                    [--tools] [--threads 1 [8 ...]]

The measured setting is the 0.6B preset's dummy weights with the SmolLM2 tokenizer: `--config` a copy of
configs/h200-qwen3-0.6b.yaml whose model folder holds its config.json beside SmolLM2's tokenizer files.

The model needs a tokenizer (structured output compiles its grammars against it): the embedded
SmolLM2-135M-Instruct by default, or any local folder with one (the dummy-weight presets have none).
Each variant queues the batch, runs until every request decodes, then times `--steps` scheduler steps
of the whole batch back to back (wall clock, the device synchronized at both ends) and aborts the
requests; three runs of each, alternating, and the median. The
unconstrained steps overlap (the default); the constrained ones too, with their masks filled once the
forward is launched (docs/structured-output.md), so the difference is the mask's device work
(`apply_token_mask`, timed alone) plus the host work the forward does not cover: reading the previous
step's tokens, accepting them and filling the 64 masks (`Grammars.token_mask`, timed alone) before the
sampler can run. `--threads`: the constrained variant once with each of these `Grammars.threads` (1: the
accepts and fills in the scheduler's thread; 2 or more: over its pool), alternating with the others
(default: `Grammars`' own, 1). A plain script, not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from minisgl.core import SamplingParams
from minisgl.engine.token_mask import apply_token_mask
from minisgl.llm import LLM
from perf.common import goal_note
from perf.gpu.timing import sync

# a long string keeps every request decoding through the timed steps (at least ~100 tokens each)
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        "story": {"type": "string", "minLength": 600, "maxLength": 900},
    },
    "required": ["title", "year", "story"],
}
GOAL = 1.25
TOOLS_GOAL = 1.5


def time_steps(llm: LLM, prompts: list[list[int]], params: SamplingParams, steps: int) -> float:
    """Seconds a scheduler step once all of `prompts` decode: `steps` steps back to back, the device
    synchronized before the first and after the last (so overlap scheduling keeps its overlap), divided
    by their number. Then the requests are aborted."""
    sched, device = llm.scheduler, llm.engine.device
    states = [sched.add_request(p, params) for p in prompts]
    for _ in range(1000):  # prefill (in chunks), then a few decode steps to settle
        sched.step()
        if all(s.prefilled for s in states) and all(len(s.output_ids) >= 4 for s in states):
            break
    assert all(s.prefilled and not s.finished for s in states), "the batch did not reach its decode steps"
    sync(device)
    started = time.perf_counter()
    for _ in range(steps):
        sched.step()
    sync(device)
    seconds = (time.perf_counter() - started) / steps
    assert not any(s.finished for s in states), "a request finished during the timed steps: raise minLength"
    for state in states:
        sched.abort(state)
    while sched.has_work():
        sched.step()
    return seconds


def mask_costs(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, float]:
    """(host ms to fill the batch's masks, device ms to apply them to (B, V) logits), medians."""
    sched, device = llm.scheduler, llm.engine.device
    states = [sched.add_request(p, params) for p in prompts]
    while not all(s.prefilled and len(s.output_ids) >= 4 for s in states):
        sched.step()
    saved = [s.req.device_len for s in states]
    for state in states:  # as a decode batch prepares them: each computes its last token
        state.req.device_len = len(state.req.input_ids)
    fills = []
    for _ in range(50):
        started = time.perf_counter()
        mask = sched.grammars.token_mask(states, device)
        fills.append(time.perf_counter() - started)
    assert mask is not None
    for state, device_len in zip(states, saved):
        state.req.device_len = device_len
        sched.abort(state)
    while sched.has_work():
        sched.step()
    vocab = llm.engine.config.model_config.vocab_size
    logits = torch.randn(len(states), vocab, device=device)
    for _ in range(3):
        apply_token_mask(logits, mask)
    sync(device)
    started = time.perf_counter()
    for _ in range(50):
        apply_token_mask(logits, mask)
    sync(device)
    return statistics.median(fills) * 1e3, (time.perf_counter() - started) / 50 * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a folder with a tokenizer (default: SmolLM2-135M)")
    parser.add_argument("--batch", type=int, nargs="+", default=[64], help="batch sizes, each timed")
    parser.add_argument("--tools", action="store_true", help="a forced tool call's grammar, not the schema's")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--config", default=None, help="a settings YAML (its model_path needs a tokenizer)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--threads",
        type=int,
        nargs="+",
        default=None,
        help="Grammars.threads, each timed (default: Grammars' own, 1)",
    )
    args = parser.parse_args()
    llm = LLM(
        args.model, config=args.config, device=args.device, dtype=args.dtype, max_running_req=max(args.batch)
    )
    try:
        prompts = [
            llm.chat_prompt(
                [{"role": "user", "content": f"Write story number {i} about a lighthouse as JSON."}]
            )
            for i in range(max(args.batch))
        ]
        free = SamplingParams(max_tokens=400, ignore_eos=True)
        if args.tools:
            from minisgl.server.tool_grammar import forced_grammar
            from minisgl.server.tool_parsers import FORMATS

            grammar = forced_grammar(FORMATS["hermes"], (("write_story", json.dumps(SCHEMA)),), False)
            name, constrained, goal = "forced call", SamplingParams(ebnf=grammar, max_tokens=400), TOOLS_GOAL
        else:
            name, constrained, goal = "json_schema", SamplingParams(json_schema=SCHEMA, max_tokens=400), GOAL
        grammars = llm.scheduler.grammars
        # (label, params, Grammars.threads): the unconstrained variant, then the constrained one per count
        variants = [("unconstrained", free, grammars.threads)] + [
            (f"{name}, {n} thread{'s' * (n != 1)}", constrained, n)
            for n in args.threads or [grammars.threads]
        ]
        for batch in args.batch:
            batch_prompts = prompts[:batch]
            for _, params, threads in variants:  # warm-up: graphs, compiled paths, the grammar, the pool
                grammars.threads = threads
                time_steps(llm, batch_prompts, params, 4)
            results = {label: [] for label, _, _ in variants}
            for _ in range(3):  # alternating, the median of three
                for label, params, threads in variants:
                    grammars.threads = threads
                    results[label].append(time_steps(llm, batch_prompts, params, args.steps) * 1e3)
            results = {label: statistics.median(ms) for label, ms in results.items()}
            print(f"{batch} requests, {llm.model_name}, {args.dtype}, {llm.engine.device}")
            for label, ms in results.items():
                print(f"  {label:>26}: {ms:7.3f} ms a decode step ({args.steps} steps, median of 3 runs)")
            for label, _, threads in variants[1:]:
                grammars.threads = threads
                fill_ms, apply_ms = mask_costs(llm, batch_prompts, constrained)
                ratio = results[label] / results["unconstrained"]
                print(f"  {label}: ratio {ratio:.3f}x" + goal_note(ratio, goal, at_most=True))
                print(
                    f"    of which: filling the {batch} masks {fill_ms:.3f} ms (host), "
                    f"applying them {apply_ms:.3f} ms"
                )
    finally:
        llm.shutdown()


if __name__ == "__main__":
    main()
