"""Programmatic dependent launch (PDL) for the Triton kernels of a decode step, on Hopper GPUs and newer.

Each kernel calls `gdc_launch_dependents` first, so the next launches while it runs, and loads only
what no kernel of the step writes (weights) before its `gdc_wait`. The kernels ask `pdl_enabled(tensor)`
(an engine's forward with `use_pdl`, compute capability 9+, a Triton with `launch_pdl`, never the
interpreter); outside a forward a caller may pass `pdl=True`. docs/gpu.md ("Programmatic dependent
launch").
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


@functools.cache
def sm_count(device: torch.device) -> int:
    """The device's streaming multiprocessors, which the kernels size their grids by (8 off CUDA: the
    interpreter's stand-in); read once per device, on the host."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


def pdl_enabled(t: torch.Tensor) -> bool:
    """True inside the forward of an engine with `use_pdl`, for a tensor on a device that supports it."""
    return pdl_mode() and t.is_cuda and pdl_supported(t.device)


def launch_options(pdl: bool) -> dict:
    """The extra launch keywords of a kernel that takes `USE_PDL`: the constexpr and Triton's option."""
    return {"USE_PDL": pdl, "launch_pdl": True} if pdl else {"USE_PDL": False}
