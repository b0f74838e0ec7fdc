"""The e2e script's lone-prefill probe: timing per length and the profiler-trace summary."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "e2e"))
import prefill_probe


def _prompts(num: int, length: int, seed: int) -> list[list[int]]:
    return [[seed * 100 + i] * length for i in range(num)]


def test_time_prefills_fresh_prompt_per_request_first_untimed():
    seen: list[tuple[int, int]] = []
    out = prefill_probe.time_prefills(lambda p: seen.append((len(p), p[0])), _prompts, (3, 5), 4)
    assert sorted(out) == ["3", "5"] and out["3"]["requests"] == 4
    assert [n for n, _ in seen] == [3] * 5 + [5] * 5
    assert len({first for _, first in seen}) == 10  # every request its own prompt
    for v in out.values():
        assert v["min_ms"] <= v["median_ms"] <= v["max_ms"]


def _write_trace(path: Path, kernels: list[tuple[str, float, float]], cpu: int = 3) -> None:
    ev = [{"cat": "kernel", "name": n, "ts": ts, "dur": d} for n, ts, d in kernels]
    ev += [{"cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 5.0}] * cpu
    ev += [
        {"cat": "cuda_runtime", "name": n, "ts": 0.0, "dur": 1.0}
        for n in ("cudaLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch", "cudaMemcpyAsync")
    ]
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": ev}, f)


def test_summarize_trace_busy_counts_overlaps_once(tmp_path):
    p = tmp_path / "w.pt.trace.json.gz"
    # [0, 10) and [5, 12) overlap -> busy 12; gap to [20, 30) -> span 30, idle 8
    _write_trace(p, [("gemm", 0.0, 10.0), ("attn", 5.0, 7.0), ("gemm", 20.0, 10.0)])
    s = prefill_probe.summarize_trace(p)
    assert (s["kernels"], s["span_us"], s["busy_us"], s["idle_us"]) == (3, 30.0, 22.0, 8.0)
    assert [(t["name"], t["calls"], t["total_us"]) for t in s["top"]] == [
        ("gemm", 2, 20.0),
        ("attn", 1, 7.0),
    ]
    assert s["top_cpu_ops"] == [{"name": "aten::mm", "calls": 3, "total_us": 15.0, "mean_us": 5.0}]
    assert (s["kernel_launches"], s["graph_launches"]) == (2, 1)
    cpu_only = tmp_path / "f.pt.trace.json.gz"
    _write_trace(cpu_only, [])
    assert prefill_probe.summarize_trace(cpu_only)["kernels"] == 0


def test_profile_prefills_reads_the_new_gpu_trace(tmp_path):
    trace_dir = tmp_path / "traces"
    trace_dir.mkdir()
    _write_trace(trace_dir / "old.pt.trace.json.gz", [("stale", 0.0, 99.0)])
    state = {}

    def start(prefix: str) -> None:
        state["prefix"] = prefix

    def stop() -> None:
        # the frontend's CPU-only trace and the worker's GPU trace, as vLLM writes them
        _write_trace(trace_dir / f"{state['prefix']}_front.pt.trace.json.gz", [])
        _write_trace(trace_dir / f"{state['prefix']}_w.pt.trace.json.gz", [("k", 0.0, 4.0)])

    out = prefill_probe.profile_prefills(start, stop, lambda p: None, _prompts, trace_dir, (8,))
    assert out["8"]["trace"] == "prefill8_w.pt.trace.json.gz" and out["8"]["busy_us"] == 4.0
    missing = prefill_probe.profile_prefills(
        lambda _: None, lambda: None, lambda p: None, _prompts, trace_dir, (8,)
    )
    assert "no GPU trace" in missing["8"]["error"]
