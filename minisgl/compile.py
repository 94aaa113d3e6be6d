"""Compiler policy of the engine's compiled code: dynamo's recompile limit, and whether the running
forward keeps its kernel choices independent of the batch.

It sits just above `minisgl.core` in the import layers (see tests/test_layers.py): the layer functions
read `batch_invariant_mode`, the graph runner and the sampler call `raise_recompile_limit`.
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


def batch_invariant_mode() -> bool:
    """True while the forward of an engine with ``batch_invariant`` runs (read by `linear`)."""
    ctx = current_ctx()
    return ctx is not None and ctx.batch_invariant
