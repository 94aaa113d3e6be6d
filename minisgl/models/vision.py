"""What the vision encoders of Qwen2.5-VL and Qwen3-VL share: their config, weight holders named as the
checkpoint names them (under ``visual.`` or ``model.visual.``), and pure functions over explicit tensors.

Patches arrive as the preprocessing makes them (`minisgl.multimodal.qwen_vl`): the images of a batch one
after another, each image's patches in merge-block order (the merge_size x merge_size patches that merge
into one token are consecutive), with `grid_thw` (images, 3) giving each image's (t, h, w) in patches.
Attention never crosses images: the segments that attend within themselves (images, or windows inside
them) are given by their bounds (segments + 1: starts and total, `cu_seqlens`), and no batch is padded to
a square.

Everything that needs host values (the window order, rotary positions, segment bounds) is computed once
per encoder call from `grid_thw`'s host copy, before the layers run: each segmentation becomes a
`SegmentPlan` (one attention launch per layer: a batched SDPA on CPU, torch's varlen attention or
FlashInfer's ragged prefill on CUDA), which the layers name by slot, so the block stack reads no host
value and can run under torch.compile (`Encoder.configure`). docs/vision.md.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from minisgl.layers.basic import linear, rms_norm
from minisgl.layers.rope import RopeConfig, apply_rope, build_rope_cache
from minisgl.models.weights import checkpoint_files, load_checkpoint

ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}
CHECKPOINT_PREFIXES = ("model.visual.", "visual.")  # transformers 5 saves Qwen3-VL under model.visual.
ATTENTION_METHODS = ("auto", "sdpa", "loop", "torch_varlen", "flashinfer")  # see SegmentPlan


@dataclass(frozen=True)
class VisionConfig:
    """A config.json's ``vision_config``: the encoder's shapes (window and full-attention layers for
    Qwen2.5-VL, learned positions and DeepStack layers for Qwen3-VL)."""

    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    out_hidden_size: int
    """What the merger gives: the text model's hidden size."""
    fullatt_block_indexes: tuple[int, ...] = ()
    """Qwen2.5-VL: the blocks that attend over whole images (the others within windows)."""
    hidden_act: str = "silu"
    """The MLP's activation, a key of ACTIVATIONS."""
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    deepstack_visual_indexes: tuple[int, ...] = ()
    """Qwen3-VL: the blocks after which a DeepStack merger runs."""
    rope_theta: float = 10000.0
    """The 2D rotary base (``rope_parameters.rope_theta``)."""
    window_size: int = 112
    """Qwen2.5-VL: the side of an attention window, in pixels."""
    num_position_embeddings: int = 0
    """Qwen3-VL: entries of the learned position table (a square)."""

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values in one patch: channels x temporal patch x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> VisionConfig:
        """From a ``vision_config`` mapping (``in_chans`` read as ``in_channels``)."""
        values = dict(raw)
        if "in_chans" in values:
            values.setdefault("in_channels", values["in_chans"])
        values["rope_theta"] = (values.get("rope_parameters") or {}).get("rope_theta", cls.rope_theta)
        for name in ("fullatt_block_indexes", "deepstack_visual_indexes"):
            values[name] = tuple(values.get(name) or ())
        required = ("depth", "hidden_size", "num_heads", "intermediate_size", "out_hidden_size", "hidden_act")
        missing = [name for name in required if name not in values]
        if missing:
            raise ValueError(f"vision_config lacks {', '.join(missing)}: not a Qwen2.5-VL / Qwen3-VL config")
        if values["hidden_act"] not in ACTIVATIONS:
            raise ValueError(
                f"vision_config hidden_act={values['hidden_act']!r} is not one of {list(ACTIVATIONS)}"
            )
        return cls(**{name: values[name] for name in cls.__dataclass_fields__ if name in values})

    @classmethod
    def from_folder(cls, model_path: str | Path) -> VisionConfig:
        path = Path(model_path) / "config.json"
        raw = json.loads(path.read_text(encoding="utf-8"))
        if "vision_config" not in raw:
            raise ValueError(f"{str(path)!r} has no vision_config: not a vision-language model")
        return cls.from_dict(raw["vision_config"])


# -- weight holders (their attribute paths are the checkpoint's names) ----------------------------------


def empty_param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        self.weight = empty_param(out_features, in_features)
        self.bias = empty_param(out_features) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class Norm(nn.Module):
    """RMSNorm (Qwen2.5-VL, no bias) or LayerNorm (Qwen3-VL, with bias), eps 1e-6 either way."""

    def __init__(self, dim: int, layer_norm: bool) -> None:
        super().__init__()
        self.weight = empty_param(dim)
        self.bias = empty_param(dim) if layer_norm else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return rms_norm(x, self.weight, 1e-6)
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-6)


class PatchEmbed(nn.Module):
    """The checkpoint's Conv3d whose kernel equals its stride: one linear map of each patch's values."""

    def __init__(self, cfg: VisionConfig, bias: bool) -> None:
        super().__init__()
        p, t = cfg.patch_size, cfg.temporal_patch_size
        self.proj = nn.Module()  # the Conv3d's weight (hidden, C, T, P, P) and bias
        self.proj.weight = empty_param(cfg.hidden_size, cfg.in_channels, t, p, p)
        self.proj.bias = empty_param(cfg.hidden_size) if bias else None

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight.reshape(self.proj.weight.shape[0], -1)
        return linear(pixel_values.to(weight.dtype), weight, self.proj.bias)


class Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = Linear(dim, 3 * dim)
        self.proj = Linear(dim, dim)

    def forward(self, x: torch.Tensor, cos_sin: torch.Tensor, slot: int) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv(x).view(tokens, 3, self.num_heads, -1).unbind(1)
        q, k = apply_rope(q.float(), k.float(), cos_sin)  # rotated in float32, as the reference does
        out = segment_attention(q.to(v.dtype), k.to(v.dtype), v, slot)
        return self.proj(out.reshape(tokens, -1))


class Block(nn.Module):
    """norm1 -> attention within the segments of plan `slot` (see `segment_plans`) -> residual, norm2 ->
    `mlp` -> residual."""

    def __init__(self, cfg: VisionConfig, mlp: nn.Module, layer_norm: bool) -> None:
        super().__init__()
        self.norm1 = Norm(cfg.hidden_size, layer_norm)
        self.norm2 = Norm(cfg.hidden_size, layer_norm)
        self.attn = Attention(cfg.hidden_size, cfg.num_heads)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, cos_sin: torch.Tensor, slot: int) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos_sin, slot)
        return x + self.mlp(self.norm2(x))


class Encoder(nn.Module):
    """What both encoders share around their blocks: how their attention runs (`attention`, a method of
    ATTENTION_METHODS, resolved per call by the device and dtype) and whether their block stack runs
    compiled (`configure`). Subclasses define `blocks_forward`, the layer stack alone (no host values in
    it: the segment plans are made before it runs, `plan`), and call it through `run_blocks`."""

    attention = "auto"
    _compiled: Callable[..., Any] | None = None

    def configure(
        self, attention: str | None = None, compile: bool | None = None, backend: str | Callable = "inductor"
    ) -> None:
        """`attention`: a method of ATTENTION_METHODS; `compile`: run the block stack under torch.compile
        with `backend` (dynamic shapes, one graph; the attention is the opaque op
        ``minisgl::vision_attention``). None leaves a setting as it is."""
        if attention is not None:
            if attention not in ATTENTION_METHODS:
                raise ValueError(f"vision attention {attention!r} is not one of {ATTENTION_METHODS}")
            self.attention = attention
        if compile is not None:
            self._compiled = None
            if compile:
                self._compiled = torch.compile(
                    self.blocks_forward, backend=backend, dynamic=True, fullgraph=True
                )

    def run_blocks(self, plans: tuple[SegmentPlan, ...], *args: Any) -> Any:
        """`blocks_forward(*args)` with `plans` as the attention's slots, compiled if configured so."""
        forward = self._compiled or self.blocks_forward
        with segment_plans(*plans):
            return forward(*args)

    def plan(
        self, bounds: list[list[int]], device: torch.device, dtype: torch.dtype
    ) -> tuple[SegmentPlan, ...]:
        """One SegmentPlan per segmentation of this call's tokens (`bounds`: each one's host segment
        bounds, in slot order), for q, k, v of `dtype` on `device`."""
        cfg: VisionConfig = self.cfg  # type: ignore[assignment]
        method = resolve_attention_method(self.attention, device, dtype)
        return tuple(
            SegmentPlan(segments, device, method, cfg.num_heads, cfg.head_dim, dtype, slot)
            for slot, segments in enumerate(bounds)
        )


# -- pure functions -------------------------------------------------------------------------------------


def loop_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: Sequence[int]) -> torch.Tensor:
    """The per-segment reference: one SDPA call per segment of host `bounds` (segments + 1)."""
    out = torch.empty_like(q)
    for start, stop in zip(bounds[:-1], bounds[1:]):
        segment = [t[start:stop].transpose(0, 1) for t in (q, k, v)]  # (heads, length, head_dim)
        out[start:stop] = F.scaled_dot_product_attention(*segment).transpose(0, 1)
    return out


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`; to CUDA from pinned memory, without waiting for the device."""
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def resolve_attention_method(method: str, device: torch.device, dtype: torch.dtype) -> str:
    """'auto': on CUDA in bf16 / fp16 torch's varlen attention where the installed torch has it, else
    FlashInfer's ragged prefill where flashinfer is installed, else (and on CPU, and in float32) 'sdpa'.
    A named method is checked against the device and dtype."""
    fused = torch.device(device).type == "cuda" and dtype in (torch.float16, torch.bfloat16)
    have = {"torch_varlen": fused and _torch_varlen() is not None,
            "flashinfer": fused and importlib.util.find_spec("flashinfer") is not None}  # fmt: skip
    if method == "auto":
        return next((name for name, ok in have.items() if ok), "sdpa")
    if method not in ATTENTION_METHODS:
        raise ValueError(f"vision attention {method!r} is not one of {ATTENTION_METHODS}")
    if not have.get(method, True):
        raise ValueError(
            f"vision attention {method!r} needs CUDA, bf16 / fp16 and "
            + ("torch.nn.attention.varlen" if method == "torch_varlen" else "flashinfer")
            + f" (here: {device}, {dtype})"
        )
    return method


def _torch_varlen() -> Callable[..., torch.Tensor] | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch before 2.10
        return None
    return varlen_attn


class SegmentPlan:
    """How one segmentation of a call's tokens (whole images, or Qwen2.5-VL's windows) is attended,
    built once per encoder call from the host `bounds` (segments + 1: the starts and the total) and used
    by every layer of that segmentation; `attend` reads no host value (no device sync).

    Methods: 'sdpa' (any device; the reference): the segments padded to the longest into a batch, one
    SDPA call with a key mask (none when all have one length), the real rows gathered back; 'loop': the
    old one SDPA call per segment; 'torch_varlen': torch.nn.attention.varlen (CUDA, bf16 / fp16);
    'flashinfer': FlashInfer's ragged prefill (`minisgl.attention.ragged`; CUDA, bf16 / fp16)."""

    def __init__(
        self, bounds: Sequence[int], device: torch.device, method: str = "sdpa",
        num_heads: int = 0, head_dim: int = 0, dtype: torch.dtype | None = None, slot: int = 0,
    ) -> None:  # fmt: skip
        self.method, self.bounds = method, list(bounds)
        lengths = torch.tensor(self.bounds).diff()
        self.max_len = int(lengths.max())
        self.shape = (len(lengths), self.max_len)
        self.gather = self.scatter = self.mask = None
        self.cu_seqlens = None
        if method == "sdpa" and bool((lengths != self.max_len).any()):
            columns = torch.arange(self.max_len)
            valid = columns < lengths[:, None]  # (segments, max_len)
            starts = torch.tensor(self.bounds[:-1])
            gather = starts[:, None] + torch.minimum(columns, lengths[:, None] - 1)  # padding: a real row
            self.gather = upload(gather.flatten(), device)
            self.scatter = upload(valid.flatten().nonzero()[:, 0], device)
            self.mask = upload(valid, device)[:, None, None, :]
        elif method == "torch_varlen":
            self.varlen = _torch_varlen()
            self.cu_seqlens = upload(torch.tensor(self.bounds, dtype=torch.int32), device)
        elif method == "flashinfer":
            from minisgl.attention.ragged import ragged_attention

            self.ragged = ragged_attention(device, slot)
            self.ragged.plan(self.bounds, num_heads, head_dim, dtype)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Bidirectional attention of (T, heads, head_dim) q, k, v within each segment."""
        if self.method == "loop":
            return loop_attention(q, k, v, self.bounds)
        if self.method in ("torch_varlen", "flashinfer"):  # the fused kernels: rows of stride heads * dim
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
            if self.method == "flashinfer":
                return self.ragged.run(q, k, v)
            cu, length = self.cu_seqlens, self.max_len
            return self.varlen(q, k, v, cu, cu, length, length)  # positional: torch 2.10's signature too
        tokens, heads, head_dim = q.shape
        segments, length = self.shape

        def batched(t: torch.Tensor) -> torch.Tensor:  # (segments, heads, length, head_dim)
            t = t if self.gather is None else t[self.gather]
            return t.view(segments, length, heads, head_dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(batched(q), batched(k), batched(v), attn_mask=self.mask)
        out = out.transpose(1, 2).reshape(segments * length, heads, head_dim)
        return out if self.scatter is None else out[self.scatter]


_active_plans: tuple[SegmentPlan, ...] = ()


@contextmanager
def segment_plans(*plans: SegmentPlan) -> Iterator[None]:
    """The plans that `segment_attention`'s slots 0, 1, ... name while the block stack runs."""
    global _active_plans
    saved, _active_plans = _active_plans, plans
    try:
        yield
    finally:
        _active_plans = saved


@torch.library.custom_op("minisgl::vision_attention", mutates_args=())
def _vision_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot: int) -> torch.Tensor:
    return _active_plans[slot].attend(q, k, v).contiguous()


@_vision_attention_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot: int) -> torch.Tensor:
    return q.new_empty(q.shape)


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot: int) -> torch.Tensor:
    """Attention within the segments of the active plan `slot`: under torch.compile the custom op
    ``minisgl::vision_attention`` (one opaque node), in eager mode the plan directly."""
    if torch.compiler.is_compiling():
        return _vision_attention_op(q, k, v, slot)
    return _active_plans[slot].attend(q, k, v)


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor | Sequence[int]
) -> torch.Tensor:
    """Bidirectional attention of (T, heads, head_dim) q, k, v within each segment of `cu_seqlens`, one
    SDPA call ('sdpa' of `SegmentPlan`). A one-off: it reads `cu_seqlens` on the host (a device sync if
    it is on a GPU); the encoders plan once per call instead."""
    bounds = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
    return SegmentPlan(bounds, q.device).attend(q, k, v)


def host_grid(grid_thw: torch.Tensor) -> torch.Tensor:
    """`grid_thw` on the host (one device read if it is on a GPU: pass the host copy to avoid it)."""
    return grid_thw if grid_thw.device.type == "cpu" else grid_thw.cpu()


def image_seqlens(grid_thw: torch.Tensor) -> torch.Tensor:
    """cu_seqlens of whole frames: one segment of h * w patches per frame of each image."""
    lengths = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0])
    return F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)


def patch_positions(grid_thw: torch.Tensor, merge_size: int) -> torch.Tensor:
    """(T, 2) long: each patch's (row, column) in its image, in merge-block order."""
    positions = []
    for t, h, w in grid_thw.tolist():
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        grid = torch.stack([rows, cols], dim=-1).reshape(
            h // merge_size, merge_size, w // merge_size, merge_size, 2
        )
        positions.append(grid.permute(0, 2, 1, 3, 4).reshape(-1, 2).repeat(t, 1))
    return torch.cat(positions).to(grid_thw.device)


def vision_rope(
    positions: torch.Tensor, head_dim: int, theta: float, size: int | None = None
) -> torch.Tensor:
    """The 2D rotary cos/sin of (T, 2) positions, (2, T, 1, head_dim) as `apply_rope` takes them: the first
    quarter of the frequencies turns with the row, the second with the column, both halves repeated.
    `size`: more than the largest position (None: read from `positions`, a device sync on a GPU)."""
    size = int(positions.max()) + 1 if size is None else size
    cache = upload(build_rope_cache(head_dim // 2, size, RopeConfig(theta)), positions.device)  # no wait
    row_cos, row_sin = cache[positions[:, 0]].chunk(2, dim=-1)
    col_cos, col_sin = cache[positions[:, 1]].chunk(2, dim=-1)
    cos, sin = torch.cat([row_cos, col_cos], dim=-1), torch.cat([row_sin, col_sin], dim=-1)
    return torch.stack([torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)]).unsqueeze(2)


# -- weights --------------------------------------------------------------------------------------------


def load_visual_weights(encoder: nn.Module, model_path: str | Path) -> None:
    """Fills `encoder`'s parameters from the folder's ``visual.*`` (or ``model.visual.*``) safetensors
    tensors; the text model's tensors are skipped."""
    names: set[str] = set()
    for file in checkpoint_files(model_path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            names.update(f.keys())
    prefix = next((p for p in CHECKPOINT_PREFIXES if any(n.startswith(p) for n in names)), None)
    if prefix is None:
        raise ValueError(
            f"the checkpoint in {str(model_path)!r} holds no visual.* tensors (no vision encoder)"
        )
    destinations = {prefix + name: param for name, param in encoder.named_parameters()}
    load_checkpoint(destinations, model_path, ignored=frozenset(n for n in names if not n.startswith(prefix)))
