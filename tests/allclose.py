"""Comparison helpers: a verbose allclose and the per-dtype tolerance table."""

from __future__ import annotations

import torch

# (atol, rtol) per output dtype, for a kernel that accumulates in fp32 and rounds once on store;
# bf16 keeps 8 mantissa bits (2^-8 = 0.0039 relative), fp16 11 bits.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}

POISON = float("nan")


def assert_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    atol: float,
    rtol: float,
    what: str = "output",
    max_report: int = 8,
) -> None:
    """Like torch.testing.assert_close, but prints the first mismatching indices and values.

    NaN in `actual` never passes, whatever `expected` holds at that place.
    """
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    bad = ~torch.isclose(a, e, atol=atol, rtol=rtol, equal_nan=False)
    bad |= torch.isnan(a)
    if bad.any():
        idx = bad.nonzero()[:max_report]
        lines = [
            f"  at {tuple(i.tolist())}: got {a[tuple(i)].item():.6g}, want {e[tuple(i)].item():.6g}"
            for i in idx
        ]
        diff = (a - e).abs().nan_to_num(float("inf"))
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.numel()} elements differ "
            f"(atol={atol}, rtol={rtol}, max abs diff {diff.max().item():.3g}):\n"
            + "\n".join(lines)
        )
