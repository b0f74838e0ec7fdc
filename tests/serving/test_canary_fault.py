"""The canary against a custom arm broken by the plugin's test-only fault switch.

`FUSELANE_FAULT_INJECT=attention` in the custom arm's environment corrupts fuselane's attention
output (plugin/faults.py), with telemetry checking every call. Mirrored greedy requests then
disagree and the numerical checks fail: the canary must roll the custom arm back.

A probe first runs one in-process vLLM engine with the switch (a few seconds): while the
plugin's kernels do not yet replace vLLM's on the CPU engine, the switch changes nothing and
the module is skipped, saying so.
"""

import json
import os
import subprocess
import sys
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

_PROBE = """
import os, sys
from vllm import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="float32", max_model_len=256, enforce_eager=True)
out = llm.generate(["every request writes the keys"], SamplingParams(temperature=0, max_tokens=8))
print("TOKENS", list(out[0].outputs[0].token_ids))
"""


def _probe_tokens(model, env: dict) -> list[int]:
    full = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        # An in-process engine imports Triton before plugins load: choose the interpreter first.
        "TRITON_INTERPRET": "1",
        **env,
    }
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, str(model)],
        env=full,
        capture_output=True,
        text=True,
        timeout=240,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("TOKENS ")]
    if proc.returncode != 0 or not lines:
        pytest.fail(f"probe engine failed ({env}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("TOKENS ") :])


@pytest.fixture(scope="module")
def faulty_canary(tmp_path_factory, ray_metrics):
    from fuselane.serving.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
    if _probe_tokens(model, FAULT_ENV) == _probe_tokens(model, {"FUSELANE_KERNELS": "none"}):
        pytest.skip(
            "FUSELANE_FAULT_INJECT=attention does not change the CPU engine's output yet "
            "(fuselane's attention does not replace vLLM's on the CPU platform)"
        )
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
            )
