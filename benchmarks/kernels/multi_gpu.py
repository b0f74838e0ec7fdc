"""`fuselane bench kernels --gpus N`: one selection's sections spread over N GPUs of one host.

The full grid takes about half an hour on one GPU. On a host of several GPUs of one model the
sections are independent, so each GPU runs the ordinary single-GPU benchmark on its share of
them (same models, grid, peers, budget and seed; its own process, pinned to its GPU with
CUDA_VISIBLE_DEVICES, its own output folder `--out/gpu<i>`), and the parts are then merged
into one JSON, report and plots in `--out`, as `--merge` would (each part's ceilings and time
kept under `parts`). Shares are balanced by the grid's estimated seconds, largest section
first onto the least loaded GPU. Every process measures its own GPU's ceilings; the GPUs share
the host's CPUs (FlashInfer's module builds, the launches) and FlashInfer's JIT cache, whose
builds take a file lock, so a module two parts need is built once.

The parser, the assignment and the worker command lines need no torch; `run` starts the
processes and waits for them (stopping them all when one is interrupted).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from fuselane.benchmarks.kernels import grid as kgrid

WORKER_MODULE = "fuselane.benchmarks.kernels.cli"


def section_seconds(
    grid: str, families: tuple[str, ...], models: tuple[str, ...], sections: tuple[str, ...]
) -> dict[str, float]:
    """Estimated seconds of each section of the selection (grid order), without the start."""
    cases = kgrid.build_grid(families, models or None, grid, sections or None)
    out: dict[str, float] = {}
    for case in cases:
        out[case.section] = out.get(case.section, 0.0) + kgrid.estimate_s(case)
    return out


def assign(seconds: dict[str, float], gpus: int) -> list[list[str]]:
    """Sections onto at most `gpus` shares, largest first onto the least loaded one (ties: the
    lower index); empty shares dropped; each share keeps the grid's section order."""
    if gpus < 1:
        raise ValueError(f"gpus: expected at least 1, got {gpus}")
    order = list(seconds)
    loads = [0.0] * gpus
    shares: list[list[str]] = [[] for _ in range(gpus)]
    for section in sorted(order, key=lambda s: -seconds[s]):
        i = min(range(gpus), key=lambda k: (loads[k], k))
        shares[i].append(section)
        loads[i] += seconds[section]
    return [sorted(s, key=order.index) for s in shares if s]


def shares(
    grid: str,
    families: tuple[str, ...],
    models: tuple[str, ...],
    sections: tuple[str, ...],
    gpus: int,
) -> list[tuple[list[str], float]]:
    """(sections, estimated seconds) of each process: the selection's sections `assign`ed to at
    most `gpus` processes."""
    seconds = section_seconds(grid, families, models, sections)
    return [(share, sum(seconds[s] for s in share)) for share in assign(seconds, gpus)]


def visible_devices(gpus: int, env: dict[str, str] | None = None) -> list[str]:
    """The device each share runs on: the first `gpus` entries of CUDA_VISIBLE_DEVICES when it
    is set (a list of indices or UUIDs), else 0..gpus-1. Raises ValueError when the variable
    names fewer devices."""
    env = os.environ if env is None else env
    listed = env.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return [str(i) for i in range(gpus)]
    devices = [d.strip() for d in listed.split(",") if d.strip()]
    if len(devices) < gpus:
        raise ValueError(
            f"--gpus {gpus}: CUDA_VISIBLE_DEVICES={listed!r} names {len(devices)} device(s)"
        )
    return devices[:gpus]


def worker_argv(args: argparse.Namespace, sections: list[str], out: Path) -> list[str]:
    """The single-GPU command line of one share: the parent's selection and settings with its
    own sections and output folder (the section names its family)."""
    argv: list[str] = []
    for section in sections:
        argv += ["--section", section]
    for model in args.model or ():
        argv += ["--model", model]
    if args.quick:
        argv.append("--quick")
    if args.interpret_smoke:
        argv.append("--interpret-smoke")
    if args.peers is not None:
        argv += ["--peers", ",".join(sorted(args.peers)) or "none"]
    argv += ["--budget", f"{args.budget:g}", "--seed", str(args.seed), "--out", str(out)]
    return [*argv, "--no-progress"]


def run(
    args: argparse.Namespace,
    grid: str,
    families: tuple[str, ...],
    sections: tuple[str, ...],
    devices: list[str],
) -> tuple[int, list[Path]]:
    """Runs the shares, one process per device, each logging to its folder's run.log; returns
    (the worst exit status, the parts' results files that were written)."""
    planned = shares(grid, families, tuple(args.model or ()), sections, len(devices))
    procs: list[tuple[subprocess.Popen, Path]] = []
    print(f"{len(planned)} process(es), one per GPU:")
    try:
        for i, ((share, est), device) in enumerate(zip(planned, devices, strict=False)):
            out = args.out / f"gpu{i}"
            out.mkdir(parents=True, exist_ok=True)
            print(f"  GPU {device}: {', '.join(share)} (~{est:.0f} s) -> {out}/run.log")
            log = (out / "run.log").open("w")
            env = {**os.environ, "CUDA_VISIBLE_DEVICES": device, "PYTHONUNBUFFERED": "1"}
            cmd = [sys.executable, "-m", WORKER_MODULE, *worker_argv(args, share, out)]
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            procs.append((proc, out))
            log.close()
        sys.stdout.flush()
        status = 0
        for proc, out in procs:
            code = proc.wait()
            if code != 0:
                print(f"  {out}: exit {code} (see {out}/run.log)", file=sys.stderr)
            status = max(status, code)
    finally:  # interrupted (Ctrl-C, SIGTERM as SystemExit): no benchmark left on a GPU
        for proc, _ in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGINT)
        for proc, _ in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
            if proc.poll() is None:
                proc.kill()
    files = [f for _, out in procs for f in sorted(out.glob("kernels-*.json"))]
    return status, files


def part_summary(files: list[Path]) -> list[str]:
    """One line per part: its file, rows, skipped cases and failures."""
    lines = []
    for f in files:
        payload = json.loads(f.read_text())
        lines.append(
            f"  {f}: {len(payload['results'])} rows, {len(payload['skipped'])} skipped, "
            f"{len(payload['failures'])} failures, {payload['elapsed_s']:.0f} s"
        )
    return lines
