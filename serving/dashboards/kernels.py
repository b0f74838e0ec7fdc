"""The kernels dashboard: what fuselane's kernels do inside vLLM, from their telemetry.

The metrics are `plugin/telemetry.py`'s. They reach Prometheus two ways, under two prefixes:
vLLM's own `/metrics` (`fuselane_*`, with `PROMETHEUS_MULTIPROC_DIR`) and Ray's export of the
canary's replicas (`ray_fuselane_*`, with an `arm` label; histograms there are gauges holding
the cumulative buckets, on which `rate()` and `histogram_quantile()` work the same). The
`prefix` variable finds which of the two the data source holds, so one dashboard serves both.
Latency and errors are grouped by `impl` as well, so fuselane's kernels and vLLM's stock path
show side by side wherever both are observed (the sampler's fallback).
"""

from __future__ import annotations

from typing import Any

from .common import (
    Query,
    Row,
    assemble,
    datasource_variable,
    heatmap,
    query_variable,
    stat,
    timeseries,
    vllm_links,
)

UID = "fuselane-kernels"
# What the `prefix` variable can resolve to: vLLM's /metrics, Ray Serve's export.
PREFIXES = ("fuselane", "ray_fuselane")
FILTERS = 'kernel=~"$kernel", phase=~"$phase", arm=~"$arm", instance=~"$instance"'
SITE = "kernel, phase, impl"
SITE_LEGEND = "{{kernel}} {{phase}} ({{impl}})"


def metric(name: str, extra: str = "") -> str:
    """`${prefix}_<name>{filters}`: one of the kernel metrics, from the chosen source."""
    matchers = FILTERS + (", " + extra if extra else "")
    return f"${{prefix}}_{name}{{{matchers}}}"


def rate(name: str, extra: str = "") -> str:
    return f"rate({metric(name, extra)}[$__rate_interval])"


def quantile(q: float, histogram: str, by: str) -> str:
    return f"histogram_quantile({q}, sum by (le, {by}) ({rate(histogram + '_bucket')}))"


def share(part: str, whole: str) -> str:
    """part / whole, 0 where `whole` has a series and `part` none (a counter's series exists
    from its first event on: no failed check yet is a share of 0, not a missing one)."""
    return f"({part} or 0 * {whole}) / {whole}"


def _variables() -> list[Any]:
    launches = "${prefix}_kernel_launches_total"
    return [
        datasource_variable(),
        query_variable(
            "prefix",
            "Source",
            "metrics(fuselane_kernel_launches_total$)",
            "fuselane: vLLM's /metrics (PROMETHEUS_MULTIPROC_DIR set); ray_fuselane: the Ray "
            "Serve canary's replicas (Ray's metrics export)",
            multi=False,
            regex="/^(.*fuselane)_kernel_launches_total$/",
        ),
        query_variable("kernel", "Kernel", f"label_values({launches}, kernel)", "kernel family"),
        query_variable(
            "phase",
            "Phase",
            f'label_values({launches}{{kernel=~"$kernel"}}, phase)',
            "the engine step's phase: prefill, decode, mixed",
        ),
        query_variable(
            "arm", "Arm", f"label_values({launches}, arm)", "canary arm (Ray Serve only)"
        ),
        query_variable(
            "instance",
            "Instance",
            f"label_values({launches}, instance)",
            "the scraped endpoint: a vLLM server, or a Ray node's metrics agent",
        ),
    ]


def _latency_row() -> Row:
    latency = "kernel_latency_seconds"
    about = (
        "Sampled calls only (FUSELANE_TELEMETRY_TIMING_RATE): device time between probes on "
        "GPUs, host time of the synchronous launch under Triton's interpreter."
    )
    panels: list[Any] = [
        timeseries(
            f"Latency p{round(q * 100)}",
            f"{round(q * 100)}th percentile of kernel latency by kernel, phase and "
            f"implementation. {about}",
            [Query(quantile(q, latency, SITE), SITE_LEGEND)],
            unit="s",
        )
        for q in (0.5, 0.95, 0.99)
    ]
    panels.append(
        timeseries(
            "Mean latency",
            f"Mean kernel latency (sum over count of the sampled calls). {about}",
            [
                Query(
                    f"sum by ({SITE}) ({rate(latency + '_sum')}) "
                    f"/ sum by ({SITE}) ({rate(latency + '_count')})",
                    SITE_LEGEND,
                )
            ],
            unit="s",
            width=12,
        )
    )
    panels.append(
        timeseries(
            "Timed calls per second",
            "How many calls the latency quantiles are computed from, by launch mode (eager, "
            "or a CUDA-graph replay carrying timing probes).",
            [
                Query(
                    f"sum by (kernel, launch) ({rate(latency + '_count')})",
                    "{{kernel}} ({{launch}})",
                )
            ],
            unit="ops",
            width=12,
        )
    )
    return Row("Latency", panels)


def _launch_row() -> Row:
    launches = "kernel_launches_total"
    by_fuselane = rate(launches, 'impl="fuselane"')
    everything = rate(launches)
    return Row(
        "Launches",
        [
            timeseries(
                "Launches per second",
                "Kernel launcher calls that ran, exact (CUDA-graph replays included).",
                [Query(f"sum by ({SITE}) ({rate(launches)})", SITE_LEGEND)],
                unit="ops",
                width=9,
            ),
            timeseries(
                "fuselane share of launches",
                "Of the launches observed at each seam, the share run by fuselane's kernel; "
                "below 1 where vLLM's stock path still runs (e.g. the sampler's fallback for "
                "batches it does not support).",
                [
                    Query(
                        share(
                            f"sum by (kernel) ({by_fuselane})", f"sum by (kernel) ({everything})"
                        ),
                        "{{kernel}}",
                    )
                ],
                unit="percentunit",
                width=9,
                min_value=0,
                max_value=1,
            ),
            stat(
                "Sample rates",
                "Configured fractions of kernel calls timed and checked "
                "(FUSELANE_TELEMETRY_TIMING_RATE, FUSELANE_TELEMETRY_CHECK_RATE).",
                [
                    Query(
                        "max by (what) (${prefix}_telemetry_sample_rate_ratio"
                        '{arm=~"$arm", instance=~"$instance"})',
                        "{{what}}",
                    )
                ],
                unit="percentunit",
            ),
        ],
    )


def _checks_row() -> Row:
    checks = "numerical_checks_total"
    not_passed = rate(checks, 'result!="pass"')
    about = "Sampled calls recomputed with the torch reference (FUSELANE_TELEMETRY_CHECK_RATE)."
    return Row(
        "Numerical checks",
        [
            timeseries(
                "Checks per second by result",
                f"{about} result: pass, fail (outside the per-dtype tolerance), error (the "
                "check itself broke).",
                [Query(f"sum by (kernel, result) ({rate(checks)})", "{{kernel}} {{result}}")],
                unit="ops",
            ),
            timeseries(
                "Failed checks (share of checked calls)",
                f"{about} Any value above 0 is a numerical bug in a kernel or its reference; "
                "the canary rolls the custom arm back on it.",
                [
                    Query(
                        share(
                            f"sum by ({SITE}) ({not_passed})", f"sum by ({SITE}) ({rate(checks)})"
                        ),
                        SITE_LEGEND,
                    )
                ],
                unit="percentunit",
            ),
            timeseries(
                "Mismatched elements per second",
                "Output elements of checked calls outside the tolerance (NaN and inf included).",
                [
                    Query(
                        f"sum by ({SITE}) ({rate('numerical_mismatched_elements_total')})",
                        SITE_LEGEND,
                    )
                ],
                unit="short",
            ),
            timeseries(
                "Max absolute error p50 / p99",
                "Per checked call, the largest absolute difference from the reference (output "
                "units); percentiles over the calls checked in the interval.",
                [
                    Query(
                        quantile(q, "numerical_max_abs_error", "kernel"),
                        f"p{round(q * 100)} {{{{kernel}}}}",
                    )
                    for q in (0.5, 0.99)
                ],
                unit="none",
                width=12,
            ),
            heatmap(
                "Max absolute error distribution",
                "Checked calls per error bucket (all kernels and phases selected).",
                Query(
                    f"sum by (le) (increase({metric('numerical_max_abs_error_bucket')}"
                    "[$__rate_interval]))",
                    "{{le}}",
                ),
                unit="none",
            ),
            timeseries(
                "Max relative error p99",
                "Per checked call, the largest absolute error over the reference's largest "
                "magnitude; 99th percentile by kernel.",
                [
                    Query(
                        quantile(0.99, "numerical_max_rel_error_ratio", "kernel"),
                        "{{kernel}}",
                    )
                ],
                unit="percentunit",
                width=12,
            ),
        ],
    )


def build() -> dict[str, Any]:
    return assemble(
        title="fuselane kernels",
        uid=UID,
        description="Per-kernel latency, launches and numerical checks of fuselane's Triton "
        "kernels in vLLM (FUSELANE_TELEMETRY=1).",
        tags=["fuselane"],
        variables=_variables(),
        links=vllm_links(),
        rows=[_latency_row(), _launch_row(), _checks_row()],
    )
