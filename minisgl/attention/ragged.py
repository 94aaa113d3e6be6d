"""FlashInfer's ragged prefill (`BatchPrefillWithRaggedKVCacheWrapper`) without a KV cache: the segments
of packed (T, heads, head_dim) q, k, v attend within themselves, non-causally, in one launch (the vision
encoders' attention, `minisgl.models.vision`). Needs CUDA and flashinfer, imported on first use.

FlashInfer's FA2 prefill kernels are right only for head dims that are multiples of 64 (flashinfer issue
#4299: 80, Qwen2.5-VL's, faults; 72, Qwen3-VL's, silently drops the last columns), so q, k and v are
zero-padded up to the next multiple of 64 (the scores and the kept output columns are unchanged; the
softmax scale stays that of the real head dim) and the output cut back.

A wrapper is planned on the host (its segment bounds are host values) once per encoder call and run by
every layer of that segmentation; planning stages its arrays in a pinned buffer copied asynchronously,
so a re-plan first waits for the event recorded after the previous one (long done in practice).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended float workspace (split-KV partial results)
_workspaces: dict[torch.device, torch.Tensor] = {}
_wrappers: dict[tuple[torch.device, int], RaggedAttention] = {}


def padded_head_dim(head_dim: int) -> int:
    return -(-head_dim // 64) * 64


class RaggedAttention:
    """One planned ragged prefill wrapper: `plan` with segment bounds, then `run` per layer."""

    def __init__(self, device: torch.device) -> None:
        import flashinfer

        workspace = _workspaces.get(device)
        if workspace is None:
            workspace = _workspaces[device] = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.wrapper: Any = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD")
        self._planned: torch.cuda.Event | None = None
        self.head_dim = self.padded = 0

    def plan(self, bounds: list[int], num_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        """`bounds` (segments + 1) host ints: the segments' starts and the total."""
        if self._planned is not None:
            self._planned.synchronize()
        self.head_dim, self.padded = head_dim, padded_head_dim(head_dim)
        indptr = torch.tensor(bounds, dtype=torch.int32)
        self.wrapper.plan(
            indptr, indptr, num_heads, num_heads, self.padded,
            causal=False, sm_scale=head_dim**-0.5, q_data_type=dtype, kv_data_type=dtype,
        )  # fmt: skip
        self._planned = torch.cuda.Event()
        self._planned.record()

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        pad = self.padded - self.head_dim
        if pad:
            q, k, v = (F.pad(t, (0, pad)) for t in (q, k, v))
        out = self.wrapper.run(q, k, v)
        return out[..., : self.head_dim] if pad else out


def ragged_attention(device: torch.device, slot: int) -> RaggedAttention:
    """The process's wrapper for `slot` (one per segmentation in use at once: whole images, windows) on
    `device`; the wrappers of a device share one workspace (they run one after another on a stream)."""
    key = (torch.device(device), slot)
    wrapper = _wrappers.get(key)
    if wrapper is None:
        wrapper = _wrappers[key] = RaggedAttention(key[0])
    return wrapper
