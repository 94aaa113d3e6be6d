"""Greedy generation on the embedded default model, through the Engine API.

python examples/generate.py "The capital of France is" [--max-tokens 32]
"""

import argparse
import logging

import transformers

from minisgl.core import SamplingParams
from minisgl.engine import Engine, generate
from minisgl.settings import EngineSettings


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("prompt", nargs="+")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--config", help="a YAML settings file (default: configs/cpu-smollm2.yaml)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    settings = EngineSettings.load(args.config or "configs/cpu-smollm2.yaml")
    engine = Engine(settings.to_engine_config())
    tokenizer = transformers.AutoTokenizer.from_pretrained(engine.config.model_path)
    prompts = [tokenizer(p)["input_ids"] for p in args.prompt]
    outputs = generate(engine, prompts, SamplingParams(max_tokens=args.max_tokens))
    for text, tokens in zip(args.prompt, outputs):
        print(f"{text}{tokenizer.decode(tokens, skip_special_tokens=True)}")
    engine.shutdown()


if __name__ == "__main__":
    main()
