"""Loading safetensors checkpoints tensor by tensor into a model's parameters, or dummy weights.

A model's `checkpoint_map()` maps each checkpoint tensor name to its destination: a parameter view, a
`Shard` (only the rank's part is read), or any `Destination` (`full_shape` and `load(source)`, as the
FP8 weights of `minisgl.models.fp8`), which raises `BadTensor` when the tensor is unusable; the loader
names the tensor and its file. Peak host memory stays at the model plus its largest tensor; only
safetensors are read, never pickles. docs/architecture.md.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open
from tqdm import tqdm

logger = logging.getLogger(__name__)

# tensors a checkpoint may carry that minisgl recomputes or does not need
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def checkpoint_files(model_path: str | Path) -> list[Path]:
    folder = Path(model_path)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        with open(index, encoding="utf-8") as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        files = [folder / name for name in names]
        missing = [str(p) for p in files if not p.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} lists shard files that do not exist: {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickles = [p.name for p in folder.glob("*.bin")] + [p.name for p in folder.glob("*.pt")]
        hint = f" (found {', '.join(pickles)}: minisgl never loads pickled checkpoints)" if pickles else ""
        raise FileNotFoundError(f"no *.safetensors files in model folder {str(folder)!r}{hint}")
    return files


class BadTensor(ValueError):
    """A checkpoint tensor its destination cannot take; the message completes "checkpoint tensor NAME in
    FILE ..." (the loader adds the name and the file)."""


class Destination(Protocol):
    """Where one checkpoint tensor goes, beyond a plain tensor (see the module docstring)."""

    @property
    def full_shape(self) -> tuple[int, ...]: ...

    def load(self, source: Any) -> None: ...


def source_dtype(source: Any) -> str:
    """The safetensors dtype name of a lazy slice ('BF16', 'F8_E4M3', ...) or of a tensor."""
    if isinstance(source, torch.Tensor):
        names = {
            torch.float8_e4m3fn: "F8_E4M3",
            torch.bfloat16: "BF16",
            torch.float16: "F16",
            torch.float32: "F32",
        }
        return names.get(source.dtype, str(source.dtype).removeprefix("torch."))
    return source.get_dtype()


@dataclass(frozen=True)
class Shard:
    """`dest` receives part `part` of the checkpoint tensor cut into `parts` parts of `dest`'s size along
    `dim`. With `total` (the checkpoint's size along `dim`, when `parts` does not divide it) the parts are
    padded: the last ones hold fewer rows (or none) and the rest of `dest` is zeroed."""

    dest: torch.Tensor
    dim: int
    part: int
    parts: int
    total: int | None = None

    @property
    def full_shape(self) -> tuple[int, ...]:
        shape = list(self.dest.shape)
        shape[self.dim] = shape[self.dim] * self.parts if self.total is None else self.total
        return tuple(shape)

    def load(self, source) -> None:
        """Copies this part of `source` (a tensor, or a lazy safetensors slice: only the part is read)."""
        size = self.dest.shape[self.dim]
        total = self.full_shape[self.dim]
        start = min(self.part * size, total)
        stop = min(start + size, total)
        self.dest.narrow(self.dim, 0, stop - start).copy_(
            source[(slice(None),) * self.dim + (slice(start, stop),)]
        )
        self.dest.narrow(self.dim, stop - start, size - (stop - start)).zero_()


@dataclass(frozen=True)
class Fused:
    """One checkpoint tensor that holds several destinations' tensors along its rows, in order (Phi-3's
    qkv_proj and gate_up_proj): each `parts` entry (a tensor or a `Destination`) receives its rows."""

    parts: tuple[Any, ...]

    @staticmethod
    def _shape(dest: Any) -> tuple[int, ...]:
        return tuple(dest.shape) if isinstance(dest, torch.Tensor) else tuple(dest.full_shape)

    @property
    def full_shape(self) -> tuple[int, ...]:
        shapes = [self._shape(dest) for dest in self.parts]
        return (sum(shape[0] for shape in shapes), *shapes[0][1:])

    def load(self, source: Any) -> None:
        start = 0
        for dest in self.parts:
            rows = self._shape(dest)[0]
            part = source[start : start + rows]
            if isinstance(dest, torch.Tensor):
                dest.copy_(part)
            else:
                dest.load(part)
            start += rows


@torch.no_grad()
def load_checkpoint(
    destinations: Mapping[str, torch.Tensor | Destination],
    model_path: str | Path,
    ignored: frozenset[str] = frozenset(),
    optional: frozenset[str] = frozenset(),
) -> None:
    """Fills every destination from the checkpoint; tensors named in `ignored` are skipped quietly, and
    destinations named in `optional` keep their values where the checkpoint lacks them. A destination of
    shape () also takes a tensor of shape (1,) (checkpoints store scalars either way)."""
    seen: set[str] = set()
    unexpected: list[str] = []
    files = checkpoint_files(model_path)
    with tqdm(
        total=len(set(destinations) - optional), desc="loading weights", unit="tensor", leave=False
    ) as bar:
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    dest = destinations.get(name)
                    if dest is None:
                        if name not in ignored and not name.endswith(IGNORED_SUFFIXES):
                            unexpected.append(name)
                        continue
                    source = f.get_slice(name)  # reads nothing yet
                    shape = tuple(source.get_shape())
                    is_tensor = isinstance(dest, torch.Tensor)
                    expected = tuple(dest.shape) if is_tensor else tuple(dest.full_shape)
                    if shape != expected and not (expected == () and shape == (1,)):
                        note = getattr(dest, "shape_note", "from config.json")
                        raise ValueError(
                            f"checkpoint tensor {name!r} in {file.name} has shape {shape}, expected "
                            f"{expected} {note}; the weights do not match the config"
                        )
                    try:
                        if is_tensor:
                            dest.copy_(f.get_tensor(name).reshape(dest.shape))
                        else:
                            dest.load(source)  # a Shard reads only this rank's part
                    except BadTensor as e:
                        raise BadTensor(f"checkpoint tensor {name!r} in {file.name} {e}") from None
                    seen.add(name)
                    bar.update(1)
    missing = sorted(set(destinations) - seen - optional)
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(
            f"checkpoint in {str(model_path)!r} is missing tensor(s) {', '.join(map(repr, missing[:5]))}{more}"
        )
    if unexpected:
        logger.warning(
            "ignored %d checkpoint tensor(s) the model does not use, e.g. %s", len(unexpected), unexpected[0]
        )


@torch.no_grad()
def init_dummy_weights(params: dict[str, torch.Tensor], seed: int = 0) -> None:
    """Random weights made on the parameters' device: norms at 1, everything else N(0, 0.02)."""
    generator = None
    for name, param in params.items():
        if generator is None or generator.device != param.device:
            generator = torch.Generator(device=param.device).manual_seed(seed)
        if param.dim() == 1 and "norm" in name:
            param.fill_(1.0)
        else:
            param.normal_(0.0, 0.02, generator=generator)
