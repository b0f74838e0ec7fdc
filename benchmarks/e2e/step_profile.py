"""The engine's steps during a workload, by kind: prefill, decode, and mixed (both in one step).

A workload's wall time alone does not say which steps an arm wins or loses: its prompts'
prefill, the decode steps, or the steps that carry both. The step timer wraps the model
runner's `execute_model` and `sample_tokens` (vLLM's V1 and V2 runners; `runner_hooks`) in the
engine core's process. A step starts at an `execute_model` call with tokens scheduled (not a
dummy run, not inside a CUDA-graph capture) and ends when `sample_tokens` returns, or when
`execute_model` returns the step's output itself. Per step:

- its kind, from the scheduler's tokens per request: every request one token, decode; every
  request more, prefill; both, mixed;
- the tokens and requests scheduled;
- host seconds inside the two calls (the runner's own host time, not the scheduler's);
- on a GPU, the time between two CUDA events recorded on the runner's stream at the step's
  start and end: the step's span on the GPU's timeline, its work and any wait for the host
  inside it. The start event completes only when the stream reaches it, after the previous
  step's work, so steps do not overlap however far ahead the host runs (async scheduling).

`take(worker)` (through `LLM.collective_rpc`) returns the sums by kind since the last take and
starts anew; `offline.py` takes once before a workload (the warm-up's steps) and once after.
"""

from __future__ import annotations

import functools
import statistics
import time
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import runner_hooks

# The runner modules the step timer wraps (a name of its own: the tests point it elsewhere).
RUNNER_MODULES = runner_hooks.RUNNER_MODULES
# Where a runner keeps its steps: an attribute of the model runner.
STEPS_ATTR = "_e2e_steps"
KINDS = ("prefill", "mixed", "decode")


@dataclass
class Step:
    kind: str
    tokens: int
    requests: int
    host_s: float = 0.0
    events: tuple[Any, Any] | None = None  # CUDA start / end events, on a GPU


@dataclass
class _Steps:
    done: list[Step] = field(default_factory=list)
    open: Step | None = None


def step_kind(num_scheduled_tokens: dict[str, int]) -> str:
    """A step's kind from the scheduler's tokens per request (from the counts alone, a prompt's
    last chunk of a single token reads as decode)."""
    ones = sum(1 for n in num_scheduled_tokens.values() if n == 1)
    if ones == len(num_scheduled_tokens):
        return "decode"
    return "prefill" if ones == 0 else "mixed"


def install() -> dict[str, str]:
    """Wrap the runners' `execute_model` and `sample_tokens`, now or when they are imported.
    Called in the offline engine's process before `LLM()`. Returns per module: "wrapped",
    "on import" or why not."""
    return runner_hooks.wrap_on_import(RUNNER_MODULES, _wrap_runner)


def _steps(runner: Any) -> _Steps:
    steps = getattr(runner, STEPS_ATTR, None)
    if steps is None:
        steps = _Steps()
        setattr(runner, STEPS_ATTR, steps)
    return steps


def _cuda_event(runner: Any) -> Any:
    """A timing event recorded now on the runner's current stream, or None off a GPU."""
    device = getattr(runner, "device", None)
    if getattr(device, "type", None) != "cuda":
        return None
    import torch

    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))
    return event


def _capturing() -> bool:
    try:
        import torch

        return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    except Exception:  # noqa: BLE001 - no CUDA: nothing is captured
        return False


def _close(runner: Any, steps: _Steps, host_s: float) -> None:
    step = steps.open
    steps.open = None
    if step is None:
        return
    step.host_s += host_s
    end = _cuda_event(runner)
    if step.events is not None and end is not None:
        step.events = (step.events[0], end)
    steps.done.append(step)


def _wrap_runner(module: types.ModuleType) -> str:
    """Wrap `module.GPUModelRunner`'s two step methods; never raises (it runs inside vLLM's
    import of the runner)."""
    try:
        cls = module.GPUModelRunner
        execute, sample = cls.execute_model, cls.sample_tokens
        if getattr(execute, "_e2e_steps", False):
            return "wrapped"

        @functools.wraps(execute)
        def execute_model(
            self: Any, scheduler_output: Any, *args: Any, __fn: Callable = execute, **kwargs: Any
        ) -> Any:
            scheduled = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
            timed = bool(scheduled) and not kwargs.get("dummy_run") and not _capturing()
            steps = _steps(self)
            steps.open = None  # a step whose sample_tokens never came (an error) is dropped
            if timed:
                start = _cuda_event(self)
                steps.open = Step(
                    kind=step_kind(scheduled),
                    tokens=sum(scheduled.values()),
                    requests=len(scheduled),
                    events=(start, None) if start is not None else None,
                )
            t0 = time.perf_counter()
            out = __fn(self, scheduler_output, *args, **kwargs)
            if steps.open is not None:
                if out is None:  # sample_tokens finishes the step
                    steps.open.host_s += time.perf_counter() - t0
                else:
                    _close(self, steps, time.perf_counter() - t0)
            return out

        @functools.wraps(sample)
        def sample_tokens(self: Any, *args: Any, __fn: Callable = sample, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            out = __fn(self, *args, **kwargs)
            steps = _steps(self)
            if steps.open is not None:
                _close(self, steps, time.perf_counter() - t0)
            return out

        execute_model._e2e_steps = True  # type: ignore[attr-defined]
        cls.execute_model, cls.sample_tokens = execute_model, sample_tokens
        return "wrapped"
    except Exception as e:  # noqa: BLE001 - the timer is optional; the engine must start
        return f"not wrapped: {type(e).__name__}: {e}"


def summarize(done: list[Step]) -> dict[str, Any]:
    """Sums by kind (KINDS, each present only if it ran): steps, tokens, requests, host
    seconds, and on a GPU the steps' GPU seconds and median step in ms."""
    out: dict[str, Any] = {}
    for kind in KINDS:
        steps = [s for s in done if s.kind == kind]
        if not steps:
            continue
        row: dict[str, Any] = {
            "steps": len(steps),
            "tokens": sum(s.tokens for s in steps),
            "requests": sum(s.requests for s in steps),
            "host_s": round(sum(s.host_s for s in steps), 4),
        }
        spans = [s.events[0].elapsed_time(s.events[1]) for s in steps if s.events and s.events[1]]
        if spans and len(spans) == len(steps):
            row["gpu_s"] = round(sum(spans) / 1e3, 4)
            row["gpu_step_ms_p50"] = round(statistics.median(spans), 3)
        out[kind] = row
    return out


def take(worker: Any) -> dict[str, Any]:
    """Runs in each vLLM worker (`LLM.collective_rpc`): `summarize` of the steps since the last
    take, which are then forgotten; {"wrapped": False} where the timer did not reach the
    runner (a spawned engine core)."""
    runner = getattr(worker, "model_runner", None)
    if not getattr(getattr(type(runner), "execute_model", None), "_e2e_steps", False):
        return {"wrapped": False}
    steps = _steps(runner)
    done, steps.done = steps.done, []
    if any(s.events for s in done):
        import torch

        torch.cuda.synchronize(runner.device)  # every end event completed
    return {"wrapped": True, "kinds": summarize(done)}


def take_all(llm: Any) -> dict[str, Any]:
    """`take` of every worker (one per tensor-parallel rank), or the error."""
    try:
        return {"workers": llm.collective_rpc(take)}
    except Exception as e:  # noqa: BLE001 - recorded; the workload's wall time remains
        return {"error": f"{type(e).__name__}: {e}"}


def kinds_of(offline: dict[str, Any]) -> dict[str, Any] | None:
    """The step sums of one arm's workload result (its first worker's: every tensor-parallel
    rank runs the same steps), or None where the timer did not run."""
    workers = ((offline or {}).get("steps") or {}).get("workers") or []
    if not workers or not workers[0].get("wrapped"):
        return None
    return workers[0].get("kinds")


def compare(ref: dict[str, Any], arm: dict[str, Any]) -> dict[str, Any]:
    """Per kind both ran: the reference's seconds / the arm's (GPU where timed, and host), and
    both step counts. Empty where either has no step sums."""
    a, b = kinds_of(arm), kinds_of(ref)
    if not a or not b:
        return {}
    out: dict[str, Any] = {}
    for kind in KINDS:
        if kind not in a or kind not in b:
            continue
        row: dict[str, Any] = {"steps": [b[kind]["steps"], a[kind]["steps"]]}
        for key in ("gpu_s", "host_s"):
            if a[kind].get(key) and b[kind].get(key):
                row[key] = round(b[kind][key] / a[kind][key], 3)
        out[kind] = row
    return out


def lines(report: dict[str, Any]) -> list[str]:
    """Per compared arm and workload: each kind's steps, GPU (else host) seconds of both arms,
    and the ratio (> 1: the arm's steps of that kind took less)."""
    out = []
    arms = report.get("arms", {})
    for name, r in (report.get("ratios") or {}).items():
        ref = arms.get(r["reference"]) or {}
        for wl, by_kind in (r.get("offline_steps") or {}).items():
            a = kinds_of(((arms.get(name) or {}).get("offline") or {}).get(wl) or {}) or {}
            b = kinds_of((ref.get("offline") or {}).get(wl) or {}) or {}
            parts = []
            for kind, c in by_kind.items():
                key = "gpu_s" if "gpu_s" in c else "host_s"
                parts.append(
                    f"{kind} {c['steps'][1]} steps {a[kind][key]:.2f} s against "
                    f"{b[kind][key]:.2f} ({c.get(key, 0):.3f}x)"
                )
            if parts:
                what = "GPU" if any("gpu_s" in c for c in by_kind.values()) else "host"
                out.append(f"steps {wl} {name} vs {r['reference']} ({what}): " + "; ".join(parts))
    return out
