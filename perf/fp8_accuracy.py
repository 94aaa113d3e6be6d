"""FP8 accuracy on real weights: the default model (SmolLM2-135M-Instruct) in float32, bf16 and FP8
(docs/quantization.md), on the CPU, where FP8 runs minisgl's float32 emulation: e4m3 weights in 128x128
blocks quantized at load (the setting `quantization: fp8`), activations rounded per token in groups of
128; also FP8 weights with the FP8 KV cache (`kv_cache_dtype: fp8_e4m3`, scales 1.0).

    python -m perf.fp8_accuracy [--tokens 4096] [--greedy 1000] [--prompts 4] [--variants ...] [--json FILE]

- Perplexity: of a fixed text, the first `--tokens` tokens of the Python standard library's reference
  text on the execution and data models (`pydoc_data.topics`, this Python's), scored as one prompt
  (prompt log probabilities: every token after the first).
- Greedy agreement: float32 continues `--prompts` prompts (64-token pieces of the same text further on)
  greedily, `--greedy` tokens in all (EOS ignored). Teacher-forced: each variant scores those
  sequences, and the share of the generated positions where its most likely token is float32's token
  is its agreement. Free-running: each variant generates greedily from the same prompts, and the
  share of its tokens equal to float32's at the same place (all tokens after a first difference
  usually differ) and where the first difference falls.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass

VARIANTS: dict[str, dict] = {
    "float32": dict(dtype="float32"),
    "bf16": dict(dtype="bfloat16"),
    "fp8": dict(dtype="float32", quantization="fp8"),
    "fp8+fp8-kv": dict(dtype="float32", quantization="fp8", kv_cache_dtype="fp8_e4m3"),
}
PROMPT_TOKENS = 64


@dataclass
class Result:
    variant: str
    perplexity: float
    text_top1_agreement: float  # share of the text's positions whose most likely token is float32's
    greedy_agreement: float  # teacher-forced on float32's greedy tokens
    free_running_same: float  # share of its own greedy tokens equal to float32's at the same place
    first_difference: list[int | None]  # per prompt: index of the first token differing from float32's
    seconds: float


def fixed_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in ("execmodel", "objects", "types"))


def score(llm, ids: list[int]) -> tuple[list[float], list[int]]:
    """(log probability of each token after the first, most likely token at each of those positions)."""
    from minisgl.core import SamplingParams

    (out,) = llm.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=1))
    entries = out.prompt_logprobs[1:]
    return [e.logprob for e in entries], [e.top[0][0] for e in entries]


def greedy(llm, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    from minisgl.core import SamplingParams

    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
    return [o.token_ids for o in outs]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m perf.fp8_accuracy", description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096, help="tokens of the fixed text scored")
    parser.add_argument("--greedy", type=int, default=1000, help="greedy tokens generated in all")
    parser.add_argument("--prompts", type=int, default=4, help="prompts the greedy tokens are spread over")
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=list(VARIANTS),
        default=list(VARIANTS),
        help="float32 always runs first",
    )
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args(argv)
    variants = ["float32"] + [name for name in args.variants if name != "float32"]

    from minisgl.llm import LLM

    results: list[Result] = []
    reference: dict[str, list] = {}
    for name in variants:
        settings = VARIANTS[name]
        started = time.perf_counter()
        with LLM(device="cpu", max_running_req=args.prompts, **settings) as llm:
            if not reference:
                ids = llm.tokenizer.encode(fixed_text(), add_special_tokens=False)
                need = args.tokens + args.prompts * PROMPT_TOKENS
                if len(ids) < need:
                    raise SystemExit(f"the fixed text has {len(ids)} tokens, fewer than the {need} needed")
                text = ids[: args.tokens]
                prompts = [
                    ids[args.tokens + i * PROMPT_TOKENS : args.tokens + (i + 1) * PROMPT_TOKENS]
                    for i in range(args.prompts)
                ]
                per_prompt = args.greedy // args.prompts
                reference.update(text=text, prompts=prompts)
            text, prompts = reference["text"], reference["prompts"]
            logprobs, text_top1 = score(llm, text)
            own = greedy(llm, prompts, per_prompt)
            if name == "float32":
                reference.update(text_top1=text_top1, greedy=own)
            # teacher-forced: this variant's most likely token at each of float32's greedy positions
            agree = total = 0
            for prompt, continuation in zip(prompts, reference["greedy"]):
                _, top1 = score(llm, prompt + continuation)
                predicted = top1[len(prompt) - 1 :]  # the predictions of the generated positions
                agree += sum(p == t for p, t in zip(predicted, continuation))
                total += len(continuation)
        same = sum(a == b for mine, ref in zip(own, reference["greedy"]) for a, b in zip(mine, ref))
        firsts = [
            next((i for i, (a, b) in enumerate(zip(m, r)) if a != b), None)
            for m, r in zip(own, reference["greedy"])
        ]
        result = Result(
            variant=name,
            perplexity=math.exp(-sum(logprobs) / len(logprobs)),
            text_top1_agreement=sum(a == b for a, b in zip(text_top1, reference["text_top1"]))
            / len(text_top1),
            greedy_agreement=agree / total,
            free_running_same=same / total,
            first_difference=firsts,
            seconds=time.perf_counter() - started,
        )
        results.append(result)
        print(
            f"{name:>12}: perplexity {result.perplexity:.4f}, text top-1 = float32's {result.text_top1_agreement:.2%}, "
            f"greedy agreement {result.greedy_agreement:.2%} (teacher-forced, {total} tokens), free-running same "
            f"{result.free_running_same:.2%}, first difference at {firsts} ({result.seconds:.0f} s)",
            flush=True,
        )
    print(f"\n{args.tokens} tokens of text, {total} greedy tokens over {args.prompts} prompts")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump([asdict(r) for r in results], f, indent=2)


if __name__ == "__main__":
    main()
