"""Qwen2.5-VL's vision encoder (the checkpoint's ``visual.*``): patches in, one embedding per merged patch
(the image's placeholder tokens) out.

Patch embedding, then `depth` blocks (RMSNorm, attention with 2D rotary positions, SwiGLU MLP with
biases) and the patch merger (RMSNorm, the merge block's patches side by side, Linear-GELU-Linear). The
blocks in ``fullatt_block_indexes`` attend over each whole image, the others within windows of
``window_size`` pixels (windows of merged tokens, cut from the image's top-left corner; the last ones of
a row or column smaller). The encoder reorders the tokens window by window so that every window is one
contiguous segment of `cu_seqlens`, and puts the merged tokens back in the image's order at the end.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.models.vision import (
    ACTIVATIONS,
    Block,
    Encoder,
    Linear,
    Norm,
    PatchEmbed,
    VisionConfig,
    host_grid,
    image_seqlens,
    patch_positions,
    upload,
    vision_rope,
)


class SwiGLU(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class PatchMerger(nn.Module):
    """ln_q, then each merge block's tokens concatenated, then mlp.0 -> GELU -> mlp.2 (the checkpoint's
    nn.Sequential, whose index 1 is the GELU)."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        merged = cfg.hidden_size * cfg.spatial_merge_size**2
        self.ln_q = Norm(cfg.hidden_size, layer_norm=False)
        self.mlp = nn.ModuleList([Linear(merged, merged), nn.GELU(), Linear(merged, cfg.out_hidden_size)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fc1, _, fc2 = self.mlp
        x = self.ln_q(x).view(-1, fc1.weight.shape[1])
        return fc2(F.gelu(fc1(x)))


def window_order(grid_thw: torch.Tensor, merge_size: int, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(merged-token permutation, cu_seqlens in patches), from a host `grid_thw`: the merged tokens of
    each frame ordered window by window (`window` merged tokens a side), keeping the image order inside
    a window; the segments are the windows."""
    order, lengths, offset = [], [], 0
    for t, h, w in grid_thw.tolist():
        rows, cols = h // merge_size, w // merge_size
        per_row = -(-cols // window)
        per_frame = -(-rows // window) * per_row
        r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
        window_id = ((r // window) * per_row + c // window).flatten()
        window_id = torch.cat([window_id + frame * per_frame for frame in range(t)])
        order.append(torch.sort(window_id, stable=True).indices + offset)
        counts = torch.bincount(window_id, minlength=t * per_frame)
        lengths.append(counts[counts > 0] * merge_size**2)
        offset += t * rows * cols
    cu_seqlens = F.pad(torch.cat(lengths).cumsum(0), (1, 0)).to(torch.int32)
    return torch.cat(order), cu_seqlens


class Qwen2_5_VisionEncoder(Encoder):
    """Holds ``visual.*``; `forward` composes the functions of `minisgl.models.vision`."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg, bias=False)
        self.blocks = nn.ModuleList(Block(cfg, SwiGLU(cfg), layer_norm=False) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg)
        # the attention slot of each block: 0 whole images, 1 windows
        self.slots = tuple(0 if i in cfg.fullatt_block_indexes else 1 for i in range(cfg.depth))

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """(patches, patch_dim) pixel values of the images of `grid_thw` -> (patches / merge_size**2,
        out_hidden_size) embeddings, image after image, each image's in its placeholder tokens' order.
        The window order, positions and segment plans come from `grid_thw` on the host (pass it there to
        spare one device read), before the layers run."""
        cfg, device = self.cfg, pixel_values.device
        grid = host_grid(grid_thw)
        unit = cfg.spatial_merge_size**2
        units, cu_windows = window_order(
            grid, cfg.spatial_merge_size, cfg.window_size // cfg.spatial_merge_size // cfg.patch_size
        )
        order = (units[:, None] * unit + torch.arange(unit)).flatten()  # in patches
        positions = patch_positions(grid, cfg.spatial_merge_size)[order]
        size = int(grid[:, 1:].max())
        order, positions, restore = (upload(t, device) for t in (order, positions, torch.argsort(units)))
        cos_sin = vision_rope(positions, cfg.head_dim, cfg.rope_theta, size)
        dtype = self.patch_embed.proj.weight.dtype
        plans = self.plan([image_seqlens(grid).tolist(), cu_windows.tolist()], device, dtype)
        x = self.run_blocks(plans, self.patch_embed(pixel_values)[order], cos_sin)
        return self.merger(x)[restore]

    def blocks_forward(self, x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
        for block, slot in zip(self.blocks, self.slots):
            x = block(x, cos_sin, slot)
        return x
