"""The attention script's sweeps (bench_attention): fuselane at other launch configurations than
the launch rule picks, run after every goal case in SWEEP_ORDER until BUDGET_S.

- decode_sweep, at every decode case: other (tile, stages, splits, merge as a 2nd launch, grid
  order) of the Triton kernel, and Hopper's warp-specialized kernel's;
- decode_rule: batches between the decode cases, where the rule switches regime, at the rule's
  plan and at the other regime's (or the Triton kernel's, where the rule took Hopper's);
- prefill_sweep, at every prefill length: other (block_m, block_n, warps, stages, grid order).

Every point is checked against the reference before it is timed; decode outputs are checked
again after the graph replays (a race in the fused split merge would show there).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from fuselane.benchmarks.kernels import attention_workload as aw
from fuselane.benchmarks.kernels import family_script
from fuselane.benchmarks.kernels.attention_timing import (
    Runner,
    default_plan,
    fuselane_fn,
    plan_extra,
    recheck,
    time_checked,
    time_flashinfer,
    time_rule,
)
from fuselane.kernels import attention as attn

BUDGET_S = 270.0  # sweeps are skipped past this many seconds (a run must stay under 5 minutes)

# Sweeps (after every goal case). Decode: changes to the Triton kernel's plan, or with
# warp_specialized=True to the Hopper kernel's (bench_decode_sweep). The Triton rule
# (kernels/attention/plan.py, DECODE_STAGES_PIPELINED): 3 stages, two programs per SM,
# kv-head-fastest grid, unless 5 stages with one program per SM fill the unsplit batch's waves
# clearly better; on Hopper, B <= SMs / (4 x Hkv) takes the warp-specialized kernel
# (DECODE_WS_TILE).
DECODE_SWEEP_LARGE_B = [
    dict(head_fast=False),  # run 5's default
    dict(num_stages=5),
    dict(tile_n=64, num_stages=7),
]
DECODE_SWEEP = {
    1: [
        dict(),  # the Triton kernel's rule (the Hopper rule's before 2026-11-26)
        dict(num_stages=5, num_splits=16, head_fast=False),
        # Hopper's warp-specialized decode kernel: `num_stages` K/V slots of `tile_n` tokens
        *(
            dict(warp_specialized=True, tile_n=t, num_stages=b, num_splits=n)
            for t, b, n in ((64, 4, 16), (64, 6, 16), (128, 3, 16), (128, 2, 12), (128, 2, 20))
        ),
    ],
    16: [
        dict(num_splits=2),
        dict(num_stages=3, num_splits=2, head_fast=True),
        *(
            dict(warp_specialized=True, tile_n=t, num_stages=b, num_splits=1)
            for t, b in ((64, 4), (128, 2))
        ),
    ],
    64: DECODE_SWEEP_LARGE_B,
    128: DECODE_SWEEP_LARGE_B,
    256: DECODE_SWEEP_LARGE_B,
}
# Batches between the measured cases, where the rule switches regime (ctx 4096): each timed
# with the rule's plan and with the other regime's plan, or the Triton kernel's plan where the
# rule took the Hopper kernel (decode_rule section).
DECODE_RULE_BATCHES = (2, 4, 8, 24, 32, 40, 48)
# Prefill: (block_m, block_n, num_warps, num_stages, head_fast) at every prefill length; the
# Triton rule picks 256x64, 16 warps, 7 stages, kv-head-fastest grid; on Hopper the
# warp-specialized kernel's PREFILL_WS_TILE (sweep points equal to the rule's config are
# skipped). For the Triton kernel with wgmma the pipeliner keeps one more K/V buffer than for
# mma.sync, but at 3 stages still waits for every copy at the top of each iteration
# (async_wait num=0); 5 stages keep one tile in flight (two buffers), 7 stages two (three
# buffers, 193 KiB at 256x64).
PREFILL_SWEEP = [  # (block_m, block_n, warps, stages, head_fast[, warp-specialized])
    (256, 64, 16, 7, True),  # the Triton kernel's rule (the Hopper rule's before 2026-11-26)
    # Hopper's warp-specialized kernel: two compute warpgroups of block_m / 2 rows (warps = 4
    # per warpgroup), one loader warpgroup, `stages` K/V slots.
    (256, 64, 4, 4, True, True),  # the Hopper rule
    (256, 64, 4, 5, True, True),
    (256, 64, 4, 3, True, True),
    (256, 64, 4, 4, False, True),
]
# Order of the sweeps when the time budget may cut them: most informative first.
SWEEP_ORDER = [
    ("decode", 1),
    ("decode", 16),
    ("prefill", 8192),
    ("decode", 128),
    ("decode", 256),
    ("prefill", 16384),
    ("decode", 64),
    ("prefill", 4096),
]


def decode_label(dec: attn.DecodeConfig) -> str:
    flags = (
        ("" if dec.fused_reduce or dec.num_splits == 1 else ",unfused")
        + (",head_fast" if dec.head_fast else "")
        + (",ws" if dec.warp_specialized else "")
    )
    return (
        f"fuselane[tile={dec.tile_n},w={dec.num_warps},s={dec.num_stages},"
        f"splits={dec.num_splits},budget={dec.split_budget}{flags}]"
    )


def bench_decode_sweep(
    run: Runner, p: aw.Problem, plan: attn.LaunchPlan, nbytes: int, expected: aw.Expected
) -> None:
    section, case = "decode_sweep", aw.decode_case(len(p.lens), p.lens[0])
    out = aw.nan_like(p.q)
    fn = fuselane_fn(run, p, out)
    run.time(section, case, "fuselane", fn, nbytes=nbytes, extra=plan_extra(plan))
    changes = DECODE_SWEEP.get(len(p.lens), DECODE_SWEEP_LARGE_B)
    # Changes apply to the Triton kernel's plan, or (warp_specialized=True) to the
    # warp-specialized kernel's: the rule's, if it took that kernel.
    triton = default_plan(p, run, warp_specialized=False).decode
    ws_base = plan.decode
    if not ws_base.warp_specialized:
        ws_base = dataclasses.replace(
            triton, block_m=attn.DECODE_WS_ROWS, max_q=0, head_fast=False, warp_specialized=True
        )
    points = []
    for change in changes:
        base = ws_base if change.get("warp_specialized") else triton
        dec = dataclasses.replace(base, **change)
        if dec != plan.decode and dec not in points:
            points.append(dec)
    for dec in points:
        if run.elapsed() > BUDGET_S:
            run.peers.note(f"{section}: time budget spent, rest of the sweep skipped")
            return
        label = decode_label(dec)
        sweep_plan = dataclasses.replace(plan, decode=dec)
        fn = fuselane_fn(run, p, out, sweep_plan)
        if time_checked(run, section, case, label, fn, out, expected, sweep_plan, nbytes=nbytes):
            recheck(run, f"{section} {case} {label}", out, expected)


def other_regime(run: Runner, plan: attn.LaunchPlan, p: aw.Problem) -> attn.DecodeConfig:
    """The decode config of the schedule the rule did not pick (3 stages + two programs per SM
    <-> 5 stages + one, each with its own split count; `attn.decode_schedules`)."""
    dec = plan.decode
    schedules = attn.decode_schedules(
        len(p.lens),
        p.q.shape[1],
        p.kv.shape[3],
        p.q.shape[2],
        dec.qpos,
        attn.sm_count(p.q.device),
        attn.split_room(run.workspace),
        p.kv.element_size(),
    )
    _, stages, splits = next(sch for sch in schedules if sch[1] != dec.num_stages)
    head_fast = stages == attn.DECODE_STAGES
    return dataclasses.replace(dec, num_stages=stages, num_splits=splits, head_fast=head_fast)


def bench_decode_rule(run: Runner, pool: torch.Tensor, ok: bool, gen: torch.Generator) -> None:
    """Batches where the rule switches regime: the rule's plan, the other regime's, FlashInfer."""
    if not ok:
        return
    section, ctx = "decode_rule", 4096
    for batch in DECODE_RULE_BATCHES:
        case = aw.decode_case(batch, ctx)
        p = aw.make_problem([1] * batch, [ctx] * batch, gen, kv=pool)
        nbytes = aw.decode_bytes(p)
        expected = aw.Expected(p)
        rule = time_rule(run, section, case, p, expected, True, nbytes=nbytes)
        plan = rule.plan
        if plan.decode.warp_specialized:  # the Triton kernel's plan
            alt = default_plan(p, run, warp_specialized=False)
        else:
            alt = dataclasses.replace(plan, decode=other_regime(run, plan, p))
        label = decode_label(alt.decode)
        fn = fuselane_fn(run, p, rule.out, alt)
        time_checked(run, section, case, label, fn, rule.out, expected, alt, nbytes=nbytes)
        time_flashinfer(run, section, case, p, expected, decode=True, nbytes=nbytes)


def bench_prefill_sweep(
    run: Runner, p: aw.Problem, plan: attn.LaunchPlan, flops: float, expected: aw.Expected
) -> None:
    section, case = "prefill_sweep", aw.prefill_case(p.lens[0])
    out = aw.nan_like(p.q)
    fn = fuselane_fn(run, p, out)
    run.time(section, case, "fuselane", fn, flops=flops, extra=plan_extra(plan))
    for bm, bn, w, s, head_fast, *ws in PREFILL_SWEEP:
        if run.elapsed() > BUDGET_S:
            run.peers.note(f"{section}: time budget spent, rest of the sweep skipped")
            return
        pre = dataclasses.replace(
            plan.prefill,
            block_m=bm,
            block_n=bn,
            num_warps=w,
            num_stages=s,
            head_fast=head_fast,
            warp_specialized=bool(ws),
        )
        if pre == plan.prefill:
            continue
        sweep_plan = dataclasses.replace(plan, prefill=pre)
        flags = (",head_fast" if head_fast else "") + (",ws" if ws else "")
        label = f"fuselane[{bm}x{bn},w={w},s={s}{flags}]"
        fn = fuselane_fn(run, p, out, sweep_plan)
        time_checked(run, section, case, label, fn, out, expected, sweep_plan, flops=flops)


def run_sweeps(run: Runner, sweeps: dict[tuple[str, int], Callable[[], None]]) -> None:
    """The queued sweeps in SWEEP_ORDER (then any other); one failing sweep skips only itself."""
    order = [key for key in SWEEP_ORDER if key in sweeps]
    order += [key for key in sweeps if key not in order]
    for key in order:
        with family_script.guarded(run.peers.note, f"sweep {key}"):
            sweeps[key]()
        print(f"  [{run.elapsed():.0f} s] sweep {key[0]} {key[1]} done", flush=True)
