"""Qwen3-VL's vision encoder (the checkpoint's ``model.visual.*``): patches in, one embedding per merged
patch out, plus the DeepStack features that the first text layers add to the image tokens.

Patch embedding (with bias) plus learned absolute positions (a square table bilinearly resized to each
image's grid, corners aligned), then `depth` blocks (LayerNorm, attention over each whole image with 2D
rotary positions, Linear-activation-Linear MLP) and the patch merger (LayerNorm, the merge block's
tokens side by side, Linear-GELU-Linear). After each block of ``deepstack_visual_indexes`` a DeepStack
merger (the same, normalizing after the concatenation) makes one more set of merged embeddings.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.models import vision


class Mlp(nn.Module):
    def __init__(self, cfg: vision.VisionConfig) -> None:
        super().__init__()
        self.linear_fc1 = vision.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.linear_fc2 = vision.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = vision.ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class PatchMerger(nn.Module):
    """norm -> merge block concatenated (or concatenated -> norm: `after_merge`, the DeepStack mergers')
    -> linear_fc1 -> GELU -> linear_fc2."""

    def __init__(self, cfg: vision.VisionConfig, after_merge: bool) -> None:
        super().__init__()
        self.merged = cfg.hidden_size * cfg.spatial_merge_size**2
        self.after_merge = after_merge
        self.norm = vision.Norm(self.merged if after_merge else cfg.hidden_size, layer_norm=True)
        self.linear_fc1 = vision.Linear(self.merged, self.merged)
        self.linear_fc2 = vision.Linear(self.merged, cfg.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.merged)) if self.after_merge else self.norm(x).view(-1, self.merged)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


def learned_positions(table: torch.Tensor, grid_thw: torch.Tensor, merge_size: int) -> torch.Tensor:
    """(patches, hidden): the (side * side, hidden) table resized to each image's (h, w) grid (bilinear,
    corners aligned), in merge-block order, repeated over the frames."""
    side = math.isqrt(table.shape[0])
    square = table.view(side, side, -1).permute(2, 0, 1).unsqueeze(0).float()  # (1, hidden, side, side)
    out = []
    for t, h, w in grid_thw.tolist():
        grid = F.interpolate(square, size=(h, w), mode="bilinear", align_corners=True)[0]  # (hidden, h, w)
        blocks = grid.reshape(-1, h // merge_size, merge_size, w // merge_size, merge_size)
        out.append(blocks.permute(1, 3, 2, 4, 0).reshape(h * w, -1).repeat(t, 1))
    return torch.cat(out).to(table.dtype)


class Qwen3VisionEncoder(vision.Encoder):
    """Holds ``model.visual.*``; `forward` composes the functions of `minisgl.models.vision`."""

    def __init__(self, cfg: vision.VisionConfig) -> None:
        super().__init__()
        if math.isqrt(cfg.num_position_embeddings) ** 2 != cfg.num_position_embeddings:
            raise ValueError(
                f"vision_config num_position_embeddings={cfg.num_position_embeddings} is not a square "
                "(Qwen3-VL's learned positions form a square grid)"
            )
        self.cfg = cfg
        self.patch_embed = vision.PatchEmbed(cfg, bias=True)
        self.pos_embed = nn.Module()  # the checkpoint's nn.Embedding
        self.pos_embed.weight = vision.empty_param(cfg.num_position_embeddings, cfg.hidden_size)
        self.blocks = nn.ModuleList(vision.Block(cfg, Mlp(cfg), layer_norm=True) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg, after_merge=False)
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(cfg, after_merge=True) for _ in cfg.deepstack_visual_indexes
        )

    def forward(
        self, pixel_values: torch.Tensor, grid_thw: torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(patches, patch_dim) pixel values of the images of `grid_thw` -> the (patches / merge_size**2,
        out_hidden_size) embeddings, and the DeepStack features (one such tensor per layer of
        deepstack_visual_indexes, in layer order)."""
        cfg, device = self.cfg, pixel_values.device
        grid = vision.host_grid(grid_thw)
        x = self.patch_embed(pixel_values)
        x = x + learned_positions(self.pos_embed.weight, grid, cfg.spatial_merge_size).to(x.dtype)
        positions = vision.upload(vision.patch_positions(grid, cfg.spatial_merge_size), device)
        cos_sin = vision.vision_rope(positions, cfg.head_dim, cfg.rope_theta, int(grid[:, 1:].max()))
        plans = self.plan([vision.image_seqlens(grid).tolist()], device, self.patch_embed.proj.weight.dtype)
        x, deepstack = self.run_blocks(plans, x, cos_sin)
        return self.merger(x), deepstack

    def blocks_forward(
        self, x: torch.Tensor, cos_sin: torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The blocks, and the DeepStack features of the blocks of deepstack_visual_indexes (layer
        order)."""
        cfg = self.cfg
        deepstack = []
        for index, block in enumerate(self.blocks):
            x = block(x, cos_sin, 0)
            if index in cfg.deepstack_visual_indexes:
                merger = self.deepstack_merger_list[cfg.deepstack_visual_indexes.index(index)]
                deepstack.append(merger(x))
        return x, deepstack
