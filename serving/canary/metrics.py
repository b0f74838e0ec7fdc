"""The canary's own metrics, through Ray's Prometheus export (`ray.util.metrics`).

Names follow fuselane's convention, `fuselane_canary_<thing>_<unit>`, counters ending in
`_total`; Ray's exporter prefixes every application metric with `ray_` (so Prometheus sees
`ray_fuselane_canary_requests_total`) and adds its own labels (node, worker). Our labels are
bounded: `arm` (stock, custom), `result` (ok, error, client_error), `reason` (the rollback
reasons, or the failover causes: timeout, unavailable, error, cooldown, rollback, weight_zero),
`build` (the custom build a rollback rolled back from: one value per build rolled out).

Objects are made in a replica's constructor, never at import (`ray.util.metrics` needs a
connected Ray worker).
"""

from __future__ import annotations

# Latency buckets (s): tiny CPU models answer in tens of ms, real models in seconds.
LATENCY_BOUNDARIES = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
RATIO_BOUNDARIES = [0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 0.999]
NATS_BOUNDARIES = [1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 0.1, 1.0]


class IngressMetrics:
    """Per-request metrics, recorded by every ingress replica."""

    def __init__(self) -> None:
        from ray.util.metrics import Counter, Histogram

        self.requests = Counter(
            "fuselane_canary_requests_total",
            description="Requests answered by each arm (each attempt: a failover counts twice).",
            tag_keys=("arm", "result"),
        )
        self.latency = Histogram(
            "fuselane_canary_request_latency_seconds",
            description="End-to-end latency of successful requests, by arm.",
            boundaries=LATENCY_BOUNDARIES,
            tag_keys=("arm",),
        )
        self.streams_cut = Counter(
            "fuselane_canary_streams_cut_total",
            description="Streams that failed after their first chunk (the client got an error "
            "event, no [DONE]), by arm; each is also a request with result error.",
            tag_keys=("arm",),
        )
        self.failovers = Counter(
            "fuselane_canary_failovers_total",
            description="Requests meant for custom that stock answered, by cause.",
            tag_keys=("reason",),
        )
        self.shadow = Counter(
            "fuselane_canary_shadow_comparisons_total",
            description="Mirrored greedy requests compared, by result (exact, diverged, error).",
            tag_keys=("result",),
        )
        self.agreement = Histogram(
            "fuselane_canary_shadow_agreement_ratio",
            description="Greedy token agreement of mirrored pairs (common prefix / length).",
            boundaries=RATIO_BOUNDARIES,
        )
        self.logprob_diff = Histogram(
            "fuselane_canary_shadow_logprob_divergence_nats",
            description="Max |logprob difference| over a mirrored pair's common prefix.",
            boundaries=NATS_BOUNDARIES,
        )

    def request(self, arm: str, result: str, latency_s: float | None) -> None:
        self.requests.inc(1, tags={"arm": arm, "result": result})
        if result == "ok" and latency_s is not None:
            self.latency.observe(latency_s, tags={"arm": arm})

    def stream_cut(self, arm: str) -> None:
        self.streams_cut.inc(1, tags={"arm": arm})

    def failover(self, reason: str) -> None:
        self.failovers.inc(1, tags={"reason": reason})

    def compared(self, exact: bool | None, agreement: float, logprob_diff: float) -> None:
        if exact is None:
            self.shadow.inc(1, tags={"result": "error"})
            return
        self.shadow.inc(1, tags={"result": "exact" if exact else "diverged"})
        self.agreement.observe(agreement)
        self.logprob_diff.observe(logprob_diff)


class MonitorMetrics:
    """State metrics, recorded by the single monitor replica."""

    def __init__(self) -> None:
        from ray.util.metrics import Counter, Gauge

        self.weight = Gauge(
            "fuselane_canary_weight_ratio",
            description="Share of traffic routed to custom now (0 while rolled back).",
        )
        self.operator_weight = Gauge(
            "fuselane_canary_operator_weight_ratio",
            description="Share of traffic the operator asked for (the user_config weight).",
        )
        self.rolled_back = Gauge(
            "fuselane_canary_rolled_back",
            description="1 while an automatic rollback holds the custom arm at weight 0.",
        )
        self.rollbacks = Counter(
            "fuselane_canary_rollbacks_total",
            description="Automatic rollbacks of the custom arm, by reason and the custom build "
            "rolled back from (VERSION/KERNEL_HASH).",
            tag_keys=("reason", "build"),
        )
        self.agreement = Gauge(
            "fuselane_canary_shadow_agreement_mean_ratio",
            description="Mean greedy token agreement over the rollback window.",
        )

    def state(self, operator_weight: float, effective: float, rolled_back: bool) -> None:
        self.operator_weight.set(operator_weight)
        self.weight.set(effective)
        self.rolled_back.set(1.0 if rolled_back else 0.0)
