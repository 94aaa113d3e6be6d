"""Compiler policy of the engine's compiled code: dynamo's recompile limit, and whether the running
forward keeps its kernel choices independent of the batch; dynamo's `mark_unbacked`, imported when used.

It sits just above `minisgl.core` in the import layers (see tests/test_layers.py): the layer functions
read `gemv_kernel_mode`, the graph runner and the sampler call `raise_recompile_limit`.
"""

from __future__ import annotations

import torch

from minisgl.core import current_ctx

# dynamo's recompile limit for the engine's compiled functions (see raise_recompile_limit)
RECOMPILE_LIMIT = 64


def raise_recompile_limit() -> None:
    """Raises dynamo's recompile limit (default 8) to `RECOMPILE_LIMIT`, knowingly: each engine in a
    process (tests hold several) adds entries for its shapes to the same compiled code objects (the
    model forward, the sampler), and under fullgraph reaching the limit is an error."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)


def mark_unbacked(tensor: torch.Tensor, dim: int) -> None:
    """dynamo's `mark_unbacked`, imported at the first call: `torch._dynamo` takes about 2 s to import
    on a 2-core machine, and a process that compiles nothing (a CPU server, its scheduler, a tokenizer
    worker) never needs it."""
    from torch._dynamo.decorators import mark_unbacked as mark

    mark(tensor, dim)


def gemv_kernel_mode() -> bool:
    """False while the forward of an engine with ``use_gemv_kernel`` off or ``batch_invariant`` on runs
    (read by `linear`: a row alone must then get the bits it gets inside a batch); True otherwise,
    outside a forward too."""
    ctx = current_ctx()
    return ctx is None or (ctx.use_gemv_kernel and not ctx.batch_invariant)


def fused_kernels_mode() -> bool:
    """False while the forward of an engine with ``use_fused_kernels`` off runs (read by the layers that
    have a fused Triton kernel: `norm_linear`, `silu_mul_linear`, the attention's q/k-norm + RoPE + KV
    store); True otherwise."""
    ctx = current_ctx()
    return ctx is None or ctx.use_fused_kernels


def pdl_mode() -> bool:
    """True while the forward of an engine with ``use_pdl`` runs (read by the Triton kernels of a decode
    step, see `minisgl.kernels.pdl`); False otherwise, outside a forward too."""
    ctx = current_ctx()
    return ctx is not None and ctx.use_pdl
