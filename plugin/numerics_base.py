"""What every numerical check shares: tolerances, the comparison of a kernel's output with its
reference, snapshots copied off the launching stream, and row selection."""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

# Rows (query rows, token rows) kept per check: enough to catch a wrong kernel, small enough to
# copy at any batch size.
MAX_ROWS = 32
# A check whose snapshot would exceed this (attention pages of very long sequences) is skipped
# and counted as dropped.
MAX_SNAPSHOT_BYTES = 64 << 20
# Checks waiting for the worker; beyond this new ones are dropped (and counted), never queued.
MAX_PENDING = 16

# (atol, rtol) per dtype against the fp32 references: the kernel tests' tables
# (tests/kernels/test_attention.py, tests/allclose.py).
ATTENTION_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (2.5e-2, 2.5e-2),
    torch.float32: (1e-5, 1e-5),
}
ROTARY_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}
# Chosen-token log-probabilities: fp32 math on both sides.
LOGPROB_TOLERANCE = (1e-3, 1e-3)
FP8 = torch.float8_e4m3fn


class SnapshotTooLarge(Exception):
    """The call is too big to copy for a check (counted as a dropped check)."""


@dataclass
class Outcome:
    """One check's result."""

    passed: bool
    max_abs: float = 0.0
    max_rel: float = 0.0
    nan: int = 0
    inf: int = 0
    mismatched: int = 0
    detail: str = ""

    def merge(self, other: Outcome) -> Outcome:
        return Outcome(
            passed=self.passed and other.passed,
            max_abs=max(self.max_abs, other.max_abs),
            max_rel=max(self.max_rel, other.max_rel),
            nan=self.nan + other.nan,
            inf=self.inf + other.inf,
            mismatched=self.mismatched + other.mismatched,
            detail="; ".join(d for d in (self.detail, other.detail) if d),
        )


def compare(
    actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float, what: str
) -> Outcome:
    """Elementwise |a - e| <= atol + rtol |e|; where e is not finite, a must equal it."""
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    if a.shape != e.shape:
        return Outcome(False, math.inf, math.inf, 0, 0, max(a.numel(), 1), f"{what}: shape")
    e_fin = torch.isfinite(e)
    a_fin = torch.isfinite(a)
    nan = int((torch.isnan(a) & e_fin).sum())
    inf = int((torch.isinf(a) & e_fin).sum())
    both = e_fin & a_fin
    diff = torch.where(both, (a - e).abs(), 0.0)
    max_abs = float(diff.max()) if diff.numel() else 0.0
    scale = float(torch.where(e_fin, e.abs(), 0.0).max()) if e.numel() else 0.0
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf)
    out_of_tol = int((both & (diff > atol + rtol * e.abs())).sum())
    same_nonfinite = (a == e) | (torch.isnan(a) & torch.isnan(e))
    nonfinite_wrong = int((~e_fin & ~same_nonfinite).sum())
    mismatched = out_of_tol + nan + inf + nonfinite_wrong
    detail = ""
    if mismatched:
        detail = (
            f"{what}: {mismatched} of {a.numel()} elements off (max abs err {max_abs:.3g}, "
            f"atol {atol}, rtol {rtol}, {nan} NaN, {inf} inf)"
        )
    return Outcome(mismatched == 0, max_abs, max_rel, nan, inf, mismatched, detail)


# ---------------------------------------------------------------------------------------------
# Snapshots: what one check keeps, and the check itself
# ---------------------------------------------------------------------------------------------


class Snapshot:
    """Tensors copied at the call (device or host) and the check to run on their host copy."""

    kernel = ""

    def __init__(self, tensors: dict[str, torch.Tensor], **info: Any) -> None:
        self.info = info
        self._event: Any = None
        self._pinned: dict[str, torch.Tensor] | None = None
        if any(t.is_cuda for t in tensors.values()):
            # Non-blocking copies to pinned memory, ordered after the kernel on its stream.
            pinned = {}
            for name, t in tensors.items():
                dst = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                dst.copy_(t, non_blocking=True)
                pinned[name] = dst
            self._pinned = pinned
            self._event = torch.cuda.Event()
            self._event.record()
            self.tensors: dict[str, torch.Tensor] = {}
        else:
            self.tensors = tensors

    def ready(self, guard: Callable[[], AbstractContextManager[bool]]) -> bool:
        """Whether the host copy is complete (then `tensors` holds it)."""
        if self._event is None:
            return True
        with guard() as ok:
            if not ok or not self._event.query():
                return False
            # Own pageable copies; the pinned buffers go back to torch's pinned pool here,
            # under the guard (its bookkeeping makes CUDA calls).
            self.tensors = {k: v.clone() for k, v in self._pinned.items()}
            self._pinned = None
            self._event = None
        return True

    def check(self) -> Outcome | None:
        raise NotImplementedError


def _tensor_bytes(t: torch.Tensor, rows: int | None = None) -> int:
    per_row = t[0].numel() * t.element_size() if t.dim() and t.shape[0] else 0
    return per_row * (t.shape[0] if rows is None else rows)


def _gather_rows(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows of a paged cache `[num_blocks, block_size, H, D]` at `slots` (bytes for fp8)."""
    view = cache.view(torch.uint8) if cache.dtype == FP8 else cache
    block_size = cache.shape[1]
    safe = slots.long().clamp(0, cache.shape[0] * block_size - 1)
    return view[safe // block_size, safe % block_size]


def _spread(n: int, device: torch.device) -> torch.Tensor:
    """Up to MAX_ROWS row indices spread over [0, n), built on the device (no host copy)."""
    r = min(n, MAX_ROWS)
    return torch.arange(r, device=device) * (n // r)


class _Rotating:
    """Picks which sequence / row of the batch the next check looks at."""

    def __init__(self) -> None:
        self._turn = 0

    def next(self, n: int) -> int:
        self._turn += 1
        return (self._turn - 1) % n
