"""What the fuzzer's three families share: the case loop and its bookkeeping, the outcome
types, the comparison helpers and the count of compiled kernel variants.

A family (`Family`) draws a pool of kernel profiles once per run (the choices that change a
compiled variant: head counts, head size, block size, dtypes, option switches) and then, per
case, a profile from the pool and the runtime shapes and values around it. `run_family` runs
the cases and sorts each into passed, refused (an out-of-contract configuration refused with a
`ValueError` naming the argument the contract names), mismatched (a wrong output, a refusal of
a valid configuration, an accepted invalid one) or errors (any other exception).
"""

from __future__ import annotations

import importlib
import math
import os
import random
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

# Sizes of what a case draws: "full" for a GPU, "small" for the CPU under Triton's interpreter
# (CI), "sanitizer" for compute-sanitizer runs (every feature, shapes a slowed GPU gets through).
SCALES = ("full", "small", "sanitizer")
# Cases per compile-ahead batch (`run_family`): few enough that their inputs are drawn twice
# within a short time, many enough to keep the compile threads busy.
COMPILE_BATCH = 500
# Records kept per list in the JSON (all are counted).
MAX_RECORDS = 50
# A draw's share of deliberately out-of-contract configurations (each must be refused).
INVALID_RATE = 0.03


class Refused(Exception):
    """The kernel entry point refused its arguments with a ValueError (the message)."""


class Mismatch(AssertionError):
    """The kernel's output differs from the reference's: the message is the first difference."""


def call_kernel(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` with its ValueError turned into `Refused`: only the kernel call's
    refusals are refusals, a ValueError of the fuzzer's own code stays an error."""
    try:
        return fn(*args, **kwargs)
    except ValueError as e:
        raise Refused(str(e)) from e


@dataclass(frozen=True)
class Family:
    """One kernel family's part of the fuzzer.

    profiles(rng, count, scale) -> the run's pool of profiles (JSON-able dicts)
    draw(rng, pool, scale) -> one case's configuration (JSON-able; holds its profile)
    run(config, device, check=True) -> statistics of a passing case (raises Refused /
        Mismatch); check=False only calls the kernels (the compile-ahead pass)
    expected_refusal(config) -> the argument the contract refuses this configuration for
    finish(stats) -> family-wide checks over the merged statistics ({} if none)
    """

    name: str
    profiles: Callable[[random.Random, int, str], list[dict]]
    draw: Callable[[random.Random, list[dict], str], dict]
    run: Callable[..., dict]
    expected_refusal: Callable[[dict], str | None]
    kernel_modules: tuple[str, ...]
    default_profiles: dict[str, int]
    finish: Callable[[dict], dict] = lambda stats: {}


# ----------------------------------------------------------------------------------------------
# Drawing
# ----------------------------------------------------------------------------------------------


def profile_pool(family: Family, seed: int, count: int, scale: str) -> list[dict]:
    """The run's profiles: a function of (seed, family, count, scale) alone. String seeds hash
    through SHA-512, stable across processes and machines."""
    return family.profiles(random.Random(f"{seed}/{family.name}/profiles"), count, scale)


def draw_case(family: Family, seed: int, index: int, pool: list[dict], scale: str) -> dict:
    """Case `index`'s configuration: a function of (seed, family, index) and the pool alone, so
    that any case can be rerun by itself (`--index`)."""
    return family.draw(random.Random(f"{seed}/{family.name}/{index}"), pool, scale)


def start_case(rng: random.Random, pool: list[dict]) -> tuple[dict, bool]:
    """A case's configuration so far (a copy of its profile, and the profile's index) and
    whether the case puts an argument out of contract (a share INVALID_RATE of the cases)."""
    index = rng.randrange(len(pool))
    return {"profile": index, **pool[index]}, rng.random() < INVALID_RATE


def log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    """An int in [lo, hi] (lo >= 1) whose logarithm is uniform: small sizes as often as big."""
    return min(hi, int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1)))))


def log_uniform_float(rng: random.Random, lo: float, hi: float) -> float:
    """A float in [lo, hi] (lo > 0) whose logarithm is uniform."""
    return lo * (hi / lo) ** rng.random()


def covering(rng: random.Random, count: int, choices: dict[str, list]) -> list[dict]:
    """`count` dicts whose every key cycles through all of its choices in a shuffled order
    (each value appears once per len(choices) dicts), keys shuffled independently, so a pool
    covers every value of every dimension in few profiles with varied combinations."""
    columns = {}
    for key, values in choices.items():
        order: list = []
        while len(order) < count:
            block = list(values)
            rng.shuffle(block)
            order += block
        columns[key] = order[:count]
    return [{k: columns[k][i] for k in choices} for i in range(count)]


# e4m3fn's NaN byte: what an fp8 cache holds where nothing may be read or written.
FP8_NAN_BYTE = 0x7F


def poison_(t: torch.Tensor, where: torch.Tensor | None = None) -> torch.Tensor:
    """Fill `t` (or its elements under the bool mask `where`) with NaN, for fp8 too."""
    if t.dtype == torch.float8_e4m3fn:
        t = t.view(torch.uint8)
        value: float = FP8_NAN_BYTE
    else:
        value = float("nan")
    if where is None:
        t.fill_(value)
    else:
        t.masked_fill_(where, value)
    return t


def generator(device: torch.device, seed: int) -> torch.Generator:
    """A torch generator on `device`: inputs drawn where they are used (a GPU draws gigabytes
    in milliseconds), so a case reproduces on the same kind of device."""
    return torch.Generator(device=device).manual_seed(seed)


# ----------------------------------------------------------------------------------------------
# Comparisons
# ----------------------------------------------------------------------------------------------


def bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view of `t`'s bit patterns (NaN payloads included), any float dtype."""
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.view(torch.uint8).view(width) if t.element_size() == 1 else t.view(width)


def _where(idx: torch.Tensor) -> str:
    return "[" + ", ".join(str(int(i)) for i in idx) + "]"


def assert_bitwise(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Raise Mismatch at the first element whose bits differ."""
    bad = bits(actual) != bits(expected)
    if bad.any():
        idx = bad.nonzero()[0]
        got, want = actual[tuple(idx)].float().item(), expected[tuple(idx)].float().item()
        raise Mismatch(
            f"{what}{_where(idx)}: got {got:.6g}, want {want:.6g} (bitwise); "
            f"{int(bad.sum())} of {bad.numel()} elements differ"
        )


def assert_close(
    actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float, what: str
) -> None:
    """Raise Mismatch at the first element outside atol + rtol * |expected|; NaN in `actual`
    never passes, infinities must match exactly."""
    a, e = actual.double(), expected.double()
    bad = ~torch.isclose(a, e, atol=atol, rtol=rtol) | torch.isnan(a)
    if bad.any():
        idx = bad.nonzero()[0]
        diff = (a - e).abs().nan_to_num(float("inf")).max().item()
        raise Mismatch(
            f"{what}{_where(idx)}: got {a[tuple(idx)].item():.6g}, want "
            f"{e[tuple(idx)].item():.6g} (atol {atol:g}, rtol {rtol:g}); {int(bad.sum())} of "
            f"{bad.numel()} elements differ, max abs diff {diff:.3g}"
        )


# ----------------------------------------------------------------------------------------------
# Compiled variants
# ----------------------------------------------------------------------------------------------


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def compiled_variants(modules: Iterable[str]) -> dict[str, int]:
    """Compiled variants per @triton.jit kernel of `modules` on the current GPU (Triton's own
    cache of the device); {} under the interpreter, which compiles nothing."""
    if interpreting() or not torch.cuda.is_available():
        return {}
    dev = torch.cuda.current_device()
    out = {}
    for name in modules:
        try:
            module = importlib.import_module(name)
        except ImportError:  # Hopper's Gluon kernels on a Triton without Gluon
            continue
        for attr, obj in vars(module).items():
            caches = getattr(obj, "device_caches", None)
            if isinstance(caches, dict) and dev in caches:
                out[f"{name.rsplit('.', 1)[-1]}.{attr}"] = len(caches[dev][0])
    return out


# ----------------------------------------------------------------------------------------------
# The case loop
# ----------------------------------------------------------------------------------------------


@dataclass
class Report:
    """One family's results, as the JSON holds them."""

    family: str
    seed: int
    scale: str
    profiles: list[dict]
    cases_requested: int
    cases_run: int = 0
    passed: int = 0
    refused: dict[str, dict] = field(default_factory=dict)
    mismatched_count: int = 0
    errors_count: int = 0
    mismatched: list[dict] = field(default_factory=list)
    errors: list[dict] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)
    checks: dict[str, Any] = field(default_factory=dict)
    timing: dict[str, float] = field(default_factory=dict)
    compile_variants: dict[str, int] = field(default_factory=dict)
    new_compiles: int = 0
    wall_s: float = 0.0
    stopped_by_time_limit: bool = False
    aborted: str | None = None

    @property
    def ok(self) -> bool:
        return (
            self.mismatched_count == 0
            and self.errors_count == 0
            and self.aborted is None
            and all(c.get("ok", True) for c in self.checks.values())
        )


def repro_command(family: str, seed: int, index: int, profiles: int, scale: str) -> str:
    return (
        f"python -m fuselane.benchmarks.fuzz.kernel_fuzz --family {family} --seed {seed} "
        f"--index {index} --profiles {profiles} --scale {scale} --out repro-{family}-{index}.json"
    )


def _merge(into: dict[str, Any], stats: dict[str, Any]) -> None:
    """Counters add up, lists concatenate."""
    for k, v in stats.items():
        if isinstance(v, list):
            into.setdefault(k, []).extend(v)
        else:
            into[k] = into.get(k, 0) + v


def _names(message: str, argument: str) -> bool:
    """A refusal names `argument` as the checks do: "argument: expected ..." (or, for a
    parameter bundle, "params.argument: ...")."""
    head = message.split(":", 1)[0].strip()
    return head == argument or head.startswith(argument + " ") or head == f"params.{argument}"


def _fatal(e: BaseException) -> bool:
    """A device error after which the CUDA context is unusable (every later call fails)."""
    text = str(e)
    return "CUDA error" in text or "illegal memory access" in text or "device-side assert" in text


def run_family(
    family: Family,
    *,
    seed: int,
    cases: int,
    indices: list[int] | None,
    scale: str,
    num_profiles: int,
    device: torch.device,
    deadline: float | None,
    progress_every: int,
    compile_workers: int = 0,
    log: Callable[[str], None] = print,
) -> Report:
    """Run `cases` cases (or the given `indices`) of `family`; stops drawing at `deadline`
    (time.monotonic()).

    compile_workers > 0 (a GPU): each batch of COMPILE_BATCH cases is first launched with the
    kernels compiled instead of run, on that many threads at once (`_launch.compile_only`, what
    the plugin's start-up warm-up does), then run and checked. A variant compiles in seconds,
    mostly in LLVM and ptxas outside the GIL: one after another, the compiles of a run's few
    hundred variants would take longer than its thousands of cases."""
    pool = profile_pool(family, seed, num_profiles, scale)
    report = Report(family.name, seed, scale, pool, len(indices) if indices else cases)
    todo = list(indices) if indices else list(range(cases))
    before = compiled_variants(family.kernel_modules)
    start = time.monotonic()
    timing = {"compile_ahead_s": 0.0, "cases_compiling": 0, "compiling_s": 0.0, "warm_s": 0.0}
    for first in range(0, len(todo), COMPILE_BATCH):
        batch = todo[first : first + COMPILE_BATCH]
        if compile_workers > 0 and device.type == "cuda":
            t0 = time.monotonic()
            _compile_ahead(family, seed, batch, pool, scale, device, deadline, compile_workers)
            timing["compile_ahead_s"] += time.monotonic() - t0
        for index in batch:
            if deadline is not None and time.monotonic() >= deadline:
                report.stopped_by_time_limit = True
                break
            variants = sum(compiled_variants(family.kernel_modules).values())
            t0 = time.monotonic()
            _run_case(family, report, seed, index, pool, scale, num_profiles, device)
            took = time.monotonic() - t0
            if sum(compiled_variants(family.kernel_modules).values()) > variants:
                timing["cases_compiling"] += 1
                timing["compiling_s"] += took
            else:
                timing["warm_s"] += took
            if progress_every and report.cases_run % progress_every == 0:
                log(progress_line(report, time.monotonic() - start))
            if report.aborted:
                break
        if report.stopped_by_time_limit or report.aborted:
            break
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    report.wall_s = round(time.monotonic() - start, 3)
    warm = report.cases_run - timing["cases_compiling"]
    report.timing = {k: round(v, 3) for k, v in timing.items()}
    report.timing["warm_case_ms"] = round(1000 * timing["warm_s"] / max(1, warm), 3)
    report.checks = family.finish(report.stats)
    # per-draw lists (the sampling PIT values) feed the checks only, not the JSON
    report.stats = {k: v for k, v in report.stats.items() if not isinstance(v, list)}
    after = compiled_variants(family.kernel_modules)
    report.compile_variants = {k: v for k, v in after.items() if v}
    report.new_compiles = sum(after.values()) - sum(before.values())
    return report


def _compile_ahead(family, seed, batch, pool, scale, device, deadline, workers) -> None:
    """Launch the valid cases of `batch` with every kernel compiled, not run (no checks); a
    failure here is left to the checked run to report."""
    from fuselane.kernels import _launch

    with _launch.compile_only(workers):
        for index in batch:
            if deadline is not None and time.monotonic() >= deadline:
                break
            config = draw_case(family, seed, index, pool, scale)
            if family.expected_refusal(config) is None:
                try:
                    family.run(config, device, check=False)
                except Exception:  # noqa: BLE001 - the checked run reports it
                    continue


def _run_case(family, report, seed, index, pool, scale, num_profiles, device) -> None:
    """One case, sorted into passed, refused, mismatched or errors."""
    config = draw_case(family, seed, index, pool, scale)
    record = {
        "index": index,
        "seed": seed,
        "config": config,
        "repro": repro_command(family.name, seed, index, num_profiles, scale),
    }
    report.cases_run += 1
    try:
        expected = family.expected_refusal(config)
        stats = family.run(config, device)
    except Refused as r:
        message = str(r)
        if expected is not None and _names(message, expected):
            entry = report.refused.setdefault(expected, {"count": 0, "message": message})
            entry["count"] += 1
        else:
            _fail(report, record, "refused a valid configuration", message)
    except Mismatch as m:
        _fail(report, record, "wrong output", str(m))
    except Exception as e:  # noqa: BLE001 - every exception of a case is a finding
        report.errors_count += 1
        if len(report.errors) < MAX_RECORDS:
            tail = traceback.format_exc(limit=-6)
            report.errors.append({**record, "error": f"{type(e).__name__}: {e}", "tb": tail})
        if _fatal(e):
            report.aborted = f"case {index}: {type(e).__name__}: {e}"[:500]
    else:
        if expected is not None:
            _fail(report, record, "accepted an invalid configuration", f"{expected} not refused")
        else:
            report.passed += 1
            _merge(report.stats, stats)


def _fail(report: Report, record: dict, kind: str, message: str) -> None:
    report.mismatched_count += 1
    if len(report.mismatched) < MAX_RECORDS:
        report.mismatched.append({**record, "kind": kind, "first_mismatch": message[:2000]})


def progress_line(report: Report, elapsed: float) -> str:
    refused = sum(r["count"] for r in report.refused.values())
    return (
        f"[{report.family}] {report.cases_run}/{report.cases_requested} cases: "
        f"{report.passed} passed, {refused} refused, {report.mismatched_count} mismatched, "
        f"{report.errors_count} errors; {elapsed:.1f} s"
    )
