"""The canary against a custom arm broken by the plugin's test-only fault switch.

`FUSELANE_FAULT_INJECT=attention` in the custom arm's environment corrupts fuselane's attention
output (plugin/faults.py), with telemetry checking every call. Mirrored greedy requests then
disagree and the numerical checks fail: the canary must roll the custom arm back.

The custom arm runs fuselane's kernels under Triton's interpreter, every call checked: slow next
to stock, the more so when CI's other worker shares the two cores. So its first-response
timeout is long (as in the shipped CPU config), mirrored copies ask for 4 tokens, and the
dashboards get longer to show the run's shadow comparisons (the first complete some seconds
after the rollback).

(A probe used to run two in-process engines first, to skip the module while fuselane's
attention did not replace vLLM's on the CPU engine; it does now, as tests/plugin/test_engine.py
asserts, and a switch that changed nothing fails the rollback test here.)
"""

import time

import pytest

pytest.importorskip("ray.serve.llm")
pytest.importorskip("vllm")

import httpx
import ray

from fuselane.serving.canary import control
from fuselane.serving.canary.config import parse_config
from tests.grafana import panels

from .conftest import RAY_SYSTEM_CONFIG, SCRAPE_INTERVAL_S, steady_load
from .test_canary import APP, _config, _free_port

pytestmark = pytest.mark.slow

FAULT_ENV = {
    # attention alone keeps TRITON_ATTN's KV write, which the CPU platform cannot run.
    "FUSELANE_KERNELS": "attention,kv_cache",
    "FUSELANE_FAULT_INJECT": "attention",
    "FUSELANE_TELEMETRY": "1",
    "FUSELANE_TELEMETRY_CHECK_RATE": "1.0",
    "FUSELANE_TELEMETRY_FLUSH_S": "0.5",
}
# The shipped CPU config's 180 s is for whole answers under 8 clients; here requests ask for 8
# tokens, one at a time (beside up to 8 mirrored copies of 4).
FIRST_RESPONSE_TIMEOUT_S = 120.0
PANELS_TIMEOUT_S = 180.0


@pytest.fixture(scope="module")
def faulty_canary(tmp_path_factory, ray_metrics):
    from fuselane.serving.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
    port = _free_port()
    ray.init(
        num_cpus=8,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        _metrics_export_port=ray_metrics.port,
        _system_config=RAY_SYSTEM_CONFIG,
        logging_level="ERROR",
        log_to_driver=False,
    )
    try:
        cfg = _config(model, port, custom_env=FAULT_ENV)
        cfg["routing"]["weight"] = 0.5
        cfg["shadow"]["fraction"] = 1.0
        cfg["shadow"]["max_tokens"] = 4
        cfg["failover"]["first_response_timeout_s"] = FIRST_RESPONSE_TIMEOUT_S
        control.deploy(parse_config(cfg), wait_s=420)
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120, trust_env=False)
        yield client
        client.close()
    finally:
        from ray import serve

        serve.shutdown()
        ray.shutdown()


def test_fault_injected_custom_arm_is_rolled_back(faulty_canary):
    deadline = time.monotonic() + 120
    st = control.status(APP)
    i = 0
    while not st["rolled_back"] and time.monotonic() < deadline and i < 80:
        body = {"model": "tiny", "prompt": f"the cache stores {i}", "max_tokens": 8}
        assert faulty_canary.post("/v1/completions", json=body).status_code == 200
        i += 1
        time.sleep(0.3)
        st = control.status(APP)
    assert st["rolled_back"], st
    assert st["rollback"]["reason"] in ("agreement", "numerical_checks"), st["rollback"]
    assert st["weight"] == 0.0
    # both signals are there, whichever crossed its threshold first
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and st["kernel_checks"]["failed_since_reset"] == 0:
        time.sleep(1)
        st = control.status(APP)
    assert st["kernel_checks"]["failed_since_reset"] > 0, st["kernel_checks"]
    # The shadow detector shows its disagreement when it is the one that fired first.
    if st["rollback"]["reason"] == "agreement":
        assert st["shadow"]["compared"] > st["shadow"]["exact"]


def test_dashboards_show_the_faulty_arm(faulty_canary, ray_metrics):
    """The kernels dashboard (Ray Serve source) and the canary dashboard show this run: failed
    checks, mismatches, the rollback (tests/grafana/runs.py)."""
    if ray_metrics.prom is None:
        pytest.skip("no prometheus binary")
    with steady_load(faulty_canary):
        for uid in ("fuselane-kernels", "fuselane-canary"):
            panels.assert_panels_return_data(
                ray_metrics.prom.url,
                "canary-fault",
                panels.load(uid),
                scrape_interval_s=SCRAPE_INTERVAL_S,
                timeout_s=PANELS_TIMEOUT_S,
            )
