"""The sampler hook (plugin/sampler_hook.py) in real CPU engines on the tiny model.

Engines (fresh processes, tests/plugin/sampler_runner.py): float32, FUSELANE_KERNELS=sampling
against a stock engine (vLLM's CPU attention in both, so only the sampler differs), plus the
shared FUSELANE_KERNELS=all engine of test_engine.py (conftest `fuselane_run`).

Tolerances: the fused kernel and vLLM's sampler read the same fp32 logits; greedy picks must be
identical and logprobs agree to fp32 rounding of log-softmax (measured max 6e-7; allowed 1e-5).
Seeded random draws are reproducible run to run but are not stock's (fuselane draws murmur3
Gumbel noise from a seed taken from the request's generator; stock draws from the generator).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from .engines import ENGINE_TIMEOUT_S, engine_env

RUNNER = Path(__file__).resolve().parent / "sampler_runner.py"
LOGPROB_ATOL = 1e-5


def _run(model: Path, out_dir: Path, name: str, kernels: str | None) -> tuple[dict, str]:
    out = out_dir / f"sampler_{name}.json"
    proc = subprocess.run(
        [sys.executable, str(RUNNER), str(model), str(out), "--dtype", "float32"],
        env=engine_env(kernels),
        capture_output=True,
        text=True,
        timeout=ENGINE_TIMEOUT_S,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"engine {name} failed (exit {proc.returncode}):\n{log[-6000:]}"
    return json.loads(out.read_text()), log


@pytest.fixture(scope="module")
def sampler_runs(tiny_model, engine_out) -> tuple[dict, dict, str]:
    """(fused, stock, fused log): the two engines run side by side (one core each)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        fused = pool.submit(_run, tiny_model, engine_out, "fused", "sampling")
        stock = pool.submit(_run, tiny_model, engine_out, "stock", None)
        (f, log), (s, _) = fused.result(), stock.result()
    return f, s, log


def test_fused_sampler_runs_in_the_engine(sampler_runs):
    fused, stock, log = sampler_runs
    assert fused["runner_sampler"] == "FuselaneSampler"
    assert stock["runner_sampler"] == "Sampler"
    for name in ("greedy", "seeded", "mixed"):
        counts = fused["phases"][name]
        assert counts.get("fused", 0) > 0 and not counts.get("stock"), (name, counts)
    assert "sampling kernel active" in log


def test_greedy_tokens_and_logprobs_match_stock(sampler_runs):
    fused, stock, _ = sampler_runs
    assert fused["greedy"] == stock["greedy"]
    for i, (want, got) in enumerate(zip(stock["logprobs"], fused["logprobs"], strict=True)):
        for step, (a, b) in enumerate(zip(want, got, strict=True)):
            assert a.keys() == b.keys(), f"prompt {i} step {step}: top-n ids {b} vs stock {a}"
            for t in a:
                assert abs(a[t] - b[t]) <= LOGPROB_ATOL, (i, step, t, a[t], b[t])


def test_penalties_and_logit_bias_match_stock_on_greedy_rows(sampler_runs):
    fused, stock, _ = sampler_runs
    # Rows 1 (logit bias) and 2 (repetition/frequency/presence penalties) are greedy.
    assert fused["mixed"][1:] == stock["mixed"][1:]
    assert fused["bias_token"] not in fused["mixed"][1]


def test_seeded_sampling_is_reproducible(sampler_runs):
    fused, _, _ = sampler_runs
    first, second = fused["sampled"]
    assert first == second, "the same seeds gave different samples"
    assert len({tuple(s) for s in first}) > 1, "different prompts/seeds gave the same sample"


def test_unsupported_feature_goes_to_stock_and_answers(sampler_runs):
    fused, stock, _ = sampler_runs
    counts = fused["phases"]["allowed_token_ids"]
    assert counts.get("stock:allowed_token_ids", 0) > 0 and not counts.get("fused"), counts
    assert fused["allowed"] == stock["allowed"]
    assert set(fused["allowed"][0]) <= set(fused["allowed_ids"])


def test_all_runs_the_fused_sampler(fuselane_run):
    result, log = fuselane_run
    assert result["counts"].get("fuselane.kernels.sampling.fused_sample", 0) > 0, result["counts"]
    assert "sampling kernel active" in log


HOOK_PROCESS = textwrap.dedent(
    """
    import json, sys
    early = sys.argv[1] == "early"
    if early:
        from vllm.v1.worker import gpu_model_runner as m
    from vllm.plugins import load_general_plugins
    import fuselane.plugin as plugin
    loaded_before = "vllm.v1.worker.gpu_model_runner" in sys.modules
    from vllm.v1.sample.sampler import Sampler
    load_general_plugins()
    from vllm.v1.worker import gpu_model_runner as m
    ours = m.Sampler
    plugin.register()
    again = m.Sampler is ours
    plugin.unregister()
    restored = m.Sampler is Sampler
    plugin.register()
    reinstalled = m.Sampler is not Sampler and issubclass(m.Sampler, Sampler)
    print(json.dumps({
        "name": ours.__name__, "subclass": issubclass(ours, Sampler), "again": again,
        "restored": restored, "reinstalled": reinstalled, "loaded_before": loaded_before,
    }))
    """
)


def test_hook_installs_once_and_unregister_restores(sampler_runs):
    """In the fused engine's process (runner module imported after the plugin loaded: the
    post-import hook) and in a fresh process that imported the runner module first."""
    fused, stock, _ = sampler_runs
    want = {"again": True, "restored": True, "reinstalled": True}
    assert fused["hook"] == want
    assert stock["runner_sampler"] == "Sampler"  # FUSELANE_KERNELS unset: no hook
    proc = subprocess.run(
        [sys.executable, "-c", HOOK_PROCESS, "early"],
        env=engine_env("sampling"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen == {
        "name": "FuselaneSampler",
        "subclass": True,
        **want,
        "loaded_before": True,
    }
