"""Memory and start-up figures of an arm's engine, and the check of a fuselane arm's against its
reference's: the KV-cache capacity must be at least the same (the kernels allocate nothing, so
vLLM's profiling must leave the cache as much memory as with its own backend), and the CUDA-graph
capture may take at most CAPTURE_RATIO times the reference's.

Three sources, all read after the engine started:
- the worker, through `LLM.collective_rpc(engine_memory)`: `num_gpu_blocks` and the block size
  from its cache config, torch's peak allocated / reserved GPU memory in that process (since
  vLLM's memory profiling reset the peaks: weights + KV cache + the largest activations);
- a timer around the model runner's `capture_model` (`install_capture_timer`, through
  `runner_hooks`): vLLM logs the capture time in whole seconds (`%.0f secs`), too coarse to
  compare captures of 3-10 s within 20%;
- the engine log (`parse_memory_log`): what vLLM prints at start-up, LOG_FIGURES below. The
  formats are those of vLLM 0.26 and 0.33 (the same printf strings in both unless noted), read
  from their sources: vllm/v1/worker/gpu_worker.py, gpu_model_runner.py, gpu/model_runner.py,
  v1/core/kv_cache_utils.py, v1/engine/core.py.
"""

from __future__ import annotations

import functools
import re
import time
import types
from collections.abc import Callable
from typing import Any

import runner_hooks

GIB = float(1 << 30)
# A fuselane arm's capture may take at most this times its reference's.
CAPTURE_RATIO = 1.2
# Where the capture timer leaves its measurement: an attribute of the model runner.
CAPTURE_ATTR = "_e2e_capture"
# The runner modules the capture timer wraps (a name of its own: the tests point it elsewhere).
RUNNER_MODULES = runner_hooks.RUNNER_MODULES

_NUM = r"(-?[0-9][0-9,]*(?:\.[0-9]+)?)"


def _last(values: list[float]) -> float:
    return values[-1]


# figure (its unit in its name): (regex, how several ranks' lines combine). With tensor
# parallelism every worker logs its own line (info_once is per process): capture and loading
# take the slowest / largest rank, the KV figures the smallest (the scheduler sizes the pool
# from it).
LOG_FIGURES: dict[str, tuple[str, Callable[[list[float]], float]]] = {
    # 0.26 / 0.33: "Available KV cache memory: 59.12 GiB" (format_gib: round(x, 2))
    "available_kv_cache_gib": (rf"Available KV cache memory: {_NUM} GiB", min),
    # 0.26: "GPU KV cache size: 484,016 tokens"; 0.33: the same, then ", Maximum concurrency
    # for ..." on the same line ("GPU + host KV cache size" with a host tier; "CPU" on CPUs)
    "kv_cache_tokens": (rf"KV cache size: {_NUM} tokens", min),
    # 0.26: its own line; 0.33: after the size: "Maximum concurrency for 8,704 tokens per
    # request: 55.61x"
    "max_concurrency": (rf"Maximum concurrency for {_NUM} tokens per request: {_NUM}x", min),
    # 0.26 / 0.33, V1 and V2 runners: "Graph capturing finished in 5 secs, took 0.53 GiB".
    # 0.33's V2 runner also logs it for the capture made while profiling memory, before the
    # serving one: the last line is the serving capture.
    "graph_capture_s": (rf"Graph capturing finished in {_NUM} secs", _last),
    "graph_capture_gib": (rf"Graph capturing finished in {_NUM} secs, took {_NUM} GiB", _last),
    # V1 runner, with the memory profiler's estimate: "CUDA graph pool memory: 0.52 GiB
    # (actual), 0.55 GiB (estimated), difference: ..."
    "graph_pool_gib": (rf"CUDA graph pool memory: {_NUM} GiB \(actual\)", max),
    "graph_pool_estimated_gib": (rf"GiB \(actual\), {_NUM} GiB \(estimated\)", max),
    # V1: "Model loading took 14.99 GiB memory and 3.2 seconds"; 0.26's V2 runner: "... GiB and"
    "model_loading_gib": (rf"Model loading took {_NUM} GiB", max),
    # "... 1.23 GiB for peak activation, ..." (the "Free memory on device ..." summary line)
    "peak_activation_gib": (rf"{_NUM} GiB for peak activation", max),
    # "init engine (profile, create kv cache, warmup model) took 57.71 s (compilation: 21.3 s)"
    "init_engine_s": (rf"\(profile, create kv cache, warmup model\) took {_NUM} s", max),
    "compilation_s": (rf"warmup model\) took {_NUM} s \(compilation: {_NUM} s", max),
}


# fuselane's start-up compilation (plugin/warmup.py): "fuselane: attention kernels compiled for
# 17 launch configurations in 9.8 s (8 threads) and loaded in 2.0 s (start-up, before serving)".
FUSELANE_STARTUP = (
    rf"fuselane: \w+ kernels compiled for \d+ launch configurations in {_NUM} s .*? "
    rf"and loaded in {_NUM} s"
)
CAPTURE_START = "Capturing CUDA graphs"
CAPTURE_END = "Graph capturing finished in"


def parse_memory_log(text: str) -> dict[str, float]:
    """The LOG_FIGURES an engine log holds (a figure it lacks is left out). Where a pattern has
    two numbers the figure is the last one. Also `fuselane_compile_in_capture_s`: the seconds of
    fuselane's start-up compilation (compile and load) logged inside vLLM's CUDA-graph capture,
    between its first progress line and its last "finished" line: the kernels compile at the
    first forward that has attention metadata, which is the capture's first warm-up run."""
    found: dict[str, float] = {}
    for name, (pattern, combine) in LOG_FIGURES.items():
        values = [float(m[-1].replace(",", "")) for m in _all(pattern, text)]
        if values:
            found[name] = combine(values)
    start, end = text.find(CAPTURE_START), text.rfind(CAPTURE_END)
    if 0 <= start < end:
        compiled = _all(FUSELANE_STARTUP, text[start:end])
        if compiled:
            found["fuselane_compile_in_capture_s"] = round(
                sum(float(a) + float(b) for a, b in compiled), 2
            )
    return found


def _all(pattern: str, text: str) -> list[tuple[str, ...]]:
    return [m if isinstance(m, tuple) else (m,) for m in re.findall(pattern, text)]


def install_capture_timer() -> dict[str, str]:
    """Time vLLM's `capture_model` (wall seconds, and what it returns: the bytes of the graphs'
    pool) on the runner it runs on; the runner keeps it as CAPTURE_ATTR, `engine_memory` reads
    it. Called in the offline engine's process before `LLM()`; the runner modules are wrapped
    when they are imported (`runner_hooks`). Under spawn the hook is lost and the log's whole
    seconds remain. Returns per module: "wrapped", "on import" or why not."""
    return runner_hooks.wrap_on_import(RUNNER_MODULES, _wrap_capture)


def _wrap_capture(module: types.ModuleType) -> str:
    """Wrap `module.GPUModelRunner.capture_model` with the timer; never raises (it runs inside
    vLLM's import of the runner)."""
    try:
        cls = module.GPUModelRunner
        fn = cls.capture_model
        if getattr(fn, "_e2e_timed", False):
            return "wrapped"

        @functools.wraps(fn)
        def timed(self: Any, *args: Any, __fn: Callable = fn, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            out = __fn(self, *args, **kwargs)
            # 0.33's V2 runner also captures during memory profiling (profile_only=True): the
            # serving graphs are the capture without it.
            if not kwargs.get("profile_only"):
                pool = out / GIB if isinstance(out, int) else None
                setattr(self, CAPTURE_ATTR, {"s": time.perf_counter() - t0, "pool_gib": pool})
            return out

        timed._e2e_timed = True  # type: ignore[attr-defined]
        cls.capture_model = timed
        return "wrapped"
    except Exception as e:  # noqa: BLE001 - the timer is optional; the engine must start
        return f"not wrapped: {type(e).__name__}: {e}"


def engine_memory(worker: Any) -> dict[str, Any]:
    """Runs in each vLLM worker (`LLM.collective_rpc`): its KV-cache blocks, torch's GPU memory
    peaks in the process, and the capture timer's measurement."""
    import torch

    cache = getattr(worker, "cache_config", None) or worker.vllm_config.cache_config
    out: dict[str, Any] = {"num_gpu_blocks": cache.num_gpu_blocks, "block_size": cache.block_size}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        dev = torch.cuda.current_device()
        out.update(
            max_allocated_gib=torch.cuda.max_memory_allocated(dev) / GIB,
            max_reserved_gib=torch.cuda.max_memory_reserved(dev) / GIB,
            allocated_gib=torch.cuda.memory_allocated(dev) / GIB,
            reserved_gib=torch.cuda.memory_reserved(dev) / GIB,
            total_gib=torch.cuda.get_device_properties(dev).total_memory / GIB,
        )
    runner = getattr(worker, "model_runner", None)
    out["capture"] = getattr(runner, CAPTURE_ATTR, None)
    # Whether the timer reached this process (not under spawn), whether or not it captured.
    out["capture_timer"] = getattr(
        getattr(type(runner), "capture_model", None), "_e2e_timed", False
    )
    return out


def probe(llm: Any) -> dict[str, Any]:
    """`engine_memory` of every worker (one per tensor-parallel rank), or the error."""
    try:
        return {"workers": llm.collective_rpc(engine_memory)}
    except Exception as e:  # noqa: BLE001 - recorded; the log's figures remain
        return {"error": f"{type(e).__name__}: {e}"}


def summary(memory: dict[str, Any]) -> dict[str, Any]:
    """One arm's figures from its `memory` record (`after_start` / `after_run` probes, `log`):
    KV blocks and tokens, peak GPU memory, capture time (the timer's where it ran, else the
    log's whole seconds) and capture memory."""
    log = memory.get("log") or {}
    start = (memory.get("after_start") or {}).get("workers") or [{}]
    end = (memory.get("after_run") or {}).get("workers") or start
    out: dict[str, Any] = {
        "num_gpu_blocks": min((w.get("num_gpu_blocks") or 0 for w in start), default=0) or None,
        "block_size": start[0].get("block_size"),
        "kv_cache_tokens": log.get("kv_cache_tokens"),
        "available_kv_cache_gib": log.get("available_kv_cache_gib"),
        "peak_allocated_gib": _max(w.get("max_allocated_gib") for w in end),
        "peak_reserved_gib": _max(w.get("max_reserved_gib") for w in end),
        "peak_allocated_after_start_gib": _max(w.get("max_allocated_gib") for w in start),
        "peak_activation_gib": log.get("peak_activation_gib"),
    }
    timed = [w["capture"] for w in start if w.get("capture")]
    if timed:
        out["capture_s"] = max(c["s"] for c in timed)
        out["capture_source"] = "timer"
        out["capture_gib"] = _max(c.get("pool_gib") for c in timed)
    else:
        out["capture_s"] = log.get("graph_capture_s")
        out["capture_source"] = "log (whole seconds)" if "graph_capture_s" in log else None
        out["capture_gib"] = log.get("graph_capture_gib")
    out["capture_log_s"] = log.get("graph_capture_s")
    out["fuselane_compile_in_capture_s"] = log.get("fuselane_compile_in_capture_s", 0.0)
    out["init_engine_s"] = log.get("init_engine_s")
    return out


def _max(values: Any) -> float | None:
    vals = [v for v in values if v is not None]
    return max(vals) if vals else None


def _ratio(pair: tuple[float | None, float | None]) -> float | None:
    """arm / reference, where both are known and the reference is positive."""
    arm, ref = pair
    return arm / ref if arm is not None and ref is not None and ref > 0 else None


def compare(arm: dict[str, Any], ref: dict[str, Any], name: str, ref_name: str) -> dict[str, Any]:
    """A fuselane arm's `summary` against its reference's: KV capacity at least the
    reference's (blocks, else the log's tokens), capture time within CAPTURE_RATIO; `flags` say
    what is not, with both numbers."""
    flags = []
    kv_key = "num_gpu_blocks" if arm.get("num_gpu_blocks") and ref.get("num_gpu_blocks") else None
    kv_key = kv_key or ("kv_cache_tokens" if arm.get("kv_cache_tokens") else None)
    kv = (arm.get(kv_key), ref.get(kv_key)) if kv_key else (None, None)
    kv_equal = None if None in kv else kv[0] == kv[1]
    # Fewer blocks is a cost to users (less concurrency); more is not (vLLM sized the cache
    # after a smaller CUDA-graph pool, as with `all` on the V1 runner: 0.13 against 0.42 GiB).
    kv_ok = None if None in kv else kv[0] >= kv[1]
    if kv_ok is False:
        flags.append(f"{name}: KV cache {kv[0]:,.0f} {kv_key} < {ref_name}'s {kv[1]:,.0f}")
    # Both from the timer, else both from the log (a timer lost under spawn in one arm only).
    source = arm.get("capture_source")
    key = "capture_s" if source == ref.get("capture_source") else "capture_log_s"
    if key == "capture_log_s":
        source = "log (whole seconds)"
    # The capture itself, without the start-up compilation that ran inside it (a cost of its
    # own, reported beside it and in the whole engine start, init_engine_s).
    compile_s = tuple(m.get("fuselane_compile_in_capture_s") or 0.0 for m in (arm, ref))
    raw = (arm.get(key), ref.get(key))
    cap = tuple(None if c is None else max(0.0, c - x) for c, x in zip(raw, compile_s, strict=True))
    ratio = _ratio(cap)
    capture_ok = None if ratio is None else ratio <= CAPTURE_RATIO
    if capture_ok is False:
        within = f" ({compile_s[0]:.1f} s of start-up compilation left out)" if compile_s[0] else ""
        flags.append(
            f"{name}: CUDA-graph capture {cap[0]:.2f} s{within} vs {ref_name}'s {cap[1]:.2f} s "
            f"({ratio:.2f}x > {CAPTURE_RATIO}x)"
        )
    init = (arm.get("init_engine_s"), ref.get("init_engine_s"))
    return {
        "reference": ref_name,
        "kv": {"key": kv_key, "arm": kv[0], "reference": kv[1], "equal": kv_equal, "ok": kv_ok},
        "capture_s": {"arm": cap[0], "reference": cap[1], "ratio": ratio, "ok": capture_ok},
        "capture_with_compilation_s": {"arm": raw[0], "reference": raw[1]},
        "fuselane_compile_in_capture_s": compile_s[0],
        "init_engine_s": {
            "arm": init[0],
            "reference": init[1],
            "ratio": _ratio(init),
        },
        "capture_source": source,
        "flags": flags,
    }
