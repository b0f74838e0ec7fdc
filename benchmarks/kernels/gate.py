"""The performance gate: a `fuselane bench kernels` run against a committed baseline run.

    fuselane bench kernels --quick --baseline benchmarks/results/baseline-h100.json \
        [--max-regression 0.05]

Rows are matched by (section, case, impl). fuselane's own rows are compared: a row whose median
is slower than the baseline's by more than `max_regression` (a fraction) AND by more than
`min_delta_us` fails the gate — the absolute floor keeps a 1.4 µs kernel from failing on the
timer's granularity (back-to-back runs on one GPU move such rows by up to ~0.1 µs). A row
that fails is timed once more (`confirm`, the CLI's second run of the failing rows' sections
and models) and fails only if that run is beyond both thresholds too: runs of an unchanged
~20 µs kernel on one GPU differed by 5.3% (sampling B=64 V=32768, 21.2 and 22.3 µs). Peers'
rows are listed with their ratio but never fail it: a peer is not the code under test, and
peers of other versions are not comparable. A baseline from another GPU model refuses to
compare at all (a gate across GPUs measures the GPUs); other differences of the two runs
(Triton, torch, CUDA, peers' versions, grid) are reported so that a reader can judge.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_MAX_REGRESSION = 0.05
DEFAULT_MIN_DELTA_US = 0.2
# Run properties that are reported when they differ (the device model refuses instead).
_REPORTED = ("triton", "torch", "cuda", "grid", "peers", "capability", "sm_count")


class GateError(ValueError):
    """The two runs cannot be compared (another GPU model, an unreadable baseline)."""


@dataclass
class RowVerdict:
    section: str
    case: str
    impl: str
    baseline_us: float
    current_us: float
    gated: bool  # fuselane's row: can fail the gate
    rerun_us: float | None = None  # its time in the confirming run (`confirm`), if one ran

    @property
    def ratio(self) -> float:
        return self.current_us / self.baseline_us if self.baseline_us > 0 else float("inf")


@dataclass
class GateReport:
    max_regression: float
    min_delta_us: float
    device: str | None = None  # the GPU model both runs were measured on
    rows: list[RowVerdict] = field(default_factory=list)
    regressions: list[RowVerdict] = field(default_factory=list)
    unconfirmed: list[RowVerdict] = field(default_factory=list)  # slower once, not again
    only_in_baseline: list[tuple[str, str, str]] = field(default_factory=list)
    only_in_current: list[tuple[str, str, str]] = field(default_factory=list)
    differences: dict[str, tuple[Any, Any]] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return not self.regressions

    def text(self) -> str:
        lines = [
            f"performance gate: {len(self.regressions)} of "
            f"{sum(r.gated for r in self.rows)} fuselane rows slower than the baseline by more "
            f"than {self.max_regression:.0%} and {self.min_delta_us:g} us"
        ]
        for r in self.regressions:
            again = "" if r.rerun_us is None else f"; again {r.rerun_us:.3f} us"
            lines.append(
                f"  SLOWER {r.section} | {r.case} | {r.impl}: {r.current_us:.3f} us against "
                f"{r.baseline_us:.3f} us ({r.ratio:.3f}x{again})"
            )
        for r in self.unconfirmed:
            lines.append(
                f"  not confirmed {r.section} | {r.case} | {r.impl}: {r.current_us:.3f} us, "
                f"again {r.rerun_us:.3f} us, against {r.baseline_us:.3f} us (run-to-run noise)"
            )
        for name, (base, cur) in self.differences.items():
            lines.append(f"  note: {name} differs: baseline {base!r}, this run {cur!r}")
        for key in self.only_in_baseline:
            lines.append(f"  not measured in this run: {' | '.join(key)}")
        for key in self.only_in_current:
            lines.append(f"  new in this run (no baseline): {' | '.join(key)}")
        lines.append("PASS" if self.passed else "FAIL")
        return "\n".join(lines)


def load(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise GateError(f"baseline {path}: cannot read it as JSON ({e})") from e
    if data.get("benchmark") != "kernels" or not isinstance(data.get("results"), list):
        raise GateError(f"baseline {path}: not a `fuselane bench kernels` results file")
    return data


def _rows(run: dict[str, Any]) -> dict[tuple[str, str, str], float]:
    rows = {}
    for r in run["results"]:
        us = r.get("us")
        if isinstance(us, (int, float)) and us > 0:
            rows[(r["section"], r["case"], r["impl"])] = float(us)
    return rows


def compare(
    current: dict[str, Any],
    baseline: dict[str, Any],
    max_regression: float = DEFAULT_MAX_REGRESSION,
    min_delta_us: float = DEFAULT_MIN_DELTA_US,
) -> GateReport:
    """The gate's verdict on `current` against `baseline` (both results files as dicts)."""
    if not 0 <= max_regression < 10:
        raise GateError(f"max_regression: expected a fraction in [0, 10), got {max_regression}")
    if current.get("device") != baseline.get("device"):
        raise GateError(
            f"the baseline was measured on {baseline.get('device')!r}, this run on "
            f"{current.get('device')!r}: compare runs of one GPU model (commit a baseline for "
            "this one)"
        )
    report = GateReport(max_regression, min_delta_us, current.get("device"))
    for name in _REPORTED:
        if current.get(name) != baseline.get(name):
            report.differences[name] = (baseline.get(name), current.get(name))
    # Case names join the models that share a shape: another model set renames cases.
    models = [sorted(run.get("models") or ()) for run in (baseline, current)]
    if models[0] != models[1]:
        report.differences["models"] = (models[0], models[1])
    base, cur = _rows(baseline), _rows(current)
    for key in sorted(base.keys() & cur.keys()):
        row = RowVerdict(*key, base[key], cur[key], gated=key[2] == "fuselane")
        report.rows.append(row)
        if row.gated and _beyond(row.current_us, row.baseline_us, max_regression, min_delta_us):
            report.regressions.append(row)
    report.only_in_baseline = sorted(k for k in base.keys() - cur.keys() if k[2] == "fuselane")
    report.only_in_current = sorted(k for k in cur.keys() - base.keys() if k[2] == "fuselane")
    return report


def _beyond(us: float, baseline_us: float, max_regression: float, min_delta_us: float) -> bool:
    """Slower than `baseline_us` by more than both thresholds."""
    return us - baseline_us > min_delta_us and us > baseline_us * (1 + max_regression)


def rerun_selection(report: GateReport, current: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(sections, models) of `current` that hold `report`'s regressions: what the confirming
    run times (a case's `models` joins the models that share its shape with '/')."""
    failing = {(r.section, r.case) for r in report.regressions}
    sections, models = set(), set()
    for r in current["results"]:
        if (r["section"], r["case"]) in failing:
            sections.add(r["section"])
            models.update(str(r.get("models") or "").split("/"))
    return sorted(sections), sorted(m for m in models if m)


def confirm(report: GateReport, rerun: dict[str, Any]) -> GateReport:
    """`report` after a second run of its regressions' rows (`rerun`, a results file of the same
    GPU model): a row stays a regression only if the rerun is beyond both thresholds too, else
    it moves to `unconfirmed`; a row the rerun did not time stays a regression."""
    if rerun.get("device") != report.device:
        raise GateError(
            f"the confirming run was measured on {rerun.get('device')!r}, the gated one on "
            f"{report.device!r}"
        )
    again = _rows(rerun)
    kept = []
    for row in report.regressions:
        row.rerun_us = again.get((row.section, row.case, row.impl))
        if row.rerun_us is None or _beyond(
            row.rerun_us, row.baseline_us, report.max_regression, report.min_delta_us
        ):
            kept.append(row)
        else:
            report.unconfirmed.append(row)
    report.regressions = kept
    return report
