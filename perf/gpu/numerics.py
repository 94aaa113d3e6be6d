"""How far each GPU path's logits are from the exact ones: tiny random models with peaked weights,
teacher-forced through transformers in float32 (the reference), transformers in bf16 (the yardstick)
and minisgl in bf16 with its defaults and with one switch changed at a time; then greedy agreement, the
prefix cache and preemption on the first shape (the method, the bounds and the figures:
docs/gpu.md#numerics).

    python -m perf.gpu.numerics [--shapes llama3 qwen2 qwen3 qwen3_moe] [--paths default fi ...]
        [--json FILE] [--device cpu]

A path passes when its mean error is at most `MEAN_BOUND` x the yardstick's and its p99 at most
`P99_BOUND` x; a position routed to other experts than in float32 (MoE) is a routing flip, counted apart.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "tests") not in sys.path:
    sys.path.insert(0, str(ROOT / "tests"))  # the tiny-model factory and the teacher-forcing loop

from conftest import make_tiny_model, teacher_forced_logits  # noqa: E402

from minisgl.core import SamplingParams  # noqa: E402
from minisgl.engine import Engine, EngineConfig  # noqa: E402
from minisgl.moe import FusedMoeBackend, TorchMoeBackend, select_experts  # noqa: E402
from minisgl.scheduler import Scheduler, SchedulerConfig, generate  # noqa: E402

MEAN_BOUND = 1.5
P99_BOUND = 2.0
NEAR_TIE = 0.05  # standard deviations of the position's float32 logits
STEPS = 16  # teacher-forced decode steps after each prompt
BATCH1_LENS = (1, 97, 2000)  # prompts run alone (the batch's sequences of these lengths)
GREEDY_TOKENS = 2000  # greedy tokens per shape checked against float32's argmax
VOCAB = 4096
MAX_POSITIONS = 4096

# Scaling (peak_weights): every projection N(0, 1/fan_in) (activations keep their size); q and k
# projections x QK_GAIN (without q/k norm: attention scores of std about QK_GAIN^2 = 1.7), or the q/k norm
# weights x QK_GAIN (the same with Qwen3's norms); embedding and LM head N(0, LOGIT_STD^2 / hidden)
# (logits of std about LOGIT_STD over the vocabulary); the router N(0, ROUTER_STD^2 / hidden).
QK_GAIN = 1.3
LOGIT_STD = 3.0
ROUTER_STD = 1.5


@dataclass(frozen=True)
class Shape:
    name: str
    arch: str  # a tiny-model family of tests/conftest.py
    config: dict[str, Any]

    def describe(self) -> str:
        c = self.config
        heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
        head_dim = c.get("head_dim") or c["hidden_size"] // heads
        tied = "tied" if c.get("tie_word_embeddings") else "untied"
        return (
            f"{self.name}: {self.arch}, hidden {c['hidden_size']}, head_dim {head_dim}, {heads} q / {kv} kv "
            f"heads (group {heads // kv}), {tied} embeddings"
        )


SHAPES: dict[str, Shape] = {
    s.name: s
    for s in (
        # a Llama-3-like shape: llama3 RoPE scaling, head_dim 64, 4 query heads per KV head
        Shape(
            "llama3",
            "llama",
            dict(
                hidden_size=512,
                num_attention_heads=8,
                num_key_value_heads=2,
                head_dim=64,
                tie_word_embeddings=True,
            ),
        ),
        # Qwen2-0.5B's attention: 14 q / 2 kv heads of 64 (a group of 7), q/k/v bias
        Shape(
            "qwen2",
            "qwen2",
            dict(hidden_size=896, num_attention_heads=14, num_key_value_heads=2, intermediate_size=1024),
        ),
        # q/k norm, head_dim 128, one query head per KV head
        Shape(
            "qwen3",
            "qwen3",
            dict(
                hidden_size=512,
                num_attention_heads=8,
                num_key_value_heads=8,
                head_dim=128,
                tie_word_embeddings=True,
            ),
        ),
        # 8 query heads per KV head, head_dim 128, 8 experts top-2 (layer 1 dense)
        Shape(
            "qwen3_moe",
            "qwen3_moe",
            dict(
                hidden_size=512,
                num_attention_heads=8,
                num_key_value_heads=1,
                head_dim=128,
                moe_intermediate_size=256,
            ),
        ),
    )
}
SHAPE_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB, intermediate_size=768, max_position_embeddings=MAX_POSITIONS, pad_token_id=None
)

# (name, engine settings changed from the defaults)
PATHS: dict[str, dict[str, Any]] = {
    "default": {},
    "torch attn": {"attention_backend": "torch"},
    "fi only": {"attention_backend": "fi"},
    "triton off": {"decode_triton_max_bs": 0},
    "graphs off": {"cuda_graph_max_bs": 0},
    "fused off": {"use_fused_kernels": False},
    "gemv off": {"use_gemv_kernel": False},
    "pdl off": {"use_pdl": False},
    "page 1": {"page_size": 1},
    "page 256": {"page_size": 256},
    "fp8": {"quantization": "fp8"},
    "fp8 kv": {"kv_cache_dtype": "fp8_e4m3"},
}
# reported beside bf16, not judged by its bounds: FP8 rounds weights, activations or K/V to 3 mantissa
# bits, far more than bf16 does (docs/quantization.md has FP8's own bounds and its tests); FP8 weights
# are not supported on the MoE shape (its experts), which skips them
REPORTED = {"fp8", "fp8 kv"}
NO_MOE = {"fp8"}
# what every engine here shares: graphs of 1 and 64 rows only (batch 1 and the batch of 64; other sizes
# pad to 64), one slot per sequence of the batch
ENGINE_COMMON: dict[str, Any] = dict(dtype=torch.bfloat16, max_running_req=64, cuda_graph_bs=(1, 64))


def peak_weights(model: torch.nn.Module) -> None:
    """Rescales a transformers model built by `make_tiny_model` in place (see QK_GAIN, LOGIT_STD,
    ROUTER_STD): projections N(0, 1/fan_in), q/k x QK_GAIN, embedding and head N(0, LOGIT_STD^2/hidden),
    router N(0, ROUTER_STD^2/hidden). Norm weights and biases stay as drawn (N(1, 0.2), N(0, 0.2)), q/k
    norm weights x QK_GAIN."""
    hidden = model.config.hidden_size
    qk_norm = any(name.endswith("q_norm.weight") for name, _ in model.named_parameters())
    for name, param in model.named_parameters():
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            param.normal_(0.0, LOGIT_STD / math.sqrt(hidden))
        elif name.endswith("mlp.gate.weight"):
            param.normal_(0.0, ROUTER_STD / math.sqrt(hidden))
        elif name.endswith(("q_norm.weight", "k_norm.weight")):
            param.mul_(QK_GAIN)
        elif param.dim() >= 2:
            gain = QK_GAIN if name.endswith(("q_proj.weight", "k_proj.weight")) and not qk_norm else 1.0
            param.normal_(0.0, gain / math.sqrt(param.shape[-1]))


def build_model(folder: Path, shape: Shape, seed: int = 0) -> Path:
    config = {**SHAPE_COMMON, **shape.config}
    return make_tiny_model(folder, shape.arch, seed=seed, adjust=peak_weights, **config)


def make_sequences(lengths: Sequence[int], steps: int, vocab: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n + steps,), generator=g).tolist() for n in lengths]


def batch_lengths(count: int = 64, longest: int = 2000, seed: int = 2) -> list[int]:
    """`count` prompt lengths from 1 to `longest`, log-uniform between, both ends included."""
    rng = random.Random(seed)
    middle = [round(math.exp(rng.uniform(0.0, math.log(longest)))) for _ in range(count - 2)]
    return [1, longest, *middle]


# -- the reference: transformers ---------------------------------------------------------------------


def _router_ids(output: Any, top_k: int) -> torch.Tensor:
    """Expert ids (T, top_k) from a transformers router's output: (logits, scores, ids) in transformers 5,
    the logits alone in 4.x (top-k of their softmax)."""
    if isinstance(output, tuple):
        return output[2]
    return torch.topk(output.float().softmax(-1), top_k, dim=-1).indices


@dataclass
class Forced:
    """Logits (R, S + 1, V) at the teacher-forced positions of R sequences, float32, and for MoE models
    the experts chosen for the token at each position ((R, S + 1, sparse layers, top_k), sorted)."""

    logits: torch.Tensor
    experts: torch.Tensor | None = None


def transformers_forced(
    folder: Path,
    seqs: list[list[int]],
    prompt_lens: list[int],
    steps: int,
    dtype: torch.dtype,
    device: torch.device,
) -> Forced:
    """transformers' logits (eager attention) at the positions of `teacher_forced_logits`, each sequence
    alone, with the experts its routers chose there."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=dtype, attn_implementation="eager"
    )
    model = model.to(device).eval()
    top_k = getattr(model.config, "num_experts_per_tok", 0)
    routed: list[torch.Tensor] = []
    hooks = [
        module.register_forward_hook(lambda m, i, out: routed.append(_router_ids(out, top_k)))
        for name, module in model.named_modules()
        if name.endswith("mlp.gate") and top_k
    ]
    logits, experts = [], []
    try:
        with torch.no_grad():
            for seq, n in zip(seqs, prompt_lens):
                routed.clear()
                rows = slice(n - 1, n + steps)
                full = model(torch.tensor([seq], device=device)).logits[0]
                logits.append(full[rows].float())
                if routed:  # (sparse layers, T, top_k) -> (S + 1, layers, top_k)
                    ids = torch.stack([r.reshape(-1, top_k) for r in routed])[:, rows]
                    experts.append(ids.transpose(0, 1).sort(-1).values)
    finally:
        for hook in hooks:
            hook.remove()
    del model
    return Forced(torch.stack(logits), torch.stack(experts) if experts else None)


# -- minisgl -------------------------------------------------------------------------------------------


class ExpertRecorder:
    """Records, for each sparse layer, the experts minisgl's MoE backend picks for each token row of a
    forward: the backends' `forward` is wrapped (for the recorder's life) so that it also copies
    `select_experts`' ids (the routing the backends compute) into a static buffer. The copies are device
    ops, so CUDA graphs capture them and every replay records too; the layer is the call's rank within a
    forward (every forward calls every sparse layer, in order)."""

    BACKENDS = (FusedMoeBackend, TorchMoeBackend)

    def __init__(self, num_sparse: int, top_k: int, max_rows: int, device: torch.device) -> None:
        self.num_sparse, self.top_k = num_sparse, top_k
        self.ids = torch.full((num_sparse, max_rows, top_k), -1, dtype=torch.int64, device=device)
        self.calls = 0
        self._saved: list[tuple[type, Callable]] = []

    def __enter__(self) -> ExpertRecorder:
        for cls in self.BACKENDS:
            original = cls.__dict__["forward"]  # a staticmethod (BaseMoeBackend)
            self._saved.append((cls, original))
            cls.forward = staticmethod(self._recording(original.__func__))
        return self

    def _recording(self, run: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def forward(x, router_logits, w13, w2, top_k, renormalize):
            _, ids = select_experts(router_logits, top_k, renormalize, x.dtype)
            self.ids[self.calls % self.num_sparse, : ids.shape[0]].copy_(ids)
            self.calls += 1
            return run(x, router_logits, w13, w2, top_k, renormalize)

        return forward

    def __exit__(self, *exc: object) -> None:
        for cls, original in self._saved:
            cls.forward = original
        self._saved.clear()

    def rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The recorded experts of token rows `rows` of the last forward: (len(rows), layers, top_k)."""
        return self.ids[:, rows].transpose(0, 1).sort(-1).values


def num_pages_for(lengths: Sequence[int], page_size: int) -> int:
    return sum(-(-n // page_size) for n in lengths) + 8


def make_engine(folder: Path, device: str, prompt_lens: Sequence[int], steps: int, **settings: Any) -> Engine:
    page_size = settings.get("page_size", 16)
    kw = {**ENGINE_COMMON, **settings}
    kw["num_page_override"] = num_pages_for([n + steps for n in prompt_lens], page_size)
    if device == "cpu":
        kw.pop("cuda_graph_bs")
    return Engine(EngineConfig(model_path=str(folder), device=device, **kw))


def minisgl_forced(
    engine: Engine, seqs: list[list[int]], prompt_lens: list[int], steps: int, recorder: ExpertRecorder | None
) -> Forced:
    """`teacher_forced_logits` through `engine` with the experts it chose at each position (the last prompt
    token's at the prefill, the fed token's at each decode step)."""
    experts: list[torch.Tensor] = []
    last_rows = torch.tensor(prompt_lens, device=engine.device).cumsum(0) - 1
    every_row = torch.arange(len(seqs), device=engine.device)

    def on_step(step: int, batch: Any) -> None:
        if recorder is not None:
            experts.append(recorder.rows(last_rows if step == 0 else every_row))

    logits = teacher_forced_logits(engine, seqs, prompt_lens, steps, on_step)
    return Forced(logits, torch.stack(experts, dim=1) if experts else None)


# -- the figures -------------------------------------------------------------------------------------------


@dataclass
class Stats:
    mean: float
    p99: float
    positions: int
    flips: int  # positions left out: routed to other experts than float32's

    def as_dict(self) -> dict[str, float | int]:
        return dict(mean=self.mean, p99=self.p99, positions=self.positions, flips=self.flips)


def normalized_error(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """|got - ref| / std(ref over the vocabulary), per logit: (..., V)."""
    return (got.float() - ref).abs() / ref.std(dim=-1, keepdim=True)


def flip_mask(got: Forced, ref: Forced) -> torch.Tensor:
    """(R, S + 1) True where the position's token went to other experts than float32's."""
    if got.experts is None or ref.experts is None:
        return torch.zeros(got.logits.shape[:2], dtype=torch.bool, device=got.logits.device)
    return (got.experts.to(ref.experts.device) != ref.experts).flatten(2).any(-1)


def error_stats(got: Forced, ref: Forced) -> Stats:
    flips = flip_mask(got, ref).to(ref.logits.device)
    err = normalized_error(got.logits.to(ref.logits.device), ref.logits)[~flips].flatten()
    p99 = torch.quantile(err.double()[torch.randperm(err.numel(), device=err.device)[: 1 << 24]], 0.99)
    return Stats(err.mean().item(), p99.item(), int((~flips).sum()), int(flips.sum()))


def within_bounds(stats: Stats, yardstick: Stats) -> bool:
    return stats.mean <= MEAN_BOUND * yardstick.mean and stats.p99 <= P99_BOUND * yardstick.p99


def greedy_gaps(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """How far below the best each chosen token's logit is, in standard deviations: logits (N, V) float32,
    tokens (N,)."""
    chosen = logits.gather(-1, tokens[:, None])[:, 0]
    return (logits.max(-1).values - chosen) / logits.std(-1)


@dataclass
class Row:
    shape: str
    path: str
    batch: int
    stats: Stats
    yardstick: Stats
    passed: bool | None = field(init=False)  # None: reported, not judged (`REPORTED`)

    def __post_init__(self) -> None:
        self.passed = None if self.path in REPORTED else within_bounds(self.stats, self.yardstick)

    def as_dict(self) -> dict[str, Any]:
        return dict(
            shape=self.shape, path=self.path, batch=self.batch, passed=self.passed, **self.stats.as_dict(),
            bf16_mean=self.yardstick.mean, bf16_p99=self.yardstick.p99, bf16_flips=self.yardstick.flips,
        )  # fmt: skip


@dataclass
class ShapeRun:
    """One shape's sequences, its references and the rows measured so far."""

    shape: Shape
    folder: Path
    device: str
    seqs: list[list[int]]
    lens: list[int]
    alone: list[int]  # indices of the sequences run at batch 1
    fp32: Forced
    bf16: Forced
    rows: list[Row] = field(default_factory=list)

    def subset(self, forced: Forced, idx: list[int]) -> Forced:
        experts = None if forced.experts is None else forced.experts[idx]
        return Forced(forced.logits[idx], experts)

    def yardstick(self, batch: int) -> Stats:
        idx = self.alone if batch == 1 else list(range(len(self.seqs)))
        return error_stats(self.subset(self.bf16, idx), self.subset(self.fp32, idx))

    def recorder(self, engine_device: torch.device) -> ExpertRecorder | None:
        if self.fp32.experts is None:
            return None
        _, _, layers, top_k = self.fp32.experts.shape
        return ExpertRecorder(layers, top_k, sum(self.lens) + 64, engine_device)

    def measure(self, path: str, settings: dict[str, Any]) -> list[Row]:
        """Batch 1 (each `alone` sequence by itself) and the whole batch through one engine."""
        recorder = self.recorder(torch.device(self.device))
        with recorder if recorder is not None else _nothing():
            engine = make_engine(self.folder, self.device, self.lens, STEPS, **settings)
            try:
                singles = [
                    minisgl_forced(engine, [self.seqs[i]], [self.lens[i]], STEPS, recorder)
                    for i in self.alone
                ]
                batch = minisgl_forced(engine, self.seqs, self.lens, STEPS, recorder)
            finally:
                engine.shutdown()
        one = Forced(
            torch.cat([s.logits for s in singles]),
            None if recorder is None else torch.cat([s.experts for s in singles]),
        )
        rows = [
            Row(
                self.shape.name,
                path,
                1,
                error_stats(one, self.subset(self.fp32, self.alone)),
                self.yardstick(1),
            ),
            Row(self.shape.name, path, len(self.seqs), error_stats(batch, self.fp32), self.yardstick(64)),
        ]
        self.rows += rows
        return rows


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def prepare_shape(
    shape: Shape, folder: Path, device: str, lens: list[int], alone_lens: Sequence[int]
) -> ShapeRun:
    model = build_model(folder / shape.name, shape)
    seqs = make_sequences(lens, STEPS, shape.config.get("vocab_size", VOCAB))
    # the batch's sequences nearest in length to each of `alone_lens`
    alone = sorted({min(range(len(lens)), key=lambda i: abs(lens[i] - n)) for n in alone_lens})
    dev = torch.device(device)
    fp32 = transformers_forced(model, seqs, lens, STEPS, torch.float32, dev)
    bf16 = transformers_forced(model, seqs, lens, STEPS, torch.bfloat16, dev)
    return ShapeRun(shape, model, device, seqs, lens, alone, fp32, bf16)


def peakedness(fp32: Forced) -> str:
    probs = fp32.logits.softmax(-1)
    top1 = probs.max(-1).values.mean().item()
    std = fp32.logits.std(-1).mean().item()
    return f"float32 logits: std {std:.2f} over the vocabulary, mean top-1 probability {top1:.2f}"


# -- greedy tokens, prefix cache, preemption -------------------------------------------------------------


def greedy_check(run: ShapeRun, total: int = GREEDY_TOKENS, requests: int = 16) -> dict[str, Any]:
    """Greedy tokens from the default path (`requests` prompts of the batch's lengths, `total` tokens in
    all) against float32's argmax at each position."""
    per = total // requests
    prompts = [s[:n] for s, n in zip(run.seqs[:requests], run.lens[:requests])]
    engine = make_engine(run.folder, run.device, [len(p) for p in prompts], per)
    try:
        outputs = generate(engine, prompts, SamplingParams(max_tokens=per))
    finally:
        engine.shutdown()
    seqs = [p + o for p, o in zip(prompts, outputs)]
    lens = [len(p) for p in prompts]
    dev = torch.device(run.device)
    ref = transformers_forced(run.folder, seqs, lens, per - 1, torch.float32, dev).logits.flatten(0, 1)
    gaps = greedy_gaps(ref, torch.tensor(outputs, device=ref.device).flatten())
    # the yardstick: transformers' bf16 argmax at the same positions (the same sequences fed)
    bf16 = transformers_forced(run.folder, seqs, lens, per - 1, torch.bfloat16, dev).logits.flatten(0, 1)
    bf16_gaps = greedy_gaps(ref, bf16.to(ref.device).argmax(-1))
    return dict(
        tokens=int(gaps.numel()),
        argmax=int((gaps == 0).sum()),
        near_ties=int(((gaps > 0) & (gaps < NEAR_TIE)).sum()),
        beyond=int((gaps >= NEAR_TIE).sum()),
        max_gap=gaps.max().item(),
        bf16_beyond=int((bf16_gaps >= NEAR_TIE).sum()),
        bf16_max_gap=bf16_gaps.max().item(),
    )


def greedy_outputs(sched: Scheduler, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Runs `prompts` through the scheduler, greedy, `max_tokens` each; returns their outputs."""
    states = [sched.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for p in prompts]
    while sched.has_work():
        sched.step()
    return [s.output_ids for s in states]


def compare_outputs(
    run: ShapeRun, prompts: list[list[int]], got: list[list[int]], want: list[list[int]]
) -> dict:
    """Tokens that differ, and at each request's first difference the float32 gap between the two tokens
    (standard deviations): a near-tie below NEAR_TIE."""
    differ = sum(a != b for g, w in zip(got, want) for a, b in zip(g, w))
    firsts = [
        (p, g, w, next(i for i, (a, b) in enumerate(zip(g, w)) if a != b))
        for p, g, w in zip(prompts, got, want)
        if g != w
    ]
    gaps = []
    if firsts:
        seqs = [p + w[:i] for p, _, w, i in firsts]
        lens = [len(seq) for seq in seqs]
        ref = transformers_forced(run.folder, seqs, lens, 0, torch.float32, torch.device(run.device)).logits[
            :, 0
        ]
        for row, (_, g, w, i) in zip(ref, firsts):
            gaps.append(((row[g[i]] - row[w[i]]).abs() / row.std()).item())
    return dict(
        tokens=sum(len(w) for w in want),
        differ=differ,
        requests_differ=len(firsts),
        beyond_near_tie=sum(gap >= NEAR_TIE for gap in gaps),
        first_gaps=[round(gap, 4) for gap in gaps],
    )


def cache_and_preemption(run: ShapeRun, requests: int = 32, max_tokens: int = 64) -> dict[str, Any]:
    """Greedy outputs with the radix cache (two passes) and under constant preemption against naive:
    `requests` prompts of 28 to 208 tokens, the first 20 to 200 from one of 4 shared bases."""
    rng = random.Random(3)
    bases = [[rng.randrange(3, VOCAB) for _ in range(200)] for _ in range(4)]
    prompts = [
        bases[i % 4][: rng.randint(20, 200)] + [rng.randrange(3, VOCAB) for _ in range(8)]
        for i in range(requests)
    ]
    lens = [len(p) + max_tokens for p in prompts]
    engine = make_engine(run.folder, run.device, lens, 0)
    try:
        naive = greedy_outputs(Scheduler(engine, SchedulerConfig(cache_type="naive")), prompts, max_tokens)
        sched = Scheduler(engine, SchedulerConfig(cache_type="radix"))
        radix1 = greedy_outputs(sched, prompts, max_tokens)
        radix2 = greedy_outputs(sched, prompts, max_tokens)  # the prompts are in the tree now
        hit = sched.prefix_cached_tokens
    finally:
        engine.shutdown()
    # pages of 4 tokens, as many as the longest request and 8 more: requests take turns and are
    # preempted as they grow
    small = make_engine(run.folder, run.device, [max(lens)], 0, page_size=4)
    try:
        psched = Scheduler(small, SchedulerConfig(cache_type="naive"))
        preempted = greedy_outputs(psched, prompts, max_tokens)
        preemptions = psched.preemptions
    finally:
        small.shutdown()
    return dict(
        radix_pass1=compare_outputs(run, prompts, radix1, naive),
        radix_pass2=compare_outputs(run, prompts, radix2, naive),
        radix_cached_tokens=hit,
        preempted=compare_outputs(run, prompts, preempted, naive),
        preemptions=preemptions,
    )


# -- the table -----------------------------------------------------------------------------------------------


def _verdict(passed: bool | None) -> str:
    return "-" if passed is None else "yes" if passed else "NO"


def table(rows: list[Row]) -> str:
    lines = [
        f"{'shape':>10} {'path':>11} {'batch':>5} {'mean':>8} {'p99':>8} {'bf16 mean':>9} {'bf16 p99':>8} "
        f"{'mean x':>6} {'p99 x':>6} {'flips':>5} {'ok':>4}"
    ]
    for r in rows:
        s, y = r.stats, r.yardstick
        flips = f"{s.flips}/{y.flips}" if s.flips or y.flips else "-"
        lines.append(
            f"{r.shape:>10} {r.path:>11} {r.batch:>5} {s.mean:>8.5f} {s.p99:>8.5f} {y.mean:>9.5f} {y.p99:>8.5f} "
            f"{s.mean / y.mean:>6.2f} {s.p99 / y.p99:>6.2f} {flips:>5} {_verdict(r.passed):>4}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--paths", nargs="+", default=None, choices=list(PATHS))
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument(
        "--batch", type=int, default=64, help="sequences in the batch (lengths 1 to --longest)"
    )
    parser.add_argument("--longest", type=int, default=2000)
    parser.add_argument(
        "--no-extras", action="store_true", help="skip the greedy, prefix-cache and preemption runs"
    )
    parser.add_argument("--json", default=None, help="write every figure to this file")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.getLogger().setLevel(logging.INFO if args.verbose else logging.WARNING)
    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference in float32, not TF32
    torch.backends.cudnn.allow_tf32 = False
    # on a CPU only the torch backend and the default settings run (the GPU switches do not apply)
    paths = args.paths or (list(PATHS) if args.device == "cuda" else ["default"])
    lens = batch_lengths(args.batch, args.longest)
    started = time.perf_counter()
    report: dict[str, Any] = {"rows": [], "extras": {}}
    all_rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.shapes:
            shape = SHAPES[name]
            run = prepare_shape(shape, Path(tmp), args.device, lens, BATCH1_LENS)
            print(
                f"{shape.describe()}; {peakedness(run.fp32)} ({time.perf_counter() - started:.0f} s)",
                flush=True,
            )
            for path in paths:
                if path in NO_MOE and shape.arch == "qwen3_moe":
                    print(f"{path}: not supported on {shape.name} (FP8 experts), skipped", flush=True)
                    continue
                rows = run.measure(path, PATHS[path])
                print(table(rows).split("\n", 1)[1], flush=True)
            all_rows += run.rows
            if not args.no_extras and name == args.shapes[0]:
                extras = {"greedy": greedy_check(run), **cache_and_preemption(run)}
                report["extras"][name] = extras
                print(json.dumps(extras), flush=True)
    report["rows"] = [r.as_dict() for r in all_rows]
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    failed = [r for r in all_rows if r.passed is False]
    print(
        f"\n{len(all_rows)} rows ({sum(r.passed is None for r in all_rows)} FP8 rows reported, not judged), {len(failed)} outside the bounds ({time.perf_counter() - started:.0f} s)"
    )
    print(table(all_rows))
    for name, extras in report["extras"].items():
        g = extras["greedy"]
        print(
            f"{name} greedy: {g['tokens']} tokens, {g['argmax']} float32 argmax, {g['near_ties']} near-ties, "
            f"{g['beyond']} beyond {NEAR_TIE} sd (max gap {g['max_gap']:.4f}); transformers bf16's argmax "
            f"there: {g['bf16_beyond']} beyond (max gap {g['bf16_max_gap']:.4f})"
        )
        for key in ("radix_pass1", "radix_pass2", "preempted"):
            c = extras[key]
            print(
                f"{name} {key}: {c['differ']}/{c['tokens']} tokens differ from naive in {c['requests_differ']} "
                f"requests, {c['beyond_near_tie']} first differences beyond a near-tie"
            )
        print(
            f"{name} radix cached tokens {extras['radix_cached_tokens']}, preemptions {extras['preemptions']}"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
