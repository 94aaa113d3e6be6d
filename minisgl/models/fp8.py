"""The projections of a decoder layer as plain weights or FP8 ones, and how each is read from a checkpoint.

A `Projection` is one weight of this rank (its merged checkpoint `Part`s and its columns);
`make_projection` allocates it (a parameter, or an `Fp8Linear` under an `Fp8Config`); `projection_map`
gives its checkpoint-map entries: `Shard`, `Fp8WeightShard` with `Fp8ScaleShard` / `Fp8TensorScale`,
or `Fp8Quantize` (the setting `quantization: fp8`, the same numbers as an FP8 checkpoint).
`fp8_split_problem` says when a tensor-parallel size would cut a block. Under a `PackedConfig` (4- and
8-bit checkpoints) the same functions hand each projection to minisgl.models.packed. docs/quantization.md.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from minisgl.kernels.fp8 import ACTIVATION_GROUP, activation_group, quantize_blocks
from minisgl.layers.fp8 import Fp8Linear
from minisgl.layers.packed import PackedLinear
from minisgl.models import packed
from minisgl.models.config import FP8_PROJECTIONS, Fp8Config, ModelConfig
from minisgl.models.quant_config import PackedConfig
from minisgl.models.weights import BadTensor, Shard, source_dtype

FP8_SOURCE_DTYPE = "F8_E4M3"
# dtypes a weight quantized at load may come in
QUANTIZABLE_DTYPES = ("BF16", "F16", "F32")


@dataclass(frozen=True)
class Part:
    """`size` rows (or columns) of this rank: part `part` of `parts` equal parts of the checkpoint's."""

    size: int
    part: int = 0
    parts: int = 1


@dataclass(frozen=True)
class Projection:
    """One projection weight of this rank: the checkpoint tensors `names` (module names under the
    layer's prefix, e.g. "self_attn.q_proj") concatenated along rows, each `segments[i]` rows of it, and
    `cols` columns. A tensor is split over the ranks along its rows or its columns, never both."""

    names: tuple[str, ...]
    segments: tuple[Part, ...]
    cols: Part

    @property
    def rows(self) -> int:
        return sum(segment.size for segment in self.segments)

    def split(self, index: int) -> tuple[int, int, int]:
        """(dim, part, parts) of checkpoint tensor `index` on this rank."""
        segment = self.segments[index]
        if segment.parts > 1:
            return 0, segment.part, segment.parts
        return 1, self.cols.part, self.cols.parts

    def row_slices(self) -> Iterator[tuple[int, str, slice]]:
        """(index, name, rows of the merged weight) of each checkpoint tensor."""
        start = 0
        for index, (name, segment) in enumerate(zip(self.names, self.segments)):
            yield index, name, slice(start, start + segment.size)
            start += segment.size


def fp8_split_problem(projection: Projection, fp8: Fp8Config | None) -> str | None:
    """What of an FP8 `projection` this rank's part would cut, and how, or None: its weight blocks (the
    scales are sliced in whole blocks), or the activation groups of its columns (per token, in groups of
    `activation_group` columns, which must not straddle two ranks)."""
    if fp8 is None:
        return None
    cols = projection.cols
    if fp8.block is None:  # per-tensor scales: any cut keeps a whole scale, but not a whole group
        group = activation_group(ACTIVATION_GROUP)
        if cols.parts > 1 and cols.size % group:
            return (
                f"activation groups ({group} columns) of {projection.names[0]}: each rank would hold "
                f"{cols.size} of its {cols.size * cols.parts} columns, not a multiple of {group}"
            )
        return None
    block_n, block_k = fp8.block
    what = f"weight blocks ({list(fp8.block)}) of"
    for name, segment in zip(projection.names, projection.segments):
        if segment.parts > 1 and segment.size % block_n:
            return (
                f"{what} {name}: each rank would hold {segment.size} of its {segment.size * segment.parts} "
                f"rows, not a multiple of the block height {block_n}"
            )
    for width, unit in ((block_k, "block width"), (activation_group(block_k), "activation group width")):
        if cols.parts > 1 and cols.size % width:
            return (
                f"{what} {projection.names[0]}: each rank would hold {cols.size} of its "
                f"{cols.size * cols.parts} columns, not a multiple of the {unit} {width}"
            )
    return None


def check_fp8_split(projections: list[Projection], cfg: ModelConfig, tp_size: int) -> None:
    """Raises where the tensor-parallel size would split the FP8 weight blocks (or activation groups)
    of a projection, or a packed checkpoint's words or groups."""
    if isinstance(cfg.quantization, PackedConfig):
        for projection in projections:
            for index, name, _ in projection.row_slices():
                dim, _, parts = projection.split(index)
                size = projection.segments[index].size
                problem = packed.split_problem(cfg.quantization, name, size, projection.cols.size, dim, parts)
                if problem is not None:
                    raise ValueError(f"tensor-parallel size {tp_size} splits the packed weights of {problem}")
        return
    for projection in projections:
        problem = fp8_split_problem(projection, cfg.quantization)
        if problem is not None:
            raise ValueError(
                f"tensor-parallel size {tp_size} splits the FP8 {problem}: each rank's scales must cover "
                "whole blocks of its weights and activations. Use a tensor-parallel size whose shards are "
                "whole blocks (1 always is)"
            )


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def make_projection(
    projection: Projection, cfg: ModelConfig, tp_size: int = 1
) -> nn.Parameter | Fp8Linear | PackedLinear:
    """The weight of `projection` on the current default device: in the default dtype, or FP8 when
    `cfg.quantization` says so. A merged FP8 weight whose segments do not all fill whole blocks keeps
    one scale row per weight row (see minisgl.layers.fp8); per-tensor scales become one scale per row
    and all of the rank's columns. A 4- or 8-bit checkpoint's projection is a `PackedLinear` on CUDA,
    a plain weight (dequantized at load) elsewhere (minisgl.models.packed)."""
    fp8 = cfg.quantization
    if isinstance(fp8, PackedConfig):
        check_fp8_split([projection], cfg, tp_size)
        if packed.keep_packed(torch.get_default_device()):
            sizes = tuple(segment.size for segment in projection.segments)
            return PackedLinear(sizes, projection.cols.size, fp8.bits, fp8.group)
    if fp8 is None or isinstance(fp8, PackedConfig):
        return _param(projection.rows, projection.cols.size)
    check_fp8_split([projection], cfg, tp_size)
    sizes = tuple(segment.size for segment in projection.segments)
    if fp8.block is None:
        block = (1, max(projection.cols.size, 1))
    else:
        block_n, block_k = fp8.block
        whole = all(size % block_n == 0 for size in sizes[:-1])
        block = (block_n if whole else 1, block_k)
    return Fp8Linear(sizes, projection.cols.size, block)


def projection_map(
    prefix: str, projection: Projection, weight: torch.Tensor | Fp8Linear, cfg: ModelConfig
) -> dict:
    """The checkpoint map's entries of `projection` (under the layer's `prefix`) into `weight`."""
    out: dict[str, Any] = {}
    fp8 = cfg.quantization
    for index, name, rows in projection.row_slices():
        dim, part, parts = projection.split(index)
        key = f"{prefix}.{name}"
        if isinstance(fp8, PackedConfig):
            out.update(_packed_map(fp8, key, projection, index, weight, rows))
            continue
        if not isinstance(weight, Fp8Linear):
            out[f"{key}.weight"] = Shard(weight[rows], dim, part, parts)
            continue
        assert fp8 is not None
        if not fp8.in_checkpoint:
            assert fp8.block is not None  # the setting quantizes in blocks
            out[f"{key}.weight"] = Fp8Quantize(weight, index, dim, part, parts, fp8.block)
            continue
        out[f"{key}.weight"] = Fp8WeightShard(weight.weight[rows], dim, part, parts)
        if fp8.block is None:
            out[f"{key}.{fp8.scale_name}"] = Fp8TensorScale(weight, index)
        else:
            out[f"{key}.{fp8.scale_name}"] = Fp8ScaleShard(weight, index, dim, part, parts, fp8.block, key)
    return out


def _packed_map(
    cfg: PackedConfig, key: str, projection: Projection, index: int, weight: Any, rows: slice
) -> dict[str, Any]:
    """Segment `index` of a projection of a 4- or 8-bit checkpoint (module `key`)."""
    split = projection.split(index)
    if cfg.ignored(key):  # compressed-tensors' `ignore`: a plain weight
        if isinstance(weight, PackedLinear):
            raise ValueError(
                f"{key} is unquantized (quantization_config.ignore) but merged with packed weights"
            )
        return {f"{key}.weight": Shard(weight[rows], *split)}
    shape = (projection.segments[index].size, projection.cols.size)
    sink = packed.Packed(weight, index) if isinstance(weight, PackedLinear) else packed.Dense(weight[rows])
    return packed.module_map(cfg, key, shape, split, sink)


def fp8_checkpoint_ignored(cfg: ModelConfig) -> frozenset[str]:
    """Tensors of an FP8 checkpoint minisgl reads nothing from: the static activation scales
    (`input_scale`, activation_scheme "static"); activations are quantized per token group instead.
    Of a 4- or 8-bit checkpoint: `minisgl.models.packed.ignored_tensors`."""
    if isinstance(cfg.quantization, PackedConfig):
        layers = [f"model.layers.{i}" for i in range(cfg.num_layers)]
        modules = [f"{layer}.{name}" for layer in layers for name in FP8_PROJECTIONS]
        experts = ("gate_proj", "up_proj", "down_proj")
        modules += [
            f"{layer}.mlp.experts.{e}.{p}"
            for layer in layers
            for e in range(cfg.num_experts)
            for p in experts
        ]
        return packed.ignored_tensors(cfg.quantization, modules)
    if cfg.quantization is None or not cfg.quantization.in_checkpoint:
        return frozenset()
    return frozenset(
        f"model.layers.{i}.{name}.input_scale" for i in range(cfg.num_layers) for name in FP8_PROJECTIONS
    )


def _require_dtype(source: Any, allowed: tuple[str, ...], why: str) -> None:
    dtype = source_dtype(source)
    if dtype not in allowed:
        raise BadTensor(f"holds {dtype}, expected {' or '.join(allowed)} ({why})")


def _part_of(source: Any, dim: int, part: int, size: int) -> torch.Tensor:
    """Part `part` of `size` entries along `dim` of a tensor or lazy safetensors slice."""
    return source[(slice(None),) * dim + (slice(part * size, (part + 1) * size),)]


def _check_scales(scale: torch.Tensor) -> None:
    if not bool(torch.isfinite(scale).all()) or bool((scale < 0).any()):
        raise BadTensor("holds scales that are negative, infinite or NaN; the checkpoint is damaged")


def _place_scales(weight: Fp8Linear, index: int, scale: torch.Tensor, block_n: int) -> None:
    """Stores segment `index`'s scales (one row per `block_n` of its rows) into `weight.scale`, one
    scale row per weight row where the merged weight keeps those."""
    scale = scale.to(device=weight.scale.device, dtype=torch.float32)
    if weight.block[0] != block_n:
        scale = scale.repeat_interleave(block_n, dim=0)[: weight.segments[index]]
    weight.scale[weight.segment_scale_rows(index)].copy_(scale)


class Fp8WeightShard(Shard):
    """A `Shard` of an FP8 checkpoint's e4m3 weight (any other dtype is refused: its scales would not
    apply)."""

    def load(self, source: Any) -> None:
        _require_dtype(source, (FP8_SOURCE_DTYPE,), "config.json's quantization_config is fp8")
        super().load(source)


@dataclass(frozen=True)
class _SegmentPart:
    """This rank's part `part` of `parts` along `dim` of checkpoint tensor `index` of `weight`, in blocks
    of `block` (rows, columns)."""

    weight: Fp8Linear
    index: int
    dim: int
    part: int
    parts: int
    block: tuple[int, int]

    @property
    def weight_shape(self) -> tuple[int, int]:
        """The checkpoint weight's (N, K)."""
        rows, cols = self.weight.segments[self.index], self.weight.shape[1]
        return (rows * self.parts, cols) if self.dim == 0 else (rows, cols * self.parts)


@dataclass(frozen=True)
class Fp8ScaleShard(_SegmentPart):
    """`weight_scale_inv` (ceil(N / bn), ceil(K / bk)) of the checkpoint weight (N, K) `name`.weight;
    this rank reads the blocks of its part of the weight."""

    name: str = ""

    @property
    def full_shape(self) -> tuple[int, int]:
        (n, k), (bn, bk) = self.weight_shape, self.block
        return -(-n // bn), -(-k // bk)

    @property
    def shape_note(self) -> str:
        return (
            f"for the {self.weight_shape} weight {self.name}.weight in blocks of {list(self.block)} "
            "(quantization_config.weight_block_size): one scale per block, partial blocks included"
        )

    def load(self, source: Any) -> None:
        full = self.full_shape
        scale = _part_of(source, self.dim, self.part, full[self.dim] // self.parts).float()
        _check_scales(scale)
        _place_scales(self.weight, self.index, scale, self.block[0])


@dataclass(frozen=True)
class Fp8TensorScale:
    """`weight_scale` of checkpoint tensor `index` of `weight`: one scale for the whole tensor."""

    weight: Fp8Linear
    index: int
    full_shape: tuple[int, ...] = ()
    shape_note = "(one scale per tensor: quantization_config has no weight_block_size)"

    def load(self, source: Any) -> None:
        scale = source[...].float().reshape(1, 1)
        _check_scales(scale)
        rows = self.weight.segment_scale_rows(self.index)
        self.weight.scale[rows].copy_(scale.expand(rows.stop - rows.start, self.weight.scale.shape[1]))


@dataclass(frozen=True)
class Fp8Quantize(_SegmentPart):
    """A checkpoint weight in bf16, float16 or float32, quantized at load into checkpoint tensor `index`
    of `weight`: this rank's part, in blocks of `block`, on the weight's device."""

    @property
    def full_shape(self) -> tuple[int, int]:
        return self.weight_shape

    def load(self, source: Any) -> None:
        _require_dtype(source, QUANTIZABLE_DTYPES, "the setting quantization: fp8 quantizes it")
        size = self.weight.segments[self.index] if self.dim == 0 else self.weight.shape[1]
        local = _part_of(source, self.dim, self.part, size).to(self.weight.weight.device, torch.float32)
        q, scale = quantize_blocks(local, self.block)
        self.weight.weight[self.weight.segment_rows(self.index)].copy_(q)
        _place_scales(self.weight, self.index, scale, self.block[0])


@dataclass(frozen=True)
class KvScale:
    """A layer's K or V scale of an FP8 KV cache (`self_attn.k_scale`, `self_attn.v_scale`): a positive
    scalar, into the 0-d tensor `dest`."""

    dest: torch.Tensor
    full_shape: tuple[int, ...] = ()

    def load(self, source: Any) -> None:
        value = source[...].float().reshape(())
        if not (bool(torch.isfinite(value)) and float(value) > 0):
            raise BadTensor(f"is {float(value)}; a KV-cache scale must be a positive finite number")
        self.dest.copy_(value)


@torch.no_grad()
def init_dummy_fp8(model: nn.Module, seed: int = 0) -> set[str]:
    """Random FP8 weights for every `Fp8Linear` of `model`, made on its device: N(0, 0.02) weights
    quantized in the layer's blocks. Returns the names of the parameters filled."""
    filled: set[str] = set()
    generator = None
    for name, module in model.named_modules():
        if not isinstance(module, Fp8Linear):
            continue
        device = module.weight.device
        if generator is None or generator.device != device:
            generator = torch.Generator(device=device).manual_seed(seed)
        values = torch.empty(module.shape, dtype=torch.float32, device=device).normal_(
            0.0, 0.02, generator=generator
        )
        q, scale = quantize_blocks(values, module.block)
        module.weight.copy_(q)
        module.scale.copy_(scale)
        filled.update({f"{name}.weight", f"{name}.scale"})
    return filled
