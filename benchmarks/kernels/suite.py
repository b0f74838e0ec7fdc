"""The `fuselane bench kernels` run: every case of the grid, fuselane and each peer, one process.

For each case (grid.py), in the grid's model-major order: build the inputs and the reference
(the family's `prepare`), then for each implementation run one call (compile / JIT happen
here; its duration is kept as `first_call_s`), check the output against the reference where
the family can (fuselane is timed only if it matches; a peer that differs is timed and
marked), and time it as the per-family scripts do (family_script.py): CUDA-graph replay of
enough calls for ~5 ms, median of enough replays for ~0.3 s (eager, and said so, if the call
cannot be captured).

FlashInfer rows whose JIT module is still being built by `peers.FlashInferWarmup` wait until
the end of the run, then are timed on inputs built again from the same seeds. The run stops
starting cases once `budget_s` has passed (what was not run is listed under `skipped`), and
always writes what it has.
"""

from __future__ import annotations

import datetime as _dt
import importlib
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Protocol

import torch

from fuselane.benchmarks import harness
from fuselane.benchmarks.kernels import family_script, grid, outputs
from fuselane.benchmarks.kernels.impls import Context, Impl, Prepared, bench_scripts_on
from fuselane.benchmarks.kernels.peers import PEERS, FlashInferWarmup, discover

FAMILY_MODULES = {
    "attention": "fuselane.benchmarks.kernels.attention_cases",
    "kv_cache": "fuselane.benchmarks.kernels.kv_cache_cases",
    "sampling": "fuselane.benchmarks.kernels.sampling_cases",
}
# Share of the budget after which no new case starts: the rest is for the FlashInfer rows
# that waited for their builds (a few tenths of a second each).
MAIN_PASS_SHARE = 0.85
NO_BUDGET_WAIT_S = 1800.0  # without a budget, how long a FlashInfer build may still take


@dataclass(frozen=True)
class Options:
    out: Path
    families: tuple[str, ...] = grid.FAMILIES
    models: tuple[str, ...] = ()  # empty: every model
    sections: tuple[str, ...] = ()  # empty: every section of the families
    grid: str = "full"
    peers: frozenset[str] = frozenset(PEERS)
    budget_s: float | None = None
    seed: int = 0

    @property
    def interpret(self) -> bool:
        return self.grid == "smoke"


class Events(Protocol):
    """Where the run reports progress (the CLI's progress bar)."""

    def begin(self, total: int) -> None: ...
    def case(self, label: str) -> None: ...
    def log(self, line: str) -> None: ...
    def end(self) -> None: ...


@dataclass
class Outcome:
    paths: dict[str, Path]
    failures: list[str]
    skipped: list[str]
    elapsed_s: float
    markdown: str


@dataclass
class _Run:
    opts: Options
    events: Events
    ctx: Context
    report: harness.Report
    modules: dict[str, ModuleType]
    failures: list[str]
    warm: FlashInferWarmup | None = None
    deadline: float | None = None  # the whole run's
    main_deadline: float | None = None  # the first pass's: no new case after it
    skipped: list[str] = field(default_factory=list)
    # FlashInfer rows waiting for their JIT build: case -> [(impl name, warm-up key)]
    deferred: dict[grid.Case, list[tuple[str, str]]] = field(default_factory=dict)

    def note(self, text: str) -> None:
        self.ctx.note(text)

    def out_of_time(self, deadline: float | None) -> bool:
        return deadline is not None and time.monotonic() > deadline


def run(opts: Options, events: Events) -> Outcome:
    t0 = time.monotonic()
    device = torch.device("cpu" if opts.interpret else "cuda")
    torch.manual_seed(opts.seed)
    report = harness.Report("kernels")

    def note(text: str) -> None:
        report.notes.append(text)
        events.log(f"NOTE {text}")

    cases = grid.build_grid(opts.families, opts.models or None, opts.grid, opts.sections or None)
    modules, failures = {}, []
    for family in dict.fromkeys(c.family for c in cases):
        try:
            modules[family] = importlib.import_module(FAMILY_MODULES[family])
        except Exception as e:  # noqa: BLE001 - the other families still run
            traceback.print_exc()
            failures.append(f"{family}: cannot be imported: {e!r}")
            note(f"family {family} not run: import failed: {e!r}")
    cases = [c for c in cases if c.family in modules]
    events.log(f"device: {report.info}")
    ctx = Context(device=device, peers=discover(opts.peers, note), grid=opts.grid, note=note)
    state = _Run(opts, events, ctx, report, modules, failures)
    if opts.budget_s:
        state.deadline = t0 + opts.budget_s
        state.main_deadline = t0 + MAIN_PASS_SHARE * opts.budget_s
    try:
        if ctx.peers.flashinfer is not None and not opts.interpret:
            specs: dict[str, dict] = {}
            for case in cases:  # in the order the cases need them
                for key, spec in modules[case.family].warmups(case).items():
                    specs.setdefault(key, spec)
            state.warm = FlashInferWarmup(specs, note)
        report.ceilings = measure_ceilings(device)
        events.log(f"ceilings: {report.ceilings}")
        events.begin(len(cases))
        with bench_scripts_on(device):
            for case in cases:
                if state.out_of_time(state.main_deadline):
                    state.skipped.append(f"{case.section} {case.key}: time budget spent")
                    continue
                events.case(f"{case.section} {case.key}")
                _run_case(state, case)
            _run_deferred(state)
    except BaseException as e:  # a stop (SIGTERM from `timeout`) or a crash: what ran is written
        note(f"run stopped early, cases after this point not run: {e!r}")
        raise
    finally:
        if state.warm is not None:
            state.warm.close()
        events.end()
        payload = _payload(state, cases, time.monotonic() - t0)
        paths = outputs.write_all(payload, opts.out)
    if not any(k.startswith("png:") for k in paths):
        events.log("PNG plots skipped: matplotlib is not installed (pip install matplotlib)")
    return Outcome(
        paths, state.failures, state.skipped, payload["elapsed_s"], outputs.markdown(payload)
    )


def measure_ceilings(device: torch.device) -> dict[str, float]:
    """The run's own ceilings: the rooflines, and every row's share of them, divide by these."""
    if device.type == "cuda":
        return family_script.rounded(family_script.measure_ceilings(gemm=True))
    # Interpreter smoke run: the host's copy and matmul rates, so every output has ceilings.
    src = torch.randn(1 << 22)
    dst = torch.empty_like(src)
    t = time.perf_counter()
    dst.copy_(src)
    copy_s = time.perf_counter() - t
    a = torch.randn(256, 256)
    t = time.perf_counter()
    a @ a
    mm_s = time.perf_counter() - t
    return {
        "copy_tbps": round(2 * src.numel() * 4 / copy_s / 1e12, 4),
        "gemm_tflops": round(2 * 256**3 / mm_s / 1e12, 4),
    }


def time_call(fn: Callable[[], object], interpret: bool) -> tuple[float, str]:
    """Milliseconds per call and how they were measured."""
    if interpret:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3, "interpreter, one call"
    calls, reps = family_script.loop_sizes(fn)
    ms, failed = family_script.time_graph_or_eager(fn, calls_per_graph=calls, reps=reps)
    return ms, "cuda-graph" if failed is None else family_script.eager_timing(failed)


def _sync() -> None:
    """Wait for the device after a failure; a broken context raises again, which is moot here."""
    if torch.cuda.is_available():
        try:
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001
            traceback.print_exc()


def _run_case(state: _Run, case: grid.Case, only: set[str] | None = None) -> None:
    try:
        prep = state.modules[case.family].prepare(state.ctx, case)
    except Exception as e:  # noqa: BLE001 - one case's failure must not end the run
        traceback.print_exc()
        _sync()
        state.failures.append(f"{case.section} {case.key}: inputs: {e!r}")
        state.note(f"{case.section} {case.key}: inputs could not be built: {e!r}")
        return
    for impl in prep.impls:
        if only is not None and impl.name not in only:
            continue
        if impl.warm is not None and state.warm is not None and only is None:
            build = state.warm.state(impl.warm)
            if build == "pending":  # timed at the end, once FlashInfer has built it
                state.deferred.setdefault(case, []).append((impl.name, impl.warm))
                continue
            if build == "failed":
                state.skipped.append(f"{case.section} {case.key} {impl.name}: build failed")
                continue
        _run_impl(state, case, prep, impl)


def _run_deferred(state: _Run) -> None:
    for case, waiting in state.deferred.items():
        if state.out_of_time(state.deadline):
            spent = f"{case.section} {case.key} {{}}: time budget spent"
            state.skipped += [spent.format(name) for name, _ in waiting]
            continue
        ready = set()
        deadline = state.deadline or time.monotonic() + NO_BUDGET_WAIT_S
        for name, key in waiting:
            build = state.warm.wait(key, deadline) if state.warm is not None else "ready"
            if build == "ready":
                ready.add(name)
            else:
                why = "build failed" if build == "failed" else "build not done within the budget"
                state.skipped.append(f"{case.section} {case.key} {name}: {why}")
        if ready:
            state.events.log(f"  (built) {case.section} {case.key}: {', '.join(sorted(ready))}")
            _run_case(state, case, only=ready)


def _failed(state: _Run, label: str, what: str, e: Exception, ours: bool) -> None:
    """A call that raised: its traceback, the device waited for, a note (`{label}: {what}`),
    and a failure of the run where the call was fuselane's."""
    traceback.print_exc()
    _sync()
    state.note(f"{label}: {what}: {e!r}")
    if ours:
        state.failures.append(f"{label}: {what}")


def _run_impl(state: _Run, case: grid.Case, prep: Prepared, impl: Impl) -> None:
    label = f"{case.section} {case.key} {impl.name}"
    ours = impl.peer == "fuselane"
    try:
        fn, check = impl.setup()
        t = time.perf_counter()
        fn()
        _sync()
        first_s = time.perf_counter() - t
    except Exception as e:  # noqa: BLE001 - an implementation that cannot run is reported
        _failed(state, label, "failed to run", e, ours)
        return
    extra: dict[str, object] = {
        "family": case.family,
        "models": case.model_label,
        "shape": case.shape.heads,
        "label": case.label,
        **case.params,
        **prep.extra,
        **impl.extra,
        "first_call_s": round(first_s, 3),
    }
    if check is not None:
        try:
            ok, detail = check()
        except Exception as e:  # noqa: BLE001 - a check that crashes is a failed check
            traceback.print_exc()
            ok, detail = False, f"check raised {e!r}"
        extra.update(check_ok=ok, check=detail)
        if not ok and ours:
            state.failures.append(f"{label}: output differs from the reference")
            state.note(f"{label}: output differs from the reference, not timed: {detail}")
            return
        if not ok:
            state.note(f"{label}: output differs from the reference (timed anyway): {detail}")
    try:
        ms, how = time_call(fn, state.opts.interpret)
    except Exception as e:  # noqa: BLE001
        _failed(state, label, "timing failed", e, ours)
        return
    extra["timing"] = how
    row = state.report.add(
        harness.Row(case.section, case.key, impl.name, ms, prep.nbytes, prep.flops, extra)
    )
    rate = f"{row.tbps:8.3f} TB/s" if row.tbps is not None else ""
    if row.tflops is not None:
        rate = f"{row.tflops:8.1f} TFLOP/s"
    state.events.log(
        f"  {case.section:<13} {case.key:<48} {impl.name:<40} {ms * 1e3:10.2f} us {rate}"
    )


def _payload(state: _Run, cases: list[grid.Case], elapsed_s: float) -> dict[str, object]:
    opts, report = state.opts, state.report
    peers = state.ctx.peers
    versions = {}
    for name in PEERS:
        if peers is None or name not in opts.peers:
            versions[name] = "not requested"
        else:
            versions[name] = peers.versions.get(name, "not importable (see notes)")
    models = {}
    for case in cases:
        for name in case.models:
            models.setdefault(name, grid.MODELS.get(name, case.shape).describe())
    return {
        "benchmark": "kernels",
        "date": _dt.date.today().isoformat(),
        **report.info,
        "interpret": opts.interpret,
        "grid": opts.grid,
        "families": list(opts.families),
        "sections": list(opts.sections) or "all",
        "models": models,
        "peers": versions,
        "ceilings": report.ceilings,
        "budget_s": opts.budget_s,
        "elapsed_s": round(elapsed_s, 1),
        "flashinfer_build_s": state.warm.build_s if state.warm is not None else {},
        "failures": state.failures,
        "skipped": state.skipped,
        "notes": report.notes,
        "results": report.as_dicts(),
    }
