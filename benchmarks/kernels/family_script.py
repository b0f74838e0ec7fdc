"""What the per-family GPU scripts (bench_attention, bench_kv_cache, bench_sampling) share.

- the start of a run: the parser (--out), the CUDA check, torch's seed, the report and the
  ceilings it measures;
- timing: the loop size for a call and CUDA-graph replay with the eager fallback (also what
  `fuselane bench kernels` times with, suite.py); `ScriptRunner`, the timing of a call into
  a row; `try_run`, one untimed call; `check_line`, one check against a reference;
- `ScriptPeers`: where a script's peers and notes live (printed, and kept in the report);
- `GoalLines`: the GOAL lines a script derives from its report's rows;
- `guarded`, `run_sections` and `finish`: the timed sections, each failure noted while the rest
  of the run goes on, then the goal lines, the JSON (to --out and benchmarks/results/) and the
  table.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch

from fuselane.benchmarks import harness

# Timing loop sizes: calls per graph for ~5 ms per replay, replays for ~0.3 s per measurement
GRAPH_MS, MEASURE_MS = 5.0, 300.0
# Decimals the results keep of each ceiling
CEILING_DIGITS = {"copy_tbps": 3, "gemm_tflops": 1, "empty_kernel_us": 3}

Note = Callable[[str], None]


# ----------------------------------------------------------------------------------------------
# Start of a run
# ----------------------------------------------------------------------------------------------


def script_parser(doc: str) -> argparse.ArgumentParser:
    """A GPU script's parser: its docstring's first line, and --out (required)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for the JSON result")
    return parser


def no_cuda(script: str) -> bool:
    """True, and said on stderr, where no CUDA device is visible: the scripts time on a GPU."""
    if torch.cuda.is_available():
        return False
    print(f"{script} needs a CUDA device", file=sys.stderr)
    return True


def measure_ceilings(gemm: bool = True) -> dict[str, float]:
    """The run's ceilings: copy bandwidth (TB/s), the bf16 GEMM rate (TFLOP/s, where the
    family's sections count FLOPs) and an empty Triton kernel's replay time (us), unrounded."""
    ceilings = {"copy_tbps": harness.copy_ceiling_tbps()}
    if gemm:
        ceilings["gemm_tflops"] = harness.gemm_ceiling_tflops()
    ceilings["empty_kernel_us"] = harness.empty_kernel_ms() * 1e3
    return ceilings


def rounded(ceilings: dict[str, float]) -> dict[str, float]:
    """Ceilings as the results record them."""
    return {k: round(v, CEILING_DIGITS[k]) for k, v in ceilings.items()}


def start(name: str, gemm: bool) -> tuple[harness.Report, float, dict[str, float]]:
    """The clock, torch's seed, the report named `name` and its ceilings (both printed); returns
    the report, the start time and the unrounded ceilings (the report keeps them rounded)."""
    t_start = time.perf_counter()
    torch.manual_seed(0)
    report = harness.Report(name)
    print(f"device: {report.info}", flush=True)
    c = measure_ceilings(gemm)
    report.ceilings = rounded(c)
    parts = [f"copy {c['copy_tbps']:.3f} TB/s"]
    if gemm:
        parts.append(f"bf16 gemm {c['gemm_tflops']:.1f} TFLOP/s")
    parts.append(f"empty Triton kernel {c['empty_kernel_us']:.3f} us")
    print(f"ceiling: {', '.join(parts)}", flush=True)
    return report, t_start, c


# ----------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------


def estimate_ms(fn: Callable[[], object]) -> float:
    """One warm eager call, for sizing the timing loop (compiles / JIT builds happen here)."""
    fn()
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(3):
        fn()
    end.record()
    end.synchronize()
    return max(begin.elapsed_time(end) / 3, 1e-3)


def loop_sizes(fn: Callable[[], object]) -> tuple[int, int]:
    """(calls per graph, replays) for `fn`: ~GRAPH_MS per replay, ~MEASURE_MS in all."""
    est = estimate_ms(fn)
    calls = max(1, min(20, round(GRAPH_MS / est)))
    reps = max(5, min(50, round(MEASURE_MS / (est * calls))))
    return calls, reps


def time_graph_or_eager(
    fn: Callable[[], object], *, calls_per_graph: int, reps: int
) -> tuple[float, Exception | None]:
    """Per-call ms by CUDA-graph replay, or by eager calls where `fn` cannot be captured; with
    the capture's failure (None if it was captured). Raises if `fn` cannot run at all."""
    try:
        return harness.time_graph(fn, calls_per_graph=calls_per_graph, reps=reps), None
    except Exception as e:  # noqa: BLE001 - a call that cannot be captured is timed eagerly
        torch.cuda.synchronize()
        return harness.time_eager(fn, reps=reps), e


def eager_timing(failure: Exception) -> str:
    """A row's `timing` field where graph capture failed."""
    return f"eager (graph capture failed: {type(failure).__name__})"


def check_line(note: Note, name: str, check: Callable[[], tuple[bool, str]]) -> bool:
    """One GPU check against a reference: a `PASS|FAIL check name: detail` line, and a note
    where it fails (a crash is a failure, reported like one); whether it passed."""
    try:
        ok, detail = check()
    except Exception as e:  # noqa: BLE001 - a crash is a failure, reported like one
        ok, detail = False, repr(e)
        traceback.print_exc()
    print(f"{'PASS' if ok else 'FAIL'} check {name}: {detail}", flush=True)
    if not ok:
        note(f"check FAILED: {name}: {detail}")
    return ok


def try_run(note: Note, label: str, fn: Callable[[], object]) -> bool:
    """Run fn once (compiles / JIT builds happen here); False and a note if it raises."""
    try:
        fn()
        torch.cuda.synchronize()
        return True
    except Exception as e:  # noqa: BLE001
        note(f"{label}: failed to run: {e!r}")
        traceback.print_exc()
        return False


class ScriptRunner:
    """A run's clock, and the timing of one call into one row of the report, printed.

    Subclasses keep how each script has always looped, noted and printed it: the loop (`LOOP`:
    calls per graph and replays; None, sized per call by `loop_sizes`), what a note of eager
    timing ends with (`EAGER_NOTE`), a note's label (`label`), the widths of the section and
    time columns of the printed row, and where notes go (`note`).
    """

    LOOP: tuple[int, int] | None = None
    EAGER_NOTE = ", eager"
    SECTION_WIDTH = US_WIDTH = 10

    def __init__(self, report: harness.Report | None, t_start: float) -> None:
        self.report = report
        self.t_start = t_start

    def elapsed(self) -> float:
        return time.perf_counter() - self.t_start

    def note(self, text: str) -> None:
        raise NotImplementedError

    def label(self, section: str, case: str, impl: str) -> str:
        return f"{section} {case} {impl}"

    def time(
        self,
        section: str,
        case: str,
        impl: str,
        fn: Callable[[], object],
        *,
        nbytes: float | None = None,
        flops: float | None = None,
        extra: dict | None = None,
    ) -> float | None:
        """Per-call ms by graph replay (eager if capture fails, noted); None if it cannot run."""
        extra = dict(extra or {})
        label = self.label(section, case, impl)
        try:
            calls, reps = self.LOOP or loop_sizes(fn)
            ms, failed = time_graph_or_eager(fn, calls_per_graph=calls, reps=reps)
        except Exception as e:  # noqa: BLE001 - an impl that cannot run is reported, not fatal
            self.note(f"{label}: timing failed: {e!r}")
            torch.cuda.synchronize()
            return None
        if failed is not None:
            extra["timing"] = eager_timing(failed)
            self.note(f"{label}: graph capture failed ({failed!r}){self.EAGER_NOTE}")
        row = self.report.add(harness.Row(section, case, impl, ms, nbytes, flops, extra))
        rate = ""
        if row.tbps is not None:
            rate = f"{row.tbps:7.3f} TB/s"
        elif row.tflops is not None:
            rate = f"{row.tflops:7.1f} TFLOP/s"
        us = f"{ms * 1e3:{self.US_WIDTH}.2f}"
        print(f"  {section:<{self.SECTION_WIDTH}} {case:<44} {impl:<52} {us} us {rate}", flush=True)
        return ms


class ScriptPeers:
    """A script's peers (each optional: a failure to import or to run is noted and the run goes
    on) and its notes, printed as they come and kept in the report."""

    def __init__(self, report: harness.Report) -> None:
        self.report = report

    def note(self, text: str) -> None:
        print(f"NOTE {text}", flush=True)
        self.report.notes.append(text)


# ----------------------------------------------------------------------------------------------
# Goals and the end of a run
# ----------------------------------------------------------------------------------------------


class GoalLines:
    """`GOAL PASS|MISS|n/a  name: detail` lines from a report's rows (as `as_dicts` gives them)."""

    def __init__(self, report: harness.Report) -> None:
        self.rows = report.as_dicts()
        self.lines: list[str] = []

    def find(self, section: str, case: str, impl: str) -> dict | None:
        return next(
            (r for r in self.rows if (r["section"], r["case"], r["impl"]) == (section, case, impl)),
            None,
        )

    def others(self, section: str, case: str) -> list[dict]:
        """The rows of a case other than fuselane's."""
        return [
            r
            for r in self.rows
            if r["section"] == section and r["case"] == case and r["impl"] != "fuselane"
        ]

    def goal(self, name: str, ok: bool | None, detail: str) -> None:
        word = "n/a " if ok is None else ("PASS" if ok else "MISS")
        self.lines.append(f"GOAL {word} {name}: {detail}")

    def faster(self, name: str, peers: list[dict], describe: Callable[[dict], str]) -> None:
        """Goal `name`: fuselane faster than each of `peers` (rows of a case fuselane has)."""
        slowest = min((r["peer_over_fuselane"] for r in peers), default=None)
        self.goal(
            name,
            None if slowest is None else slowest > 1.0,
            ", ".join(describe(r) for r in peers) or "no peer ran",
        )


@contextlib.contextmanager
def guarded(note: Note, what: str) -> Iterator[None]:
    """Runs the block; where it raises, notes `{what} failed`, prints the traceback and waits
    for the device, so that the rest of the run (and its JSON) goes on."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - keep the rest of the run and the JSON
        note(f"{what} failed: {e!r}")
        traceback.print_exc()
        torch.cuda.synchronize()


def run_sections(
    sections: Iterable[Callable[[], None]], note: Note, elapsed: Callable[[], float]
) -> None:
    """Each section in turn (`guarded`), then the time since the start."""
    for section in sections:
        with guarded(note, "section"):
            section()
        print(f"  [{elapsed():.0f} s]", flush=True)


def finish(
    report: harness.Report, goals: Callable[[], list[str]], out: Path | None, elapsed: float
) -> None:
    """The goal lines (into the notes too), the JSON to `out` and to benchmarks/results/, the
    run's duration and the table."""
    try:
        goal_lines = goals()
    except Exception as e:  # noqa: BLE001 - the JSON is written whatever happens here
        traceback.print_exc()
        goal_lines = [f"goal evaluation failed: {e!r}"]
    report.notes.extend(goal_lines)
    print("\n".join(goal_lines))
    for out_dir in (out, None):
        print(f"wrote {report.write(out_dir)}")
    print(f"total {elapsed:.0f} s")
    print(report.table())
