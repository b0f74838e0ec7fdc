"""Time to first token without the server: one request at a time, `max_tokens=1`.

The online runs report TTFT through vLLM's OpenAI server, where queueing, streaming and the
decode steps of other requests add to it. Here an offline engine prefills one prompt and samples
its first token, alone, several times per prompt length: the step time a lone request waits for.
Optionally one such step per length runs under vLLM's torch profiler (the engine was built with
`profiler_config`), and its trace is reduced to what decides the step: the GPU's busy time
against the span of its kernels, and the kernels that took longest.
"""

from __future__ import annotations

import gzip
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Prompt lengths (tokens) and timed requests per length; one untimed request first.
PREFILL_LENS = (512, 2048, 8192)
REPEATS = 8
TOP_KERNELS = 12


def time_prefills(
    generate_one: Callable[[list[int]], None],
    prompts_of: Callable[[int, int, int], list[list[int]]],
    lens: tuple[int, ...] = PREFILL_LENS,
    repeats: int = REPEATS,
) -> dict[str, dict[str, float]]:
    """Median / min / max wall ms of `generate_one` per prompt length. Every request gets a
    prompt of its own (`prompts_of(num, length, seed)`), so no prefix-cache hit shortens it."""
    out: dict[str, dict[str, float]] = {}
    for n in lens:
        prompts = prompts_of(repeats + 1, n, 7000 + n)
        times = []
        for p in prompts:
            t0 = time.perf_counter()
            generate_one(p)
            times.append((time.perf_counter() - t0) * 1e3)
        timed = times[1:]
        out[str(n)] = {
            "median_ms": statistics.median(timed),
            "min_ms": min(timed),
            "max_ms": max(timed),
            "first_ms": times[0],
            "requests": len(timed),
        }
    return out


def trace_files(trace_dir: Path) -> list[Path]:
    return sorted(trace_dir.glob("*.pt.trace.json*"), key=lambda p: p.stat().st_mtime)


def _load_trace(path: Path) -> dict[str, Any]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def summarize_trace(path: Path, top: int = TOP_KERNELS) -> dict[str, Any]:
    """GPU kernels of one torch-profiler trace: their span (first start to last end), the busy
    time within it (overlaps counted once), count, and the `top` names by total time."""
    events = _load_trace(path).get("traceEvents", [])
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    if not kernels:
        return {"trace": path.name, "kernels": 0}
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in kernels)
    busy = 0.0
    cur_lo, cur_hi = spans[0]
    for lo, hi in spans[1:]:
        if lo > cur_hi:
            busy += cur_hi - cur_lo
            cur_lo, cur_hi = lo, hi
        else:
            cur_hi = max(cur_hi, hi)
    busy += cur_hi - cur_lo
    span = spans[-1][1] - spans[0][0]
    runtime = [e for e in events if e.get("cat") == "cuda_runtime"]
    return {
        "trace": path.name,
        "kernels": len(kernels),
        "span_us": span,
        "busy_us": busy,
        "idle_us": span - busy,
        "top": _ranked(kernels, top),
        # host side: where the step's CPU time went (nested ops count in their parents too)
        "top_cpu_ops": _ranked([e for e in events if e.get("cat") == "cpu_op"], top),
        "kernel_launches": sum(1 for e in runtime if "LaunchKernel" in e.get("name", "")),
        "graph_launches": sum(1 for e in runtime if "GraphLaunch" in e.get("name", "")),
    }


def _ranked(events: list[dict[str, Any]], top: int) -> list[dict[str, Any]]:
    by_name: dict[str, list[float]] = {}
    for e in events:
        if "dur" in e:
            by_name.setdefault(e["name"], []).append(float(e["dur"]))
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    return [
        {"name": name[:120], "calls": len(d), "total_us": sum(d), "mean_us": sum(d) / len(d)}
        for name, d in ranked
    ]


def profile_prefills(
    start: Callable[[str], None],
    stop: Callable[[], None],
    generate_one: Callable[[list[int]], None],
    prompts_of: Callable[[int, int, int], list[list[int]]],
    trace_dir: Path,
    lens: tuple[int, ...] = PREFILL_LENS,
) -> dict[str, Any]:
    """One profiled lone prefill per length (a fresh prompt each): the new trace's summary."""
    out: dict[str, Any] = {}
    for n in lens:
        (prompt,) = prompts_of(1, n, 9000 + n)
        before = set(trace_files(trace_dir))  # a folder not made yet globs to nothing
        start(f"prefill{n}")
        generate_one(prompt)
        stop()
        new = [p for p in trace_files(trace_dir) if p not in before]
        # The engine's worker writes its trace; the frontend's (CPU only) has no kernels.
        summaries = [summarize_trace(p) for p in new]
        with_kernels = [s for s in summaries if s.get("kernels")]
        out[str(n)] = with_kernels[0] if with_kernels else {"error": f"no GPU trace in {new}"}
    return out
