"""Speculative decoding on the CPU against its CPU goal (docs/speculative.md): one request at a time,
prompts whose answer copies them ("Repeat this text exactly:" + a paragraph, under the chat template),
greedy, the default model in float32; n-gram speculation against none, alternating, three runs each,
medians. The ratio of the medians (decode tokens per second, speculation over none) is printed and
kept in extra_info.

    python -m pytest perf/cpu/test_speculative.py --benchmark-only -q -s    (or nox -s perf)
"""

from __future__ import annotations

import statistics

from minisgl.core import SamplingParams
from minisgl.llm import LLM
from perf.common import decode_rate

PARAGRAPHS = [
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based ink and a wooden press adapted from wine making. Books that once took "
    "months to copy by hand could now be produced in days, and the price of knowledge fell across Europe.",
    "Rivers shape the land they cross. Over thousands of years a river carves valleys, carries sand and "
    "stones to the sea, and builds wide plains where farmers grow wheat, rice and vegetables. Cities grew "
    "along rivers because water meant trade, food and power for mills.",
    "A good recipe lists its ingredients first, in the order they are used, and then gives each step in "
    "plain words: heat the oven, mix the flour with the butter, add the eggs one at a time, and bake the "
    "cake until a knife pushed into its middle comes out clean.",
]
RUNS = 3


def test_ngram_on_copy_prompts(benchmark):
    llms = {
        "none": LLM(device="cpu", dtype="float32"),
        "ngram": LLM(device="cpu", dtype="float32", speculative_method="ngram"),
    }
    try:
        prompts = [
            llms["none"].chat_prompt([{"role": "user", "content": "Repeat this text exactly:\n\n" + p}])
            for p in PARAGRAPHS
        ]
        for llm in llms.values():  # warm-up
            llm.generate([prompts[0]], SamplingParams(max_tokens=8))
        rates: dict[str, list[float]] = {"none": [], "ngram": []}
        outputs: dict[str, list[list[int]]] = {}

        def run() -> None:
            for _ in range(RUNS):
                for name, llm in llms.items():
                    rate, outputs[name] = decode_rate(llm, prompts, SamplingParams(max_tokens=96))
                    rates[name].append(rate)

        benchmark.pedantic(run, rounds=1, iterations=1)
        assert outputs["ngram"] == outputs["none"]  # greedy: the same tokens
        spec = llms["ngram"].scheduler.spec
        medians = {name: statistics.median(r) for name, r in rates.items()}
        ratio = medians["ngram"] / medians["none"]
        benchmark.extra_info.update(
            rates=rates, medians=medians, ratio=ratio, drafted=spec.drafted, accepted=spec.accepted
        )
        print(
            f"\ndecode tok/s, medians of {RUNS}: none {medians['none']:.1f}, ngram {medians['ngram']:.1f} "
            f"= {ratio:.2f}x; drafts accepted {spec.accepted}/{spec.drafted} "
            f"({spec.accepted / max(spec.drafted, 1):.0%})"
        )
    finally:
        for llm in llms.values():
            llm.shutdown()
