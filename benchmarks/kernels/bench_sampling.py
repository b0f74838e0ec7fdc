"""GPU benchmark of the fused sampler (kernels/sampling/) against its peers.

On the GPU machine, from the project root:
    source .peers/setup_device.sh
    python3 benchmarks/kernels/bench_sampling.py --out $OUT [--no-sweep]
Here (no GPU), the check code alone on tiny shapes under the interpreter:
    python benchmarks/kernels/bench_sampling.py --cpu-smoke [--one-launch-sweep]
The one-launch sweep alone (B = 1..16 x V = 32000 / 32768 / 128256, top-p 0.95 alone and
T=0.7 k=50 p=0.9: one launch at each chunk against two launches and FlashInfer; sets
`plan.use_one_launch`; JSON `sampling_one_launch-*.json`):
    python3 benchmarks/kernels/bench_sampling.py --one-launch-sweep --out $OUT

Order of work, in one process on one device:
  1. ceilings: copy bandwidth (1 GiB), empty Triton kernel;
  2. checks against the torch references on fresh random logits: greedy equals argmax; kept
     sets, seeded draws, logprobs and top-n equal the reference over several shapes and
     parameter mixes (penalties, bias, min-p, bf16, V up to 262144 and odd); NaN rows
     reported; distribution: 65,536 draws of one V=16 row (4096 rows x 16 offsets) by a
     chi-square test at p < 1e-3, with and without top-k/top-p. Rows whose mismatch is a
     rounding tie (kernel: fp32 sums, approximate exp/log/div; reference: fp64 top-p masses,
     IEEE ops) are counted as "ambiguous", reported, and do not fail a check;
  3. the goal cases (T=0.7, k=50, p=0.9; B=1/32 at V=128256, B=256 at V=151936; again
     with penalties + min-p): each is first checked on its own inputs (a failing case is not
     timed for fuselane), then fuselane and every peer are timed on the same inputs by
     CUDA-graph replay (`harness.time_graph`; eager with a note if capture fails);
  4. sweep (until BUDGET_S): other chunk sizes / warps / register caps than the launch rule
     picks, to set the table in kernels/sampling/plan.py from measurements;
  5. GOAL lines, the table; JSON to --out and benchmarks/results/.

fuselane is timed as the V2 plugin would call it: every row seeded (V2 keeps a seed per
request), no logprobs (the peers compute none), so with penalties the logits are writable
(`logits_writable`: each chunk program penalizes its seen tokens in place); one extra row per base
case adds raw logprobs with the top 5, one per penalty case keeps the logits read-only
(penalties applied to every value by the sampler itself). Bytes counted: the logits read
once (plus the dense output counts where they are read). Peers: FlashInfer 0.2.14
`top_k_top_p_sampling_from_logits` on logits already divided by T (temperature not timed for
it; with penalties, torch penalties/min-p in front of it), and `torch-sort (vLLM fallback)`:
the reference's sort-based top-k/top-p block (the same algorithm as vLLM's
apply_top_k_top_p_pytorch), softmax, exponential race (vLLM's random_sample), with the
reference's penalty / min-p blocks in front in the penalty cases.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

if "--cpu-smoke" in sys.argv:  # must precede `import torch` (it imports triton.language)
    os.environ.setdefault("TRITON_INTERPRET", "1")
if not __package__:  # run as a file: `fuselane` from this checkout (this folder is on sys.path)
    import from_checkout  # noqa: F401

import torch

from fuselane.benchmarks import harness
from fuselane.benchmarks.kernels import family_script
from fuselane.benchmarks.kernels.sampling_checks import run_checks
from fuselane.benchmarks.kernels.sampling_sections import (
    BUDGET_S,
    Runner,
    bench_case,
    flashinfer_peer,
)
from fuselane.benchmarks.kernels.sampling_sweep import (
    run_one_launch_sweep,
    run_profile,
    run_sweep,
)
from fuselane.benchmarks.kernels.sampling_workload import ARITH, CASES, case_name
from fuselane.kernels import sampling as smp

GOALS_MS = {1: 0.03, 32: 0.05, 256: 0.15}  # goals, H100/H200
PEN_RATIO_GOAL = 1.3


def goals(report: harness.Report, base_ms: dict[int, float]) -> list[str]:
    lines = []
    for B, V in CASES:
        for pen in (False, True):
            name = case_name(B, V, pen)
            ours = next((r for r in report.rows if r.case == name and r.impl == "fuselane"), None)
            if ours is None:
                lines.append(f"GOAL {name}: not timed")
                continue
            goal = GOALS_MS[B]
            text = f"GOAL {name}: {ours.ms * 1e3:.1f} us vs <= {goal * 1e3:.0f} us"
            text += " MET" if ours.ms <= goal else " MISSED"
            if pen and base_ms.get(B):
                ratio = ours.ms / base_ms[B]
                text += f"; {ratio:.2f}x the base case (goal <= {PEN_RATIO_GOAL}x)"
                text += " MET" if ratio <= PEN_RATIO_GOAL else " MISSED"
            for r in report.rows:
                if r.case == name and r.impl != "fuselane" and not r.impl.startswith("fuselane"):
                    text += f"; {r.impl}: {r.ms / ours.ms:.1f}x slower"
            lines.append(text)
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", type=Path, default=None, help="directory for the JSON result")
    ap.add_argument("--no-sweep", action="store_true", help="skip the launch-configuration sweep")
    ap.add_argument(
        "--batches",
        type=int,
        nargs="*",
        default=None,
        help="only the cases of these batch sizes (default: all of "
        + str([b for b, _ in CASES])
        + ")",
    )
    ap.add_argument("--no-peers", action="store_true", help="time fuselane only")
    ap.add_argument(
        "--no-checks",
        action="store_true",
        help="skip the broad checks (each timed case is still checked on its own inputs)",
    )
    ap.add_argument(
        "--tune",
        action="store_true",
        help="only the per-kernel profile and the sweep (no checks, no peers; own JSON name)",
    )
    ap.add_argument(
        "--one-launch-sweep",
        action="store_true",
        help="only the one-launch sweep: one launch vs two vs FlashInfer at B <= 16 (own JSON "
        "name); with --cpu-smoke, its checks on tiny shapes after the smoke checks",
    )
    ap.add_argument("--budget", type=float, default=BUDGET_S, help="seconds before the sweep stops")
    ap.add_argument(
        "--arith",
        choices=smp.ARITH_MODES,
        default=ARITH,
        help=f"the kernel's rounding (default {ARITH}: vLLM V2's); another is named in the JSON",
    )
    ap.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="no GPU: run the checks on tiny shapes under the Triton interpreter",
    )
    args = ap.parse_args()
    if args.batches:
        bad = [b for b in args.batches if b not in dict(CASES)]
        if bad:
            ap.error(f"--batches: {bad} not among the cases {[b for b, _ in CASES]}")
    t_start = time.perf_counter()
    if args.cpu_smoke:
        run = Runner(None, torch.device("cpu"), t_start)
        run_checks(run, torch.Generator().manual_seed(0), small=True)
        if args.one_launch_sweep:
            run_one_launch_sweep(run, torch.Generator().manual_seed(1), small=True)
        print(f"cpu smoke: {'all PASS' if run.ok else 'FAILURES'} in {run.elapsed():.0f} s")
        return 0 if run.ok else 1
    if not torch.cuda.is_available():
        print("no CUDA device: use --cpu-smoke here; the timed run needs a GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    torch.manual_seed(0)
    gen = torch.Generator(device=dev).manual_seed(1234)
    name = "sampling_tune" if args.tune else "sampling"
    if args.one_launch_sweep:
        name = "sampling_one_launch"
    report = harness.Report(name if args.arith == "triton" else f"{name}-arith-{args.arith}")
    report.notes.append(f"arith={args.arith}")
    ceilings = family_script.measure_ceilings(gemm=False)
    report.ceilings.update(ceilings)  # unrounded, as this script's results always were
    print(
        f"{report.info['device']}: copy {ceilings['copy_tbps']:.3f} TB/s, empty Triton kernel "
        f"{ceilings['empty_kernel_us']:.2f} us",
        flush=True,
    )
    run = Runner(report, dev, t_start, arith=args.arith)
    run.budget = args.budget
    if args.one_launch_sweep:
        fis = None if args.no_peers else flashinfer_peer(run)
        family_script.run_sections(
            [lambda: run_one_launch_sweep(run, gen, fis)], run.note, run.elapsed
        )
        print(f"wrote {report.write(args.out)}")
        print(report.table())
        return 0 if run.ok else 1
    if args.tune:
        for section in (run_profile, run_sweep):
            try:
                section(run, gen)
            except Exception as e:  # noqa: BLE001 - keep the other section and the JSON
                run.note(f"{section.__name__} failed: {e!r}")
                traceback.print_exc()
        print(f"wrote {report.write(args.out)}")
        print(report.table())
        return 0 if run.ok else 1
    try:
        if args.no_checks:
            run.note("broad checks skipped (--no-checks)")
        else:
            run_checks(run, gen, small=False)
    except Exception as e:  # noqa: BLE001 - keep going to the timed cases and the JSON
        traceback.print_exc()
        run.line("checks", False, f"raised {e!r}")
    print(f"checks done at {run.elapsed():.0f} s ({'all PASS' if run.ok else 'NOT all PASS'})")
    cases = [(b, v) for b, v in CASES if not args.batches or b in args.batches]
    fis = None if args.no_peers else flashinfer_peer(run)
    base_ms: dict[int, float] = {}
    sections: list[Callable[[], None]] = [
        lambda b=b, v=v, p=p: bench_case(run, gen, b, v, p, fis, base_ms, not args.no_peers)
        for p in (False, True)
        for b, v in cases
    ]
    if not args.no_sweep:
        sections.append(lambda: run_sweep(run, gen))
    family_script.run_sections(sections, run.note, run.elapsed)
    family_script.finish(report, lambda: goals(report, base_ms), args.out, run.elapsed())
    return 0 if run.ok else 1


if __name__ == "__main__":
    sys.exit(main())
