"""Per-test results of a run of vLLM's attention-backend tests, read from pytest's junit XML.

Each `<testcase>` becomes one record: the test function, its parameters and the backend it ran
(junit properties the plugin wrote), and an outcome:

- `passed`, `failed` (an assertion or exception in the test), `error` (in set-up or tear-down);
- `refused`: fuselane's `validate_configuration` refused the layer's configuration, so vLLM
  would never run fuselane there (the message holds vLLM's reasons);
- `not_listed`: the backend is in none of the lists the test reads (vLLM's own choice for a
  stock backend, e.g. TRITON_ATTN is not in its non-causal list);
- `out_of_time`: not started, the run's time budget (`--budget-s`) was spent;
- `skipped`: any other skip (a backend that cannot import here, a GPU-specific test), `xfailed`.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path
from typing import Any

from .pytest_plugin import CUSTOM, NOT_LISTED, OUT_OF_TIME, REFUSED

OUTCOMES = (
    "passed",
    "failed",
    "error",
    "refused",
    "not_listed",
    "out_of_time",
    "skipped",
    "xfailed",
)
MESSAGE_CHARS = 4000  # of a failure's text, enough for torch's mismatch report


def _properties(case: ET.Element) -> dict[str, Any]:
    """The plugin's properties: `backend`/`params` once; `ran`/`validation` may repeat."""
    out: dict[str, Any] = {"ran": [], "validation": {}}
    for prop in case.iter("property"):
        name, value = prop.get("name", ""), prop.get("value", "")
        if name == "ran":
            out["ran"].append(json.loads(value))
        elif name == "validation":
            out["validation"].update(json.loads(value))
        elif name == "params":
            out["params"] = json.loads(value)
        else:
            out[name] = value
    return out


def _outcome(case: ET.Element) -> tuple[str, str]:
    for tag in ("failure", "error"):
        found = case.find(tag)
        if found is not None:
            text = (found.get("message") or "") + "\n" + (found.text or "")
            return ("failed" if tag == "failure" else "error"), text.strip()[-MESSAGE_CHARS:]
    skipped = case.find("skipped")
    if skipped is None:
        return "passed", ""
    message = skipped.get("message") or skipped.text or ""
    if skipped.get("type") == "pytest.xfail":
        return "xfailed", message
    for marker, outcome in ((REFUSED, "refused"), (NOT_LISTED, "not_listed"),
                            (OUT_OF_TIME, "out_of_time")):  # fmt: skip
        if marker in message:
            return outcome, message[message.index(marker) :]
    return "skipped", message


def read_junit(path: Path) -> list[dict[str, Any]]:
    """One record per test case of the junit XML at `path`."""
    records = []
    for case in ET.parse(path).getroot().iter("testcase"):
        name = case.get("name", "")
        props = _properties(case)
        outcome, message = _outcome(case)
        records.append(
            {
                "id": f"{case.get('classname', '')}::{name}",
                "test": name.split("[", 1)[0],
                "backend": props.get("backend", "n/a"),
                "params": props.get("params", {}),
                "outcome": outcome,
                "message": message,
                "time_s": round(float(case.get("time") or 0.0), 3),
                "ran": props["ran"],
                "validation": props["validation"],
            }
        )
    return records


def summarize(records: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Outcome counts per backend (every outcome named, zeros included)."""
    out: dict[str, dict[str, int]] = {}
    for backend in sorted({r["backend"] for r in records}):
        counts = Counter(r["outcome"] for r in records if r["backend"] == backend)
        out[backend] = {k: counts.get(k, 0) for k in OUTCOMES}
    return out


def fuselane_report(records: list[dict[str, Any]]) -> dict[str, Any]:
    """fuselane's part of the run: every failure with its spec and message, and every refusal
    with vLLM's reasons, grouped by reason."""
    mine = [r for r in records if r["backend"] == CUSTOM]
    failures = [
        {k: r[k] for k in ("test", "params", "outcome", "message")}
        for r in mine
        if r["outcome"] in ("failed", "error")
    ]
    refusals: dict[str, list[str]] = {}
    for r in mine:
        if r["outcome"] == "refused":
            reason = r["message"].removeprefix(REFUSED)
            refusals.setdefault(reason, []).append(r["id"])
    ran = sum(1 for r in mine if r["ran"] and r["outcome"] in ("passed", "failed", "error"))
    return {
        "ran": ran,
        "passed": sum(1 for r in mine if r["outcome"] == "passed"),
        "failures": failures,
        "refused": [{"reasons": k, "tests": v} for k, v in sorted(refusals.items())],
        "unexplained": len(failures),
    }
