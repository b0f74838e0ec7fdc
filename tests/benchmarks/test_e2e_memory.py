"""run_e2e's memory figures: the log parsing (vLLM 0.26 and 0.33 lines, and the printf strings in
their wheels where `.vllm-targets/<version>` holds them), the capture timer, the per-arm summary
and the check of a fuselane arm against its reference, in the report and its table."""

from __future__ import annotations

import ast
import multiprocessing
import re
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from tests.benchmarks import test_e2e_script
from tests.benchmarks.test_e2e_script import REPO

# The script loaded by path, as its own tests load it (a fixture).
e2e = test_e2e_script.e2e


@pytest.fixture(scope="module")
def memory(e2e):
    import memory  # put on sys.path by run_e2e, as the script's other parts

    return memory


PREFIX = "(EngineCore_DP0 pid=4242) INFO 11-26 10:00:{:02d} [{}] "
# Start-up lines as vLLM 0.26 prints them on a GPU (V2 runner, its default there), TP=1.
LOG_026 = [
    ("gpu/model_runner.py:306", "Model loading took 14.99 GiB and 3.123456 seconds"),
    ("gpu_worker.py:561", "Available KV cache memory: 101.82 GiB"),
    ("kv_cache_utils.py:2177", "GPU KV cache size: 833,968 tokens"),
    ("kv_cache_utils.py:2179", "Maximum concurrency for 8,704 tokens per request: 95.81x"),
    ("gpu/model_runner.py:748", "Graph capturing finished in 5 secs, took 0.53 GiB"),
    (
        "gpu_worker.py:856",
        "Free memory on device (139.3/139.81 GiB) on startup. Desired GPU memory utilization is "
        "(0.85, 118.84 GiB). Actual usage is 14.99 GiB for weight, 1.87 GiB for peak activation, "
        "0.26 GiB for non-torch memory, and 0.53 GiB for CUDAGraph memory. Replace "
        "gpu_memory_utilization config with `--kv-cache-memory=1` (1.0 GiB) to fit ...",
    ),
    (
        "core.py:341",
        "init engine (profile, create kv cache, warmup model) took 57.71 s (compilation: 21.32 s)",
    ),
]
# vLLM 0.33, V2 runner: the size and the concurrency on one line; a capture while profiling
# memory before the serving one; the graph pool line; the new summary wording.
LOG_033 = [
    ("gpu_model_runner.py:5089", "Model loading took 14.99 GiB memory and 2.5 seconds"),
    ("gpu/model_runner.py:1164", "Graph capturing finished in 9 secs, took 0.70 GiB"),
    ("gpu_worker.py:773", "Available KV cache memory: 100.5 GiB"),
    (
        "kv_cache_utils.py:1148",
        "GPU KV cache size: 823,296 tokens, Maximum concurrency for 8,704 tokens per request: "
        "94.59x",
    ),
    ("gpu/model_runner.py:1164", "Graph capturing finished in 4 secs, took 0.61 GiB"),
    (
        "gpu_worker.py:1004",
        "CUDA graph pool memory: 0.61 GiB (actual), 0.66 GiB (estimated), difference: 0.05 GiB "
        "(8.2%).",
    ),
    (
        "gpu_worker.py:1060",
        "Free memory on device (139.3/139.81 GiB) on startup. ... Actual usage is 15.2 GiB for "
        "consumed memory (weights + non-torch), 2.1 GiB for peak activation, and 0.61 GiB for "
        "CUDAGraph memory. Replace ...",
    ),
    ("core.py:413", "init engine (profile, create kv cache, warmup model) took 49.20 s"),
]


def _log(lines: list[tuple[str, str]]) -> str:
    return "\n".join(PREFIX.format(i, where) + msg for i, (where, msg) in enumerate(lines))


def test_parse_vllm_026_log(memory):
    got = memory.parse_memory_log(_log(LOG_026) + "\nunrelated line 12 GiB\n")
    assert got == {
        "model_loading_gib": 14.99,
        "available_kv_cache_gib": 101.82,
        "kv_cache_tokens": 833968,
        "max_concurrency": 95.81,
        "graph_capture_s": 5,
        "graph_capture_gib": 0.53,
        "peak_activation_gib": 1.87,
        "init_engine_s": 57.71,
        "compilation_s": 21.32,
    }


def test_parse_vllm_033_log(memory):
    got = memory.parse_memory_log(_log(LOG_033))
    assert got["kv_cache_tokens"] == 823296 and got["max_concurrency"] == 94.59
    # the serving capture is the last one logged, not the one made while profiling
    assert (got["graph_capture_s"], got["graph_capture_gib"]) == (4, 0.61)
    assert (got["graph_pool_gib"], got["graph_pool_estimated_gib"]) == (0.61, 0.66)
    assert (got["peak_activation_gib"], got["init_engine_s"]) == (2.1, 49.2)
    assert "compilation_s" not in got and memory.parse_memory_log("nothing here") == {}


def test_parse_tensor_parallel_log_takes_the_smallest_pool(memory):
    ranks = "\n".join(
        f"(Worker_TP{r} pid={r}) INFO [gpu_worker.py:561] Available KV cache memory: {g} GiB"
        for r, g in ((0, 50.31), (1, 50.12))
    )
    assert memory.parse_memory_log(ranks)["available_kv_cache_gib"] == 50.12


# The printf strings in the wheels, found by a phrase and their number of arguments, and the
# arguments each is rendered with: the parser must read back what vLLM itself would print.
WHEEL_MESSAGES = (
    ("Available KV cache memory", ("101.82",), {"available_kv_cache_gib": 101.82}),
    ("KV cache size", ("833,968",), {"kv_cache_tokens": 833968}),  # 0.26
    ("KV cache size", ("GPU", "833,968", "8,704", 95.81), {"kv_cache_tokens": 833968}),  # 0.33
    ("Maximum concurrency for", ("8,704", 95.81), {"max_concurrency": 95.81}),
    ("Graph capturing finished", (5.4, 0.534), {"graph_capture_s": 5, "graph_capture_gib": 0.53}),
    ("CUDA graph pool memory", (0.61, 0.66, 0.05, 8.2), {"graph_pool_gib": 0.61}),
    ("Model loading took", ("14.99", 3.1), {"model_loading_gib": 14.99}),
    ("warmup model) took", (57.71, 21.32), {"init_engine_s": 57.71, "compilation_s": 21.32}),
)
WHEEL_FILES = (
    "vllm/v1/worker/gpu_worker.py",
    "vllm/v1/worker/gpu_model_runner.py",
    "vllm/v1/worker/gpu/model_runner.py",
    "vllm/v1/core/kv_cache_utils.py",
    "vllm/v1/engine/core.py",
)


def _logged_formats(path: Path) -> list[str]:
    """The constant first arguments of the logger calls in a source file (the parser joins
    adjacent string literals, as Python does)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("info", "info_once", "warning", "debug")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            out.append(node.args[0].value)
    return out


@pytest.mark.parametrize("version", ["0.26", "0.33"])
def test_the_wheels_printf_strings_parse(memory, version):
    root = REPO / ".vllm-targets" / version
    if not (root / "vllm").is_dir():
        pytest.skip(f"no vLLM {version} tree at .vllm-targets/{version} (see README)")
    formats = [f for rel in WHEEL_FILES for f in _logged_formats(root / rel)]
    seen = set()
    for fmt in formats:
        conversions = len(re.findall(r"%[-0-9.]*[sdf]", fmt))
        for phrase, args, want in WHEEL_MESSAGES:
            if phrase in fmt and conversions == len(args):
                got = memory.parse_memory_log(fmt % args)
                assert {k: got.get(k) for k in want} == want, (version, fmt)
                seen.add(phrase)
    # Every figure the check needs is printed by this version in a form the parser reads.
    needed = {"Available KV cache memory", "KV cache size", "Graph capturing finished"}
    assert needed | {"Model loading took", "warmup model) took"} <= seen, version


RUNNER_SOURCE = """
class GPUModelRunner:
    def capture_model(self, *, profile_only=False):
        return 3 << 29  # 1.5 GiB
"""


def test_capture_timer_wraps_on_import_and_the_probe_reads_it(memory, monkeypatch, tmp_path):
    (tmp_path / "late_runner.py").write_text(RUNNER_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))  # the hook goes again after
    broken = types.ModuleType("broken_runner")
    broken.GPUModelRunner = type("GPUModelRunner", (), {})
    monkeypatch.setitem(sys.modules, "broken_runner", broken)
    monkeypatch.delitem(sys.modules, "late_runner", raising=False)
    monkeypatch.setattr(memory, "RUNNER_MODULES", ("late_runner", "broken_runner"))
    done = memory.install_capture_timer()
    # Not imported here (vLLM's engine core imports it after the fork); an imported module
    # without capture_model is left alone.
    assert done["late_runner"] == "on import" and "late_runner" not in sys.modules
    assert done["broken_runner"].startswith("not wrapped: AttributeError")
    import late_runner

    runner = late_runner.GPUModelRunner()
    runner.capture_model(profile_only=True)  # a profiling capture is not the serving one
    assert not hasattr(runner, memory.CAPTURE_ATTR)
    assert runner.capture_model() == 3 << 29
    captured = getattr(runner, memory.CAPTURE_ATTR)
    assert captured["pool_gib"] == 1.5 and 0 <= captured["s"] < 1
    assert memory.install_capture_timer()["late_runner"] == "wrapped"  # once, not twice
    assert late_runner.GPUModelRunner.capture_model.__wrapped__.__name__ == "capture_model"
    cache = types.SimpleNamespace(num_gpu_blocks=1234, block_size=16)
    worker = types.SimpleNamespace(cache_config=cache, model_runner=runner)
    probe = memory.engine_memory(worker)
    assert (probe["num_gpu_blocks"], probe["block_size"], probe["capture"]) == (1234, 16, captured)
    assert probe["capture_timer"] is True


def _capture_in_child(conn: Any) -> None:
    """A forked child's work: import the runner (the hook wraps it) and capture once."""
    import forked_runner

    runner = forked_runner.GPUModelRunner()
    runner.capture_model()
    conn.send(vars(runner))


def test_capture_timer_reaches_a_forked_engine_core(memory, monkeypatch, tmp_path):
    """vLLM forks its engine core from the offline worker: the hook installed before must wrap
    the runner the child imports."""
    (tmp_path / "forked_runner.py").write_text(RUNNER_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.setattr(memory, "RUNNER_MODULES", ("forked_runner",))
    assert memory.install_capture_timer() == {"forked_runner": "on import"}
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_capture_in_child, args=(child,))
    proc.start()
    got = parent.recv() if parent.poll(60) else None
    proc.join(30)
    assert got and got[memory.CAPTURE_ATTR]["pool_gib"] == 1.5, got
    assert "forked_runner" not in sys.modules  # imported in the child only


def _arm(blocks: int, capture_s: float | None, log_s: float = 5.0) -> dict:
    worker = {"num_gpu_blocks": blocks, "block_size": 16, "max_allocated_gib": 60.0}
    if capture_s is not None:
        worker["capture"] = {"s": capture_s, "pool_gib": 0.5}
    return {
        "status": "ok",
        "memory": {
            "after_start": {"workers": [worker]},
            "after_run": {"workers": [{**worker, "max_allocated_gib": 61.5}]},
            "log": {"graph_capture_s": log_s, "graph_capture_gib": 0.53, "kv_cache_tokens": 1e5},
        },
    }


def test_summary_and_check_flag_kv_and_capture(e2e, memory):
    arms = {"FLASH_ATTN": _arm(52000, 4.0), "fuselane": _arm(52000, 4.6), "TRITON_ATTN": _arm(1, 9)}
    rep = e2e.finish_report({"arms": arms})
    s = arms["fuselane"]["memory"]["summary"]
    assert (s["num_gpu_blocks"], s["capture_s"], s["capture_source"]) == (52000, 4.6, "timer")
    assert (s["peak_allocated_gib"], s["peak_allocated_after_start_gib"]) == (61.5, 60.0)
    check = rep["memory"]["fuselane"]
    assert check["kv"]["equal"] and check["capture_s"]["ratio"] == pytest.approx(1.15)
    assert rep["memory_flags"] == [] and "TRITON_ATTN" not in rep["memory"]  # stock: no check
    # 1.25x the capture time and a smaller KV cache: both flagged, with the two numbers
    arms["fuselane"] = _arm(51000, 5.0)
    rep = e2e.finish_report({"arms": arms})
    assert rep["memory_flags"] == [
        "fuselane: KV cache 51,000 num_gpu_blocks < FLASH_ATTN's 52,000",
        "fuselane: CUDA-graph capture 5.00 s vs FLASH_ATTN's 4.00 s (1.25x > 1.2x)",
    ]
    text = e2e.table(rep)
    assert "memory FLASH_ATTN: KV 52000 blocks x 16" in text
    check_line = "memory check fuselane vs FLASH_ATTN: KV equal False (at least: False), capture"
    assert f"{check_line} 1.25x" in text
    # More blocks than the reference (a smaller graph pool left the cache more): not flagged.
    arms["fuselane"] = _arm(53000, 4.0)
    rep = e2e.finish_report({"arms": arms})
    assert rep["memory"]["fuselane"]["kv"] == {
        "key": "num_gpu_blocks",
        "arm": 53000,
        "reference": 52000,
        "equal": False,
        "ok": True,
    }
    assert rep["memory_flags"] == []
    assert "FLAG: fuselane: KV cache" in text


def test_without_the_timer_the_log_seconds_are_used(e2e):
    arms = {"FLASH_ATTN": _arm(10, None, log_s=5), "fuselane": _arm(10, None, log_s=6)}
    rep = e2e.finish_report({"arms": arms})
    assert arms["fuselane"]["memory"]["summary"]["capture_source"] == "log (whole seconds)"
    assert rep["memory"]["fuselane"]["capture_s"]["ratio"] == pytest.approx(1.2)
    assert rep["memory_flags"] == []
    assert "s (log, whole s)" in e2e.table(rep)
    # The timer in one arm only: both compared by the log's seconds.
    arms["fuselane"] = _arm(10, 9.0, log_s=6)
    rep = e2e.finish_report({"arms": arms})
    assert rep["memory"]["fuselane"]["capture_source"] == "log (whole seconds)"
    assert rep["memory"]["fuselane"]["capture_s"]["ratio"] == pytest.approx(1.2)


def test_start_up_compilation_inside_the_capture_is_left_out_of_its_check(e2e, memory):
    """fuselane compiles its kernels at the first forward with attention metadata, the
    capture's first warm-up run: those seconds (compile and load, from fuselane's log lines
    between the capture's first progress line and its "finished" line) are reported apart and
    left out of the capture check; a compilation logged after the capture is not counted."""
    warm = "fuselane: {} kernels compiled for {} launch configurations in {} s (8 threads) and " \
        "loaded in {} s (start-up, before serving)"  # fmt: skip
    log = _log([
        ("gpu/model_runner.py:306", "Model loading took 14.99 GiB and 3.1 seconds"),
        ("warmup.py:67", warm.format("attention", 3, 0.5, 0.1)),  # an eager run before: not in it
        ("cuda_graph.py:1", "Capturing CUDA graphs (FULL):   0%|          | 0/51"),
        ("warmup.py:67", warm.format("attention", 17, 9.8, 2.0)),
        ("warmup.py:67", warm.format("kv_cache", 3, 0.2, 0.3)),
        ("gpu/model_runner.py:748", "Graph capturing finished in 13 secs, took 0.53 GiB"),
        ("warmup.py:67", warm.format("sampling", 30, 38.5, 1.7)),
        ("core.py:341", "init engine (profile, create kv cache, warmup model) took 60.00 s"),
    ])  # fmt: skip
    got = memory.parse_memory_log(log)
    assert got["fuselane_compile_in_capture_s"] == 12.3 and got["graph_capture_s"] == 13
    assert "fuselane_compile_in_capture_s" not in memory.parse_memory_log(_log(LOG_026))
    fuselane = _arm(52000, 13.3)
    fuselane["memory"]["log"].update(fuselane_compile_in_capture_s=12.3, init_engine_s=60.0)
    ref = _arm(52000, 1.0)
    ref["memory"]["log"]["init_engine_s"] = 50.0
    rep = e2e.finish_report({"arms": {"FLASH_ATTN": ref, "fuselane": fuselane}})
    check = rep["memory"]["fuselane"]
    assert check["capture_s"]["arm"] == pytest.approx(1.0) and check["capture_s"]["ok"]
    assert check["capture_with_compilation_s"] == {"arm": 13.3, "reference": 1.0}
    assert check["init_engine_s"]["ratio"] == pytest.approx(1.2) and rep["memory_flags"] == []
    text = e2e.table(rep)
    assert "12.3 s of it start-up compilation" in text and "engine start 1.20x" in text
    # Slower beyond the compilation: flagged, saying what was left out.
    fuselane["memory"]["log"]["fuselane_compile_in_capture_s"] = 10.0
    rep = e2e.finish_report({"arms": {"FLASH_ATTN": ref, "fuselane": fuselane}})
    assert rep["memory_flags"] == [
        "fuselane: CUDA-graph capture 3.30 s (10.0 s of start-up compilation left out) vs "
        "FLASH_ATTN's 1.00 s (3.30x > 1.2x)"
    ]
