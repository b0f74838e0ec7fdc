"""An arm's offline engine: the body of the subprocess that `run_e2e.py --worker offline` runs.

One `vllm.LLM` per process, so that its GPU memory is freed when the process ends: the weights'
re-init and the correctness pass, a warm-up, the throughput workloads, and the lone prefills
(with `--golden` the correctness pass alone); the engine's memory figures after start-up and at
the end (memory.py), and each workload's engine steps by kind (step_profile.py). Each phase's
results go to the result JSON as soon as they exist, so that a crash later in the process keeps
them.
"""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import memory
import prefill_probe
import settings
import step_profile
from arms import Arm, engine_kwargs, trace_dir
from correctness import WEIGHT_SEED, WEIGHT_STD, reinit_weights, run_correctness
from settings import Workload, build_prompts, tokens_prompts


def _sampling(max_tokens: int, **extra: Any) -> Any:
    """The run's sampling (settings.TEMPERATURE / TOP_K / TOP_P / REPETITION_PENALTY) for
    `max_tokens` tokens."""
    from vllm import SamplingParams

    return SamplingParams(
        temperature=settings.TEMPERATURE,
        top_k=settings.TOP_K,
        top_p=settings.TOP_P,
        repetition_penalty=settings.REPETITION_PENALTY,
        max_tokens=max_tokens,
        ignore_eos=True,
        **extra,
    )


def run_workload(llm: Any, wl: Workload) -> dict[str, Any]:
    prompts = build_prompts(wl.num_prompts, wl.input_len, wl.seed)
    sp = _sampling(wl.output_len, detokenize=False)
    t0 = time.perf_counter()
    outs = llm.generate(tokens_prompts(prompts), sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    in_tokens = sum(len(p) for p in prompts)
    return {
        "workload": asdict(wl),
        "wall_s": wall,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "output_tok_s": out_tokens / wall,
        "total_tok_s": (in_tokens + out_tokens) / wall,
        "requests_s": len(outs) / wall,
    }


def run_lone_prefills(llm: Any, arm: Arm, profile: bool) -> dict[str, Any]:
    """`prefill_probe`: lone requests of max_tokens=1 timed per prompt length; with `profile`
    one more each under vLLM's torch profiler, summarized."""
    sp = _sampling(1, detokenize=False)

    def generate_one(prompt: list[int]) -> None:
        llm.generate(tokens_prompts([prompt]), sp, use_tqdm=False)

    lens = settings.LONE_PREFILL_LENS
    out: dict[str, Any] = {
        "latency": prefill_probe.time_prefills(generate_one, build_prompts, lens)
    }
    if profile:
        out["profile"] = prefill_probe.profile_prefills(
            llm.start_profile, llm.stop_profile, generate_one, build_prompts, trace_dir(arm), lens
        )
    return out


def _timed_runs(
    llm: Any,
    arm: Arm,
    workloads: Sequence[Workload],
    profile: bool,
    result: dict[str, Any],
    save: Callable[[], None],
) -> None:
    """The warm-up, the workloads and the lone prefills, into `result` as they finish."""
    # Warm-up: Triton autotune/JIT of any kernel not hit yet, sampler paths.
    t0 = time.perf_counter()
    n, length, warm_tokens = settings.WARMUP
    warm = _sampling(warm_tokens)
    llm.generate(tokens_prompts(build_prompts(n, length, seed=99)), warm, use_tqdm=False)
    result["phases"]["warmup_s"] = time.perf_counter() - t0
    result["offline"] = {}
    for wl in workloads:
        step_profile.take_all(llm)  # the steps before this workload's are not its own
        try:
            result["offline"][wl.name] = run_workload(llm, wl)
            result["offline"][wl.name]["steps"] = step_profile.take_all(llm)
        except Exception as e:  # noqa: BLE001 - recorded, next workload
            result["offline"][wl.name] = {"error": f"{type(e).__name__}: {e}"}
        save()
    t0 = time.perf_counter()
    try:
        result["lone_prefill"] = run_lone_prefills(llm, arm, profile)
    except Exception as e:  # noqa: BLE001 - recorded
        result["lone_prefill"] = {"error": f"{type(e).__name__}: {e}"}
    result["phases"]["lone_prefill_s"] = time.perf_counter() - t0


def worker_offline(
    arm: Arm,
    model: str,
    workloads: Sequence[Workload],
    result_path: Path,
    probe_only: bool = False,
    profile: bool = False,
    golden: bool = False,
) -> int:
    """Subprocess body: one engine; correctness pass, warm-up, workloads, lone prefills; JSON to
    result_path. `probe_only`: warm-up and lone prefills only; `golden`: the correctness pass
    only."""
    result: dict[str, Any] = {"arm": arm.name, "phases": {}}

    def save() -> None:
        result_path.write_text(json.dumps(result))

    try:
        # Before the engine exists: its core process inherits the timers (runner_hooks.py).
        result["memory"] = {"capture_timer": memory.install_capture_timer()}
        result["step_timer"] = step_profile.install()
        from vllm import LLM

        t0 = time.perf_counter()
        llm = LLM(**engine_kwargs(arm, model, profile))
        result["engine_start_s"] = time.perf_counter() - t0
        result["memory"]["after_start"] = memory.probe(llm)
        save()
        if not probe_only:  # the probe times lone requests; the dummy weights serve it
            t0 = time.perf_counter()
            try:
                result["weights"] = llm.collective_rpc(
                    reinit_weights, args=(WEIGHT_SEED, WEIGHT_STD)
                )
            except Exception as e:  # noqa: BLE001 - correctness then runs on the dummy weights
                result["weights"] = f"dummy (re-init failed: {type(e).__name__}: {e})"
            result["correctness"] = run_correctness(llm)
            result["phases"]["correctness_s"] = time.perf_counter() - t0
            save()
        if not golden:
            _timed_runs(llm, arm, [] if probe_only else workloads, profile, result, save)
        result["memory"]["after_run"] = memory.probe(llm)
        result["status"] = "ok"
    except BaseException as e:  # noqa: BLE001 - the parent records it
        result["status"] = "failed"
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc(limit=20)
    save()
    return 0 if result.get("status") == "ok" else 1
