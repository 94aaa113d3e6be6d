"""Triton's interpreter without its repeated patching (loaded by conftest.py where no GPU is).

A kernel launch under TRITON_INTERPRET=1 patches `triton.language` to its NumPy builtins once, runs
the grid, and restores the module. But every call of a `@triton.jit` helper inside the kernel (a
device function) patches the same modules again: `inspect.getmembers` over `tl`, `tl.tensor`,
`tl.math`, each call, for no change, since the launch's patch is still in place. On the sampler's
filtered draw that was 40% of the time. Here a device call made during a launch, from a module whose
`triton.language` modules are patched already (by the launch, or by an earlier helper's call, whose
patch Triton never restores), reuses that patch; anything else patches as before. The kernels' results are the same: the same builtins are in place when the helper runs."""

from __future__ import annotations

import inspect
from typing import Any


def skip_repeated_patching() -> bool:
    """Install the shortcut into Triton's interpreter; False (nothing changed) where this Triton's
    interpreter lacks the functions it wraps."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    needed = ("_patch_lang", "_LangPatchScope", "GridExecutor")
    if not all(hasattr(interpreter, name) for name in needed):
        return False
    tl, core = interpreter.tl, interpreter.tl.core
    patch_lang = interpreter._patch_lang
    launch_call = interpreter.GridExecutor.__call__
    state: dict[str, Any] = {"launching": False, "patched": None}

    langs: dict[int, frozenset[int]] = {}  # a module's (its globals') language modules, by id

    def langs_of(fn: Any) -> frozenset[int]:
        found = langs.get(id(fn.__globals__))
        if found is None:
            found = frozenset(
                id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, core)
            )
            langs[id(fn.__globals__)] = found
        return found

    def patch_once(fn: Any) -> Any:
        patched = state["patched"]
        if patched is not None and langs_of(fn) <= patched:
            return interpreter._LangPatchScope()  # nothing to restore
        scope = patch_lang(fn)
        if state["launching"]:  # the launch's own patch, or a helper's (never restored by Triton)
            state["patched"] = langs_of(fn) | (patched or frozenset())
        return scope

    def launch(self: Any, *args: Any, **kwargs: Any) -> Any:
        state["launching"], state["patched"] = True, None
        try:
            return launch_call(self, *args, **kwargs)
        finally:
            state["launching"], state["patched"] = False, None

    interpreter._patch_lang = patch_once
    interpreter.GridExecutor.__call__ = launch
    return True
