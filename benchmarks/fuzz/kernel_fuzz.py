"""Kernel fuzzer: random configurations of every kernel family checked against its torch
reference, on a GPU (compiled kernels) or on the CPU under Triton's interpreter.

    python -m fuselane.benchmarks.fuzz.kernel_fuzz --family attention|kv_cache|sampling|all \\
        --cases N --seed S --out FILE.json [--time-limit SECONDS] [--index I,J] [--sanitizer-set]

Each case is a function of (seed, family, index) alone: `--index` reruns chosen cases (a failure
in the JSON carries its command line). Exit status 1 on any mismatch, error or failed
distribution check. What each family draws and how to run it: docs/notes/fuzz.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from fuselane.benchmarks.fuzz.core import SCALES, Family, Report, interpreting, run_family

FAMILIES = ("attention", "kv_cache", "sampling")
# `--family all` runs the quick family first: with a time limit, what it leaves of its share goes
# to the two slow ones (10,000 cases on an H100: kv_cache 36 s, attention ~230 s, sampling
# ~230 s, compiles included; docs/notes/fuzz.md).
RUN_ORDER = ("kv_cache", "attention", "sampling")
SANITIZER_CASES = 20


def _families(names: Sequence[str]) -> list[Family]:
    """The family modules, imported only now: the kernels must see the interpreter choice."""
    from fuselane.benchmarks.fuzz import attention, kv_cache, sampling

    table = {"attention": attention, "kv_cache": kv_cache, "sampling": sampling}
    return [table[n].FAMILY for n in names]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m fuselane.benchmarks.fuzz.kernel_fuzz", description=__doc__.split("\n")[0]
    )
    p.add_argument("--family", choices=(*FAMILIES, "all"), default="all")
    p.add_argument("--cases", type=int, default=None, help="cases per family (default 100)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="results JSON")
    p.add_argument(
        "--time-limit",
        type=float,
        default=None,
        help="seconds for the whole run: each family gets an equal share of what is left when "
        "it starts, and stops drawing cases when it is spent",
    )
    p.add_argument(
        "--index", default=None, help="comma list of case indices to run instead (reproduce)"
    )
    p.add_argument("--profiles", type=int, default=None, help="profiles per family")
    p.add_argument(
        "--scale",
        choices=SCALES,
        default=None,
        help="shape sizes (default: small under the interpreter, full on a GPU)",
    )
    p.add_argument(
        "--sanitizer-set",
        action="store_true",
        help=f"{SANITIZER_CASES} cases per family at sanitizer scale, to run under "
        "compute-sanitizer (see docs/notes/fuzz.md)",
    )
    p.add_argument("--progress-every", type=int, default=1000)
    p.add_argument(
        "--compile-workers",
        type=int,
        default=min(16, os.cpu_count() or 1),
        help="threads compiling each batch's new kernel variants ahead of its run (GPU; 0: "
        "compile on first launch, one at a time)",
    )
    args = p.parse_args(argv)
    if args.sanitizer_set:
        args.scale = args.scale or "sanitizer"
        args.cases = args.cases or SANITIZER_CASES
    args.cases = 100 if args.cases is None else args.cases
    if args.cases < 0:
        p.error("--cases: expected a count >= 0")
    if args.profiles is not None and args.profiles < 1:
        p.error("--profiles: expected a count >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from fuselane.kernels import use_interpreter_without_gpu

    use_interpreter_without_gpu()  # before any kernel module is imported
    device = torch.device("cuda" if torch.cuda.is_available() and not interpreting() else "cpu")
    scale = args.scale or ("small" if interpreting() else "full")
    names = RUN_ORDER if args.family == "all" else (args.family,)
    indices = [int(i) for i in args.index.split(",")] if args.index else None
    families = _families(names)
    start = time.monotonic()
    reports: list[Report] = []
    for k, family in enumerate(families):
        deadline = None
        if args.time_limit is not None:  # an equal share of what is left
            left = args.time_limit - (time.monotonic() - start)
            deadline = time.monotonic() + max(0.0, left) / (len(families) - k)
        report = run_family(
            family, seed=args.seed, cases=args.cases, indices=indices, scale=scale,
            num_profiles=args.profiles or family.default_profiles[scale], device=device,
            deadline=deadline, progress_every=args.progress_every,
            compile_workers=args.compile_workers,
        )  # fmt: skip
        print(summary_line(report), flush=True)
        for m in report.mismatched[:3]:
            print(f"  mismatch, case {m['index']}: {m['kind']}: {m['first_mismatch'][:300]}")
            print(f"    rerun: {m['repro']}")
        for e in report.errors[:3]:
            print(f"  error, case {e['index']}: {e['error'][:300]}\n    rerun: {e['repro']}")
        reports.append(report)
        if report.aborted:
            print(f"  aborted: {report.aborted}", flush=True)
            break
    ok = all(r.ok for r in reports)
    payload = {
        "tool": "kernel_fuzz",
        "argv": list(sys.argv[1:] if argv is None else argv),
        "seed": args.seed,
        "scale": scale,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "interpret": interpreting(),
        "torch": torch.__version__,
        "triton": _triton_version(),
        "python": platform.python_version(),
        "wall_s": round(time.monotonic() - start, 3),
        "ok": ok,
        "families": {r.family: _as_json(r) for r in reports},
    }
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(payload, indent=1, default=str) + "\n")
        print(f"wrote {args.out}")
    print("OK" if ok else "FAILED", flush=True)
    return 0 if ok else 1


def _triton_version() -> str:
    import triton

    return triton.__version__


def _as_json(report: Report) -> dict:
    out = dataclasses.asdict(report)
    out["ok"] = report.ok
    out["refused_count"] = sum(r["count"] for r in report.refused.values())
    return out


def summary_line(report: Report) -> str:
    refused = sum(r["count"] for r in report.refused.values())
    limit = " (time limit)" if report.stopped_by_time_limit else ""
    checks = "".join(
        f", {name} {'ok' if c['ok'] else 'FAILED'}" for name, c in report.checks.items()
    )
    return (
        f"{report.family}: {report.cases_run}/{report.cases_requested} cases{limit}, "
        f"{report.passed} passed, {refused} refused, {report.mismatched_count} mismatched, "
        f"{report.errors_count} errors{checks}; {report.new_compiles} compiled variants "
        f"({report.timing.get('compile_ahead_s', 0):.1f} s compiling ahead), "
        f"{report.timing.get('warm_case_ms', 0):.1f} ms per case without compiles, "
        f"{report.wall_s:.1f} s"
    )


if __name__ == "__main__":
    sys.exit(main())
