"""Host-side launch helpers (kernels/_launch.py)."""

from __future__ import annotations

import triton

from fuselane.kernels._launch import cdiv, next_pow2


def test_host_helpers_agree_with_triton():
    # The launchers size tiles and grids with these instead of Triton's JIT-callable versions.
    assert [next_pow2(n) for n in range(4100)] == [triton.next_power_of_2(n) for n in range(4100)]
    assert [cdiv(a, b) for a in range(300) for b in range(1, 70)] == [
        triton.cdiv(a, b) for a in range(300) for b in range(1, 70)
    ]
