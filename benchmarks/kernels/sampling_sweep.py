"""The sampling script's tuning sections (bench_sampling): the launch-configuration sweep and
the per-kernel profile, to set the table in kernels/sampling/plan.py from measurements.

The sweep times `fused_sample` at other chunk sizes / warps / register caps than the launch rule
picks (each point checked first; penalty cases with writable logits, as timed) until the run's
budget; the profile gives the device time per kernel of the rule's launch (which of the two
launches holds the time).
"""

from __future__ import annotations

import torch

from fuselane.benchmarks.kernels.sampling_sections import Runner, checked_time
from fuselane.benchmarks.kernels.sampling_workload import (
    CASES,
    case_name,
    make_logits,
    make_params,
)
from fuselane.kernels import sampling as smp

SWEEP = {  # (chunk or 0 = the rule's, warps or 0 = the rule's, maxnreg or 0); base cases
    256: [(4096, 4, 128), (4096, 8, 0), (2048, 4, 0)],
    32: [(4096, 8, 0), (1024, 4, 0)],
    1: [(2048, 4, 0), (2048, 8, 0)],
}
SWEEP_PEN = {  # the same with penalties (written in place, as timed) and min-p
    256: [(4096, 4, 128), (4096, 8, 0), (2048, 4, 0)],
    32: [(4096, 8, 0), (1024, 4, 0)],
    1: [(2048, 4, 0)],
}


def run_profile(run: Runner, gen: torch.Generator) -> None:
    """Device time per kernel of the rule's launch, from the CUDA profiler (which launch of
    the two holds the time)."""
    from torch.profiler import ProfilerActivity, profile

    dev = run.device
    for B, V in sorted(CASES, reverse=True):
        for pen in (False, True):
            x = make_logits(B, V, gen, dev)
            prm = make_params(B, V, gen, dev, pen=pen)
            ws = smp.SamplingWorkspace.allocate(B, V, dev, max_logprobs=5, arith=run.arith)
            for _ in range(3):
                smp.fused_sample(x, prm, workspace=ws, num_logprobs=None)
            torch.cuda.synchronize()
            calls = 20
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(calls):
                    smp.fused_sample(x, prm, workspace=ws, num_logprobs=None)
                torch.cuda.synchronize()
            parts = []
            for ev in prof.key_averages():
                us = getattr(ev, "device_time_total", 0) or 0
                if us > 0:
                    parts.append(f"{ev.key[:40]} {us / calls:.1f} us")
            run.note(f"profile {case_name(B, V, pen)}: " + "; ".join(parts))


def run_sweep(run: Runner, gen: torch.Generator) -> None:
    """Every case's sweep points (largest batch first) until the run's budget."""
    for B, V in sorted(CASES, reverse=True):
        for pen in (False, True):
            points = SWEEP_PEN.get(B, []) if pen else SWEEP[B]
            if points:
                sweep_case(run, gen, B, V, pen, points)
            if run.elapsed() > run.budget:
                run.note(f"sweep stopped at {run.elapsed():.0f} s (budget {run.budget:.0f} s)")
                return


def sweep_case(
    run: Runner,
    gen: torch.Generator,
    B: int,
    V: int,
    pen: bool,
    points: list[tuple[int, int, int]],
) -> None:
    """Time `fused_sample` at other launch configurations (chunk, warps, register cap) than
    the rule's, each checked first (penalty cases: logits writable, as timed)."""
    dev = run.device
    x = make_logits(B, V, gen, dev)
    prm = make_params(B, V, gen, dev, pen=pen)
    name = case_name(B, V, pen)
    rule_chunk, rule_warps, _ = smp.pick_launch(B, V, penalties=pen)
    for chunk, warps, maxnreg in points:
        if run.elapsed() > run.budget:
            return
        chunk, warps = chunk or rule_chunk, warps or rule_warps
        impl = f"fuselane chunk={chunk} warps={warps}" + (f" maxnreg={maxnreg}" if maxnreg else "")
        try:
            ws = smp.SamplingWorkspace.allocate(
                B,
                V,
                dev,
                max_logprobs=5,
                arith=run.arith,
                chunk=chunk,
                chunk_warps=warps,
                maxnreg=maxnreg or None,
            )
            checked_time(run, name, impl, x, prm, ws, pen)
        except Exception as e:  # noqa: BLE001 - keep the other configurations
            run.note(f"sweep {name} {impl}: {e!r}")
            torch.cuda.synchronize()
