"""Building blocks shared by the dashboards: variables, panels, links, rendering.

Conventions taken from vLLM's and Ray's dashboards: a `datasource` template variable that
every panel and query uses, a stable `uid` per dashboard, `$__rate_interval` in every
`rate()`, multi-value filter variables whose "All" matches series without the label too
(`.*`), and dashboard links by tag (`vllm`, `fuselane`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import heatmap as hm
from grafana_foundation_sdk.builders import prometheus as prom
from grafana_foundation_sdk.builders import stat as st
from grafana_foundation_sdk.builders import table as tb
from grafana_foundation_sdk.builders import timeseries as ts
from grafana_foundation_sdk.builders.common import StackingConfig
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import StackingMode
from grafana_foundation_sdk.models.dashboard import (
    DashboardCursorSync,
    DashboardLinkType,
    DataSourceRef,
    DataTransformerConfig,
    VariableOption,
    VariableRefresh,
    VariableSort,
)
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
# Grafana's tag search (panel links cannot search by tag, the browse page can)
VLLM_DASHBOARDS_URL = "/dashboards?tag=vllm"
REF_IDS = "ABCDEFGHIJ"


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str = "__auto"


@dataclass
class Row:
    title: str
    panels: list[Any] = field(default_factory=list)


def datasource_variable() -> db.DatasourceVariable:
    return db.DatasourceVariable("datasource").label("Data source").type("prometheus")


def query_variable(
    name: str,
    label: str,
    query: str,
    description: str,
    *,
    multi: bool = True,
    regex: str | None = None,
) -> db.QueryVariable:
    """A variable filled from Prometheus; multi-value ones offer "All" = `.*`."""
    v = (
        db.QueryVariable(name)
        .label(label)
        .description(description)
        .datasource(DATASOURCE)
        .query(query)
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(VariableSort.ALPHABETICAL_ASC)
        .multi(multi)
    )
    if multi:
        v = v.include_all(True).all_value(".*").current(_all())
    if regex is not None:
        v = v.regex(regex)
    return v


def custom_variable(
    name: str, label: str, values: Sequence[str], description: str
) -> db.CustomVariable:
    return (
        db.CustomVariable(name)
        .label(label)
        .description(description)
        .values(",".join(values))
        .multi(True)
        .include_all(True)
        .all_value(".*")
        .current(_all())
    )


def _all() -> VariableOption:
    return VariableOption(selected=True, text=["All"], value=["$__all"])


def target(query: Query, index: int, *, fmt: PromQueryFormat | None = None) -> prom.Dataquery:
    t = prom.Dataquery().expr(query.expr).legend_format(query.legend).ref_id(REF_IDS[index])
    t = t.datasource(DATASOURCE)
    # A table shows the series as they are now; the other panels, over the time range.
    t = t.instant() if fmt == PromQueryFormat.TABLE else t.range()
    return t if fmt is None else t.format(fmt)


def timeseries(
    title: str,
    description: str,
    queries: Sequence[Query],
    *,
    unit: str,
    width: int = 8,
    height: int = 8,
    percent_stack: bool = False,
    min_value: float | None = None,
    max_value: float | None = None,
    links: Sequence[db.DashboardLink] = (),
) -> ts.Panel:
    p = (
        ts.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit(unit)
        .span(width)
        .height(height)
        .fill_opacity(10)
        .targets([target(q, i) for i, q in enumerate(queries)])
    )
    if percent_stack:
        p = p.stacking(StackingConfig().mode(StackingMode.PERCENT)).fill_opacity(60)
    if min_value is not None:
        p = p.min(min_value)
    if max_value is not None:
        p = p.max(max_value)
    if links:
        p = p.links(list(links))
    return p


def stat(
    title: str, description: str, queries: Sequence[Query], *, unit: str, width: int = 6
) -> st.Panel:
    return (
        st.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit(unit)
        .span(width)
        .height(8)
        .targets([target(q, i) for i, q in enumerate(queries)])
    )


def heatmap(title: str, description: str, query: Query, *, unit: str, width: int = 12) -> hm.Panel:
    """A heatmap of a Prometheus histogram's buckets (`sum by (le) (increase(..._bucket))`)."""
    return (
        hm.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .span(width)
        .height(8)
        .calculate(False)
        .y_axis(hm.YAxisConfig().unit(unit))
        .targets([target(query, 0, fmt=PromQueryFormat.HEATMAP)])
    )


def table(
    title: str, description: str, query: Query, *, hide: Sequence[str], width: int = 8
) -> tb.Panel:
    """One row per series of an instant query, a column per label (`hide`: columns left out,
    Grafana's `Time` and `Value` for an info metric)."""
    organize = DataTransformerConfig(
        id_val="organize", options={"excludeByName": dict.fromkeys(hide, True)}
    )
    return (
        tb.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .span(width)
        .height(8)
        .targets([target(query, 0, fmt=PromQueryFormat.TABLE)])
        .transformations([organize])
    )


def dashboard_link(title: str, tags: Sequence[str], tooltip: str) -> db.DashboardLink:
    return (
        db.DashboardLink(title)
        .type(DashboardLinkType.DASHBOARDS)
        .tags(list(tags))
        .tooltip(tooltip)
        .as_dropdown(True)
        .keep_time(True)
        .include_vars(False)
    )


def url_link(title: str, url: str, tooltip: str) -> db.DashboardLink:
    return (
        db.DashboardLink(title)
        .type(DashboardLinkType.LINK)
        .url(url)
        .tooltip(tooltip)
        .keep_time(True)
    )


def vllm_links() -> list[db.DashboardLink]:
    """Dashboard links to vLLM's own dashboards: they carry the tag `vllm` once imported."""
    return [
        dashboard_link("vLLM", ["vllm"], "vLLM's own dashboards (tagged vllm)"),
        dashboard_link("fuselane", ["fuselane"], "the other fuselane dashboards"),
    ]


def panel_link_to_vllm() -> db.DashboardLink:
    return url_link("vLLM dashboards", VLLM_DASHBOARDS_URL, "dashboards tagged vllm")


def assemble(
    *,
    title: str,
    uid: str,
    description: str,
    tags: Sequence[str],
    variables: Sequence[Any],
    links: Sequence[db.DashboardLink],
    rows: Sequence[Row],
    annotations: Sequence[db.AnnotationQuery] = (),
) -> dict[str, Any]:
    """The dashboard as Grafana's JSON model (a plain dict), panels numbered in order."""
    d = (
        db.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(list(tags))
        .editable()
        .tooltip(DashboardCursorSync.CROSSHAIR)
        .refresh("30s")
        .time("now-1h", "now")
        .timezone("browser")
        .variables(list(variables))
        .links(list(links))
    )
    if annotations:
        d = d.annotations(list(annotations))
    for row in rows:
        d = d.with_row(db.Row(row.title))
        for panel in row.panels:
            d = d.with_panel(panel)
    model = json.loads(json.dumps(d.build(), cls=JSONEncoder))
    for i, panel in enumerate(model["panels"], start=1):
        panel["id"] = i
    return model


def annotation(name: str, expr: str, color: str) -> db.AnnotationQuery:
    return (
        db.AnnotationQuery()
        .name(name)
        .datasource(DATASOURCE)
        .expr(expr)
        .enable(True)
        .icon_color(color)
    )


def render(model: dict[str, Any]) -> str:
    """The committed text of a dashboard: stable key order, so diffs show real changes."""
    return json.dumps(model, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
