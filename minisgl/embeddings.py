"""Embeddings (docs/embeddings.md): the pooling a model folder asks for, the inputs checked, and the pooled
vectors finished (normalized, truncated to `dimensions`, encoded). The pooling itself runs in the engine
(`Engine.forward_batch`, `SamplingParams.pooling`)."""

from __future__ import annotations

import base64
import json
import math
import numbers
import struct
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import Any

MAX_EMBEDDING_INPUTS = 2048  # inputs per embeddings request, at most
ENCODING_FORMATS = ("float", "base64")
# sentence-transformers' Pooling config keys -> minisgl's pooling
_POOLING_KEYS = {
    "pooling_mode_lasttoken": "last",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
}


def folder_pooling(model_path: str | Path, read_mode: bool = True) -> tuple[str | None, bool | None]:
    """The pooling and normalization a model folder's sentence-transformers files say (`modules.json`,
    its Pooling module's `config.json`, a Normalize module); (None, None) without `modules.json`.
    `read_mode` False: the normalization only (the Pooling module is not read)."""
    folder = Path(model_path)
    try:
        modules = json.loads((folder / "modules.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError) as e:
        raise ValueError(f"{folder / 'modules.json'}: not a readable JSON file ({e})") from None
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ValueError(f"{folder / 'modules.json'}: must hold a list of modules (objects)")
    pooling, normalize = None, False
    for module in modules:
        kind = str(module.get("type", ""))
        if kind.endswith(".Normalize"):
            normalize = True
        elif kind.endswith(".Pooling") and read_mode:
            path = folder / str(module.get("path", "")) / "config.json"
            try:
                config = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:
                raise ValueError(f"{path}: the Pooling module's config is not readable ({e})") from None
            given = [key for key, value in config.items() if key.startswith("pooling_mode") and value]
            modes = [_POOLING_KEYS[key] for key in given if key in _POOLING_KEYS]
            if len(given) != 1 or len(modes) != 1:
                raise ValueError(
                    f"{path} sets {', '.join(given) or 'no pooling mode'}: minisgl pools by exactly one of "
                    f"{', '.join(_POOLING_KEYS)}; set the setting pooling (last, mean or cls) to override"
                )
            pooling = modes[0]
    return pooling, normalize


def resolve_pooling(model_path: str | Path, pooling: str, normalize: bool | None) -> tuple[str, bool]:
    """The pooling and normalization served: the settings (`pooling`, `normalize_embeddings`) where
    given, else the folder's sentence-transformers files, else the last token, normalized."""
    folder_mode, folder_normalize = folder_pooling(model_path, read_mode=pooling == "auto")
    if pooling == "auto":
        pooling = folder_mode or "last"
    if normalize is None:
        normalize = True if folder_normalize is None else folder_normalize
    return pooling, normalize


def finish(vector: Sequence[float], normalize: bool, dimensions: int | None = None) -> list[float]:
    """A pooled vector as served: its first `dimensions` values (Matryoshka truncation), L2-normalized
    when the model normalizes."""
    vector = list(vector[:dimensions])
    if normalize:
        norm = math.hypot(*vector)
        if norm > 0:
            vector = [x / norm for x in vector]
    return vector


def finish_all(vectors: Sequence[array], normalize: bool, dimensions: int | None = None) -> list[list[float]]:
    """`finish` of many pooled vectors of one width (float32 arrays, `RequestState.embedding`) at once:
    truncated and normalized in float64 in one go, then made Python lists in one conversion."""
    import torch  # the server's front end imports this module and needs no torch

    flat = torch.frombuffer(bytearray().join(vectors), dtype=torch.float32)
    rows = flat.view(len(vectors), -1)[:, :dimensions].double()
    if normalize:
        norms = torch.linalg.vector_norm(rows, dim=1, keepdim=True)
        rows = rows / norms.masked_fill(norms == 0, 1.0)  # a zero vector stays as it is
    return rows.tolist()


def encode(vector: list[float], encoding_format: str) -> list[float] | str:
    """`float`: the list; `base64`: its little-endian float32 bytes in base64 (as OpenAI sends them)."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


def check_options(encoding_format: Any, dimensions: Any, hidden_size: int) -> None:
    """Raises a ValueError naming a bad `encoding_format` or `dimensions`."""
    if encoding_format not in ENCODING_FORMATS:
        raise ValueError(
            f"encoding_format must be 'float' or 'base64', got encoding_format={encoding_format!r}"
        )
    if dimensions is not None and (
        isinstance(dimensions, bool)
        or not isinstance(dimensions, numbers.Integral)
        or not 1 <= dimensions <= hidden_size
    ):
        raise ValueError(
            f"dimensions must be an integer in [1, {hidden_size}] (the model's hidden size), got dimensions={dimensions!r}"
        )


def split_inputs(value: Any) -> list[str | list[int]]:
    """The inputs of an embeddings request: a string, a list of strings, a list of token ids or a list
    of lists of token ids, as a list of single inputs; a ValueError naming what is wrong."""
    if isinstance(value, str):
        inputs: list[Any] = [value]
    elif isinstance(value, list | tuple) and value and _all_ids(value):
        inputs = [list(value)]
    elif isinstance(value, list | tuple):
        inputs = list(value)
    else:
        raise ValueError(
            f"input must be a string, a list of strings, a list of token ids or a list of lists of token "
            f"ids, got {type(value).__name__}"
        )
    if not inputs:
        raise ValueError("input is an empty list: give at least one string or list of token ids")
    if len(inputs) > MAX_EMBEDDING_INPUTS:
        raise ValueError(
            f"input holds {len(inputs)} inputs, more than {MAX_EMBEDDING_INPUTS} per request: split it"
        )
    for i, item in enumerate(inputs):
        if isinstance(item, str):
            if not item:
                raise ValueError(f"input[{i}] is an empty string: give some text")
        elif isinstance(item, list | tuple):
            if not item:
                raise ValueError(f"input[{i}] is an empty list of token ids: give at least one token")
            if not _all_ids(item):
                bad = next(t for t in item if not _is_id(t))
                raise ValueError(f"input[{i}] holds {bad!r}: token ids are integers")
        else:
            raise ValueError(
                f"input[{i}] is a {type(item).__name__}: each input is a string or a list of token ids"
            )
    return [item if isinstance(item, str) else list(item) for item in inputs]


def check_ids(ids: list[int], index: int, vocab_size: int, max_len: int) -> None:
    """Raises a ValueError if input `index`'s token ids are outside the vocabulary or too many."""
    if not 0 <= min(ids) <= max(ids) < vocab_size:
        bad = next(t for t in ids if not 0 <= t < vocab_size)
        raise ValueError(f"input[{index}] holds token id {bad}, outside the vocabulary [0, {vocab_size})")
    if len(ids) > max_len:
        raise ValueError(
            f"input[{index}] has {len(ids)} tokens, more than the context of {max_len}: shorten it"
        )


def _is_id(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _all_ids(values: list | tuple) -> bool:
    """Whether every item is a token id (`_is_id`): a list of plain ints is checked at C speed."""
    return set(map(type, values)) <= {int} or all(map(_is_id, values))
