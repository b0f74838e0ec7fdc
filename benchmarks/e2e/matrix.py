"""The end-to-end model matrix (GPU): `run_e2e.py` cells side by side, one GPU each, from a queue.

    python3 benchmarks/e2e/matrix.py --gpus 4 --out DIR [--cells NAME ...] [--reverse]
        [--deadline-s 570] [--list] [--dry-run]

A cell is one `run_e2e.py` run: a model of `models/`, a workload set, a KV-cache dtype and its
arms, run one after another on one GPU (`CUDA_VISIBLE_DEVICES`), with its own `--out DIR/<cell>`
and `--work-dir` (engines' results and compile caches apart). Cells wait in the order given
(CELLS' order by default, longest first); a GPU takes the next one when its last one ends. A
cell whose expected seconds no longer fit before the deadline is not started (said in the
summary); a started cell gets what is left of the deadline as its `--budget-s` (at most
run_e2e's 530 s), so one call of the GPU machine (10 minutes) holds the whole run. The ratio of
a cell compares its arms on one GPU, so the cells beside it do not enter it; they share the
host's CPUs, which the summary records.

`--reverse` runs each cell's arms in the opposite order (fuselane before FLASH_ATTN), for the
second order of a ratio within 2% of 1.0. `--dry-run` passes run_e2e's own `--dry-run` (the
plans, no engine). Writes DIR/<cell>/ (run_e2e's report and logs, `run.log`) and
DIR/matrix.json: per cell its GPU, arguments, exit status, seconds, and from its report the
ratios of every arm to its reference, the greedy verdict and the memory flags. Needs vLLM (the
staged 0.26) and fuselane importable by run_e2e.py, as the docstring of run_e2e.py says.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RUN_E2E = HERE / "run_e2e.py"
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
from processes import exit_on_termination  # noqa: E402  (the folder's parts, by bare name)

from fuselane.benchmarks.kernels.multi_gpu import visible_devices  # noqa: E402

# run_e2e's whole-run budget (its default): a cell never gets more.
MAX_CELL_BUDGET_S = 530.0
# Seconds kept back before the deadline for a cell's own teardown and the summary.
MARGIN_S = 15.0


@dataclass(frozen=True)
class Cell:
    """One run_e2e.py run: its arguments besides --arms, its arms in run order, and the seconds
    it is expected to take (measured on H200s with fresh compile caches, 2026-11-27, or an
    estimate from the phases measured there where the cell has not run yet)."""

    args: tuple[str, ...]
    arms: tuple[str, ...]
    expected_s: float

    def command(self, out: Path, work_dir: Path, budget_s: float, reverse: bool) -> list[str]:
        arms = self.arms[::-1] if reverse else self.arms
        return [
            sys.executable, str(RUN_E2E), *self.args, "--arms", *arms, "--out", str(out),
            "--work-dir", str(work_dir), "--no-results-copy", "--budget-s", f"{budget_s:.0f}",
        ]  # fmt: skip


THREE = ("FLASH_ATTN", "fuselane", "TRITON_ATTN")
# The matrix's cells, longest first. Expected seconds: three arms of the default set 370-390 s,
# two arms of the long-prompt set ~205 s, the sampling set's two V1 arms 283 s (measured);
# Gemma-2-9B's four arms and long-context decode are estimates (~90 s an engine start, its
# workloads longer than Llama-3-8B's).
CELLS: dict[str, Cell] = {
    "default-gemma-2-9b": Cell(
        ("--model", "gemma-2-9b", "--skip-online"), (*THREE, "fuselane_triton"), 520.0
    ),
    "long-decode-llama-3-8b": Cell(("--workloads", "long-decode"), THREE, 500.0),
    "online-llama-3-8b": Cell((), ("FLASH_ATTN", "fuselane"), 480.0),
    "default-llama-3-8b": Cell(("--skip-online",), THREE, 390.0),
    "default-qwen2.5-7b": Cell(("--model", "qwen2.5-7b", "--skip-online"), THREE, 370.0),
    "default-mistral-7b-v0.1": Cell(("--model", "mistral-7b-v0.1", "--skip-online"), THREE, 380.0),
    "kv-fp8-llama-3-8b": Cell(("--kv-cache-dtype", "fp8", "--skip-online"), THREE, 390.0),
    "long-prompts-llama-3-8b": Cell(("--workloads", "long-prompts"), THREE, 300.0),
    "long-prompts-qwen2.5-7b": Cell(
        ("--model", "qwen2.5-7b", "--workloads", "long-prompts"), THREE, 300.0
    ),
    "sampling-qwen2.5-1.5b": Cell(
        ("--model", "qwen2.5-1.5b", "--workloads", "sampling"),
        ("FLASH_ATTN_v1", "fuselane_all_v1"),
        290.0,
    ),
}


def work_dir(name: str) -> Path:
    """A cell's engines' results, compile caches and traces (run_e2e's --work-dir)."""
    return Path("/tmp") / f"fuselane-e2e-{name}"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if "OUT" in os.environ
                   else None, help="output folder (default $OUT)")  # fmt: skip
    p.add_argument("--gpus", type=int, default=1, help="cells at once, one GPU each")
    p.add_argument("--cells", nargs="+", metavar="NAME", help="these cells, in this order")
    p.add_argument("--reverse", action="store_true", help="each cell's arms in reverse order")
    p.add_argument("--deadline-s", type=float, default=570.0, help="whole run, seconds")
    p.add_argument("--dry-run", action="store_true", help="run_e2e.py --dry-run for each cell")
    p.add_argument("--list", action="store_true", help="print the cells and their commands")
    args = p.parse_args(argv)
    unknown = [c for c in args.cells or () if c not in CELLS]
    if unknown:
        p.error(f"--cells: unknown {unknown}; known: {', '.join(CELLS)}")
    if args.gpus < 1:
        p.error(f"--gpus: expected at least 1, got {args.gpus}")
    if args.deadline_s <= MARGIN_S:
        p.error(f"--deadline-s: expected more than {MARGIN_S:.0f}, got {args.deadline_s:g}")
    if args.out is None and not args.list:
        p.error("--out (or $OUT) is needed")
    return args


Start = Callable[[list[str], dict[str, str], Path], subprocess.Popen]


def _start(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with log.open("w") as f:
        return subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)


@dataclass
class _Queue:
    """The cells waiting, the GPUs free, the cells running (process, GPU, start) and every
    cell's record, for `run`."""

    out: Path
    deadline_s: float
    reverse: bool
    dry_run: bool
    start: Start
    clock: Callable[[], float]
    waiting: list[str]
    free: list[str]
    t0: float = 0.0
    running: dict[str, tuple[subprocess.Popen, str, float]] = field(default_factory=dict)
    records: dict[str, dict[str, Any]] = field(default_factory=dict)

    def collect(self) -> None:
        """Record the cells that ended and free their GPUs."""
        for name, (proc, gpu, began) in list(self.running.items()):
            if proc.poll() is not None:
                seconds = round(self.clock() - began, 1)
                self.records[name].update(rc=proc.returncode, seconds=seconds)
                self.free.append(gpu)
                del self.running[name]

    def start_next(self) -> None:
        """Start waiting cells on the free GPUs while they fit before the deadline."""
        while self.waiting and self.free:
            name = self.waiting.pop(0)
            cell = CELLS[name]
            left = self.deadline_s - (self.clock() - self.t0) - MARGIN_S
            if (0.0 if self.dry_run else cell.expected_s) > left:
                reason = f"expected {cell.expected_s:.0f} s, {left:.0f} s left"
                self.records[name] = {"status": "not started", "reason": reason}
                continue
            gpu = self.free.pop(0)
            cell_out = self.out / name
            cell_out.mkdir(parents=True, exist_ok=True)
            budget = min(MAX_CELL_BUDGET_S, max(left, 1.0))
            cmd = cell.command(cell_out, work_dir(name), budget, self.reverse)
            cmd += ["--dry-run"] if self.dry_run else []
            env = dict(os.environ, CUDA_VISIBLE_DEVICES=gpu)
            self.running[name] = (self.start(cmd, env, cell_out / "run.log"), gpu, self.clock())
            self.records[name] = {"status": "started", "gpu": gpu, "command": cmd[1:],
                                  "budget_s": round(budget)}  # fmt: skip

    def stop(self) -> None:
        """Interrupted (SIGTERM, Ctrl-C): each running cell's run_e2e stops its engines on
        SIGTERM."""
        for proc, _, _ in self.running.values():
            proc.terminate()
        for proc, _, _ in self.running.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)


def run(
    names: Sequence[str],
    out: Path,
    gpus: Sequence[str],
    deadline_s: float,
    reverse: bool = False,
    dry_run: bool = False,
    start: Start = _start,
    clock: Callable[[], float] = time.monotonic,
    poll_s: float = 1.0,
) -> list[dict[str, Any]]:
    """Run the cells `names` from a queue on `gpus` until the deadline; one record per cell
    (in `names`' order): its GPU, command, exit status and seconds, or why it did not start.
    `dry_run`: run_e2e's --dry-run for each (no engine, so no cell is too long to start)."""
    q = _Queue(out, deadline_s, reverse, dry_run, start, clock, list(names), list(gpus))
    q.t0 = clock()
    try:
        while q.waiting or q.running:
            q.collect()
            q.start_next()
            if q.running:
                time.sleep(poll_s)
    finally:
        q.stop()
    return [dict(q.records[n], cell=n) for n in names]


def cell_results(record: dict[str, Any], out: Path) -> dict[str, Any]:
    """A cell's record with what its report says: each arm's ratios to its reference, the
    greedy verdict, the memory flags (nothing where it wrote no report)."""
    path = out / record["cell"] / "e2e_results.json"
    if not path.exists():
        return record
    report = json.loads(path.read_text())
    verdict = report.get("correctness_verdict") or {}
    return dict(
        record,
        ratios={arm: r.get("offline_output_tok_s") for arm, r in report.get("ratios", {}).items()},
        online={arm: r.get("online") for arm, r in report.get("ratios", {}).items()},
        verdict=None if "ok" not in verdict else ("PASS" if verdict["ok"] else "FAIL"),
        memory_flags=report.get("memory_flags", []),
        arms_status={arm: a.get("status") for arm, a in report.get("arms", {}).items()},
    )


def summary_lines(records: Sequence[dict[str, Any]]) -> list[str]:
    lines = ["cell                         gpu  rc    s    arm              ratios"]
    for r in records:
        if r.get("status") == "not started":
            lines.append(f"{r['cell']:28s} -    -     -    not started: {r['reason']}")
            continue
        ratios = r.get("ratios") or {"-": None}
        for i, (arm, by_workload) in enumerate(ratios.items()):
            text = " / ".join(f"{k} {v:.3f}" for k, v in (by_workload or {}).items()) or "-"
            head = f"{r['cell']:28s} {r['gpu']:4s} {r.get('rc')!s:5s} {r.get('seconds', '-')!s:4s}"
            lines.append(f"{head if i == 0 else ' ' * len(head)} {arm:16s} {text}")
        if r.get("verdict") is not None:
            lines.append(f"{'':28s} verdict {r['verdict']}; memory flags {r.get('memory_flags')}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    names = list(args.cells or CELLS)
    if args.list:
        for name in names:
            c = CELLS[name]
            cmd = c.command(Path("OUT") / name, work_dir(name), MAX_CELL_BUDGET_S, args.reverse)
            print(f"{name:28s} ~{c.expected_s:.0f} s  {' '.join(cmd[1:])}")
        return 0
    try:
        gpus = visible_devices(args.gpus)
    except ValueError as e:  # the variable names fewer devices than --gpus
        raise SystemExit(str(e)) from None
    args.out.mkdir(parents=True, exist_ok=True)
    exit_on_termination()
    started = time.time()
    records = run(names, args.out, gpus, args.deadline_s, args.reverse, args.dry_run)
    records = [cell_results(r, args.out) for r in records]
    payload = {
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "gpus": gpus,
        "reverse": args.reverse,
        "deadline_s": args.deadline_s,
        "note": "cells side by side, one GPU each; each cell's ratio compares its arms on its own "
        "GPU, one after another; the cells share the host's CPUs",
        "cells": records,
    }
    (args.out / "matrix.json").write_text(json.dumps(payload, indent=1))
    print("\n".join(summary_lines(records)))
    failed = [r["cell"] for r in records if r.get("rc") not in (0, None)]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
