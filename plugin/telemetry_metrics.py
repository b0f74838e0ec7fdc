"""The `fuselane_*` Prometheus metric families of the kernels (created once per process)."""

from __future__ import annotations

import threading
from typing import Any

from . import build_info, metrics_export
from .telemetry_config import ERROR_BUCKETS, LATENCY_BUCKETS


class KernelMetrics:
    """The `fuselane_*` metric families, with label children cached per site."""

    def __init__(self) -> None:
        from prometheus_client import Counter as PCounter
        from prometheus_client import Gauge, Histogram

        site = ["kernel", "phase", "impl"]
        self.launches = PCounter(
            "fuselane_kernel_launches_total",
            "fuselane kernel launcher calls that ran (CUDA-graph replays included)",
            site,
        )
        self.latency = Histogram(
            "fuselane_kernel_latency_seconds",
            "Sampled kernel latency: device time between probes (GPU), host time of the "
            "synchronous launch (Triton interpreter)",
            [*site, "launch"],
            buckets=LATENCY_BUCKETS,
        )
        self.checks = PCounter(
            "fuselane_numerical_checks_total",
            "Sampled kernel calls recomputed with the torch reference, by result",
            [*site, "result"],
        )
        self.abs_error = Histogram(
            "fuselane_numerical_max_abs_error",
            "Max absolute error of a checked call against the reference (output units)",
            site,
            buckets=ERROR_BUCKETS,
        )
        self.rel_error = Histogram(
            "fuselane_numerical_max_rel_error_ratio",
            "Max absolute error of a checked call over the reference's max magnitude",
            site,
            buckets=ERROR_BUCKETS,
        )
        self.nonfinite = PCounter(
            "fuselane_numerical_nonfinite_total",
            "Checked output elements that are NaN or inf where the reference is finite",
            [*site, "kind"],
        )
        self.mismatched = PCounter(
            "fuselane_numerical_mismatched_elements_total",
            "Checked output elements outside the per-dtype tolerance",
            site,
        )
        self.dropped = PCounter(
            "fuselane_telemetry_dropped_total",
            "Timing samples and numerical checks given up, by reason",
            ["kernel", "reason"],
        )
        self.direct_fallbacks = PCounter(
            "fuselane_direct_launch_fallbacks_total",
            "Kernels switched at start-up from fuselane's direct launch to Triton's launcher "
            "(their direct launch raised or differed from Triton's)",
            ["kernel"],
        )
        self.rates = Gauge(
            "fuselane_telemetry_sample_rate_ratio",
            "Configured fraction of kernel calls timed / checked",
            ["what"],
            multiprocess_mode="max",
        )
        self.build = Gauge(
            "fuselane_build_info",
            "The fuselane build this process runs (value 1): version, kernel-source hash, and "
            "the Triton, torch, vLLM and CUDA versions",
            list(build_info.LABELS),
            multiprocess_mode="max",
        )
        self._children: dict[tuple[Any, ...], Any] = {}

    def child(self, metric: Any, *labels: str) -> Any:
        key = (id(metric), *labels)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = metric.labels(*labels)
        return c


_metrics: KernelMetrics | None = None
_metrics_lock = threading.Lock()


def kernel_metrics() -> KernelMetrics:
    global _metrics
    with _metrics_lock:
        if _metrics is None:
            metrics_export.prepare_values()  # before the first metric object exists
            _metrics = KernelMetrics()
        return _metrics
