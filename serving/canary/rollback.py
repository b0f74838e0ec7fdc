"""Sliding windows of the arms' outcomes, and the rollback decision.

The custom arm is rolled back (its weight forced to 0) when, in the most recent window:

- `error_rate`: custom's share of failed attempts exceeds `max_error_rate` (an attempt that
  failed and was retried on stock still counts: the user was spared, the kernels were not);
- `latency_ratio`: custom's median latency over stock's exceeds `max_latency_ratio` (both arms
  draw from the same traffic mix, so their medians compare);
- `agreement`: the mean greedy token agreement of mirrored pairs is below `min_agreement`;
- `numerical_checks`: the custom replicas' fuselane numerical-check failures since the last
  operator action exceed `max_numerical_check_failures`.

Rates are judged only once `min_requests` (or `min_shadow_samples`) outcomes are in the window,
so one early error does not roll back a fresh deployment. Reasons are a closed set: they are
the `reason` label of `fuselane_canary_rollbacks_total`.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from .config import RollbackSpec

REASONS = ("error_rate", "latency_ratio", "agreement", "numerical_checks")


@dataclass(frozen=True)
class Breach:
    reason: str  # one of REASONS
    detail: str  # for people: the numbers that crossed the threshold


@dataclass
class ArmWindow:
    size: int
    ok: deque[bool] = field(init=False)
    latencies: deque[float] = field(init=False)

    def __post_init__(self) -> None:
        self.ok = deque(maxlen=self.size)
        self.latencies = deque(maxlen=self.size)

    def add(self, ok: bool, latency_s: float | None) -> None:
        self.ok.append(ok)
        if ok and latency_s is not None:
            self.latencies.append(latency_s)

    def error_rate(self) -> float:
        return 0.0 if not self.ok else 1.0 - sum(self.ok) / len(self.ok)

    def p50(self) -> float | None:
        return statistics.median(self.latencies) if self.latencies else None

    def clear(self) -> None:
        self.ok.clear()
        self.latencies.clear()


class RollbackJudge:
    """Holds the windows; `judge()` returns the first threshold crossed, or None."""

    def __init__(self, spec: RollbackSpec) -> None:
        self.spec = spec
        self.arms = {arm: ArmWindow(spec.window) for arm in ("stock", "custom")}
        self.agreement: deque[float] = deque(maxlen=spec.window)
        self.check_failures = 0

    def add_outcome(self, arm: str, ok: bool, latency_s: float | None) -> None:
        self.arms[arm].add(ok, latency_s)

    def add_agreement(self, agreement: float) -> None:
        self.agreement.append(agreement)

    def reset_custom(self) -> None:
        """After an operator action: custom is judged afresh (stock's window is still good)."""
        self.arms["custom"].clear()
        self.agreement.clear()
        self.check_failures = 0

    def judge(self) -> Breach | None:
        s = self.spec
        if not s.enabled:
            return None
        custom, stock = self.arms["custom"], self.arms["stock"]
        n = len(custom.ok)
        if n >= s.min_requests and custom.error_rate() > s.max_error_rate:
            return Breach(
                "error_rate",
                f"custom error rate {custom.error_rate():.3f} > {s.max_error_rate:g} "
                f"over the last {n} custom requests",
            )
        if (
            s.max_latency_ratio is not None
            and len(custom.latencies) >= s.min_requests
            and len(stock.latencies) >= s.min_requests
        ):
            c50, s50 = custom.p50(), stock.p50()
            if c50 is not None and s50 and c50 / s50 > s.max_latency_ratio:
                return Breach(
                    "latency_ratio",
                    f"custom p50 {c50 * 1e3:.1f} ms / stock p50 {s50 * 1e3:.1f} ms = "
                    f"{c50 / s50:.2f} > {s.max_latency_ratio:g}",
                )
        m = len(self.agreement)
        if s.min_agreement is not None and m >= s.min_shadow_samples:
            mean = sum(self.agreement) / m
            if mean < s.min_agreement:
                return Breach(
                    "agreement",
                    f"mean greedy token agreement {mean:.3f} < {s.min_agreement:g} "
                    f"over the last {m} mirrored requests",
                )
        if (
            s.max_numerical_check_failures is not None
            and self.check_failures > s.max_numerical_check_failures
        ):
            return Breach(
                "numerical_checks",
                f"{self.check_failures} fuselane numerical-check failures on the custom arm "
                f"> {s.max_numerical_check_failures}",
            )
        return None
