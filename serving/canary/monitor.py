"""The canary monitor: one replica that sees every ingress replica's outcomes and decides.

Ingress replicas report their batched outcomes every half second (`report`) and get back the
state to route by (operator weight, rollback); custom replicas report their numerical-check
failures (`report_kernels`). The monitor keeps the rollback windows (`rollback.RollbackJudge`),
the cumulative per-arm tallies behind `fuselane canary status`, and the rollback record.

A rollback holds until an operator acts: a `user_config` with a higher `epoch` (what
`fuselane canary weight W` sends). Replica restarts re-send the same epoch and change nothing.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from typing import Any

from ray import serve

from .config import CanaryConfig
from .metrics import MonitorMetrics
from .rollback import RollbackJudge

LATENCY_SAMPLES = 2000  # per arm, for the status table's percentiles


def _percentile(values: list[float], p: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))
    return s[k]


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
class CanaryMonitor:
    def __init__(self, config: dict[str, Any]) -> None:
        self.config = CanaryConfig.model_validate(config)
        self.judge = RollbackJudge(self.config.rollback)
        self.metrics = MonitorMetrics()
        self.weight = self.config.routing.weight
        self.shadow_fraction = self.config.shadow.fraction
        self.epoch = -1
        self.rollback: dict[str, Any] | None = None
        self.history: deque[dict[str, Any]] = deque(maxlen=20)
        self.results: dict[str, Counter] = {"stock": Counter(), "custom": Counter()}
        self.latencies: dict[str, deque[float]] = {
            arm: deque(maxlen=LATENCY_SAMPLES) for arm in ("stock", "custom")
        }
        self.failovers: Counter = Counter()
        self.shadow = {"compared": 0, "exact": 0, "errors": 0, "max_logprob_diff": 0.0}
        self.agreements: deque[float] = deque(maxlen=self.config.rollback.window)
        # replica id -> (failed, total) checks as last reported; baseline at the last reset.
        self.kernel_checks: dict[str, tuple[float, float]] = {}
        self.check_baseline: dict[str, float] = {}
        self.kernel_samples: dict[str, dict[str, Any]] = {}
        self.started = time.time()
        self._publish()

    # -- state -----------------------------------------------------------------------------

    def effective_weight(self) -> float:
        return 0.0 if self.rollback else self.weight

    def _state(self) -> dict[str, Any]:
        return {
            "weight": self.effective_weight(),
            "operator_weight": self.weight,
            "shadow_fraction": self.shadow_fraction,
            "rolled_back": self.rollback is not None,
            "epoch": self.epoch,
        }

    def _publish(self) -> None:
        self.metrics.state(self.weight, self.effective_weight(), self.rollback is not None)
        if self.agreements:
            self.metrics.agreement.set(sum(self.agreements) / len(self.agreements))

    async def operator(self, weight: float, shadow_fraction: float, epoch: int) -> dict[str, Any]:
        """An ingress replica applied a user_config. A higher epoch is an operator's action:
        it clears a rollback and starts the custom arm's judgment afresh."""
        if epoch > self.epoch:
            if self.rollback is not None:
                self.rollback["cleared_at"] = time.time()
                self.rollback = None
            self.judge.reset_custom()
            self.check_baseline = {r: f for r, (f, _) in self.kernel_checks.items()}
            self.epoch = epoch
        if epoch >= self.epoch:
            self.weight, self.shadow_fraction = weight, shadow_fraction
        self._publish()
        return self._state()

    # -- reports ---------------------------------------------------------------------------

    async def report(self, outcomes: list[tuple], comparisons: list[tuple]) -> dict[str, Any]:
        """Outcomes: (arm, result, latency_s | None, failover_reason | None, epoch).
        Comparisons: (agreement | None, exact | None, max_logprob_diff, epoch). Reports from
        an older epoch count in the tallies but not in the rollback windows."""
        for arm, result, latency, failover, epoch in outcomes:
            self.results[arm][result] += 1
            if failover:
                self.failovers[failover] += 1
            ok = result == "ok"
            if ok and latency is not None:
                self.latencies[arm].append(latency)
            if result == "client_error" or epoch < self.epoch:
                continue  # the request's fault, or judged before the operator's last action
            self.judge.add_outcome(arm, ok, latency)
        for agreement, exact, lp_diff, epoch in comparisons:
            if agreement is None:
                self.shadow["errors"] += 1
                continue
            self.shadow["compared"] += 1
            self.shadow["exact"] += int(bool(exact))
            self.shadow["max_logprob_diff"] = max(self.shadow["max_logprob_diff"], lp_diff)
            self.agreements.append(agreement)
            if epoch >= self.epoch:
                self.judge.add_agreement(agreement)
        self._evaluate()
        return self._state()

    async def report_kernels(
        self, replica: str, arm: str, failed: float, total: float, samples: list[dict[str, Any]]
    ) -> None:
        self.kernel_samples[replica] = {"arm": arm, "samples": samples, "at": time.time()}
        if arm != "custom":
            return
        self.kernel_checks[replica] = (failed, total)
        self.check_baseline.setdefault(replica, 0.0)
        self.judge.check_failures = int(
            sum(f - self.check_baseline.get(r, 0.0) for r, (f, _) in self.kernel_checks.items())
        )
        self._evaluate()

    def _evaluate(self) -> None:
        if self.rollback is None and self.weight > 0:
            breach = self.judge.judge()
            if breach is not None:
                self.rollback = {
                    "reason": breach.reason,
                    "detail": breach.detail,
                    "at": time.time(),
                    "weight_before": self.weight,
                    "epoch": self.epoch,
                }
                self.history.append(dict(self.rollback))
                self.metrics.rollbacks.inc(1, tags={"reason": breach.reason})
        self._publish()

    # -- status ----------------------------------------------------------------------------

    async def status(self) -> dict[str, Any]:
        arms = {}
        for arm in ("stock", "custom"):
            res = self.results[arm]
            attempts = sum(res.values())
            lat = list(self.latencies[arm])
            arms[arm] = {
                "requests": attempts,
                "ok": res["ok"],
                "errors": res["error"],
                "client_errors": res["client_error"],
                "error_rate_window": self.judge.arms[arm].error_rate(),
                "latency_p50_s": _percentile(lat, 50),
                "latency_p95_s": _percentile(lat, 95),
            }
        total = sum(a["requests"] for a in arms.values())
        for a in arms.values():
            a["traffic_share"] = a["requests"] / total if total else 0.0
        shadow = dict(self.shadow)
        shadow["agreement_mean_window"] = (
            sum(self.agreements) / len(self.agreements) if self.agreements else None
        )
        return {
            "app": self.config.name,
            "model": self.config.model.id,
            **self._state(),
            "rollback": self.rollback,
            "rollbacks": list(self.history),
            "arms": arms,
            "failovers": dict(self.failovers),
            "shadow": shadow,
            "kernel_checks": {
                "failed_since_reset": self.judge.check_failures,
                "by_replica": {
                    r: {"failed": f, "total": t} for r, (f, t) in self.kernel_checks.items()
                },
            },
            "kernel_metrics": self.kernel_samples,
            "uptime_s": time.time() - self.started,
        }
