"""The embeddings' figures on a GPU (docs/embeddings.md#figures): offline throughput against the engine's
own prefill, one short input's latency at an idle server, and a chat load's TPOT with embeddings beside it.

    python -m perf.gpu.embeddings [--config YAML] [--model DIR] [--reps 3] [--chat-reps 2]
                                  [--embed-rate 4] [--embed-batch 8] [--parts server,offline]
                                  [--out FILE.json] [--shape cpu]

Parts: server (one `minisgl-run serve`: `latency`, a 32-token input alone, `--latency-requests`
sequential `POST /v1/embeddings` after a warm-up, median and p90 of the client's time; `chat`, the
serving benchmark's client at 4 requests/s alone, then the same run with embeddings requests arriving
beside it, Poisson at `--embed-rate` per second of `--embed-batch` inputs each: TPOT p50 of each run
and their ratio), offline (the engine in this process, after the server is gone: 1,024 inputs of 128
to 512 random tokens, fixed seed, through `LLM.embed`, against the same inputs run as generation with
max_tokens=1: prompt tokens per second of each and their ratio). The weights are the preset's dummy
ones (Qwen3-0.6B's config.json); the chat runs use the chat endpoint when the model folder has a
tokenizer with a chat template, else completions with token-id prompts (the report says which).
`--shape cpu`: a dry run on the CPU (the default model or `--model`, few short inputs), for
tests/test_perf_embeddings.py. Every figure goes to `--out` (the server's log beside it) and a table is
printed last. Servers bind to 127.0.0.1 and are stopped by process group; every loop is bounded in
count and seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time
import traceback
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from perf.common import (
    PRESET,
    ROOT,
    WARM_UP,
    ServerProcess,
    bench_serving,
    free_port,
    goal_note,
    http_get,
    median,
    report_line,
    serve_command,
    stop_servers_on_sigterm,
)

CPU_CONFIG = ROOT / "configs" / "cpu-smollm2.yaml"
CHAT_RATE = 4.0  # chat requests per second
GOAL_THROUGHPUT, GOAL_LATENCY_MS, GOAL_TPOT = 0.9, 10.0, 1.1
PART_TIMEOUT_S = 1800  # each part's loops stop past this


@dataclass(frozen=True)
class Shape:
    inputs: int  # offline inputs
    min_len: int  # their length in tokens, and the embeddings load's
    max_len: int
    latency_len: int  # the latency part's input
    latency_requests: int
    chat: tuple[str, ...]  # bench-serving workload flags of a chat run (rate and endpoint apart)
    warm_up: tuple[str, ...]  # bench-serving flags of the chat warm-up (none: no warm-up)
    run_timeout_s: float  # one chat run
    settings: dict[str, Any] = field(default_factory=dict)  # extra settings (LLM and serve)


GPU = Shape(1024, 128, 512, 32, 20, ("--num-prompts", "128"), tuple(WARM_UP), 300.0)
CPU = Shape(
    16, 16, 48, 32, 5,
    ("--num-prompts", "6", "--min-input", "16", "--max-input", "48", "--min-output", "8", "--max-output", "16"),
    (), 60.0, {"cpu_kv_budget_gib": 0.25},
)  # fmt: skip


def inputs(count: int, low: int, high: int, vocab: int, seed: int) -> list[list[int]]:
    """`count` token-id inputs of `low` to `high` random tokens (the benchmark workload's draw)."""
    from minisgl.bench.serving import workload

    return [list(r.prompt) for r in workload(count, low, high, 1, 1, seed=seed, vocab_size=vocab)]


def post_embeddings(url: str, model: str, ids: list[list[int]], timeout: float = 60.0) -> tuple[float, Any]:
    """One `POST /v1/embeddings` of token-id inputs: the client's seconds and the answer's data."""
    body = json.dumps({"model": model, "input": ids}).encode()
    request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=timeout) as response:
        data = json.loads(response.read())["data"]
    return time.perf_counter() - started, data


class EmbeddingLoad:
    """Embeddings requests sent in threads beside another run, Poisson at `rate` per second (a fixed
    seed), `batch` inputs each (`draw(i)`: request i's), until `stop`, `max_seconds` or as many
    requests as that time holds at the rate."""

    def __init__(
        self, url: str, model: str, draw: Callable[[int], list[list[int]]], rate: float, batch: int
    ) -> None:
        self.url, self.model, self.draw, self.rate, self.batch = url, model, draw, rate, batch
        self.seconds = 0.0
        self.done: list[tuple[float, int]] = []  # (seconds, input tokens) of each answered request
        self.failed: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _one(self, i: int) -> None:
        ids = self.draw(i)
        try:
            seconds, _ = post_embeddings(self.url, self.model, ids)
        except OSError as e:
            self.failed.append(str(e))
            return
        self.done.append((seconds, sum(map(len, ids))))

    def _send(self, max_requests: int, max_seconds: float) -> None:
        rng, started = random.Random(1), time.monotonic()
        due = 0.0
        with ThreadPoolExecutor(16) as pool:
            for i in range(max_requests):
                due += rng.expovariate(self.rate)
                if self._stop.wait(max(0.0, started + due - time.monotonic())) or due > max_seconds:
                    break
                pool.submit(self._one, i)
        self.seconds = time.monotonic() - started

    def start(self, max_seconds: float) -> EmbeddingLoad:
        max_requests = int(self.rate * max_seconds) + 1
        self._thread = threading.Thread(target=self._send, args=(max_requests, max_seconds), daemon=True)
        self._thread.start()
        return self

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(120)  # the requests in flight end (each bounded by its timeout)
        tokens = sum(n for _, n in self.done)
        return {
            "requests": len(self.done),
            "failed": len(self.failed),
            "inputs_per_request": self.batch,
            "tokens": tokens,
            "tokens_per_s": tokens / max(self.seconds, 1e-9),
            "latency_p50_ms": 1e3 * median([s for s, _ in self.done], float("nan")),
        }


# ------------------------------------------------------------------------------------------ the parts


def flush_cache(base: str) -> None:
    """`POST /flush_cache`: the server's prefix cache emptied."""
    urllib.request.urlopen(
        urllib.request.Request(f"{base}/flush_cache", b"", method="POST"), timeout=60
    ).close()


def chat_flags(model_dir: Path) -> tuple[str, list[str]]:
    """The endpoint the chat runs use and its bench-serving flags: chat where the folder has a chat
    template (where transformers reads one), else completions (token-id prompts)."""
    config = model_dir / "tokenizer_config.json"
    template = config.is_file() and json.loads(config.read_text()).get("chat_template")
    if template or any((model_dir / f"chat_template.{ext}").is_file() for ext in ("jinja", "json")):
        return "chat", ["--endpoint", "chat", "--tokenizer", str(model_dir)]
    return "completions", []


def part_server(args: argparse.Namespace, shape: Shape, out: Path) -> dict[str, Any]:
    """The latency and chat figures, on one server."""
    from minisgl.settings import EngineSettings

    settings = EngineSettings.load(args.config, **_model(args))
    model_dir = Path(settings.resolved_model_path())
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    endpoint, flags = chat_flags(model_dir)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = serve_command(args.config, port, model=args.model)
    for key, value in shape.settings.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    result: dict[str, Any] = {"endpoint": endpoint}
    deadline = time.monotonic() + PART_TIMEOUT_S
    server = ServerProcess(cmd, out.with_suffix(".server.log"), f"{base}/health")
    try:
        result["start_s"] = server.start_s
        model = json.loads(http_get(f"{base}/v1/models")[1])["data"][0]["id"]
        url = f"{base}/v1/embeddings"
        # latency: a new input each request (a repeated one would start from the prefix cache)
        short = inputs(args.latency_requests + 3, shape.latency_len, shape.latency_len, vocab, seed=32)
        times = []
        for i, ids in enumerate(short):
            if time.monotonic() > deadline:
                raise RuntimeError("the latency loop ran out of time")
            seconds, data = post_embeddings(url, model, [ids])
            if i >= 3:  # the first three warm up
                times.append(1e3 * seconds)
        result["dims"] = len(data[0]["embedding"])
        result["latency"] = {
            "input_tokens": shape.latency_len,
            "requests": len(times),
            "p50_ms": statistics.median(times),
            "p90_ms": statistics.quantiles(times, n=10)[-1] if len(times) > 1 else times[0],
        }
        print(f"latency, {shape.latency_len} tokens: p50 {result['latency']['p50_ms']:.2f} ms", flush=True)
        # chat alone and with embeddings beside it, in turn
        chat = [*flags, *shape.chat, "--request-rate", str(CHAT_RATE)]
        if shape.warm_up:  # the server's first requests may compile kernels
            bench_serving(base + "/v1", *flags, *shape.warm_up, timeout=shape.run_timeout_s)

        def draw(i: int) -> list[list[int]]:  # inputs of their own (none from the prefix cache)
            return inputs(args.embed_batch, shape.min_len, shape.max_len, vocab, seed=1000 + i)

        result["alone"], result["beside"], result["embeddings"] = [], [], []
        for i in range(args.chat_reps):
            for key in ("alone", "beside"):
                if time.monotonic() > deadline:
                    raise RuntimeError("the chat runs ran out of time")
                flush_cache(base)  # both runs send the same prompts: neither starts from the other's
                load = None
                if key == "beside":
                    load = EmbeddingLoad(url, model, draw, args.embed_rate, args.embed_batch)
                    load.start(shape.run_timeout_s)
                try:
                    report = bench_serving(base + "/v1", *chat, timeout=shape.run_timeout_s)
                finally:
                    if load is not None:
                        result["embeddings"].append(load.stop())
                result[key].append(report)
                print(report_line(f"chat {key} #{i + 1}", report), flush=True)
        tpot = {key: median([r["tpot_ms"]["p50"] for r in result[key]]) for key in ("alone", "beside")}
        result["tpot_p50_ms"] = {**tpot, "ratio": tpot["beside"] / tpot["alone"]}
    finally:  # stopped in every case, and gone before the engine part takes the device
        server.stop()
        server.wait_gone()
    return result


def part_offline(args: argparse.Namespace, shape: Shape) -> dict[str, Any]:
    """`LLM.embed` of the inputs against their prefill (generation, max_tokens=1), `--reps` times each,
    in turn, the prefix cache emptied before each run."""
    import torch

    from minisgl.core import SamplingParams
    from minisgl.llm import LLM

    llm = LLM(args.model, config=args.config, **shape.settings)
    try:
        cuda = llm.engine.device.type == "cuda"
        vocab = llm.engine.config.model_config.vocab_size
        prompts = inputs(shape.inputs, shape.min_len, shape.max_len, vocab, seed=0)
        tokens = sum(map(len, prompts))
        params = SamplingParams(max_tokens=1, ignore_eos=True)
        llm.embed(prompts[:8])  # warm-up: the first steps of a size may compile
        llm.generate(prompts[:8], params)
        rates: dict[str, list[float]] = {"embed": [], "prefill": []}
        dims = 0
        for _ in range(args.reps):
            for key in rates:
                llm.flush_cache()
                if cuda:
                    torch.cuda.synchronize()
                started = time.perf_counter()
                if key == "embed":
                    dims = len(llm.embed(prompts)[0])
                else:
                    llm.generate(prompts, params)
                rates[key].append(tokens / (time.perf_counter() - started))
            print(
                f"offline: embed {rates['embed'][-1]:,.0f} tok/s, prefill {rates['prefill'][-1]:,.0f}",
                flush=True,
            )
        embed, prefill = median(rates["embed"]), median(rates["prefill"])
        device = str(llm.engine.device) + (f" ({torch.cuda.get_device_name()})" if cuda else "")
    finally:
        llm.shutdown()
    return {"inputs": len(prompts), "tokens": tokens, "dims": dims, "device": device, "tok_s": rates,
            "embed_tok_s": embed, "prefill_tok_s": prefill, "ratio": embed / prefill}  # fmt: skip


# ------------------------------------------------------------------------------------------ the table


def table(results: dict[str, Any]) -> str:
    rows = []
    offline = results.get("offline")
    if offline:
        rows.append(("offline embed tok/s (median)", f"{offline['embed_tok_s']:,.0f}"))
        rows.append(("offline prefill tok/s (max_tokens=1)", f"{offline['prefill_tok_s']:,.0f}"))
        ratio = offline["ratio"]
        rows.append(("embed / prefill", f"{ratio:.3f}x" + goal_note(ratio, GOAL_THROUGHPUT)))
    server = results.get("server") or {}
    if "latency" in server:
        lat = server["latency"]
        met = "met" if lat["p50_ms"] < GOAL_LATENCY_MS else "NOT met"
        rows.append(
            (f"{lat['input_tokens']}-token input, idle server p50 ms",
             f"{lat['p50_ms']:.2f} (p90 {lat['p90_ms']:.2f}; goal < {GOAL_LATENCY_MS:.0f}: {met})")
        )  # fmt: skip
    if "tpot_p50_ms" in server:
        tpot = server["tpot_p50_ms"]
        rows.append((f"{server['endpoint']} 4 req/s TPOT p50 ms alone", f"{tpot['alone']:.3f}"))
        rows.append(("  with embeddings beside", f"{tpot['beside']:.3f}"))
        note = goal_note(tpot["ratio"], GOAL_TPOT, at_most=True)
        rows.append(("  beside / alone", f"{tpot['ratio']:.3f}x" + note))
        load = server["embeddings"][-1]
        rows.append(
            ("  embeddings load (last run)",
             f"{load['requests']} requests x {load['inputs_per_request']} inputs, {load['tokens_per_s']:,.0f} tok/s, "
             f"p50 {load['latency_p50_ms']:.1f} ms, failed {load['failed']}")
        )  # fmt: skip
    for part, error in results.get("errors", {}).items():
        rows.append((f"{part} FAILED", error.strip().splitlines()[-1]))
    width = max((len(k) for k, _ in rows), default=0)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _model(args: argparse.Namespace) -> dict[str, str]:
    return {"model_path": args.model} if args.model else {}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", choices=["full", "cpu"], default="full", help="cpu: a small dry run")
    parser.add_argument(
        "--config", default=None, help=f"settings YAML (default {PRESET.name}; cpu: {CPU_CONFIG.name})"
    )
    parser.add_argument("--model", default=None, help="model folder (default: the config's)")
    parser.add_argument("--parts", default="server,offline")
    parser.add_argument("--reps", type=int, default=None, help="offline runs of each kind (default 3; cpu 1)")
    parser.add_argument(
        "--chat-reps", type=int, default=None, help="chat runs of each kind (default 2; cpu 1)"
    )
    parser.add_argument("--latency-requests", type=int, default=None, help="default 20; cpu 5")
    parser.add_argument("--embed-rate", type=float, default=4.0, help="embeddings requests/s beside chat")
    parser.add_argument(
        "--embed-batch", type=int, default=None, help="inputs per embeddings request (8; cpu 2)"
    )
    parser.add_argument("--out", default="embeddings-out.json")
    args = parser.parse_args(argv)
    cpu = args.shape == "cpu"
    args.config = str(args.config or (CPU_CONFIG if cpu else PRESET))
    args.reps = args.reps or (1 if cpu else 3)
    args.chat_reps = args.chat_reps or (1 if cpu else 2)
    args.latency_requests = args.latency_requests or (CPU if cpu else GPU).latency_requests
    args.embed_batch = args.embed_batch or (2 if cpu else 8)
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    stop_servers_on_sigterm()
    args = parse_args(argv)
    shape = CPU if args.shape == "cpu" else GPU
    parts = set(args.parts.split(","))
    out = Path(args.out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    os.environ["TQDM_DISABLE"] = "1"
    results: dict[str, Any] = {"shape": args.shape, "config": args.config, "model": args.model, "errors": {}}
    for part, fn in (("server", part_server), ("offline", part_offline)):
        if part not in parts:  # the server first: the in-process engine then has the device to itself
            continue
        started = time.monotonic()
        try:
            results[part] = fn(args, shape, out) if part == "server" else fn(args, shape)
        except Exception:
            traceback.print_exc()
            results["errors"][part] = traceback.format_exc()
        results.setdefault("seconds", {})[part] = time.monotonic() - started
        out.write_text(json.dumps(results, indent=1))
    print(f"\n--- embeddings ({args.shape}; {out}) ---\n{table(results)}", flush=True)
    if results["errors"]:
        sys.exit(1)
    return results


if __name__ == "__main__":
    main()
