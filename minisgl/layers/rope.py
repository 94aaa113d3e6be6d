"""Rotary position embeddings (the rotate-half layout of Llama and Qwen) with linear, Llama 3, YaRN
(gpt-oss) and LongRoPE (Phi-3) scaling, over the whole head or its first `rotary_dim` columns (partial
rotary)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


@dataclass(frozen=True)
class RopeConfig:
    """A model's rotary embedding: base `theta` and scaling (`rope_type` one of SUPPORTED_ROPE_TYPES)."""

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # YaRN (gpt-oss): the ramp between interpolated and kept frequencies (`beta_fast`, `beta_slow`,
    # `truncate`). YaRN and LongRoPE: the factor cos and sin are scaled by (`rope_scale`; YaRN's None:
    # 0.1 ln(factor) + 1). LongRoPE (Phi-3): the per-frequency divisors below and beyond
    # `original_max_position_embeddings`
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()


def _inv_freq(head_dim: int, rope: RopeConfig, factors: tuple[float, ...] = ()) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    if factors:  # LongRoPE: each frequency divided by its factor
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * rope.theta**exponents)
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        # Llama 3: keep high frequencies, divide low ones by `factor`, blend smoothly in between.
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_medium, blended, scaled)
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(inv_freq, head_dim, rope)
    return inv_freq


def _yarn_inv_freq(inv_freq: torch.Tensor, head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """YaRN: frequencies that turn fewer than `beta_slow` times over the original context are divided by
    `factor`, those that turn more than `beta_fast` times kept, with a linear ramp over the dimensions in
    between (bounds rounded outwards with `truncate`)."""

    def dim_of(turns: float) -> float:  # the dimension whose frequency turns `turns` times
        length = rope.original_max_position_embeddings
        return head_dim * math.log(length / (turns * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = dim_of(rope.beta_fast), dim_of(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    ramp = (torch.arange(head_dim // 2, dtype=torch.float32) - low) / max(high - low, 0.001)
    keep = 1 - ramp.clamp(0, 1)
    return inv_freq / rope.factor * (1 - keep) + inv_freq * keep


def rope_scale(rope: RopeConfig) -> float:
    """The factor cos and sin are multiplied by: YaRN's and LongRoPE's attention factor, else 1."""
    if rope.rope_type not in ("yarn", "longrope"):
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor
    return 0.1 * math.log(rope.factor) + 1.0 if rope.rope_type == "yarn" and rope.factor > 1 else 1.0


def build_rope_cache(
    head_dim: int, max_positions: int, rope: RopeConfig, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """A float32 table of shape (max_positions, head_dim): cos in the first half, sin in the second
    (`head_dim`: the rotated columns), both times `rope_scale`. LongRoPE stacks two, (2 * max_positions,
    head_dim): the short factors' rows, then the long factors' (`longrope_positions` picks)."""
    sets = (rope.short_factor, rope.long_factor) if rope.rope_type == "longrope" else ((),)
    tables = []
    for factors in sets:
        freqs = torch.outer(
            torch.arange(max_positions, dtype=torch.float32), _inv_freq(head_dim, rope, factors)
        )
        tables.append(torch.cat([freqs.cos(), freqs.sin()], dim=-1) * rope_scale(rope))
    return torch.cat(tables).to(device)


def longrope_positions(
    positions: torch.Tensor, last_indices: torch.Tensor | None, original_max: int, max_positions: int
) -> torch.Tensor:
    """The rows of a LongRoPE table (`build_rope_cache`) for `positions` (T,): the long factors' rows
    for every token of a request whose last position in this forward is at least `original_max` (its
    length then exceeds it: transformers' rule at that length), the short factors' otherwise.
    `last_indices` (sorted): each request's last row; None: every row is a request of its own (decode).
    Device work only (no host sync)."""
    ends = positions
    if last_indices is not None and last_indices.numel() > 0:
        rows = torch.arange(positions.shape[0], device=positions.device)
        request = torch.searchsorted(last_indices, rows).clamp_(max=last_indices.shape[0] - 1)
        ends = torch.maximum(positions[last_indices][request], positions)
    return positions + (ends >= original_max).to(positions.dtype) * max_positions


def rope_cos_sin(
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    dtype: torch.dtype,
    mrope_axes: torch.Tensor | None = None,
) -> torch.Tensor:
    """The (T, 1, head_dim) cos and (T, 1, head_dim) sin rows of `positions`, stacked: (2, T, 1, head_dim).
    Looked up once per forward and shared by every layer.

    M-RoPE (Qwen2.5-VL, Qwen3-VL): `positions` (3, T) holds each token's (t, h, w) position and
    `mrope_axes` (head_dim,) the axis (0, 1, 2) each cos / sin column takes its position from
    (`mrope_axes`); positions (T,) mean t = h = w, the plain rotary embedding."""
    rows = cos_sin_cache[positions]
    if positions.dim() == 2:  # (3, T, head_dim): each column from its own axis
        rows = rows.gather(0, mrope_axes.expand(1, rows.shape[1], -1))[0]
    cos, sin = rows.to(dtype).unsqueeze(1).chunk(2, dim=-1)
    return torch.stack([torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)])


def mrope_axes(head_dim: int, section: tuple[int, ...], interleaved: bool) -> torch.Tensor:
    """(head_dim,) int64: the position axis (t 0, h 1, w 2) of each column of the cos / sin table. Of the
    head_dim / 2 frequencies, `section` (t, h, w) gives each axis its count: in consecutive blocks
    (Qwen2.5-VL), or `interleaved` (Qwen3-VL: t h w t h w ..., the rest t)."""
    half = head_dim // 2
    if sum(section) != half:
        raise ValueError(f"mrope_section {list(section)} must add up to head_dim / 2 = {half}")
    if interleaved:
        index = torch.arange(half)
        axes = torch.zeros(half, dtype=torch.int64)
        for axis in (1, 2):
            axes[(index % 3 == axis) & (index < 3 * section[axis])] = axis
    else:
        axes = torch.repeat_interleave(torch.arange(3), torch.tensor(section))
    return torch.cat([axes, axes])


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q: (T, num_heads, head_dim), k: (T, num_kv_heads, head_dim), cos_sin from `rope_cos_sin`; a
    table narrower than the heads rotates their first columns only (partial rotary), the rest pass."""
    cos, sin = cos_sin[0], cos_sin[1]
    rot = cos.shape[-1]
    if rot < q.shape[-1]:
        q_rot, k_rot = apply_rope(q[..., :rot], k[..., :rot], cos_sin)
        return torch.cat([q_rot, q[..., rot:]], dim=-1), torch.cat([k_rot, k[..., rot:]], dim=-1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)
