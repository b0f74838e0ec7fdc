"""Prefill kernel sweep (GPU): fuselane's two prefill kernels on every head size and option.

The prefill rule (`kernels/attention/plan.py`) gives Hopper's warp-specialized kernel
(`prefill_ws`) the prefill launches at the head sizes `prefill_ws_rule_applies` names. This
script times it against the Triton kernel's plan on one sequence of S tokens (the grid's
prefill case; or a chunk of S tokens after a cached prefix) for a model of the sweeps
(`grid.SWEEP_MODELS`: the grid's and head size 64), with its options or others (a sliding
window, a soft cap, sinks), and at head size 256 also at each register split of
D256_REGISTERS. Every point's output is checked against the reference (a whole prefill at its
first and last rows, a chunk whole) before it is timed (CUDA-graph replay medians).

    python -m fuselane.benchmarks.kernels.prefill_ws_sweep --out DIR --model NAME
        [--window W] [--softcap C] [--sinks] [--seq 1024,4096] [--prefix N] [--kv fp8]
        [--small-tile] [--budget SECONDS]

Writes DIR/prefill-ws-sweep-<gpu>-<date>-<tag>.json: device, versions, and per case the rule's
plan and every point (kernel, tile, µs, TFLOP/s, match).
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
from fuselane.benchmarks.kernels.attention_cases import visible_pairs
from fuselane.benchmarks.kernels.grid import SWEEP_MODELS
from fuselane.benchmarks.kernels.impls import generator
from fuselane.kernels import attention as attn
from fuselane.kernels.attention import prefill_ws

SEQS = (1024, 2048, 4096, 8192, 16384, 32768)
# Register splits (compute warpgroup, loader) timed at head size 256 beside WS_REGISTERS' own.
D256_REGISTERS = ((232, 40), (216, 72))


def plans_for(
    p: aw.Problem, ws: attn.AttentionWorkspace, small_tile: bool = False
) -> list[tuple[str, dict, object]]:
    """(label, register split or {}, plan) of every point: the rule's, the Triton kernel's
    (where the rule took the other) and the warp-specialized kernel's (where it suits the
    heads), at head size 256 once per register split of D256_REGISTERS; `small_tile`: also
    at 128 rows (64 per compute warpgroup; head size <= 128), twice the programs."""
    shape = aw.plan_shape(p, ws)
    max_q = p.q.shape[0]
    rule = attn.plan_launch(max_query_len=max_q, warp_specialized=True, **shape)
    triton = attn.plan_launch(max_query_len=max_q, warp_specialized=False, **shape)
    out: list[tuple[str, dict, object]] = [("rule", {}, rule)]
    if triton != rule:
        out.append(("triton", {}, triton))
    head = p.q.shape[2]
    ws_cfg = attn.prefill_ws_config(
        shape["num_q_heads"], shape["num_kv_heads"], head, triton.prefill.min_q,
        shape["max_smem"], shape["kv_bytes"],
    )  # fmt: skip
    if ws_cfg is not None:
        plan = dataclasses.replace(rule, prefill=ws_cfg)
        splits = D256_REGISTERS if head > 128 else (prefill_ws.WS_REGISTERS[head],)
        for regs in splits:
            out.append((f"ws {regs[0]}/{regs[1]}", {head: regs}, plan))
        group = shape["num_q_heads"] // shape["num_kv_heads"]
        if small_tile and head <= 128 and group <= 128:
            small = dataclasses.replace(ws_cfg, block_m=128)
            out.append(("ws 128 rows", {}, dataclasses.replace(rule, prefill=small)))
    return out


def run_case(
    model: str,
    seq: int,
    options: dict,
    budget_end: float,
    prefix: int = 0,
    kv: str = "bf16",
    small_tile: bool = False,
) -> dict:
    """One sequence of `seq` query tokens after `prefix` cached ones (a chunk of a chunked
    prefill), every point of `plans_for`, on a bf16 or fp8 cache."""
    m = SWEEP_MODELS[model]
    p = aw.make_problem(
        [seq], [prefix + seq], generator(torch.device("cuda"), seq * 31 + m.head_size),
        hq=m.num_q_heads, hkv=m.num_kv_heads, d=m.head_size,
        kv_dtype=aw.FP8 if kv == "fp8" else aw.DTYPE,
    )  # fmt: skip
    opts = dict(scale=m.head_size**-0.5, **options)
    if opts.pop("sinks", False):
        gen = torch.Generator().manual_seed(seq)
        opts["sinks"] = (torch.randn(m.num_q_heads, generator=gen) * 2.0).to(p.q.device)
    # The prefill check (first and last rows) assumes no prefix; a chunk is checked whole.
    expected = aw.Expected(p, prefix == 0, **opts)
    ws = attn.AttentionWorkspace.allocate(
        aw.WS_ROWS, m.num_q_heads, m.head_size, p.q.device, max_splits=aw.WS_SPLITS
    )
    q, kc, vc = p.q, p.key_cache, p.value_cache
    batch, aopts = p.bundles(**opts)
    window = opts.get("sliding_window")
    flops = 4.0 * m.num_q_heads * m.head_size * visible_pairs(seq, prefix + seq, window)
    points = []
    saved = dict(prefill_ws.WS_REGISTERS)
    plans = plans_for(p, ws, small_tile)
    for label, regs, plan in plans:
        if time.monotonic() > budget_end:
            break
        pre = plan.prefill
        point = {
            "label": label,
            "kernel": "ws" if pre.warp_specialized else "triton",
            "tile": [pre.block_m, pre.block_n, pre.num_warps, pre.num_stages],
            "registers": next(iter(regs.values()), None),
        }
        prefill_ws.WS_REGISTERS.update(regs)
        out = aw.nan_like(q)

        def fn(plan=plan, out=out):
            attn.run._run(q, kc, vc, out, batch, aopts, ws, plan=plan)

        point.update(aw.checked_point(fn, out, expected))
        if "us" in point:
            point["TFLOPs"] = round(flops / (point["us"] * 1e-6) / 1e12, 1)
        prefill_ws.WS_REGISTERS.clear()
        prefill_ws.WS_REGISTERS.update(saved)
        points.append(point)
    line = " ".join(f"{pt['label']}={pt.get('us', 'FAIL')}" for pt in points)
    print(f"{model:16s} S={seq:<6d} prefix={prefix:<6d} kv={kv:4s} {_tag(options):24s} {line}",
          flush=True)  # fmt: skip
    rule = plans[0][2].prefill  # the first point is the rule's plan
    return {
        "model": model,
        "seq": seq,
        "prefix": prefix,
        "kv": kv,
        "options": {k: (v if k != "sinks" else True) for k, v in options.items()},
        "flops": flops,
        "rule": dataclasses.asdict(rule),
        "points": points,
    }


def _tag(options: dict) -> str:
    parts = [f"{k}={v:g}" for k, v in options.items() if k != "sinks" and v]
    if options.get("sinks"):
        parts.append("sinks")
    return ",".join(parts) or "plain"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=pathlib.Path, required=True)
    ap.add_argument("--model", choices=sorted(SWEEP_MODELS), required=True)
    ap.add_argument("--window", type=int, default=None, help="sliding window (default: model's)")
    ap.add_argument("--softcap", type=float, default=None, help="soft cap (default: model's)")
    ap.add_argument("--sinks", action="store_true", help="random per-head sinks")
    ap.add_argument("--seq", default=",".join(map(str, SEQS)), help="e.g. 1024,8192")
    ap.add_argument("--prefix", type=int, default=0, help="cached tokens before the query")
    ap.add_argument("--kv", choices=("bf16", "fp8"), default="bf16")
    ap.add_argument("--small-tile", action="store_true", help="also the 128-row Hopper tile")
    ap.add_argument("--budget", type=float, default=300.0, help="seconds; later points skipped")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("prefill_ws_sweep: needs a CUDA GPU")
    m = SWEEP_MODELS[args.model]
    window = m.sliding_window if args.window is None else (args.window or None)
    softcap = m.softcap if args.softcap is None else args.softcap
    options: dict = {"sliding_window": window, "softcap": softcap}
    if args.sinks:
        options["sinks"] = True
    end = time.monotonic() + args.budget
    cases = []
    for seq in (int(x) for x in args.seq.split(",") if x):
        if time.monotonic() > end:
            break
        cases.append(run_case(args.model, seq, options, end, args.prefix, args.kv, args.small_tile))
    args.out.mkdir(parents=True, exist_ok=True)
    gpu = str(harness.device_info()["device"]).lower().replace(" ", "-")
    tag = f"{args.model}-{_tag(options).replace(',', '-').replace('=', '')}"
    if args.prefix:
        tag += f"-prefix{args.prefix}"
    if args.kv != "bf16":
        tag += f"-kv{args.kv}"
    if args.small_tile:
        tag += "-small-tile"
    path = args.out / f"prefill-ws-sweep-{gpu}-{datetime.date.today()}-{tag}.json"
    payload = {"device": harness.device_info(), "cases": cases}
    path.write_text(json.dumps(payload, indent=1))
    print("wrote", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
