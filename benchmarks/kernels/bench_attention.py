"""GPU benchmark of the paged-attention family (kernels/attention/) against its peers.

On the GPU machine, from the project root:
    source .peers/setup_device.sh
    python3 benchmarks/kernels/bench_attention.py --out $OUT [--quick] [--no-sweep] [--prefill-only]

Order of work, all in one process on one device:
  1. ceilings: copy bandwidth (1 GiB device-to-device), bf16 GEMM rate, empty Triton kernel;
  2. check: fuselane against its torch reference (`paged_attention_reference`) on fresh random
     inputs over several shapes (decode with splits, speculative verify, prefill, mixed; GQA
     1..8 and 7, head sizes 64/80/96/128/256, pages 16/32/64, fp16/bf16, fp8 KV, window,
     soft cap, sinks): PASS/FAIL lines with the max error;
  3. decode, prefill, mixed (the goal cases, as the peers' H200 anchors): each case first
     checks fuselane's output on the timed inputs against the reference (a case that fails is
     not timed for fuselane), then times fuselane and every peer on the same inputs by
     CUDA-graph replay (`harness.time_graph`; `time_eager` with a note if a peer cannot be
     captured);
  4. sweeps, at every decode case and prefill length, in SWEEP_ORDER until BUDGET_S: the decode
     kernel at other (tile, stages, splits, merge as a 2nd launch, grid order) and the prefill
     kernel at other (block_m, block_n, warps, stages, grid order) than the launch rule picks,
     each checked against the reference before timing, and fuselane's outputs checked again
     after the graph replays (a race in the fused split merge would show there);
  5. GOAL lines (the family's targets), then the table; JSON to --out and benchmarks/results/.

Workload (Llama-3-8B attention, as the peers' H200 anchors): Hq=32, Hkv=8, D=128, page 16, bf16,
scale 1/sqrt(D). One KV pool of ~4.3 GB ([pages, 2, page, Hkv, D], random data; K and V are
its [:, 0] / [:, 1] views for fuselane and vLLM, the 5-D tensor itself for FlashInfer), pages
handed out as a random permutation. Decode: every sequence at the same context length.
Prefill: one sequence, query_len == seq_len (its KV already in the cache, as vLLM writes it
before attention). Mixed: 60 decode rows then 4 prefill chunks of 512, all at seq_len 4096.
Bytes counted for decode: K and V read, plus q read and out written. FLOPs for prefill:
2 * S^2 * Hq * D (causal half of 4 S^2 Hq D), as the anchors.
Peers: vLLM's `unified_attention` (TRITON_ATTN's kernel, with its 3-D split scratch sized as
triton_attn.py does), FlashInfer 0.2.14 BatchDecodeWithPagedKVCacheWrapper (tensor cores)
and BatchPrefillWithPagedKVCacheWrapper (plan() outside the timed region), torch SDPA (flash
and cuDNN backends) on dense MHA-expanded tensors for prefill.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

if not __package__:  # run as a file: `fuselane` from this checkout (this folder is on sys.path)
    import from_checkout  # noqa: F401

import torch

from fuselane.benchmarks import harness
from fuselane.benchmarks.kernels import family_script
from fuselane.benchmarks.kernels.attention_sections import bench_decode, bench_mixed, bench_prefill
from fuselane.benchmarks.kernels.attention_sweep import bench_decode_rule, run_sweeps
from fuselane.benchmarks.kernels.attention_timing import Runner
from fuselane.benchmarks.kernels.attention_workload import (
    DECODE_CASES,
    DTYPE,
    HKV,
    MIXED_CASE,
    PAGE,
    POOL_PAGES,
    PREFILL_LENS,
    D,
    decode_case,
    make_pool,
    prefill_case,
    run_checks,
)

# Goals of the attention family
GOAL_PCT_COPY = 90.0  # decode, B >= 16
GOAL_B1_TBPS = 3.0  # decode B=1 ctx=32768 (H200)
GOAL_OVER_SDPA = 1.1  # prefill TFLOP/s vs torch SDPA flash
GOAL_OVER_FI_PREFILL = 0.9  # prefill TFLOP/s vs FlashInfer


def goals(report: harness.Report) -> list[str]:
    g = family_script.GoalLines(report)
    for batch, ctx in DECODE_CASES:
        case = decode_case(batch, ctx)
        ours = g.find("decode", case, "fuselane")
        if ours is None:
            g.goal(f"decode {case}", None, "fuselane not timed")
            continue
        peers = g.others("decode", case)
        peers = [r for r in peers if r["impl"].startswith(("vllm", "flashinfer"))]
        g.faster(
            f"decode {case} faster than vLLM and FlashInfer",
            peers,
            lambda r: f"{r['impl']} {r['us']} us = {r['peer_over_fuselane']}x",
        )
        if batch >= 16:
            pct = ours.get("pct_copy_ceiling")
            g.goal(
                f"decode {case} >= {GOAL_PCT_COPY}% of copy bandwidth",
                pct is not None and pct >= GOAL_PCT_COPY,
                f"{ours.get('TBps')} TB/s = {pct}%",
            )
        if batch == 1:
            g.goal(
                f"decode {case} >= {GOAL_B1_TBPS} TB/s",
                ours["TBps"] >= GOAL_B1_TBPS,
                f"{ours['TBps']} TB/s ({ours['us']} us)",
            )
    for seq in PREFILL_LENS:
        case = prefill_case(seq)
        ours = g.find("prefill", case, "fuselane")
        if ours is None:
            g.goal(f"prefill {case}", None, "fuselane not timed")
            continue
        for impl, need in (
            ("torch-sdpa-flash", GOAL_OVER_SDPA),
            ("flashinfer", GOAL_OVER_FI_PREFILL),
        ):
            peer = g.find("prefill", case, impl)
            if peer is None:
                g.goal(f"prefill {case} >= {need}x {impl}", None, "peer not timed")
                continue
            ratio = peer["us"] / ours["us"]  # same FLOPs: the TFLOP/s ratio
            g.goal(
                f"prefill {case} >= {need}x {impl}",
                ratio >= need,
                f"{ours['TFLOPs']} vs {peer['TFLOPs']} TFLOP/s = {ratio:.2f}x",
            )
    ours = g.find("mixed", MIXED_CASE, "fuselane")
    vllm = g.find("mixed", MIXED_CASE, "vllm-triton-unified")
    if ours is None or vllm is None:
        g.goal(f"mixed {MIXED_CASE} faster than vLLM unified", None, "not timed")
    else:
        g.goal(
            f"mixed {MIXED_CASE} faster than vLLM unified",
            vllm["peer_over_fuselane"] > 1.0,
            f"{ours['us']} us vs {vllm['us']} us = {vllm['peer_over_fuselane']}x",
        )
    return g.lines


def main() -> int:
    parser = family_script.script_parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="B=1, B=64, S=4096, mixed; no sweep")
    parser.add_argument("--no-sweep", action="store_true", help="skip the config sweeps")
    parser.add_argument(
        "--prefill-only", action="store_true", help="the prefill cases and their sweeps only"
    )
    parser.add_argument(
        "--decode-only", action="store_true", help="the decode cases and their sweeps only"
    )
    args = parser.parse_args()
    if family_script.no_cuda("bench_attention"):
        return 2
    report, t_start, _ = family_script.start("attention", gemm=True)
    gen = torch.Generator().manual_seed(0)

    run = Runner(report, t_start)
    ok = run_checks(run.peers.note)
    print(f"checks done at {run.elapsed():.0f} s (all {'PASS' if ok else 'NOT PASS'})", flush=True)

    decode_cases = [(1, 32768), (64, 4096)] if args.quick else DECODE_CASES
    decode_cases = [] if args.prefill_only else decode_cases
    prefill_lens = () if args.decode_only else (4096,) if args.quick else PREFILL_LENS
    pool = make_pool(POOL_PAGES, PAGE, HKV, D, DTYPE)
    print(f"KV pool: {pool.numel() * pool.element_size() / 1e9:.2f} GB", flush=True)
    sweeps: dict[tuple[str, int], Callable[[], None]] = {}
    sections = [
        lambda b=b, c=c: bench_decode(run, pool, b, c, ok, gen, sweeps) for b, c in decode_cases
    ]
    sections += [lambda s=s: bench_prefill(run, pool, s, ok, gen, sweeps) for s in prefill_lens]
    if not (args.prefill_only or args.decode_only):
        sections.append(lambda: bench_mixed(run, pool, ok, gen))
    if not (args.quick or args.no_sweep or args.prefill_only or args.decode_only):
        sections.append(lambda: bench_decode_rule(run, pool, ok, gen))
    # the sweeps last: the time budget may cut them, never a goal case
    if not (args.quick or args.no_sweep):
        sections.append(lambda: run_sweeps(run, sweeps))
    family_script.run_sections(sections, run.peers.note, run.elapsed)
    family_script.finish(report, lambda: goals(report), args.out, run.elapsed())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
