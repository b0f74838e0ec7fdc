"""The canary dashboard: the Ray Serve canary's traffic, the arms' latency, agreement, rollbacks.

Everything comes through Ray's metrics export (every name prefixed `ray_`):

- the canary's own metrics (`serving/canary/metrics.py`): requests, failovers, shadow
  comparisons, weight, rollbacks — recorded by the ingress and monitor replicas;
- vLLM's engine metrics of each arm (Ray Serve LLM's `log_engine_metrics`: `ray_vllm_*`, with
  `model_name` and the replica's `WorkerId`, but no arm);
- fuselane's kernel metrics of the custom arm (`ray_fuselane_*{arm="custom"}`), its build
  (`ray_fuselane_build_info`) included.

Ray's labels say which worker process recorded a value, not which Serve application; Ray
Serve's own `ray_serve_replica_processing_queries` maps each replica's `WorkerId` to its
`application` and `deployment`. Joining on it selects the canary chosen in `$app` (its arms are
the applications `<app>-stock` and `<app>-custom`, or all of it is `<app>` in the one-app layout)
and gives vLLM's metrics their arm (the arm deployments are named `stock` and `custom`).
"""

from __future__ import annotations

from typing import Any

from fuselane.plugin.build_info import LABELS as BUILD_LABELS

from .common import (
    Query,
    Row,
    annotation,
    assemble,
    custom_variable,
    datasource_variable,
    panel_link_to_vllm,
    query_variable,
    table,
    timeseries,
    url_link,
    vllm_links,
)

UID = "fuselane-canary"
ARMS = ("stock", "custom")  # serving/canary/config.py ARMS: the arm deployments' names
INGRESS = "CanaryIngress"  # serving/canary/app.py INGRESS: the ingress deployment's name
RAY_SERVE_LLM_DASHBOARD = "/d/rayServeLlmDashboard"  # the uid Ray gives its Serve LLM dashboard

# A replica's WorkerId -> its Serve application and deployment (Ray Serve's own gauge).
REPLICA_INFO = "ray_serve_replica_processing_queries"
APP = 'application=~"$app(-stock|-custom)?"'
# Keeps the series recorded by this canary's replicas; the value is unchanged (x 1).
IN_APP = f"on (WorkerId) group_left () group by (WorkerId) ({REPLICA_INFO}{{{APP}}})"
# Adds `arm` to series recorded by an arm's replica (vLLM's engine metrics).
ARM_OF_WORKER = (
    f'label_replace(group by (WorkerId, deployment) ({REPLICA_INFO}{{{APP}, deployment=~"$arm"}}),'
    ' "arm", "$1", "deployment", "(.*)")'
)
VLLM = 'model_name=~"$model_name"'


def in_app(expr: str) -> str:
    return f"({expr} * {IN_APP})"


def rate(selector: str) -> str:
    return f"rate({selector}[$__rate_interval])"


def per_arm(expr: str) -> str:
    """A vLLM series of the arms' replicas, labelled with its arm."""
    return f"({expr} * on (WorkerId) group_left (arm) {ARM_OF_WORKER})"


def canary_quantile(q: float, histogram: str, by: str = "", matchers: str = "") -> str:
    labels = f"le, {by}" if by else "le"
    selector = f"{histogram}_bucket{{{matchers}}}" if matchers else f"{histogram}_bucket"
    return f"histogram_quantile({q}, sum by ({labels}) ({in_app(rate(selector))}))"


def vllm_quantiles(histogram: str) -> list[Query]:
    return [
        Query(
            f"histogram_quantile({q}, sum by (le, arm) "
            f"({per_arm(rate(f'{histogram}_bucket{{{VLLM}}}'))}))",
            f"p{round(q * 100)} {{{{arm}}}}",
        )
        for q in (0.5, 0.95, 0.99)
    ]


def _variables() -> list[Any]:
    return [
        datasource_variable(),
        query_variable(
            "app",
            "Canary app",
            f'label_values(ray_serve_replica_processing_queries{{deployment="{INGRESS}"}}, '
            "application)",
            "the canary's Serve application (its `name` in the canary config)",
            multi=False,
        ),
        custom_variable("arm", "Arm", ARMS, "stock: vLLM's kernels; custom: fuselane's"),
        query_variable(
            "model_name",
            "Model",
            "label_values(ray_vllm_num_requests_running, model_name)",
            "the served model name (vLLM's model_name label)",
        ),
    ]


def _since_start(what: str) -> str:
    return (
        f"{what} since the canary's replicas started. A count, not a rate: Ray creates a "
        "counter's series at its first event, which rate() cannot see, and these come in bursts."
    )


def _traffic_row() -> Row:
    requests = "ray_fuselane_canary_requests_total"
    ok_by_arm = in_app(rate(f'{requests}{{arm=~"$arm", result="ok"}}'))
    ok_all = in_app(rate(f'{requests}{{result="ok"}}'))
    failed = f'{requests}{{arm=~"$arm", result="error"}}'
    streams_cut = 'ray_fuselane_canary_streams_cut_total{arm=~"$arm"}'
    errors = in_app(rate(failed))
    attempts = in_app(rate(f'{requests}{{arm=~"$arm"}}'))
    return Row(
        "Traffic",
        [
            timeseries(
                "Custom arm weight",
                "Share of traffic routed to the custom arm: in force (0 while rolled back), "
                "as the operator set it, and whether an automatic rollback holds it at 0.",
                [
                    Query(f"max({in_app('ray_fuselane_canary_weight_ratio')})", "in force"),
                    Query(
                        f"max({in_app('ray_fuselane_canary_operator_weight_ratio')})",
                        "operator",
                    ),
                    Query(f"max({in_app('ray_fuselane_canary_rolled_back')})", "rolled back"),
                ],
                unit="percentunit",
                min_value=0,
                max_value=1,
            ),
            timeseries(
                "Traffic split",
                "Share of the answered requests each arm answered.",
                [
                    Query(
                        f"sum by (arm) ({ok_by_arm}) / ignoring (arm) group_left () sum({ok_all})",
                        "{{arm}}",
                    )
                ],
                unit="percentunit",
                percent_stack=True,
            ),
            timeseries(
                "Requests per second by arm and result",
                "Attempts answered by each arm (a request that fails over counts once per "
                "arm); result: ok, error, client_error.",
                [Query(f"sum by (arm, result) ({attempts})", "{{arm}} {{result}}")],
                unit="reqps",
            ),
            timeseries(
                "Error rate by arm",
                "Share of each arm's attempts that failed on the server side.",
                [Query(f"sum by (arm) ({errors}) / sum by (arm) ({attempts})", "{{arm}}")],
                unit="percentunit",
            ),
            timeseries(
                "Errors by arm",
                _since_start("Attempts that failed on the server side, by arm,"),
                [Query(f"sum by (arm) ({in_app(failed)})", "{{arm}}")],
                unit="short",
            ),
            timeseries(
                "Streams cut by arm",
                _since_start(
                    "Streams that failed after their first chunk (the client got an error event "
                    "and no [DONE]; each also counts among the errors), by arm,"
                ),
                [
                    Query(
                        f"sum by (arm) ({in_app(streams_cut)})",
                        "{{arm}}",
                    )
                ],
                unit="short",
            ),
            timeseries(
                "Failovers by reason",
                _since_start(
                    "Requests meant for the custom arm that the stock arm answered instead, by "
                    "cause (the custom replica failed or timed out before its first byte),"
                ),
                [
                    Query(
                        f"sum by (reason) ({in_app('ray_fuselane_canary_failovers_total')})",
                        "{{reason}}",
                    )
                ],
                unit="short",
            ),
        ],
    )


def _latency_row() -> Row:
    about = "vLLM's own histogram of each arm's engine (Ray Serve LLM's engine metrics)."
    to_vllm = [panel_link_to_vllm()]
    running = per_arm(f"ray_vllm_num_requests_running{{{VLLM}}}")
    waiting = per_arm(f"ray_vllm_num_requests_waiting{{{VLLM}}}")
    return Row(
        "Latency and load per arm",
        [
            timeseries(
                "Time to first token",
                f"TTFT p50 / p95 / p99 by arm. {about}",
                vllm_quantiles("ray_vllm_time_to_first_token_seconds"),
                unit="s",
                links=to_vllm,
            ),
            timeseries(
                "Inter-token latency",
                f"Time between consecutive output tokens, p50 / p95 / p99 by arm. {about}",
                vllm_quantiles("ray_vllm_inter_token_latency_seconds"),
                unit="s",
                links=to_vllm,
            ),
            timeseries(
                "End-to-end request latency",
                f"From arrival at the engine to the last token, p50 / p95 / p99 by arm. {about}",
                vllm_quantiles("ray_vllm_e2e_request_latency_seconds"),
                unit="s",
                links=to_vllm,
            ),
            timeseries(
                "Ingress latency p50 / p99",
                "End-to-end latency of successful requests at the canary's ingress, by arm "
                "(routing and streaming included).",
                [
                    Query(
                        canary_quantile(
                            q,
                            "ray_fuselane_canary_request_latency_seconds",
                            "arm",
                            'arm=~"$arm"',
                        ),
                        f"p{round(q * 100)} {{{{arm}}}}",
                    )
                    for q in (0.5, 0.99)
                ],
                unit="s",
            ),
            timeseries(
                "Generated tokens per second",
                "Output tokens each arm's engines produced.",
                [
                    Query(
                        "sum by (arm) "
                        f"({per_arm(rate(f'ray_vllm_generation_tokens_total{{{VLLM}}}'))})",
                        "{{arm}}",
                    )
                ],
                unit="short",
                links=to_vllm,
            ),
            timeseries(
                "Requests running and waiting",
                "Requests in each arm's engines: being processed, and queued.",
                [
                    Query(f"sum by (arm) ({running})", "running {{arm}}"),
                    Query(f"sum by (arm) ({waiting})", "waiting {{arm}}"),
                ],
                unit="short",
                links=to_vllm,
            ),
        ],
    )


def _shadow_row() -> Row:
    agreement = "ray_fuselane_canary_shadow_agreement_ratio"
    return Row(
        "Shadow comparisons",
        [
            timeseries(
                "Shadow comparisons per second",
                "Mirrored greedy requests compared, by result: exact (same tokens), diverged, "
                "error (a side failed).",
                [
                    Query(
                        "sum by (result) "
                        f"({in_app(rate('ray_fuselane_canary_shadow_comparisons_total'))})",
                        "{{result}}",
                    )
                ],
                unit="ops",
            ),
            timeseries(
                "Shadow agreement",
                "Greedy token agreement of mirrored pairs (common prefix over length): the "
                "mean over the rollback window (what the rollback judges), and the mean of the "
                "pairs compared in each interval.",
                [
                    Query(
                        f"max({in_app('ray_fuselane_canary_shadow_agreement_mean_ratio')})",
                        "rollback window mean",
                    ),
                    Query(
                        f"sum({in_app(rate(agreement + '_sum'))}) "
                        f"/ sum({in_app(rate(agreement + '_count'))})",
                        "interval mean",
                    ),
                ],
                unit="percentunit",
                min_value=0,
                max_value=1,
            ),
            timeseries(
                "Logprob divergence p50 / p99",
                "Largest |logprob difference| over a mirrored pair's common prefix (nats).",
                [
                    Query(
                        canary_quantile(q, "ray_fuselane_canary_shadow_logprob_divergence_nats"),
                        f"p{round(q * 100)}",
                    )
                    for q in (0.5, 0.99)
                ],
                unit="none",
            ),
        ],
    )


def _rollback_row() -> Row:
    failed = 'ray_fuselane_numerical_checks_total{arm="custom", result!="pass"}'
    build = 'ray_fuselane_build_info{arm=~"$arm"}'
    return Row(
        "Rollbacks and builds",
        [
            timeseries(
                "Rollbacks by reason and build",
                _since_start(
                    "Automatic rollbacks of the custom arm, by the threshold crossed (error "
                    "rate, latency ratio, shadow agreement, failed numerical checks) and the "
                    "custom build rolled back from (version/kernel-source hash),"
                )
                + " `fuselane canary weight W` clears a rollback.",
                [
                    Query(
                        f"sum by (reason, build) ({in_app('ray_fuselane_canary_rollbacks_total')})",
                        "{{reason}} from {{build}}",
                    )
                ],
                unit="short",
            ),
            timeseries(
                "Custom arm: failed numerical checks per second",
                "fuselane's kernel checks that failed in the custom arm's engines (one of the "
                "rollback signals). The kernels dashboard has the full telemetry.",
                [Query(f"sum by (kernel) ({in_app(rate(failed))})", "{{kernel}}")],
                unit="ops",
                links=[url_link("fuselane kernels", "/d/fuselane-kernels", "kernel telemetry")],
            ),
            table(
                "Build per arm",
                "The fuselane build each arm's engines run now (fuselane_build_info: version, "
                "kernel-source hash, Triton, torch, vLLM, CUDA), one row per build: two rows "
                "for an arm in the middle of a rollout. An arm without fuselane's kernels or "
                "telemetry reports none.",
                Query(
                    f"max by (arm, {', '.join(BUILD_LABELS)}) ({in_app(build)})",
                    "{{arm}}",
                ),
                hide=("Time", "Value"),
            ),
        ],
    )


def build() -> dict[str, Any]:
    return assemble(
        title="fuselane canary",
        uid=UID,
        description="The Ray Serve canary of fuselane's kernels against vLLM's: traffic, "
        "per-arm latency from vLLM's metrics, shadow agreement and rollbacks.",
        tags=["fuselane", "ray"],
        variables=_variables(),
        links=[
            *vllm_links(),
            url_link("Ray Serve LLM", RAY_SERVE_LLM_DASHBOARD, "Ray's Serve LLM dashboard"),
        ],
        rows=[_traffic_row(), _latency_row(), _shadow_row(), _rollback_row()],
        annotations=[
            annotation(
                "Custom arm rolled back",
                f"max({in_app('ray_fuselane_canary_rolled_back')}) > 0",
                "red",
            )
        ],
    )
