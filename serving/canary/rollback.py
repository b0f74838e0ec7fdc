"""Sliding windows of the arms' outcomes, and the rollback decision.

The custom arm is rolled back (its weight forced to 0, until an operator sets a weight again)
when one rule fires. Each rule reads a defined window, always since the last operator action
(`reset_custom`) and at most `window` entries per arm, none older than `window_s` seconds
(`rollback.window_s`; None: no age limit), so that a failure long past, at low traffic, does
not decide today:

- `error_rate`: custom's share of failed attempts among its last `window` attempts exceeds
  `max_error_rate`, judged once `min_requests` attempts are in the window. An attempt that
  failed and was retried on stock still counts (the user was spared, the kernels were not),
  and a stream cut after its first chunk counts, but an *outage* counts once: when a custom
  replica dies or hangs, the ingress counts that first failure and opens an outage, which lasts
  until custom answers a request again. The other attempts it costs (those in flight on the
  replica, and those sent to custom after the cooldown while Serve starts another replica) are
  retried on stock without being counted again (`Outcome.judged`). One replica crash is one
  failure, not as many as it had requests or as the arm's restart takes: it is an arm's
  availability, not evidence that its kernels answer wrong. An arm that keeps failing still
  fires the rule: its server errors count one by one, every crash after custom answered again
  is another outage, and an outage that lasts more than `max_outage_s` (custom found dead or
  hung again and again without answering in between: a crash loop, an arm that never comes
  back) fires the rule by itself (`Outcome.outage_s`);
- `latency_ratio`: custom's median over stock's median of their last `window` successful
  latencies exceeds the ratio, judged once both have `min_requests` (both arms draw from the
  same traffic mix, so their medians compare). The ratio is `max_latency_ratio` while custom's
  kernels are compiled and `max_latency_ratio_interpreted` while they run under Triton's
  interpreter (the custom replicas say which, `interpreted`): interpreted kernels on a CPU are
  orders of magnitude slower by construction, their latency says nothing about the kernels;
  None turns the rule off (the default for interpreted kernels);
- `agreement`: the mean greedy token agreement of the last `window` mirrored pairs is below
  `min_agreement`, judged once `min_shadow_samples` pairs are in the window;
- `numerical_checks`: the custom replicas' fuselane numerical-check failures since the last
  operator action exceed `max_numerical_check_failures` (not aged: a failed check is a wrong
  answer, however long ago).

Reasons are a closed set: they are the `reason` label of `fuselane_canary_rollbacks_total`.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from .config import RollbackSpec

REASONS = ("error_rate", "latency_ratio", "agreement", "numerical_checks")


@dataclass(frozen=True)
class Breach:
    reason: str  # one of REASONS
    detail: str  # for people: the numbers that crossed the threshold


class Outcome(NamedTuple):
    """One attempt on one arm, as an ingress replica reports it to the monitor."""

    arm: str
    result: str  # ok, error, client_error, stream_cut
    latency_s: float | None
    failover: str | None  # why stock answered a request meant for custom
    epoch: int  # the operator epoch the request was routed under
    judged: bool = True  # False: folded into an outage already counted (see above)
    # For a failure folded into an outage: how long custom had been out (answered nothing) by
    # then, seconds; the error rule fires past `max_outage_s`.
    outage_s: float | None = None


@dataclass
class _Window:
    """The last `size` values, none older than `max_age_s` (monotonic seconds)."""

    size: int
    max_age_s: float | None
    items: deque[tuple[float, float]] = field(init=False)

    def __post_init__(self) -> None:
        self.items = deque(maxlen=self.size)

    def add(self, value: float, now: float) -> None:
        self.items.append((now, value))

    def values(self, now: float) -> list[float]:
        if self.max_age_s is not None:
            while self.items and self.items[0][0] < now - self.max_age_s:
                self.items.popleft()
        return [v for _, v in self.items]

    def clear(self) -> None:
        self.items.clear()


@dataclass
class ArmWindow:
    size: int
    max_age_s: float | None = None
    ok: _Window = field(init=False)
    latencies: _Window = field(init=False)

    def __post_init__(self) -> None:
        self.ok = _Window(self.size, self.max_age_s)
        self.latencies = _Window(self.size, self.max_age_s)

    def add(self, ok: bool, latency_s: float | None, now: float) -> None:
        self.ok.add(float(ok), now)
        if ok and latency_s is not None:
            self.latencies.add(latency_s, now)

    def attempts(self, now: float) -> int:
        return len(self.ok.values(now))

    def error_rate(self, now: float | None = None) -> float:
        ok = self.ok.values(time.monotonic() if now is None else now)
        return 0.0 if not ok else 1.0 - sum(ok) / len(ok)

    def p50(self, now: float) -> float | None:
        lat = self.latencies.values(now)
        return statistics.median(lat) if lat else None

    def clear(self) -> None:
        self.ok.clear()
        self.latencies.clear()


class RollbackJudge:
    """Holds the windows; `judge()` returns the first threshold crossed, or None. `now` is
    monotonic seconds (the monitor's clock when a report arrives)."""

    def __init__(self, spec: RollbackSpec) -> None:
        self.spec = spec
        self.arms = {arm: ArmWindow(spec.window, spec.window_s) for arm in ("stock", "custom")}
        self.agreement = _Window(spec.window, spec.window_s)
        self.check_failures = 0
        self.custom_interpreted = False  # the custom replicas run Triton's interpreter
        self.longest_outage_s = 0.0  # the longest outage reported since the operator's action

    def add_outcome(
        self, arm: str, ok: bool, latency_s: float | None, now: float | None = None
    ) -> None:
        self.arms[arm].add(ok, latency_s, time.monotonic() if now is None else now)

    def add_outage(self, outage_s: float) -> None:
        """A failure folded into an outage that had lasted `outage_s` by then."""
        self.longest_outage_s = max(self.longest_outage_s, outage_s)

    def add_agreement(self, agreement: float, now: float | None = None) -> None:
        self.agreement.add(agreement, time.monotonic() if now is None else now)

    def reset_custom(self) -> None:
        """After an operator action: custom is judged afresh (stock's window is still good)."""
        self.arms["custom"].clear()
        self.agreement.clear()
        self.check_failures = 0
        self.longest_outage_s = 0.0

    def latency_limit(self) -> float | None:
        """The latency ratio in force: None when the rule is off for custom's kernels."""
        if self.custom_interpreted:
            return self.spec.max_latency_ratio_interpreted
        return self.spec.max_latency_ratio

    def judge(self, now: float | None = None) -> Breach | None:
        s = self.spec
        if not s.enabled:
            return None
        now = time.monotonic() if now is None else now
        return self._error_rate(now) or self._latency(now) or self._agreement(now) or self._checks()

    def _error_rate(self, now: float) -> Breach | None:
        custom, s = self.arms["custom"], self.spec
        if s.max_outage_s is not None and self.longest_outage_s > s.max_outage_s:
            return Breach(
                "error_rate",
                f"custom answered nothing for {self.longest_outage_s:.0f}s > "
                f"{s.max_outage_s:g}s: its replicas were found dead or hung again and again",
            )
        n = custom.attempts(now)
        rate = custom.error_rate(now)
        if n >= s.min_requests and rate > s.max_error_rate:
            return Breach(
                "error_rate",
                f"custom error rate {rate:.3f} > {s.max_error_rate:g} "
                f"over the last {n} custom requests",
            )
        return None

    def _latency(self, now: float) -> Breach | None:
        limit = self.latency_limit()
        custom, stock = self.arms["custom"], self.arms["stock"]
        if (
            limit is None
            or min(len(custom.latencies.values(now)), len(stock.latencies.values(now)))
            < self.spec.min_requests
        ):
            return None
        c50, s50 = custom.p50(now), stock.p50(now)
        if c50 is not None and s50 and c50 / s50 > limit:
            kind = " (interpreted kernels)" if self.custom_interpreted else ""
            return Breach(
                "latency_ratio",
                f"custom p50 {c50 * 1e3:.1f} ms / stock p50 {s50 * 1e3:.1f} ms = "
                f"{c50 / s50:.2f} > {limit:g}{kind}",
            )
        return None

    def _agreement(self, now: float) -> Breach | None:
        s = self.spec
        values = self.agreement.values(now)
        m = len(values)
        if s.min_agreement is not None and m >= s.min_shadow_samples:
            mean = sum(values) / m
            if mean < s.min_agreement:
                return Breach(
                    "agreement",
                    f"mean greedy token agreement {mean:.3f} < {s.min_agreement:g} "
                    f"over the last {m} mirrored requests",
                )
        return None

    def _checks(self) -> Breach | None:
        limit = self.spec.max_numerical_check_failures
        if limit is not None and self.check_failures > limit:
            return Breach(
                "numerical_checks",
                f"{self.check_failures} fuselane numerical-check failures on the custom arm "
                f"> {limit}",
            )
        return None
