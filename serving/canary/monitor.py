"""The canary monitor: one replica that sees every ingress replica's outcomes and decides.

Ingress replicas report their batched outcomes every half second (`report`) and get back the
state to route by (operator weight, rollback); custom replicas report their numerical-check
failures (`report_kernels`). The monitor keeps the rollback windows (`rollback.RollbackJudge`),
the cumulative per-arm tallies behind `fuselane canary status`, and the rollback record.

A rollback holds until an operator acts: a `user_config` with a higher `epoch` (what
`fuselane canary weight W` sends). Replica restarts re-send the same epoch and change nothing.
The rules' windows are `rollback.RollbackJudge`'s, on this replica's monotonic clock (the time
a report arrives: at most one report interval after the request ended).

The arms' builds come with the replicas' kernel metrics (`fuselane_build_info`); a rollback
names the custom build it rolled back from, in its record, its log line and the `build` label
of `fuselane_canary_rollbacks_total`.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from typing import Any

from ray import serve

from . import kernel_metrics as km
from .config import CanaryConfig
from .metrics import MonitorMetrics
from .rollback import Outcome, RollbackJudge
from .shadow import PairResult

LATENCY_SAMPLES = 2000  # per arm, for the status table's percentiles
# A replica whose last kernel-metrics report is older is gone (restarted, redeployed): its build
# is no longer the arm's. Replicas report every 2 s (engine.KERNEL_METRICS_INTERVAL_S).
BUILD_FRESH_S = 60.0

logger = logging.getLogger("ray.serve")


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
        self.shadow_errors: Counter = Counter()  # by exception type: a bounded set
        self.last_shadow_error: str | None = None
        self.agreements: deque[float] = deque(maxlen=self.config.rollback.window)
        # replica id -> (failed, total) checks as last reported; baseline at the last reset.
        self.kernel_checks: dict[str, tuple[float, float]] = {}
        self.check_baseline: dict[str, float] = {}
        self.kernel_samples: dict[str, dict[str, Any]] = {}
        self.interpreted: dict[str, bool] = {}  # custom replica id -> runs Triton's interpreter
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
        """Outcomes: `rollback.Outcome`s; comparisons: `shadow.PairResult`s. Reports from an
        older epoch count in the tallies but not in the rollback windows, nor do outcomes the
        ingress folded into an outage already counted (`Outcome.judged`), except for how long
        that outage had lasted (`Outcome.outage_s`)."""
        now = time.monotonic()
        for o in map(Outcome._make, outcomes):
            self.results[o.arm][o.result] += 1
            if o.failover:
                self.failovers[o.failover] += 1
            ok = o.result == "ok"
            if ok and o.latency_s is not None:
                self.latencies[o.arm].append(o.latency_s)
            if o.result == "client_error" or o.epoch < self.epoch:
                continue  # the request's fault, or judged before the last operator action
            if o.outage_s is not None:
                self.judge.add_outage(o.outage_s)  # how long custom has been out, for the rule
            if o.judged:  # else folded into an outage already counted
                self.judge.add_outcome(o.arm, ok, o.latency_s, now)
        for p in map(PairResult._make, comparisons):
            if p.agreement is None:
                self.shadow["errors"] += 1
                reason = p.error or "unknown: no reason reported"
                self.shadow_errors[reason.split(":", 1)[0]] += 1
                self.last_shadow_error = reason
                continue
            self.shadow["compared"] += 1
            self.shadow["exact"] += int(bool(p.exact))
            self.shadow["max_logprob_diff"] = max(
                self.shadow["max_logprob_diff"], p.max_logprob_diff
            )
            self.agreements.append(p.agreement)
            if p.epoch >= self.epoch:
                self.judge.add_agreement(p.agreement, now)
        self._evaluate()
        return self._state()

    async def report_kernels(
        self,
        replica: str,
        arm: str,
        failed: float,
        total: float,
        samples: list[dict[str, Any]],
        interpreted: bool = False,
    ) -> None:
        """A replica's kernel metrics and numerical-check counts; `interpreted`: its fuselane
        kernels run under Triton's interpreter (the latency rule reads another ratio then)."""
        self.kernel_samples[replica] = {"arm": arm, "samples": samples, "at": time.time()}
        if arm != "custom":
            return
        self.interpreted[replica] = interpreted
        self.judge.custom_interpreted = any(self.interpreted.values())
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
                custom = self.builds()["custom"]
                build = custom[0]["build"] if custom else None  # the most replicas' build
                self.rollback = {
                    "reason": breach.reason,
                    "detail": breach.detail,
                    "at": time.time(),
                    "weight_before": self.weight,
                    "epoch": self.epoch,
                    "build": km.build_id(build),
                    "build_info": build,
                }
                self.history.append(dict(self.rollback))
                self.metrics.rollbacks.inc(
                    1, tags={"reason": breach.reason, "build": km.build_id(build)}
                )
                logger.warning(
                    "fuselane canary %s: custom arm rolled back from build %s: %s: %s",
                    self.config.name,
                    km.build_id(build),
                    breach.reason,
                    breach.detail,
                )
        self._publish()

    def builds(self) -> dict[str, list[dict[str, Any]]]:
        """Per arm, the builds its live replicas report, most replicas first."""
        return km.arm_builds(self.kernel_samples, time.time(), BUILD_FRESH_S)

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
                "errors": res["error"] + res["stream_cut"],
                "streams_cut": res["stream_cut"],
                "client_errors": res["client_error"],
                "error_rate_window": self.judge.arms[arm].error_rate(),
                "latency_p50_s": _percentile(lat, 50),
                "latency_p95_s": _percentile(lat, 95),
            }
        total = sum(a["requests"] for a in arms.values())
        for a in arms.values():
            a["traffic_share"] = a["requests"] / total if total else 0.0
        shadow = dict(self.shadow)
        shadow["error_types"] = dict(self.shadow_errors)
        shadow["last_error"] = self.last_shadow_error
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
            "latency_rule": {
                "custom_interpreted": self.judge.custom_interpreted,
                "max_ratio": self.judge.latency_limit(),
            },
            "kernel_checks": {
                "failed_since_reset": self.judge.check_failures,
                "by_replica": {
                    r: {"failed": f, "total": t} for r, (f, t) in self.kernel_checks.items()
                },
            },
            "kernel_metrics": self.kernel_samples,
            "builds": self.builds(),
            "uptime_s": time.time() - self.started,
        }
