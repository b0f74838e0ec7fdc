"""The sampling script's tuning sections (bench_sampling): the launch-configuration sweep, the
per-kernel profile and the one-launch sweep, to set the rules in kernels/sampling/plan.py from
measurements.

The sweep times `fused_sample` at other chunk sizes / warps / register caps than the launch rule
picks (each point checked first; penalty cases with writable logits, as timed) until the run's
budget; the profile gives the device time per kernel of the rule's launch (which of the two
launches holds the time). The one-launch sweep (`--one-launch-sweep`) times the one-launch
kernel (`kernels/sampling/row.py`, at each of ONE_LAUNCH_CHUNKS) against the two launches and
FlashInfer at small batches (ONE_LAUNCH_BATCHES x ONE_LAUNCH_VOCABS; top-p 0.95 alone, and
T=0.7 k=50 p=0.9), each fuselane point checked first, to set `plan.use_one_launch`.
"""

from __future__ import annotations

import torch

from fuselane.benchmarks.kernels import family_script
from fuselane.benchmarks.kernels.sampling_sections import Runner, checked_time
from fuselane.benchmarks.kernels.sampling_workload import (
    CASES,
    T,
    case_name,
    compare,
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


ONE_LAUNCH_BATCHES = (1, 2, 4, 8, 16)
ONE_LAUNCH_VOCABS = (32000, 32768, 128256)
ONE_LAUNCH_CHUNKS = (8192, 16384, 32768)  # values a one-launch program holds at once
ONE_LAUNCH_GOAL_US = 12.0  # B <= 8 at V <= 32768, every option mix
TOP_P_ONLY = 0.95


def _one_launch_cases(B: int, V: int, gen: torch.Generator, dev: torch.device):
    """(label, params) of the sweep's two mixes: top-p 0.95 alone (T=0.7), T=0.7 k=50 p=0.9."""
    top_p = make_params(B, V, gen, dev, top_k=None, top_p=torch.full((B,), TOP_P_ONLY, device=dev))
    return [(f"T={T} p={TOP_P_ONLY}", top_p), ("T/k/p", make_params(B, V, gen, dev))]


def run_one_launch_sweep(run: Runner, gen: torch.Generator, fis=None, small: bool = False) -> None:
    """One launch (each chunk of ONE_LAUNCH_CHUNKS up to the row's size) against two launches
    and FlashInfer, per (batch, vocabulary, mix); `fuselane one launch` rows are the rule's
    configuration (`plan.row_launch`). Every fuselane configuration is checked first against
    the reference (a failing one is reported, not timed). small: the CPU smoke run's shapes,
    checks only (no timing)."""
    dev = run.device
    shapes = (
        [(b, v) for b in (1, 3) for v in (1000, 3001)]
        if small
        else [(b, v) for v in ONE_LAUNCH_VOCABS for b in ONE_LAUNCH_BATCHES]
    )
    for B, V in shapes:
        x = make_logits(B, V, gen, dev)
        for label, prm in _one_launch_cases(B, V, gen, dev):
            name = f"one-launch sweep B={B} V={V} {label}"
            rule_chunk = smp.row_launch(V)[0]
            configs = [("fuselane two launches", dict(one_launch=False))]
            configs.append(("fuselane one launch", dict(one_launch=True)))
            for chunk in ONE_LAUNCH_CHUNKS:
                if chunk != rule_chunk and chunk <= max(smp.MIN_CHUNK, 2 * V):
                    configs.append(
                        (f"fuselane one launch chunk={chunk}", dict(one_launch=True, chunk=chunk))
                    )
            if small:
                chunked = ("fuselane one launch chunk=512", dict(one_launch=True, chunk=512))
                configs = [*configs[:2], chunked]
            times: dict[str, float | None] = {}
            for impl, kw in configs:
                try:
                    ws = smp.SamplingWorkspace.allocate(
                        B, V, dev, max_logprobs=5, arith=run.arith, **kw
                    )
                    if small:
                        ok, summary, _ = compare(x, prm, ws)
                        run.line(f"{name} {impl}", ok, summary)
                        continue
                    ok, summary, info = compare(x, prm, ws, num_logprobs=None)
                    if not ok:
                        run.line(f"{name} {impl}", ok, summary)
                        continue
                    times[impl] = run.time(
                        "one_launch",
                        name,
                        impl,
                        lambda ws=ws, x=x, prm=prm: smp.fused_sample(
                            x, prm, workspace=ws, num_logprobs=None
                        ),
                        nbytes=x.numel() * x.element_size(),
                        extra={"fallback_rows_in_check": info["fallback_rows"]},
                    )
                except Exception as e:  # noqa: BLE001 - keep the other configurations
                    run.line(f"{name} {impl}", False, f"raised {e!r}")
            if small:
                continue
            if fis is not None:
                _time_flashinfer(run, fis, name, x, prm)
            one, two = times.get("fuselane one launch"), times.get("fuselane two launches")
            best = min(
                ((t, i) for i, t in times.items() if t and i.startswith("fuselane one")),
                default=None,
            )
            line = f"ONE-LAUNCH {name[len('one-launch sweep ') :]}:"
            line += f" one {one * 1e3:.1f} us" if one else " one not timed"
            line += f", two {two * 1e3:.1f} us" if two else ", two not timed"
            if one and two:
                line += f" ({two / one:.2f}x)"
            if best:
                line += (
                    f"; best one-launch {best[1][len('fuselane one launch') :].strip() or 'rule'}"
                )
                line += f" {best[0] * 1e3:.1f} us"
            if B <= 8 and V <= 32768 and one:
                met = one * 1e3 <= ONE_LAUNCH_GOAL_US
                line += f"; goal <= {ONE_LAUNCH_GOAL_US:.0f} us {'MET' if met else 'MISSED'}"
            print(line, flush=True)
            run.note(line)


def _time_flashinfer(run: Runner, fis, name: str, x: torch.Tensor, prm) -> None:
    """FlashInfer on logits already divided by T (T not timed): top_k_top_p_sampling_from_logits
    with the mix's k (top-p alone: k = V, every token)."""
    V = x.shape[1]
    z = (x / prm.temperature[:, None]).contiguous()
    top_k = prm.top_k if prm.top_k is not None else torch.full_like(prm.seeds, V, dtype=torch.int32)

    def fn():
        return fis.top_k_top_p_sampling_from_logits(z, top_k, prm.top_p, deterministic=True)

    if not family_script.try_run(run.note, f"{name} flashinfer", fn):
        return  # a failing peer is noted, the run goes on
    run.time(
        "one_launch",
        name,
        "flashinfer top_k_top_p_sampling_from_logits",
        fn,
        nbytes=x.numel() * x.element_size(),
    )
