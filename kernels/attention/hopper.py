"""Hopper's warp-specialized attention kernels: whether this process may plan them.

The kernels are Gluon programs (`decode_ws.py`, `prefill_ws.py`). They are off in a process
whose Triton lacks Gluon's Hopper API, after one failed its start-up warm-up
(`disable_hopper_kernels`), and for calls whose dtypes, head size, alignment or options they do
not cover (`prefill_ws.supports`, `decode_ws.supports`); the Triton kernels then take those
batches.
"""

from __future__ import annotations

import torch

from .._triton_compat import gluon_hopper_missing

# Hopper's warp-specialized kernels are written in Gluon (Triton's experimental API; 3.6 to
# 3.9 have what they use). Without it the Triton kernels run every batch.
if gluon_hopper_missing() is None:
    from . import decode_ws, prefill_ws
else:
    decode_ws = prefill_ws = None  # type: ignore[assignment]
WS_HEAD_SIZES = prefill_ws.WS_HEAD_SIZES if prefill_ws is not None else ()
DECODE_WS_HEAD_SIZES = decode_ws.HEAD_SIZES if decode_ws is not None else ()
# Why the Hopper kernels are off in this process (None: the launch rule may pick them).
_hopper_off: str | None = gluon_hopper_missing()


def hopper_kernels_off() -> str | None:
    """Why Hopper's warp-specialized kernels are off in this process (None: they may run)."""
    return _hopper_off


def disable_hopper_kernels(reason: str) -> None:
    """Keep Hopper's warp-specialized kernels out of every later plan in this process (the
    Triton kernels take their batches); `reason` is what `hopper_kernels_off` reports. Plans
    already recorded for replay keep them until their step's metadata changes."""
    global _hopper_off
    _hopper_off = reason
    from .ops import LAUNCHES  # its recordings may hold Hopper launches

    LAUNCHES.clear()


def enable_hopper_kernels() -> None:
    """Undo `disable_hopper_kernels` (tests); a Triton without Gluon keeps them off."""
    global _hopper_off
    _hopper_off = gluon_hopper_missing()


def warp_specialized_ok(
    q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor
) -> bool:
    """Whether Hopper's warp-specialized prefill kernel can run a call with these tensors, with
    any window, soft cap or sinks (`prefill_ws.supports`; False while `hopper_kernels_off`);
    the decode kernel's answer is `decode_warp_specialized_ok`."""
    return _hopper_off is None and prefill_ws.supports(q, key_cache, value_cache)


def decode_warp_specialized_ok(
    q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor
) -> bool:
    """Whether Hopper's warp-specialized decode kernel can run a call with these tensors, with
    any window, soft cap or sinks (`decode_ws.supports`; False while `hopper_kernels_off`)."""
    return _hopper_off is None and decode_ws.supports(q, key_cache, value_cache)
