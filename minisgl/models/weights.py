"""Loading safetensors checkpoints tensor by tensor into a model's parameters, or dummy weights.

A model describes its checkpoint as `checkpoint_map()`: checkpoint tensor name -> the destination view
(a parameter, or a slice of a merged one such as QKV), or a `Shard` of it under tensor parallelism:
then only the rank's part of the checkpoint tensor is read from the file. Each tensor is read, checked
against its destination's shape and copied into it (converting dtype and moving device on the way), so
peak host memory stays at the model plus the largest tensor. Only safetensors are read: never pickles.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

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


@torch.no_grad()
def load_checkpoint(
    destinations: Mapping[str, torch.Tensor | Shard],
    model_path: str | Path,
    ignored: frozenset[str] = frozenset(),
) -> None:
    """Fills every destination from the checkpoint; tensors named in `ignored` are skipped quietly."""
    seen: set[str] = set()
    unexpected: list[str] = []
    files = checkpoint_files(model_path)
    with tqdm(total=len(destinations), desc="loading weights", unit="tensor", leave=False) as bar:
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
                    expected = dest.full_shape if isinstance(dest, Shard) else tuple(dest.shape)
                    if shape != expected:
                        raise ValueError(
                            f"checkpoint tensor {name!r} in {file.name} has shape {shape}, expected "
                            f"{expected} from config.json; the weights do not match the config"
                        )
                    if isinstance(dest, Shard):
                        dest.load(source)  # reads only this rank's part
                    else:
                        dest.copy_(f.get_tensor(name))
                    seen.add(name)
                    bar.update(1)
    missing = sorted(set(destinations) - seen)
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
