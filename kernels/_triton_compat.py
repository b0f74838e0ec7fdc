"""The Triton versions fuselane supports (3.6 to 3.9) and the API differences between them.

Every name that differs between supported Triton releases is resolved here, once, so the kernels
are written against one spelling:

- Gluon's CTA-wide barrier is `gl.thread_barrier()` in 3.6 and `gl.barrier()` from 3.7 on (both
  lower to the same `gpu.barrier`); `cta_barrier` is whichever this Triton has.
- cp.async into shared memory is `async_copy.async_copy_global_to_shared` up to 3.8 and
  `async_copy.async_load` in 3.9, which removed the old name (same arguments: smem, pointer,
  mask); `async_load` is whichever this Triton has.
- Gluon's Hopper API (warp specialization, wgmma, mbarriers, cp.async) is present in 3.6-3.9;
  `gluon_hopper_missing()` says what is missing on a Triton that lacks it, and the attention
  launch rule then keeps the Triton kernels.
"""

from __future__ import annotations

import functools

import triton

# The tested range: pyproject's `triton` requirement says the same.
SUPPORTED_TRITON = ((3, 6), (3, 9))


def triton_version() -> tuple[int, int]:
    """(major, minor) of the Triton in use."""
    major, minor = triton.__version__.split(".")[:2]
    return int(major), int(minor)


def triton_supported() -> bool:
    """Whether the Triton in use is inside the tested range."""
    lo, hi = SUPPORTED_TRITON
    return lo <= triton_version() <= hi


@functools.cache
def gluon_hopper_missing() -> str | None:
    """Why this Triton cannot build the Gluon Hopper kernels (None: it can)."""
    try:
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.language.nvidia import hopper  # noqa: F401
        from triton.experimental.gluon.language.nvidia.ampere import async_copy  # noqa: F401
    except ImportError as e:
        return f"triton {triton.__version__} has no Gluon Hopper API ({e})"
    if getattr(gl, "barrier", None) is None and getattr(gl, "thread_barrier", None) is None:
        return f"triton {triton.__version__}'s Gluon has neither barrier() nor thread_barrier()"
    if getattr(gl, "warp_specialize", None) is None:
        return f"triton {triton.__version__}'s Gluon has no warp_specialize()"
    return None


def _gluon_cta_barrier():
    from triton.experimental.gluon import language as gl

    return getattr(gl, "barrier", None) or gl.thread_barrier


def _gluon_async_load():
    from triton.experimental.gluon.language.nvidia.ampere import async_copy

    return getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared


# Gluon builtins (they carry `__triton_builtin__`), so @gluon.jit code may call them as globals.
cta_barrier = _gluon_cta_barrier() if gluon_hopper_missing() is None else None
async_load = _gluon_async_load() if gluon_hopper_missing() is None else None
