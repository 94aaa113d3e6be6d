"""Qwen2.5-VL-7B (or Qwen3-VL-8B's encoder) on the GPU with dummy bf16 weights, in two parts
(`--parts encoder,requests`, both by default): the vision encoder alone on one 1280x720 image (or
`--images` of them in one call), per attention method, eager and compiled; then image requests through
the whole model in the engine against text-only requests of the same token counts.

    python -m perf.gpu.vision [--parts encoder,requests] [--model qwen2.5-vl-7b | qwen3-vl-8b]
                              [--model-config PATH] [--image 1280x720] [--images 1] [--iters 20]
                              [--peak-tflops 989] [--vl-model configs/models/qwen2.5-vl-7b] [--reps 5]
                              [--question-tokens 32] [--batch 32] [--steps 50] [--requests 64]
                              [--max-tokens 128] [--out FILE.json]
    python -m perf.gpu.vision --shape cpu      # tiny models on the CPU: the dry run of the script

Encoder. Rows: each attention method the machine has (`minisgl.models.vision.SegmentPlan`: `loop`, the
old one SDPA launch per segment; `sdpa`, the segments padded into one batched SDPA; `torch_varlen`,
torch's varlen attention; `flashinfer`, FlashInfer's ragged prefill), eager, then the block stack
compiled (inductor, one graph) with the fused methods. Columns: `ms` the median device time of one
encoder call (CUDA events around the call: its host planning included where the GPU waits for it),
`ms/image`, `GEMM TFLOP/s` the linear layers' FLOPs (counted from the shapes: patch embedding, qkv,
proj, MLP, mergers) over that time, `% peak` of `--peak-tflops` (dense bf16; 989 on H100 / H200 SXM),
and the attention's FLOPs (4 x sum of segment lengths squared x hidden, per layer) over the same time.
Below the table, the GEMMs alone: each distinct linear shape timed by itself (F.linear on random
activations) times its count, their sum and its TFLOP/s: what the encoder's GEMMs reach without
anything between them. `--model-config` reads the vision_config of a config.json (or of a model
folder's) instead of the built-in one.

Requests. One engine in this process (`--vl-model`: a folder with config.json and
preprocessor_config.json, run with dummy weights; no tokenizer: prompts are token ids and images,
`ImagePrompt`), driven step by step. An image request's prompt is `<|vision_start|>`, the image's
placeholders, `<|vision_end|>` and `--question-tokens` random ids; its image a random-pixel PIL image
of `--image` (a fixed seed per image), preprocessed as the engine's front end does (host time
reported apart: `preprocess_ms`). A text request has random ids of the same length.
- `ttft`: one image request at a time (max_tokens 1), `--reps` times after warm-ups, each a new
  image and question with the prefix cache emptied (encoder and prefill both run): the median time
  from `add_request` to its first token on the host (`ttft_ms`), that plus the request's
  preprocessing (`ttft_with_preprocess_ms`), and on CUDA the device times of its encoder call and its
  prefill forward. Goal: at most 100 ms.
- `decode`: `--batch` image requests, stepped past their prefills, then `--steps` decode steps; the
  same with text requests; rounds alternate image and text. `wall_ms` the median time between two
  step returns, `device_ms` the median device time of a decode forward (the scheduler's step records;
  CUDA only); `ratio` image over text. Goal: at most 1.03.
- `throughput`: `--requests` image requests added at once, `--max-tokens` each (ignore_eos), stepped
  until all finish, after a warm-up of the same requests with 2 tokens (the prefix cache emptied
  after); the same with text requests. Output tokens per second (and prompt + output tokens per
  second) over the time from the adds to the last token; `ratio` image over text output tokens per
  second. Goal: at least 0.8.
Every stepping loop is bounded in steps and seconds. `--out` writes every figure as JSON; a table
with each figure beside its goal is printed last. A plain script, not a test
(tests/test_perf_vision.py runs the dry run).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from minisgl.models.qwen_vl import ENCODERS
from minisgl.models.vision import ATTENTION_METHODS, VisionConfig, resolve_attention_method
from minisgl.multimodal.qwen_vl import smart_resize
from perf.common import ROOT, goal_note, median
from perf.gpu.latency import _clear, _run_until, _step
from perf.gpu.timing import median_ms

# vision_config of the checkpoints' config.json (the keys the encoders read)
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2.5-vl-7b": ("qwen2_5_vl", dict(
        depth=32, hidden_size=1280, num_heads=16, intermediate_size=3420, out_hidden_size=3584,
        hidden_act="silu", patch_size=14, temporal_patch_size=2, spatial_merge_size=2, in_chans=3,
        window_size=112, fullatt_block_indexes=[7, 15, 23, 31],
    )),
    "qwen3-vl-8b": ("qwen3_vl", dict(
        depth=27, hidden_size=1152, num_heads=16, intermediate_size=4304, out_hidden_size=4096,
        hidden_act="gelu_pytorch_tanh", patch_size=16, temporal_patch_size=2, spatial_merge_size=2,
        in_channels=3, num_position_embeddings=2304, deepstack_visual_indexes=[8, 16, 24],
    )),
}  # fmt: skip
CPU_SHAPE = dict(
    depth=2, hidden_size=64, num_heads=4, intermediate_size=96, out_hidden_size=48, hidden_act="silu",
    patch_size=14, window_size=56, fullatt_block_indexes=[1],
)  # fmt: skip
MAX_PIXELS = 12845056  # Qwen2.5-VL's preprocessor_config.json
MIN_PIXELS = 3136


def image_grid(width: int, height: int, cfg: VisionConfig) -> tuple[int, int, int]:
    """(t, h, w) in patches of a `width` x `height` image after the preprocessing's resize."""
    factor = cfg.patch_size * cfg.spatial_merge_size
    h, w = smart_resize(height, width, factor, MIN_PIXELS, MAX_PIXELS)
    return 1, h // cfg.patch_size, w // cfg.patch_size


def gemm_shapes(cfg: VisionConfig, family: str, patches: int) -> Counter[tuple[int, int, int]]:
    """Every linear layer of one call as (rows, in, out) -> count."""
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    merged, tokens = hidden * cfg.spatial_merge_size**2, patches // cfg.spatial_merge_size**2
    mlp_in = 2 if family == "qwen2_5_vl" else 1  # SwiGLU's gate and up, or fc1
    shapes: Counter[tuple[int, int, int]] = Counter()
    shapes[(patches, cfg.patch_dim, hidden)] += 1
    shapes[(patches, hidden, 3 * hidden)] += cfg.depth
    shapes[(patches, hidden, hidden)] += cfg.depth
    shapes[(patches, hidden, inter)] += mlp_in * cfg.depth
    shapes[(patches, inter, hidden)] += cfg.depth
    mergers = 1 + len(cfg.deepstack_visual_indexes)
    shapes[(tokens, merged, merged)] += mergers
    shapes[(tokens, merged, cfg.out_hidden_size)] += mergers
    return shapes


def gemm_flops(shapes: Counter[tuple[int, int, int]]) -> float:
    return float(sum(2 * m * k * n * count for (m, k, n), count in shapes.items()))


def attention_flops(cfg: VisionConfig, family: str, grids: list[tuple[int, int, int]]) -> float:
    """4 x sum(len^2) x hidden per layer (QK^T and PV), windows for Qwen2.5-VL's windowed layers."""
    from minisgl.models.qwen2_5_vl_vision import window_order

    grid = torch.tensor(grids)
    frames = [h * w for t, h, w in grids for _ in range(t)]
    full = sum(n * n for n in frames)
    windowed_layers = 0
    windows = full
    if family == "qwen2_5_vl":
        window = cfg.window_size // cfg.spatial_merge_size // cfg.patch_size
        lengths = window_order(grid, cfg.spatial_merge_size, window)[1].diff().tolist()
        windows = sum(n * n for n in lengths)
        windowed_layers = cfg.depth - len(cfg.fullatt_block_indexes)
    return 4.0 * cfg.hidden_size * (full * (cfg.depth - windowed_layers) + windows * windowed_layers)


def time_ms(fn: Callable[[], Any], iters: int, device: torch.device) -> float:
    """Median milliseconds of `fn()`: CUDA events around each call on a GPU, the wall clock on a CPU."""
    if device.type == "cuda":
        return median_ms(fn, iters, warmup=2)
    fn()
    times = []
    for _ in range(iters):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def gemm_alone_ms(shapes: Counter[tuple[int, int, int]], dtype, device, iters: int) -> float:
    """The GEMMs alone: each shape timed by itself, times its count."""
    total = 0.0
    for (m, k, n), count in shapes.items():
        x = torch.randn(m, k, dtype=dtype, device=device)
        w = torch.randn(n, k, dtype=dtype, device=device)
        total += count * time_ms(lambda x=x, w=w: F.linear(x, w), iters, device)
    return total


def load_config(args: argparse.Namespace) -> tuple[str, VisionConfig]:
    if args.shape == "cpu":
        return "qwen2_5_vl", VisionConfig.from_dict(CPU_SHAPE)
    family, raw = MODELS[args.model]
    if args.model_config:
        path = Path(args.model_config)
        path = path / "config.json" if path.is_dir() else path
        config = json.loads(path.read_text(encoding="utf-8"))
        raw = config.get("vision_config", config)
        family = "qwen3_vl" if "num_position_embeddings" in raw else "qwen2_5_vl"
    return family, VisionConfig.from_dict(raw)


def dummy_encoder(
    family: str, cfg: VisionConfig, dtype: torch.dtype, device: torch.device
) -> torch.nn.Module:
    model = ENCODERS[family](cfg).to(device=device, dtype=dtype)
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator, device=device) * 0.02)
    return model.eval()


# ------------------------------------------------------------------------------------ requests

VL_PRESET = ROOT / "configs" / "models" / "qwen2.5-vl-7b"
TTFT_GOAL_MS = 100.0  # one image request's time to first token, at most
DECODE_GOAL = 1.03  # image over text decode step, at most
THROUGHPUT_GOAL = 0.8  # image over text output tokens per second, at least
RECORDS = 4096  # step records kept while measuring (more than any measurement takes)


@dataclass(frozen=True)
class RequestsShape:
    reps: int  # TTFT repetitions
    warmup: int  # TTFT warm-up requests
    batch: int  # decode batch
    steps: int  # timed decode steps per round
    rounds: int  # decode rounds, each an image and a text batch
    requests: int  # requests at once of the throughput
    max_tokens: int  # their output tokens
    settings: dict[str, Any] = field(default_factory=dict)


GPU_REQUESTS = RequestsShape(5, 2, 32, 50, 2, 64, 128, dict(device="cuda", dtype="bfloat16"))
CPU_REQUESTS = RequestsShape(
    2, 1, 2, 3, 1, 3, 4,
    dict(device="cpu", dtype="float32", attention_backend="torch", cpu_kv_budget_gib=0.25),
)  # fmt: skip
# the dry run's model: a tiny Qwen2.5-VL (the encoder part's CPU_SHAPE as its vision tower), special
# tokens past the ids of the random questions
TINY_VL: dict[str, Any] = dict(
    architectures=["Qwen2_5_VLForConditionalGeneration"], model_type="qwen2_5_vl", vocab_size=512,
    hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False,
    rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}, bos_token_id=1, eos_token_id=2,
    vision_start_token_id=504, vision_end_token_id=505, image_token_id=506, torch_dtype="float32",
    vision_config=dict(CPU_SHAPE, out_hidden_size=64, spatial_merge_size=2, temporal_patch_size=2),
)  # fmt: skip
TINY_PREPROCESSOR = dict(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=14, merge_size=2)


def write_tiny_vl(folder: Path) -> Path:
    """The dry run's model folder: config.json and preprocessor_config.json (dummy weights)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(TINY_VL, indent=1))
    (folder / "preprocessor_config.json").write_text(json.dumps(TINY_PREPROCESSOR, indent=1))
    return folder


def noise_image(width: int, height: int, seed: int) -> Any:
    """A `width` x `height` RGB PIL image of random pixels."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


class Prompts:
    """Image prompts (`ImagePrompt`: the image's placeholders between vision start and end, then a random
    question) and text prompts of the same length, for one engine's model."""

    def __init__(self, llm: Any, folder: str, width: int, height: int, question: int) -> None:
        from minisgl.multimodal.qwen_vl import ImageProcessorConfig

        self.config = llm.engine.config.model_config
        self.processor = ImageProcessorConfig.from_folder(folder)
        raw = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
        image_id = self.config.image_token_id
        self.start_id = raw.get("vision_start_token_id", image_id)
        self.end_id = raw.get("vision_end_token_id", image_id)
        # random ids below every special token (Qwen's from 151643 on)
        specials = (image_id, self.start_id, self.end_id, *self.config.eos_token_ids, 151643)
        self.limit = min(self.config.vocab_size, *specials)
        self.size, self.question = (width, height), question

    def image(self, seed: int) -> tuple[Any, float]:
        """An image prompt (its image and question drawn from `seed`), and the ms its preprocessing
        and `ImageInputs` took on the host."""
        from minisgl.multimodal.inputs import ImageInputs, ImagePrompt
        from minisgl.multimodal.qwen_vl import preprocess_image

        picture = noise_image(*self.size, seed)
        rng = random.Random(seed)
        started = time.perf_counter()
        processed = preprocess_image(picture, self.processor)
        ids = [self.start_id, *[self.config.image_token_id] * processed.num_tokens, self.end_id]
        ids += [rng.randrange(self.limit) for _ in range(self.question)]
        inputs = ImageInputs.build(ids, [processed], self.config.image_token_id, self.processor.merge_size)
        return ImagePrompt(ids, inputs), 1e3 * (time.perf_counter() - started)

    def text(self, seed: int, length: int) -> list[int]:
        rng = random.Random(-1 - seed)
        return [rng.randrange(self.limit) for _ in range(length)]


def _add(llm: Any, prompt: Any, params: Any) -> Any:
    """Queues `prompt` (token ids or an `ImagePrompt`) on the LLM's scheduler."""
    images = getattr(prompt, "images", None)
    ids = prompt.token_ids if images is not None else prompt
    with llm._lock:
        return llm.scheduler.add_request(ids, params, images=images)


class Recorder:
    """The scheduler's step records and the engine's encoder times while measuring: `take` returns
    (and forgets) the records and the encoder seconds since the last `take`. The encoder's times are
    read by wrapping `Engine.take_encoder_seconds` on the instance (the scheduler reads them each step
    for its metric, and still gets them); `close` removes the wrapper and restores `record_steps`."""

    def __init__(self, llm: Any) -> None:
        self.sched, self.engine = llm.scheduler, llm.engine
        self.kept = self.sched.record_steps
        self.sched.record_steps = RECORDS
        self.encoder_s: list[float] = []
        original = self.engine.take_encoder_seconds

        def take_encoder_seconds() -> list[float]:
            done = original()
            self.encoder_s += done
            return done

        self.engine.take_encoder_seconds = take_encoder_seconds

    def take(self) -> tuple[list[Any], list[float]]:
        """Call with nothing in flight (after a drain): every encoder run is then complete."""
        self.engine.take_encoder_seconds()
        records = list(self.sched.step_records)
        self.sched.step_records.clear()
        encoder, self.encoder_s = self.encoder_s, []
        return records, encoder

    def close(self) -> None:
        del self.engine.take_encoder_seconds  # the class's method again
        self.sched.record_steps = self.kept


def _drain(llm: Any) -> None:
    _run_until(llm, lambda: not llm.scheduler.has_work(), "draining")
    llm.flush_cache()


def measure_ttft(llm: Any, prompts: Prompts, recorder: Recorder, reps: int, warmup: int) -> dict[str, Any]:
    """One image request at a time, max_tokens 1, each a new image and question, the prefix cache
    emptied before each: medians of `reps` after `warmup` requests."""
    from minisgl.core import SamplingParams

    rows = []
    for rep in range(warmup + reps):
        prompt, preprocess_ms = prompts.image(10_000 + rep)
        recorder.take()
        state = _add(llm, prompt, SamplingParams(max_tokens=1))
        _run_until(llm, lambda s=state: s.first_token_time is not None, "first token")
        ttft_ms = 1e3 * (state.first_token_time - state.arrival_time)
        _drain(llm)
        records, encoder = recorder.take()
        prefills = [r for r in records if r.phase == "prefill"]
        if rep >= warmup:
            rows.append(dict(
                ttft_ms=ttft_ms, preprocess_ms=preprocess_ms, ttft_with_preprocess_ms=ttft_ms + preprocess_ms,
                encoder_ms=1e3 * sum(encoder) if encoder else None, prefill_steps=len(prefills),
                prefill_device_ms=_device_sum(prefills),
            ))  # fmt: skip
    result: dict[str, Any] = {name: median(row[name] for row in rows) for name in rows[0]}
    result |= {"reps": reps, "warmup": warmup, "runs_ms": [row["ttft_ms"] for row in rows]}
    result["prefill_steps"] = max(row["prefill_steps"] for row in rows)
    return result


def decode_steps(llm: Any, batch: list[Any], steps: int, recorder: Recorder) -> dict[str, Any]:
    """`batch` requests stepped past their prefills, then `steps` timed decode steps."""
    from minisgl.core import SamplingParams

    params = SamplingParams(max_tokens=steps + 64, ignore_eos=True)
    states = [_add(llm, prompt, params) for prompt in batch]
    try:
        _run_until(llm, lambda: all(s.first_token_time for s in states), "prefill")
        recorder.take()
        returns = [_step(llm) for _ in range(steps + 1)]
    finally:
        _clear(llm, states)
    records, _ = recorder.take()
    decodes = [r for r in records if r.phase == "decode" and r.batch_size == len(batch)]
    walls = [1e3 * (b - a) for a, b in zip(returns, returns[1:])]
    return {"walls_ms": walls, "devices_ms": [r.device_ms for r in decodes[:steps]]}


def measure_decode(
    llm: Any, images: list[Any], texts: list[list[int]], steps: int, rounds: int, recorder: Recorder
) -> dict[str, Any]:
    """Image and text batches in turn (`rounds` of each, after a warm-up of 2 steps each): the median
    step over every round's steps, and image over text."""
    for batch in (images, texts):
        decode_steps(llm, batch, 2, recorder)  # warm-up
    runs: dict[str, dict[str, list[float]]] = {
        kind: {"walls_ms": [], "devices_ms": []} for kind in ("image", "text")
    }
    for _ in range(rounds):
        for kind, batch in (("image", images), ("text", texts)):
            for name, values in decode_steps(llm, batch, steps, recorder).items():
                runs[kind][name] += values
    result: dict[str, Any] = {"batch": len(images), "steps": steps, "rounds": rounds}
    result["context"] = len(texts[0])
    for kind, run in runs.items():
        result[kind] = {"wall_ms": median(run["walls_ms"]), "device_ms": median(run["devices_ms"])}
        result[kind]["timed_steps"] = len(run["walls_ms"])
    result["ratio"] = result["image"]["wall_ms"] / result["text"]["wall_ms"]
    image_device, text_device = result["image"]["device_ms"], result["text"]["device_ms"]
    result["ratio_device"] = image_device / text_device if image_device and text_device else None
    return result


def _device_sum(records: list[Any]) -> float | None:
    """The forwards' device milliseconds together (None off CUDA)."""
    if not records or any(r.device_ms is None for r in records):
        return None
    return sum(r.device_ms for r in records)


def run_at_once(llm: Any, prompts: list[Any], max_tokens: int, recorder: Recorder) -> dict[str, Any]:
    """`prompts` added at once, `max_tokens` each (ignore_eos), stepped until all finish."""
    from minisgl.core import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    recorder.take()
    started = time.perf_counter()
    states = [_add(llm, prompt, params) for prompt in prompts]
    try:
        ended = _run_until(llm, lambda: all(s.finished for s in states), "requests at once")
    finally:
        _clear(llm, states)
    records, encoder = recorder.take()
    seconds = ended - started
    output = sum(len(s.output_ids) for s in states)
    prompt_tokens = sum(len(s.prompt_ids) for s in states)
    prefill = [r for r in records if r.phase == "prefill"]
    decode = [r for r in records if r.phase == "decode"]
    return dict(
        seconds=seconds, output_tokens=output, prompt_tokens=prompt_tokens,
        output_tok_s=output / seconds, total_tok_s=(output + prompt_tokens) / seconds,
        finished=sum(s.finish_reason == "length" for s in states),
        ttft_ms_median=median(1e3 * (s.first_token_time - s.arrival_time) for s in states),
        ttft_ms_max=max(1e3 * (s.first_token_time - s.arrival_time) for s in states),
        prefill_steps=len(prefill), decode_steps=len(decode),
        prefill_device_ms=_device_sum(prefill), decode_device_ms=_device_sum(decode),
        encoder_calls=len(encoder), encoder_ms=1e3 * sum(encoder) if encoder else None,
    )  # fmt: skip


def measure_throughput(
    llm: Any, images: list[Any], texts: list[list[int]], max_tokens: int, recorder: Recorder
) -> dict[str, Any]:
    result: dict[str, Any] = {"requests": len(images), "max_tokens": max_tokens}
    result["prompt_tokens_each"] = len(texts[0])
    for kind, prompts in (("image", images), ("text", texts)):
        run_at_once(llm, prompts, 2, recorder)  # warm-up (its prefix cache emptied after)
        result[kind] = run_at_once(llm, prompts, max_tokens, recorder)
        print(
            f"{len(prompts)} {kind} requests at once: {result[kind]['output_tok_s']:,.0f} output tok/s",
            flush=True,
        )
    result["ratio"] = result["image"]["output_tok_s"] / result["text"]["output_tok_s"]
    return result


def part_requests(args: argparse.Namespace, shape: RequestsShape, folder: str) -> dict[str, Any]:
    from minisgl.llm import LLM

    width, height = args.size
    at_once = max(args.batch, args.requests)
    settings = dict(use_dummy_weight=True, detokenize=False, **shape.settings)
    settings |= dict(max_running_req=max(at_once, 8))
    if shape.settings["device"] == "cuda":
        settings["cuda_graph_max_bs"] = at_once
    started = time.perf_counter()
    result: dict[str, Any] = {"model": folder, "image": f"{width}x{height}", "settings": settings}
    with LLM(folder, **settings) as llm:
        result["start_s"] = time.perf_counter() - started
        result["start_phases_s"] = dict(llm.engine.start_phases)
        print(f"engine started in {result['start_s']:.1f} s", flush=True)
        prompts = Prompts(llm, folder, width, height, args.question_tokens)
        made = [prompts.image(i) for i in range(at_once)]
        images = [prompt for prompt, _ in made]
        length = len(images[0].token_ids)
        texts = [prompts.text(i, length) for i in range(at_once)]
        result |= dict(
            image_tokens=len(images[0].images.token_positions), question_tokens=args.question_tokens,
            prompt_tokens=length, preprocess_ms=median(ms for _, ms in made),
        )  # fmt: skip
        recorder = Recorder(llm)
        try:
            result["ttft"] = measure_ttft(llm, prompts, recorder, args.reps, shape.warmup)
            print(f"TTFT {result['ttft']['ttft_ms']:.2f} ms", flush=True)
            result["decode"] = measure_decode(
                llm, images[: args.batch], texts[: args.batch], args.steps, shape.rounds, recorder
            )
            print(f"decode ratio {result['decode']['ratio']:.4f}", flush=True)
            result["throughput"] = measure_throughput(
                llm, images[: args.requests], texts[: args.requests], args.max_tokens, recorder
            )
        finally:
            recorder.close()
    return result


def _ms_goal(value: float, goal: float) -> str:
    return f" (goal <= {goal:g} ms: {'met' if value <= goal else 'NOT met'})"


def _opt(value: float | None, fmt: str = ".2f") -> str:
    return "-" if value is None else format(value, fmt)


def requests_table(req: dict[str, Any]) -> str:
    """The requests part's figures, each beside its goal."""
    ttft, dec, thr = req["ttft"], req["decode"], req["throughput"]
    lines = [
        f"prompt: one {req['image']} image ({req['image_tokens']} placeholder tokens) + "
        f"{req['question_tokens']} question tokens = {req['prompt_tokens']} tokens; preprocessing "
        f"{req['preprocess_ms']:.1f} ms an image (host); engine started in {req['start_s']:.1f} s",
        f"TTFT, one image request, median of {ttft['reps']}: {ttft['ttft_ms']:.2f} ms"
        + _ms_goal(ttft["ttft_ms"], TTFT_GOAL_MS)
        + f"; with its preprocessing {ttft['ttft_with_preprocess_ms']:.2f} ms"
        + _ms_goal(ttft["ttft_with_preprocess_ms"], TTFT_GOAL_MS)
        + f"; its encoder call {_opt(ttft['encoder_ms'])} ms, its prefill forward {_opt(ttft['prefill_device_ms'])} ms "
        "(device; the encoder's on a CPU: host)",
        f"decode step, batch {dec['batch']}, context {dec['context']}+, median of {dec['image']['timed_steps']} "
        f"steps, wall (device): image {dec['image']['wall_ms']:.3f} ({_opt(dec['image']['device_ms'], '.3f')}) ms, "
        f"text {dec['text']['wall_ms']:.3f} ({_opt(dec['text']['device_ms'], '.3f')}) ms; image/text "
        f"{dec['ratio']:.3f}x{goal_note(round(dec['ratio'], 3), DECODE_GOAL, True)}, device "
        + ("-" if dec["ratio_device"] is None else f"{dec['ratio_device']:.3f}x")
        + (
            "" if dec["ratio_device"] is None else goal_note(round(dec["ratio_device"], 3), DECODE_GOAL, True)
        ),
    ]
    for kind in ("image", "text"):
        row = thr[kind]
        lines.append(
            f"{thr['requests']} {kind} requests at once, {thr['max_tokens']} output tokens each: "
            f"{row['output_tok_s']:,.0f} output tok/s ({row['total_tok_s']:,.0f} prompt + output tok/s, "
            f"{row['seconds']:.2f} s; TTFT median {row['ttft_ms_median']:.0f} ms, max {row['ttft_ms_max']:.0f} ms)"
        )
    lines.append(
        f"image/text output tok/s: {thr['ratio']:.3f}x{goal_note(round(thr['ratio'], 3), THROUGHPUT_GOAL)}"
    )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------- the script


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--parts", default="encoder,requests", help="comma-separated: encoder, requests (default both)"
    )
    parser.add_argument("--model", choices=list(MODELS), default="qwen2.5-vl-7b")
    parser.add_argument(
        "--model-config", help="a config.json (or a folder with one) whose vision_config to use"
    )
    parser.add_argument(
        "--image", help="WIDTHxHEIGHT before the preprocessing's resize (1280x720; --shape cpu: 224x168)"
    )
    parser.add_argument("--images", type=int, default=1, help="images of that size in one encoder call")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="the card's dense bf16 peak")
    parser.add_argument("--shape", choices=["gpu", "cpu"], default="gpu", help="cpu: a tiny dry run")
    parser.add_argument(
        "--methods", nargs="+", choices=ATTENTION_METHODS[1:], default=list(ATTENTION_METHODS[1:])
    )
    parser.add_argument("--no-compile", action="store_true", help="eager rows only")
    requests = parser.add_argument_group("requests part (defaults: GPU; --shape cpu: tiny)")
    requests.add_argument(
        "--vl-model", help=f"model folder, run with dummy weights (default {VL_PRESET.relative_to(ROOT)})"
    )
    requests.add_argument("--reps", type=int, help="TTFT repetitions (5)")
    requests.add_argument("--question-tokens", type=int, default=32)
    requests.add_argument("--batch", type=int, help="decode batch (32)")
    requests.add_argument("--steps", type=int, help="timed decode steps per round (50)")
    requests.add_argument("--requests", type=int, help="requests at once (64)")
    requests.add_argument("--max-tokens", type=int, help="their output tokens (128)")
    parser.add_argument("--out", help="write every figure to this JSON file")
    args = parser.parse_args(argv)
    args.parts = [part.strip() for part in args.parts.split(",") if part.strip()]
    if not args.parts or set(args.parts) - {"encoder", "requests"}:
        parser.error(f"--parts takes encoder and/or requests, got {args.parts}")
    gpu_preset = args.shape == "gpu" and args.vl_model is None
    if "requests" in args.parts and args.model != "qwen2.5-vl-7b" and gpu_preset:
        parser.error(f"the requests part has no preset for {args.model}: pass --vl-model FOLDER")
    cpu = args.shape == "cpu"
    args.size = tuple(map(int, (args.image or ("224x168" if cpu else "1280x720")).lower().split("x")))
    shape = CPU_REQUESTS if cpu else GPU_REQUESTS
    for name, default in (("reps", shape.reps), ("batch", shape.batch), ("steps", shape.steps),
                          ("requests", shape.requests), ("max_tokens", shape.max_tokens)):  # fmt: skip
        if getattr(args, name) is None:
            setattr(args, name, default)
    return args


def part_encoder(args: argparse.Namespace) -> dict[str, Any]:
    """The encoder alone: one row per attention method and mode, printed as they come."""
    cpu = args.shape == "cpu"
    device = torch.device("cpu" if cpu else "cuda")
    dtype = torch.float32 if cpu else torch.bfloat16
    backend = "aot_eager" if cpu else "inductor"  # inductor's C++ build is slow on a small CPU
    iters = 2 if cpu else args.iters
    family, cfg = load_config(args)
    width, height = args.size
    grids = [image_grid(width, height, cfg)] * args.images
    grid_thw = torch.tensor(grids)  # on the host, as the preprocessing gives it
    patches = int(grid_thw.prod(-1).sum())
    pixel_values = torch.randn(patches, cfg.patch_dim, dtype=dtype, device=device)
    shapes = gemm_shapes(cfg, family, patches)
    flops, attn_flops = gemm_flops(shapes), attention_flops(cfg, family, grids)
    print(
        f"{family} encoder (depth {cfg.depth}, hidden {cfg.hidden_size}, head_dim {cfg.head_dim}), {args.images} "
        f"image(s) of {width}x{height} -> grid {grids[0]}: {patches} patches; {flops / 1e9:.1f} GFLOP of GEMMs, "
        f"{attn_flops / 1e9:.1f} GFLOP of attention; {device}, {dtype}"
    )
    encoder = dummy_encoder(family, cfg, dtype, device)
    runs = []
    for method in args.methods:
        try:
            resolve_attention_method(method, device, dtype)
        except ValueError as e:
            print(f"  {method}: skipped ({e})")
            continue
        runs.append((method, False))
    if not args.no_compile:
        runs += [(method, True) for method, _ in runs if method not in ("loop", "sdpa") or cpu]
    rows = []
    print(
        f"\n{'attention':>13} {'mode':>8} {'ms':>8} {'ms/image':>9} {'GEMM TFLOP/s':>13} {'% peak':>7} {'attn TFLOP/s':>13}"
    )
    with torch.inference_mode():
        for method, compiled in runs:
            encoder.configure(attention=method, compile=compiled, backend=backend)
            ms = time_ms(lambda: encoder(pixel_values, grid_thw), iters, device)
            tflops = flops / ms / 1e9
            row = dict(attention=method, compiled=compiled, ms=ms, ms_per_image=ms / args.images,
                       gemm_tflops=tflops, peak_fraction=tflops / args.peak_tflops, attn_tflops=attn_flops / ms / 1e9)  # fmt: skip
            rows.append(row)
            print(
                f"{method:>13} {'compiled' if compiled else 'eager':>8} {ms:8.2f} {ms / args.images:9.2f} "
                f"{tflops:13.1f} {100 * row['peak_fraction']:6.1f}% {row['attn_tflops']:13.1f}"
            )
        encoder.configure(compile=False)
        alone = gemm_alone_ms(shapes, dtype, device, iters)
    print(
        f"\nthe GEMMs alone ({sum(shapes.values())} calls of {len(shapes)} shapes): {alone:.2f} ms, "
        f"{flops / alone / 1e9:.1f} TFLOP/s ({100 * flops / alone / 1e9 / args.peak_tflops:.1f}% of "
        f"{args.peak_tflops:.0f})"
    )
    for (m, k, n), count in sorted(shapes.items()):
        print(f"  {m:>6} x {k:>5} -> {n:>5}  x{count}")
    return dict(
        family=family, image=f"{width}x{height}", images=args.images, grid=list(grids[0]), patches=patches,
        gemm_gflop=flops / 1e9, attention_gflop=attn_flops / 1e9, rows=rows, gemms_alone_ms=alone,
        gemms_alone_tflops=flops / alone / 1e9,
    )  # fmt: skip


def run(argv: list[str] | None = None) -> dict[str, Any]:
    """Every part asked for: the report (what `--out` writes)."""
    args = parse_args(argv)
    os.environ.setdefault("TQDM_DISABLE", "1")
    cpu = args.shape == "cpu"
    results: dict[str, Any] = {"shape": args.shape, "parts": args.parts}
    if not cpu and torch.cuda.is_available():
        results["device"] = torch.cuda.get_device_name()
    if "encoder" in args.parts:
        results["encoder"] = part_encoder(args)
        gc.collect()
        torch._dynamo.reset()  # the compiled encoder's graphs go with it
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the engine sizes its KV cache from the memory free at its start
    if "requests" in args.parts:
        print(flush=True)
        shape = CPU_REQUESTS if cpu else GPU_REQUESTS
        with tempfile.TemporaryDirectory(prefix="minisgl-vision-") as tmp:
            folder = args.vl_model or str(write_tiny_vl(Path(tmp) / "tiny-qwen2.5-vl") if cpu else VL_PRESET)
            results["requests"] = part_requests(args, shape, str(folder))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    if "requests" in results:
        req = results["requests"]
        print(f"\n--- vision requests ({args.shape}; {req['model']}) ---\n{requests_table(req)}", flush=True)
    return results


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Runs the script (`run`); the encoder table's rows ([] without the encoder part)."""
    return run(argv).get("encoder", {}).get("rows", [])


if __name__ == "__main__":
    main()
