"""Loading 4- and 8-bit checkpoints (AWQ, GPTQ, compressed-tensors pack-quantized; `PackedConfig`) into
minisgl's one packed layout (minisgl.kernels.packed), or dequantized into plain weights.

Each checkpoint module (one segment of a merged projection, or one expert's projection) has a few
tensors; a `Module` collects this rank's part of each (`Part`, a loader destination) and, once all are
read, decodes them into values u (n, k), zero points and scales per group, and each input column's
group, then hands them to its sink: `Dense` dequantizes into a plain weight (the CPU, the experts of a
MoE layer, and modules a checkpoint leaves unquantized beside packed ones), `Packed` repacks them into a
`PackedLinear` (CUDA), its columns sorted by group once where GPTQ's act order (`g_idx`) scatters them.
docs/quantization.md ("4- and 8-bit weights").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from minisgl.kernels.packed import pack_words, unpack_words
from minisgl.layers.packed import PackedLinear
from minisgl.models.quant_config import PackedConfig
from minisgl.models.weights import BadTensor

# None: pack on CUDA, dequantize at load elsewhere; True / False: always / never pack (tests)
KEEP_PACKED: bool | None = None
# AWQ's order of the 8 columns in a word: nibble i (bits 4i) holds column AWQ_ORDER[i] of its 8
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# (role, the tensor's axes): "N" / "K" output / input rows packed P (or 1) to a word, "G" groups,
# an int a fixed size
LAYOUTS: dict[str, tuple[tuple[str, tuple[Any, ...]], ...]] = {
    "awq": (("qweight", (("K", 1), ("N", 8))), ("qzeros", ("G", ("N", 8))), ("scales", ("G", ("N", 1)))),
    "gptq": (
        ("qweight", (("K", "P"), ("N", 1))),
        ("qzeros", ("G", ("N", "P"))),
        ("scales", ("G", ("N", 1))),
        ("g_idx", (("K", 1),)),
    ),
    "compressed-tensors": (
        ("weight_packed", (("N", 1), ("K", "P"))),
        ("weight_scale", (("N", 1), "G")),
        ("weight_zero_point", (("N", "P"), "G")),
        ("weight_shape", (2,)),
    ),
}


def keep_packed(device: torch.device) -> bool:
    return device.type == "cuda" if KEEP_PACKED is None else KEEP_PACKED


def experts_packed(cfg: PackedConfig, device: torch.device) -> bool:
    """Whether a MoE layer's experts stay packed on `device`: as the projections, but never with GPTQ's
    act order (the experts' kernels read x in its own order; such experts are dequantized at load)."""
    return keep_packed(device) and not cfg.desc_act


def roles(cfg: PackedConfig) -> tuple[str, ...]:
    """The tensors of a module the checkpoint holds and minisgl reads (GPTQ's g_idx with act order only;
    compressed-tensors' zero points when asymmetric)."""
    out = tuple(role for role, _ in LAYOUTS[cfg.method])
    if cfg.method == "gptq" and not cfg.desc_act:
        out = out[:-1]
    if cfg.method == "compressed-tensors" and cfg.sym:
        out = tuple(r for r in out if r != "weight_zero_point")
    return out


def ignored_tensors(cfg: PackedConfig, modules: list[str]) -> frozenset[str]:
    """Tensors of `modules` that are read by nothing: GPTQ's g_idx without act order (it is k // group)."""
    if cfg.method == "gptq" and not cfg.desc_act:
        return frozenset(f"{m}.g_idx" for m in modules)
    return frozenset()


def split_problem(cfg: PackedConfig, name: str, rows: int, cols: int, dim: int, parts: int) -> str | None:
    """What a rank's part (`rows` x `cols` of a module, cut along `dim` into `parts`) would cut: a word
    of packed values or a group of columns."""
    if parts == 1:
        return None
    pack_n = 8 if cfg.method == "awq" else 1 if cfg.method == "compressed-tensors" and cfg.sym else cfg.pack
    if dim == 0 and rows % pack_n:
        return f"{name}: each rank would hold {rows} of its {rows * parts} rows, not a multiple of {pack_n}"
    whole = cfg.group is None or cfg.desc_act  # the scales of every rank's columns are read whole
    unit = cfg.pack if whole else cfg.group
    if dim == 1 and cols % unit:
        what = f"the group size {unit}" if not whole else f"{unit} (values per int32 word)"
        return f"{name}: each rank would hold {cols} of its {cols * parts} columns, not a multiple of {what}"
    return None


@dataclass(frozen=True)
class Dense:
    """Dequantizes into `dest` (n, k), in its dtype."""

    dest: torch.Tensor

    def __call__(self, u, zeros, scales, col_group, name: str) -> None:
        z, s = zeros[:, col_group].float(), scales[:, col_group].float()
        self.dest.copy_((u.float() - z) * s)


@dataclass(frozen=True)
class Packed:
    """Repacks into segment `index` of `layer` (of its expert `expert`, for a MoE layer's experts: their
    columns in the checkpoint's order, no act order)."""

    layer: PackedLinear
    index: int
    expert: int | None = None

    def __call__(self, u, zeros, scales, col_group, name: str) -> None:
        layer, k = self.layer, u.shape[1]
        group = min(layer.group, k)
        perm = torch.argsort(col_group, stable=True)
        runs = col_group[perm].view(-1, group)
        if not bool((runs == runs[:, :1]).all()) or runs[:, 0].unique().numel() != runs.shape[0]:
            raise BadTensor(
                f"orders this rank's {k} input columns in groups other than runs of {group} ({name}.g_idx); "
                "minisgl's kernels need whole groups on each rank: use a tensor-parallel size that keeps "
                "the act-order groups whole, or tp_size=1"
            )
        ids = runs[:, 0]
        identity = bool((perm == torch.arange(k)).all())
        rows = layer.segment_rows(self.index)
        device = layer.qweight.device
        if not layer.loaded and layer.scales.dtype != scales.dtype:  # the checkpoint's scale dtype
            layer.scales.data = torch.empty_like(layer.scales, dtype=scales.dtype)
        layer.loaded = True
        at = (rows,) if self.expert is None else (self.expert, rows)
        layer.qweight[at] = pack_words(u[:, perm], layer.bits).to(device)
        layer.scales[at] = scales[:, ids].to(device, layer.scales.dtype)
        layer.zeros[at] = zeros[:, ids].to(device, torch.uint8)
        if self.expert is None:
            layer.set_perm(None if identity else perm, name)
        elif not identity:  # `experts_packed` keeps act-order checkpoints' experts dequantized
            raise BadTensor("orders its input columns by group (g_idx); packed experts take no act order")


@dataclass
class Module:
    """One checkpoint module of (n, k) on this rank: part `part` of `parts` along `dim` (0: output rows,
    1: input columns) of the checkpoint's (N, K) weight; `sink` takes it decoded."""

    cfg: PackedConfig
    name: str
    n: int
    k: int
    dim: int
    part: int
    parts: int
    sink: Callable[..., None]
    got: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def full(self) -> tuple[int, int]:
        return (self.n * self.parts, self.k) if self.dim == 0 else (self.n, self.k * self.parts)

    def axis(self, spec: Any) -> tuple[int, slice | None]:
        """(full size, this rank's slice or None for all) of one axis of a tensor."""
        if isinstance(spec, int):
            return spec, None
        cfg, (N, K) = self.cfg, self.full
        if spec == "G":
            groups = 1 if cfg.group is None else K // cfg.group
            if self.dim == 0 or cfg.group is None or cfg.desc_act:
                return groups, None
            local = self.k // cfg.group
            return groups, slice(self.part * local, (self.part + 1) * local)
        which, pack = spec
        pack = cfg.pack if pack == "P" else pack
        size, local, split = (N, self.n, 0) if which == "N" else (K, self.k, 1)
        if split != self.dim:
            return size // pack, None
        return size // pack, slice(self.part * local // pack, (self.part + 1) * local // pack)

    def destinations(self) -> dict[str, Part]:
        layout = dict(LAYOUTS[self.cfg.method])
        return {f"{self.name}.{role}": Part(self, role, layout[role]) for role in roles(self.cfg)}

    def take(self, role: str, tensor: torch.Tensor) -> None:
        self.got[role] = tensor
        if len(self.got) == len(roles(self.cfg)):
            self.sink(*self.decode(), name=self.name)
            self.got.clear()

    def decode(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(u (n, k) int32, zeros (n, groups) int32, scales (n, groups), each column's group (k,))."""
        cfg, got, bits, (n, k) = self.cfg, self.got, self.cfg.bits, (self.n, self.k)
        groups_local = k // cfg.group if cfg.group is not None else 1
        col_group = torch.arange(k) // (cfg.group or k)
        if cfg.method == "awq":
            inverse = [AWQ_ORDER.index(j) for j in range(8)]

            def awq(words: torch.Tensor) -> torch.Tensor:
                values = unpack_words(words, 4)
                return values.view(values.shape[0], -1, 8)[:, :, inverse].reshape(values.shape[0], -1).T

            u, zeros, scales = awq(got["qweight"]), awq(got["qzeros"]), got["scales"].T
        elif cfg.method == "gptq":
            u = unpack_words(got["qweight"].T.contiguous(), bits)
            zeros = unpack_words(got["qzeros"], bits).T + cfg.zero_offset
            scales = got["scales"].T
            if cfg.desc_act:
                col_group = got["g_idx"].long()
                if bool((col_group < 0).any()) or bool((col_group >= scales.shape[1]).any()):
                    raise BadTensor(f"{self.name}.g_idx names groups outside [0, {scales.shape[1]})")
        else:
            shape = got["weight_shape"].tolist()
            if shape != list(self.full):
                raise BadTensor(
                    f"{self.name}.weight_shape is {shape}, expected {list(self.full)} from config.json"
                )
            u, scales = unpack_words(got["weight_packed"], bits), got["weight_scale"]
            if cfg.sym:
                zeros = torch.full((n, groups_local), 1 << (bits - 1), dtype=torch.int32)
            else:
                zeros = unpack_words(got["weight_zero_point"].T.contiguous(), bits).T
        if int(zeros.max()) > 255:
            raise BadTensor(
                f"{self.name}: a zero point of {int(zeros.max())} is out of range; the checkpoint is damaged"
            )
        scales = scales.contiguous()
        if not bool(torch.isfinite(scales.float()).all()):
            raise BadTensor(f"{self.name}: scales that are infinite or NaN; the checkpoint is damaged")
        return u, zeros, scales, col_group


@dataclass(frozen=True)
class Part:
    """One tensor (`role`) of a `Module`: the loader's destination; reads this rank's part."""

    module: Module
    role: str
    axes: tuple[Any, ...]

    @property
    def full_shape(self) -> tuple[int, ...]:
        return tuple(self.module.axis(spec)[0] for spec in self.axes)

    @property
    def shape_note(self) -> str:
        cfg = self.module.cfg
        return f"for the {self.module.full} weight {self.module.name} in {cfg.describe()} ({cfg.method}'s layout)"

    def load(self, source: Any) -> None:
        index = tuple(self.module.axis(spec)[1] or slice(None) for spec in self.axes)
        tensor = source[index]
        if self.role in ("scales", "weight_scale"):
            if tensor.dtype not in (torch.float16, torch.bfloat16, torch.float32):
                raise BadTensor(f"holds {tensor.dtype}, expected float16, bfloat16 or float32 scales")
        elif tensor.dtype not in (torch.int32, torch.int64):
            raise BadTensor(
                f"holds {tensor.dtype}, expected int32 ({self.module.cfg.method}'s packed layout)"
            )
        self.module.take(self.role, tensor)


def module_map(
    cfg: PackedConfig, name: str, shape: tuple[int, int], split: tuple[int, int, int], sink
) -> dict:
    """The checkpoint map's entries of module `name` of this rank's `shape` (n, k), cut as `split`
    (dim, part, parts) from the checkpoint's, into `sink` (`Dense` or `Packed`)."""
    dim, part, parts = split
    problem = split_problem(cfg, name, *shape, dim, parts)
    if problem is not None:
        raise ValueError(f"tensor-parallel size {parts} splits the packed weights of {problem}")
    return Module(cfg, name, *shape, dim, part, parts, sink).destinations()


@torch.no_grad()
def init_dummy_packed(model: torch.nn.Module, seed: int = 0) -> set[str]:
    """Random packed weights for every `PackedLinear`: uniform values, zero points at the middle, scales
    that give weights of about N(0, 0.02). Returns the names of the parameters filled."""
    filled: set[str] = set()
    for name, module in model.named_modules():
        if not isinstance(module, PackedLinear):
            continue
        device = module.qweight.device
        g = torch.Generator(device=device).manual_seed(seed)
        top = 1 << module.bits
        # random words hold uniform values in every field; made in place, no N x K transient (int64
        # values packed would take 16 bytes a weight for a moment: 1.6 GiB at an 8B's gate/up)
        module.qweight.random_(-(2**31), 2**31, generator=g)
        module.zeros.fill_(top // 2)
        module.scales.fill_(0.02 * 3.46 / top)  # uniform values: std top / sqrt(12)
        filled.update(n for n, _ in module.named_parameters(prefix=name))
    return filled
