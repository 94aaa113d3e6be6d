"""Programmatic dependent launch (PDL) for the Triton kernels of a decode step, on Hopper GPUs and newer.

A kernel launched with PDL may start before the kernel ahead of it in the stream (or CUDA graph) has
finished, once every program of that kernel has called `gdc_launch_dependents`; its own `gdc_wait`
then blocks until that kernel has finished and its writes are visible. So the kernels here:

- call `gdc_launch_dependents` first, letting the next kernel launch while they run;
- load only data no kernel of the step writes (weights) before their `gdc_wait`, everything else after.
  The GEMV kernels load their first block of weights, most or all of their traffic, before waiting:
  that read overlaps the previous kernel's tail instead of following it.

A kernel that reaches `gdc_wait` has had all kernels ahead of it finish (each waited for its own
predecessor before finishing), and a kernel launched without PDL starts only after the one ahead
finishes, so mixing them with inductor's and cuBLAS's kernels is safe.

The engine turns it on with the `use_pdl` setting; the kernels ask `pdl_enabled(tensor)`: inside an
engine's forward with `use_pdl`, on a CUDA device of compute capability 9 or more, with a Triton that has
`gdc_wait` and the `launch_pdl` launch option (never under Triton's interpreter). Outside a forward it is
off, unless a caller passes `pdl=True` to a kernel's launch function (the benchmarks do).
"""

from __future__ import annotations

import functools
import os

import torch

from minisgl.compile import pdl_mode

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


@functools.cache
def pdl_supported(device: torch.device) -> bool:
    """Whether this device and this Triton can run the kernels with PDL."""
    if triton is None or device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if not hasattr(tl.extra.cuda, "gdc_wait"):
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions

        if "launch_pdl" not in CUDAOptions.__dataclass_fields__:
            return False
    except (ImportError, AttributeError):
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def pdl_enabled(t: torch.Tensor) -> bool:
    """True inside the forward of an engine with `use_pdl`, for a tensor on a device that supports it."""
    return pdl_mode() and t.is_cuda and pdl_supported(t.device)


def launch_options(pdl: bool) -> dict:
    """The extra launch keywords of a kernel that takes `USE_PDL`: the constexpr and Triton's option."""
    return {"USE_PDL": pdl, "launch_pdl": True} if pdl else {"USE_PDL": False}
