"""Which serving runs check which dashboards, and the panels a run cannot fill (with why).

A run is a test module's module-scoped serving set-up; its last test sends the dashboards'
queries to the Prometheus that scraped it (`panels.assert_panels_return_data`):

- `vllm-server`: tests/plugin/test_telemetry_serving.py — vLLM's OpenAI server, fuselane's
  kernels (all), telemetry timing and checking every call; `fuselane_*` on vLLM's /metrics;
- `canary`: tests/serving/test_canary.py — the canary with identical arms (vLLM's kernels in
  both), live reweights, a killed custom replica (errors, failovers), a shadow disagreement
  (rollback);
- `canary-fault`: tests/serving/test_canary_fault.py — the custom arm runs fuselane's attention
  and KV write with the test-only fault switch on attention and telemetry checking every call
  (failed checks, mismatches, rollback); `ray_fuselane_*` through Ray;
- `demo`: tests/serving/test_demo.py (`-m extended`) — `fuselane demo` (the CPU config:
  fuselane's kernels interpreted in the custom arm, telemetry on, shadowing), then a stream cut
  by killing the custom replica, requests failed over to stock meanwhile, and a rollback.

The canary runs are checked under a steady load (tests/serving/conftest.py `steady_load`), as
dashboards are read in production: their events come in bursts of seconds (the rollback, the
killed replica), too few scrapes for rate(). After the fault run's rollback the stock arm
answers that load and shadow copies still reach the custom arm.

Every panel must be required by at least one run that checks its dashboard
(tests/grafana/test_dashboards.py).
"""

from __future__ import annotations

KERNELS = "fuselane-kernels"
CANARY = "fuselane-canary"

RUNS: dict[str, tuple[str, ...]] = {
    "vllm-server": (KERNELS,),
    "canary": (CANARY,),
    "canary-fault": (KERNELS, CANARY),
    "demo": (CANARY,),
}

_CORRECT = "the kernels are correct here: no check fails"
_NO_ERRORS = "a corrupted kernel answers wrongly, not with errors"
_TIMED = "too few timed calls (FUSELANE_TELEMETRY_TIMING_RATE at its default, 0.01)"
_NO_CUT = "no stream fails after its first chunk here (the demo run cuts one)"
NOT_REQUIRED: dict[str, dict[str, dict[str, str]]] = {
    "vllm-server": {
        KERNELS: {
            "Mismatched elements per second": _CORRECT,
        },
    },
    "canary": {
        CANARY: {
            "Custom arm: failed numerical checks per second": "both arms run vLLM's kernels "
            "(FUSELANE_CANARY_TEST_KERNELS=none): no fuselane checks",
            "Build per arm": "both arms run vLLM's kernels, telemetry off: no fuselane build",
            "Streams cut by arm": _NO_CUT,
        },
    },
    "canary-fault": {
        # The custom arm times 1% of its calls (the default rate; FAULT_ENV raises the check
        # rate only): seconds of traffic time a handful of calls, too few for the quantiles
        # to be sure of data. The vllm-server run times every call.
        KERNELS: {
            "Latency p50": _TIMED,
            "Latency p95": _TIMED,
            "Latency p99": _TIMED,
            "Mean latency": _TIMED,
        },
        CANARY: {
            "Error rate by arm": _NO_ERRORS,
            "Errors by arm": _NO_ERRORS,
            "Failovers by reason": "no replica fails",
            "Streams cut by arm": _NO_CUT,
        },
    },
    "demo": {
        CANARY: {
            "Custom arm: failed numerical checks per second": _CORRECT,
            "Error rate by arm": "one cut stream: the error series starts at its only "
            "increment, which rate() cannot see (the canary run's killed burst fills it)",
        },
    },
}
