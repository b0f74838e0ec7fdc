"""GPU benchmark of the KV-cache update family (kernels/kv_cache.py) against its peers.

On the GPU machine, from the project root:
    source .peers/setup_device.sh
    python3 benchmarks/kernels/bench_kv_cache.py --out $OUT

Order of work, all in one process on one device (~2 minutes on an H200):
  1. ceilings: copy bandwidth (1 GiB device-to-device, timed eagerly) and an empty Triton
     kernel's replay time;
  2. check: fuselane against its torch reference on fresh random inputs over several shapes
     (PASS/FAIL lines), including forced int64 / block-and-offset addressing and one cache of
     more than 2^31 elements (the launcher must fall back to int64 offsets by itself); a
     section whose check fails is not timed for fuselane;
  3. kv_write (bf16) and kv_write_fp8 at 1..32768 tokens, rope_kv_write (neox at 1..8192
     tokens, gpt-j at 1 and 8192): each case first verifies fuselane's cache against the
     reference on the timed inputs (and each peer's cache against fuselane's, reported in the
     notes), then times fuselane and every peer by CUDA-graph replay (`harness.time_graph`),
     ROUNDS times in interleaved order, reporting the median round (and every round's time);
  4. floor: what any implementation of the write must spend at the same sizes, next to
     fuselane: an empty kernel, and a Triton copy of the same key/value bytes to a contiguous
     buffer with no slot lookup (same launch shape as fuselane's rule);
  5. sweeps: kv_write_sweep times the write at other (tokens per program, warps) settings than
     the launch rule picks, and the rule's setting with int64 block-and-offset addressing
     (`[addr64]`) and with evict-first key/value loads (`[evict_first]`); kv_write_fp8_sweep
     times the fp8 write with the interpreter's exact rounding emulation (`[emulated]`) and
     with int64 addressing, to fill the tables in kernels/kv_cache.py;
  6. GOAL lines (the family's targets), then the table; JSON to --out and benchmarks/results/.

Workload (Llama-3-8B attention shapes, as the peers' H200 anchors): Hkv=8, D=128, page 16, bf16;
key/value are strided views of a fused QKV output (Hq=32); the cache is vLLM's TRITON_ATTN
layout, K and V as `split` views of one [num_pages, page, Hkv, 2*D] tensor, the same tensors
for every implementation. Up to 256 tokens are a decode batch (one token per request, random
context lengths); more are prefill chunks of 2048 tokens. Pages are a random permutation.
Bytes counted: K and V read plus K and V written (plus q/k rotary traffic for rope cases).
"""

from __future__ import annotations

import sys
import time

if not __package__:  # run as a file: `fuselane` from this checkout (this folder is on sys.path)
    import from_checkout  # noqa: F401

import torch

from fuselane.benchmarks import harness
from fuselane.benchmarks.kernels import family_script
from fuselane.benchmarks.kernels.kv_cache_checks import run_checks
from fuselane.benchmarks.kernels.kv_cache_sections import (
    Runner,
    bench_floor,
    bench_rope,
    bench_write,
)
from fuselane.benchmarks.kernels.kv_cache_sweep import (
    FP8_SWEEP_TOKENS,
    SWEEP_TOKENS,
    bench_fp8_sweep,
    bench_sweep,
)
from fuselane.benchmarks.kernels.kv_cache_workload import (
    ROPE_GPTJ_TOKENS,
    ROPE_TOKENS,
    TOKENS,
    case_name,
    rope_case_name,
)

# Goals of the KV-cache family
GOAL_PCT_COPY = 90.0
GOAL_GAP_US = 0.3
GOAL_GAP_MAX_TOKENS = 256
GOAL_FP8_SLOWDOWN = 1.10


def goals(report: harness.Report, empty_us: float) -> list[str]:
    g = family_script.GoalLines(report)
    for section in ("kv_write", "kv_write_fp8"):
        for n in TOKENS:
            case = case_name(n)
            ours = g.find(section, case, "fuselane")
            if ours is None:
                g.goal(f"{section} {case} faster than every peer", None, "fuselane not timed")
                continue
            g.faster(
                f"{section} {case} faster than every peer",
                g.others(section, case),
                lambda r: f"{r['impl']} {r['peer_over_fuselane']}x",
            )
            if section == "kv_write" and n <= GOAL_GAP_MAX_TOKENS:
                gap = ours["us"] - empty_us
                g.goal(
                    f"{case} within {GOAL_GAP_US} us of the empty kernel",
                    gap <= GOAL_GAP_US,
                    f"gap {gap:.3f} us",
                )
            if section == "kv_write" and n == max(TOKENS):
                pct = ours.get("pct_copy_ceiling")
                g.goal(
                    f"{case} >= {GOAL_PCT_COPY}% of copy bandwidth",
                    pct is not None and pct >= GOAL_PCT_COPY,
                    f"{pct}%",
                )
            if section == "kv_write_fp8":
                bf16 = g.find("kv_write", case, "fuselane")
                if bf16 is not None:
                    ratio = ours["us"] / bf16["us"]
                    g.goal(
                        f"{case} fp8 within 10% of bf16",
                        ratio <= GOAL_FP8_SLOWDOWN,
                        f"fp8/bf16 {ratio:.3f}",
                    )
    rope_cases = [rope_case_name(n) for n in ROPE_TOKENS]
    rope_cases += [rope_case_name(n, neox=False) for n in ROPE_GPTJ_TOKENS]
    for case in rope_cases:
        ours = g.find("rope_kv_write", case, "fuselane")
        separate = g.others("rope_kv_write", case)
        if ours is None or not separate:
            g.goal(f"rope {case} faster than separate rotary + write", None, "not timed")
            continue
        g.faster(
            f"rope {case} faster than separate rotary + write",
            separate,
            lambda r: f"{r['impl']} {r['peer_over_fuselane']}x",
        )
    # Not goals: where the write stands against what any implementation must spend.
    for n in TOKENS:
        case = case_name(n)
        ours = g.find("floor", case, "fuselane")
        copy = g.find("floor", case, "triton-copy-no-slot")
        empty = g.find("floor", case, "empty-kernel")
        if ours is None or copy is None or empty is None:
            continue
        g.lines.append(
            f"FLOOR {case}: fuselane {ours['us']:.3f} us, copy of the same bytes without the "
            f"slot lookup {copy['us']:.3f} us, empty kernel {empty['us']:.3f} us: "
            f"fuselane - copy {ours['us'] - copy['us']:+.3f} us, "
            f"copy - empty {copy['us'] - empty['us']:+.3f} us"
        )
    return g.lines


def main() -> int:
    parser = family_script.script_parser(__doc__)
    parser.add_argument("--no-sweep", action="store_true", help="skip the launch-rule sweep")
    args = parser.parse_args()
    if family_script.no_cuda("bench_kv_cache"):
        return 2
    report, t_start, ceilings = family_script.start("kv_cache", gemm=False)
    gen = torch.Generator().manual_seed(0)
    empty_us = ceilings["empty_kernel_us"]

    def elapsed() -> float:
        return time.perf_counter() - t_start

    run = Runner(report, empty_us)
    ok = run_checks(run.peers.note)
    print(f"checks done at {elapsed():.0f} s", flush=True)

    for n in TOKENS:
        bench_write(run, n, fp8=False, fuselane_ok=ok["write"], gen=gen)
    for n in TOKENS:
        bench_write(run, n, fp8=True, fuselane_ok=ok["fp8"], gen=gen)
    for n in ROPE_TOKENS:
        bench_rope(run, n, fuselane_ok=ok["rope"], gen=gen)
    for n in ROPE_GPTJ_TOKENS:
        bench_rope(run, n, fuselane_ok=ok["rope"], gen=gen, neox=False)
    if ok["write"]:
        for n in TOKENS:
            bench_floor(run, n, gen)
    print(f"timed sections done at {elapsed():.0f} s", flush=True)
    if not args.no_sweep and ok["write"]:
        for n in SWEEP_TOKENS:
            bench_sweep(run, n, gen)
    if not args.no_sweep and ok["fp8"]:
        for n in FP8_SWEEP_TOKENS:
            bench_fp8_sweep(run, n, gen)
    print(f"sweeps done at {elapsed():.0f} s", flush=True)

    family_script.finish(report, lambda: goals(report, empty_us), args.out, elapsed())
    return 0 if all(ok.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
