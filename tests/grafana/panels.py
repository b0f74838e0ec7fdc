"""Dashboard panels against a real Prometheus that scraped a real serving run.

    assert_panels_return_data(prom.url, "vllm-server", dashboards.load("fuselane-kernels"))

Every panel query (and annotation) of the dashboard, with its template variables resolved the
way Grafana resolves them (query variables asked of the same Prometheus, multi-value ones at
"All"), is sent to Prometheus as a range query over everything it scraped; each must return a
series with a finite value, else the test fails naming the panel. Before that, every metric a
query reads must be one Prometheus has received from the run (a renamed metric fails here
with its name, not as "no data").

Not every run can fill every panel (a run with correct kernels has no failed checks); which
panels a run need not fill, and why, is `runs.NOT_REQUIRED`; `test_dashboards.py` checks that
each panel is required by at least one run.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from .promql import metric_names, substitute
from .runs import NOT_REQUIRED

DASHBOARD_DIR = Path(__file__).resolve().parents[2] / "grafana" / "dashboards"
STEP_S = 2.0


@dataclass(frozen=True)
class PanelQuery:
    title: str  # the panel's title, or "annotation: <name>"
    ref: str
    expr: str


def load(uid: str) -> dict[str, Any]:
    """A committed dashboard by uid (the JSON the user imports, not the generator's output)."""
    import json

    for path in sorted(DASHBOARD_DIR.glob("*.json")):
        model = json.loads(path.read_text())
        if model["uid"] == uid:
            return model
    raise LookupError(f"no dashboard with uid {uid!r} in {DASHBOARD_DIR}")


def panel_queries(model: Mapping[str, Any]) -> list[PanelQuery]:
    out = []
    for panel in _panels(model["panels"]):
        for t in panel.get("targets", []):
            out.append(PanelQuery(panel["title"], t["refId"], t["expr"]))
    for a in model.get("annotations", {}).get("list", []):
        if a.get("expr"):
            out.append(PanelQuery(f"annotation: {a['name']}", "annotation", a["expr"]))
    return out


def _panels(panels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    flat = []
    for p in panels:
        flat.append(p)
        flat.extend(_panels(p.get("panels", [])))  # inside collapsed rows
    return flat


def rate_interval(scrape_interval_s: float, step_s: float = STEP_S) -> str:
    """Grafana's `$__rate_interval`: max($__interval + scrape interval, 4 x scrape interval)."""
    return f"{round(max(step_s + scrape_interval_s, 4 * scrape_interval_s))}s"


class NoValue(AssertionError):
    """A variable with no value yet: the metric it is read from has not arrived."""


class Prom:
    """The few HTTP API calls the checks make."""

    def __init__(self, url: str) -> None:
        self.client = httpx.Client(base_url=url, timeout=30.0, trust_env=False)

    def _get(self, path: str, **params: Any) -> Any:
        body = self.client.get(f"/api/v1/{path}", params=params).json()
        if body.get("status") != "success":
            raise AssertionError(f"prometheus {path} {params}: {body.get('error', body)}")
        return body["data"]

    def started(self) -> float:
        return _rfc3339(self._get("status/runtimeinfo")["startTime"])

    def label_values(self, label: str, match: str | None = None) -> list[str]:
        params = {"match[]": match} if match else {}
        return sorted(self._get(f"label/{label}/values", **params))

    def instant(self, expr: str) -> list[dict]:
        return self._get("query", query=expr)["result"]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict]:
        return self._get("query_range", query=expr, start=start, end=end, step=step)["result"]


def resolve_variables(
    model: Mapping[str, Any], prom: Prom, overrides: Mapping[str, str] | None = None
) -> dict[str, str]:
    """{variable: the text Grafana puts in a query} for the dashboard's defaults."""
    values: dict[str, str] = {}
    for v in model.get("templating", {}).get("list", []):
        name = v["name"]
        if v["type"] == "datasource":
            continue
        if overrides and name in overrides:
            values[name] = overrides[name]
            continue
        if v["type"] == "custom":
            options = [o.strip() for o in v["query"].split(",") if o.strip()]
        elif v["type"] == "query":
            options = _query_options(substitute(v["query"], values), prom, v.get("regex", ""))
        else:
            raise AssertionError(f"variable {name}: type {v['type']} not handled by the test")
        if v.get("multi") or v.get("includeAll"):
            # the dashboards' default is "All"
            values[name] = v.get("allValue") or "(" + "|".join(map(re.escape, options)) + ")"
        elif options:
            values[name] = options[0]
        else:
            raise NoValue(f"variable {name}: no value in Prometheus for {v['query']!r}")
    return values


def _query_options(query: str, prom: Prom, regex: str) -> list[str]:
    m = re.fullmatch(r"label_values\((?:(.*),\s*)?(\w+)\)", query.strip())
    if m:
        options = prom.label_values(m.group(2), m.group(1))
    else:
        m = re.fullmatch(r"metrics\((.*)\)", query.strip())
        if m is None:
            raise AssertionError(f"variable query {query!r} not handled by the test")
        pattern = re.compile(m.group(1))
        options = [n for n in prom.label_values("__name__") if pattern.search(n)]
    if regex:
        # Grafana: /pattern/; the first capture group is the value when there is one
        pattern = re.compile(regex.strip("/"))
        kept = []
        for o in options:
            hit = pattern.search(o)
            if hit:
                kept.append(hit.group(1) if pattern.groups else o)
        options = kept
    return sorted(set(options))


def assert_panels_return_data(
    prom_url: str,
    run: str,
    model: Mapping[str, Any],
    *,
    overrides: Mapping[str, str] | None = None,
    scrape_interval_s: float = 1.0,
    timeout_s: float = 60.0,
) -> None:
    """Every query of `model` returns data from this run, except `NOT_REQUIRED[run]`'s."""
    prom = Prom(prom_url)
    skip = NOT_REQUIRED[run].get(model["uid"], {})
    queries = [q for q in panel_queries(model) if q.title not in skip]
    builtins = {"__rate_interval": rate_interval(scrape_interval_s), "__interval": f"{STEP_S:g}s"}
    start = prom.started()
    deadline = time.monotonic() + timeout_s
    while True:
        # Ray exports application metrics every second or so: what a run just did may lag.
        problems = _problems(prom, model, queries, overrides, builtins, start)
        if not problems or time.monotonic() > deadline:
            break
        time.sleep(2.0)
    if problems:
        problems.append(_scrapes(prom, start))
    prom.client.close()
    assert not problems, f"dashboard {model['uid']!r}, run {run!r}:\n" + "\n".join(problems)


def _scrapes(prom: Prom, start: float) -> str:
    """How many scrapes succeeded: a gap in the data may be a scrape that timed out."""
    window = f"{max(1, round(time.time() - start))}s"
    ok = prom.instant(f"sum by (job) (sum_over_time(up[{window}]))")
    total = prom.instant(f"sum by (job) (count_over_time(up[{window}]))")
    counts = {r["metric"].get("job"): r["value"][1] for r in total}
    return "successful scrapes: " + ", ".join(
        f"{r['metric'].get('job')} {r['value'][1]} of {counts.get(r['metric'].get('job'))}"
        for r in ok
    )


def _problems(
    prom: Prom,
    model: Mapping[str, Any],
    queries: list[PanelQuery],
    overrides: Mapping[str, str] | None,
    builtins: Mapping[str, str],
    start: float,
) -> list[str]:
    try:
        values = resolve_variables(model, prom, overrides) | dict(builtins)
    except NoValue as e:
        return [str(e)]
    exprs = {q: substitute(q.expr, values) for q in queries}
    known = set(prom.label_values("__name__"))
    unknown = [
        f"panel {q.title!r} ({q.ref}) reads {sorted(metric_names(e) - known)}, which "
        "Prometheus never received from this run"
        for q, e in exprs.items()
        if metric_names(e) - known
    ]
    if unknown:
        return unknown
    now = time.time()
    return [
        f"panel {q.title!r} ({q.ref}) returns no data: {e}"
        for q, e in exprs.items()
        if not _has_data(prom.query_range(e, start, now, STEP_S))
    ]


def _has_data(result: list[dict]) -> bool:
    return any(math.isfinite(float(v)) for series in result for _, v in series["values"])


def _rfc3339(text: str) -> float:
    # Prometheus writes nanoseconds; datetime takes microseconds
    text = re.sub(r"(\.\d{6})\d+", r"\1", text).replace("Z", "+00:00")
    return datetime.fromisoformat(text).timestamp()
