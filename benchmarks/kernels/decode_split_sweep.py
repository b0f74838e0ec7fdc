"""Decode split sweep (GPU): fuselane's two decode kernels at every split count a batch can take.

The decode rule (`kernels/attention/plan.py`) picks a kernel, a schedule and a split count from
the batch shape alone. This script measures what it chose against the alternatives on the
`fuselane bench kernels` grid's decode shapes (uniform contexts, the grid's context for each
batch size, or its ragged draws): the Triton kernel with its two schedules (3 stages,
kv-head-fastest grid; 5 stages, sequence-major) and Hopper's warp-specialized kernel (where it
suits the batch), each at split counts from 1 up to the workspace's limit. Every point's
output is checked against the reference before it is timed (CUDA-graph replay medians). The
Triton kernel is also timed with its balanced split (pieces by length,
`DecodeConfig.split_budget`) at budgets of a quarter to 32 pieces per sequence, on the uniform
shapes and on the grid's ragged batches.

    python -m fuselane.benchmarks.kernels.decode_split_sweep --out DIR [--model NAME ...]
        [--batch B ...] [--ragged chat|loguniform ...] [--kv fp8] [--splits 1,2,4]
        [--factors 0.5,1,4] [--stages 3,5] [--budget SECONDS]

Writes DIR/decode-split-sweep-<gpu>-<date>.json: device, versions, and per case the rule's
plan and every point (kernel, stages, splits, µs, match).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import pathlib
import time

import torch

from fuselane.benchmarks import harness
from fuselane.benchmarks.kernels import attention_workload as aw
from fuselane.benchmarks.kernels.grid import RAGGED_DISTS, SWEEP_MODELS, decode_context
from fuselane.benchmarks.kernels.grid import _budget_tokens as budget_tokens_of_grid
from fuselane.benchmarks.kernels.impls import generator
from fuselane.kernels import attention as attn
from fuselane.kernels._launch import next_pow2

SPLITS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
# Balanced split budgets, in sequences of the batch (budget = factor x B, at least 1).
BUDGET_FACTORS = (0.25, 0.5, 1, 2, 4, 8, 16, 32)
DEFAULT_BATCHES = (1, 2, 4, 8, 16, 24, 32, 48, 64)
SCHEDULES = ((attn.DECODE_STAGES, True), (attn.DECODE_STAGES_PIPELINED, False))


def plans_for(
    p: aw.Problem,
    ws: attn.AttentionWorkspace,
    rule: attn.LaunchPlan,
    splits: tuple[int, ...] = SPLITS,
    factors: tuple[float, ...] = BUDGET_FACTORS,
    schedules: tuple[tuple[int, bool], ...] = SCHEDULES,
) -> list:
    """Every (label, plan) to time: the rule's, then both kernels at each split count of
    `splits` that fits the workspace (the WS kernel only where `decode_ws_config` says it suits
    the batch), then the Triton kernel's balanced split at each budget of `factors` that fits;
    the Triton kernel with each of `schedules` ((stages, kv-head-fastest grid))."""
    q, kc = p.q, p.key_cache
    shape = aw.plan_shape(p, ws)
    triton = attn.plan_launch(max_query_len=1, decode_warp_specialized=False, **shape).decode
    triton = dataclasses.replace(triton, split_budget=0)
    b, hq, head_pad, hkv = len(p.lens), q.shape[1], next_pow2(q.shape[2]), kc.shape[2]
    fit = attn.workspace_splits(attn.split_room(ws), b * hq, head_pad, b * hkv)
    out = [("rule", rule)]
    for stages, head_fast in schedules:
        for s in splits:
            if s <= fit:
                dec = dataclasses.replace(
                    triton, num_stages=stages, head_fast=head_fast, num_splits=s
                )
                out.append((f"triton s{stages}", attn.LaunchPlan(decode=dec, prefill=None)))
    room = attn.workspace_budget(attn.split_room(ws), 1, hq, head_pad, b, hkv)
    for stages, head_fast in schedules:
        for factor in factors:
            budget = max(1, round(factor * b))
            if budget <= room:
                dec = dataclasses.replace(
                    triton, num_stages=stages, head_fast=head_fast, num_splits=1,
                    split_budget=budget,
                )  # fmt: skip
                out.append((f"balanced s{stages}", attn.LaunchPlan(decode=dec, prefill=None)))
    ws_dec = attn.decode_ws_config(**shape)
    if ws_dec is not None and attn.decode_warp_specialized_ok(q, kc, p.value_cache):
        for s in splits:
            if s <= fit:
                dec = dataclasses.replace(ws_dec, num_splits=s)
                out.append(("ws", attn.LaunchPlan(decode=dec, prefill=None)))
    return out


def run_case(model: str, batch: int, ctx: int | str, kv: str, budget_end: float, **which) -> dict:
    """ctx: every sequence's context, or the name of one of the grid's RAGGED_DISTS (its
    draw for this batch size, as the grid's ragged rows). which: `plans_for`'s keywords."""
    m = SWEEP_MODELS[model]
    kv_dtype = aw.FP8 if kv == "fp8" else aw.DTYPE
    lens = RAGGED_DISTS[ctx].draw(batch) if isinstance(ctx, str) else [ctx] * batch
    p = aw.make_problem(
        [1] * batch, lens, generator(torch.device("cuda"), batch * 7919 + sum(lens)),
        hq=m.num_q_heads, hkv=m.num_kv_heads, d=m.head_size, kv_dtype=kv_dtype,
    )  # fmt: skip
    opts = dict(scale=m.head_size**-0.5, sliding_window=m.sliding_window, softcap=m.softcap)
    expected = aw.Expected(p, False, **opts)
    ws = attn.AttentionWorkspace.allocate(
        aw.WS_ROWS, m.num_q_heads, m.head_size, p.q.device, max_splits=aw.WS_SPLITS
    )
    q, kc, vc = p.q, p.key_cache, p.value_cache
    batch_, options = p.bundles(**opts)
    rule = attn.plan_launch(
        max_query_len=1, decode_warp_specialized=attn.decode_warp_specialized_ok(q, kc, vc),
        **aw.plan_shape(p, ws),
    )  # fmt: skip
    nbytes = aw.decode_bytes(p, m.sliding_window)
    points = []
    for label, plan in plans_for(p, ws, rule, **which):
        if time.monotonic() > budget_end:
            break
        d = plan.decode
        point = {
            "label": label,
            "kernel": "ws" if d.warp_specialized else "triton",
            "stages": d.num_stages,
            "splits": d.num_splits,
            "budget": d.split_budget,
            "tile_n": d.tile_n,
        }
        out = aw.nan_like(q)

        def fn(plan=plan, out=out):
            attn.run._run(q, kc, vc, out, batch_, options, ws, plan=plan)

        point.update(aw.checked_point(fn, out, expected))
        if "us" in point:
            point["TBps"] = round(nbytes / (point["us"] * 1e-6) / 1e12, 3)
        points.append(point)
    timed = [pt for pt in points if pt.get("us") is not None and pt["label"] != "rule"]
    best = min(timed, key=lambda pt: pt["us"], default=None)
    rule_us = next((pt.get("us") for pt in points if pt["label"] == "rule"), None)
    print(
        f"{model:16s} B={batch:<4d} ctx={ctx!s:<10s} kv={kv:4s} rule {rule_us} us "
        f"({'ws' if rule.decode.warp_specialized else 'triton'} s{rule.decode.num_stages} "
        f"splits={rule.decode.num_splits} budget={rule.decode.split_budget}); best "
        f"{best and best['us']} us ({best and best['label']} splits={best and best['splits']} "
        f"budget={best and best['budget']})",
        flush=True,
    )
    return {
        "model": model,
        "batch": batch,
        "ctx": ctx,
        "lens": lens if isinstance(ctx, str) else None,
        "kv": kv,
        "bytes": nbytes,
        "rule": dataclasses.asdict(rule.decode),
        "points": points,
    }


def _numbers(kind: type) -> object:
    """argparse type: a comma-separated list of `kind`."""

    def parse(text: str) -> tuple:
        return tuple(kind(x) for x in text.split(",") if x)

    return parse


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=pathlib.Path, required=True)
    ap.add_argument("--model", action="append", choices=sorted(SWEEP_MODELS), default=None)
    ap.add_argument("--batch", action="append", type=int, default=None)
    ap.add_argument("--kv", choices=("bf16", "fp8"), default="bf16")
    ap.add_argument(
        "--ragged",
        action="append",
        choices=sorted(RAGGED_DISTS),
        default=None,
        help="ragged batches of this context distribution instead of uniform ones",
    )
    ap.add_argument("--splits", type=_numbers(int), default=SPLITS, help="e.g. 1,2,4,8")
    ap.add_argument(
        "--factors",
        type=_numbers(float),
        default=BUDGET_FACTORS,
        help="balanced budgets in sequences of the batch, e.g. 0.5,1,4",
    )
    ap.add_argument(
        "--stages",
        type=_numbers(int),
        default=tuple(s for s, _ in SCHEDULES),
        help=f"the Triton kernel's schedules to time, of {[s for s, _ in SCHEDULES]}",
    )
    ap.add_argument("--budget", type=float, default=400.0, help="seconds; later points skipped")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("decode_split_sweep: needs a CUDA GPU")
    end = time.monotonic() + args.budget
    schedules = tuple(sch for sch in SCHEDULES if sch[0] in args.stages)
    budget_tokens = budget_tokens_of_grid()
    cases = []
    for model in args.model or ["llama-3-8b"]:
        for b in args.batch or DEFAULT_BATCHES:
            if time.monotonic() > end:
                break
            for ctx in args.ragged or [decode_context(b, budget_tokens)]:
                cases.append(
                    run_case(
                        model,
                        b,
                        ctx,
                        args.kv,
                        end,
                        splits=args.splits,
                        factors=args.factors,
                        schedules=schedules,
                    )
                )
    args.out.mkdir(parents=True, exist_ok=True)
    gpu = str(harness.device_info()["device"]).lower().replace(" ", "-")
    path = args.out / f"decode-split-sweep-{gpu}-{datetime.date.today()}.json"
    payload = {"device": harness.device_info(), "splits": SPLITS, "cases": cases}
    path.write_text(json.dumps(payload, indent=1))
    print("wrote", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
