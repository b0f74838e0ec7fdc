"""The reports of `fuselane bench serve`: what goes into `--out` (`requests.jsonl`,
`results.json` with versions and server info, `comparison.md`, and with matplotlib
`latency.png` and `throughput.png`), the comparison table printed at the end, and
`load_request_log`, which reads a request log back."""

from __future__ import annotations

import datetime as _dt
import json
import math
import platform
from collections.abc import Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fuselane.serving.bench_serve_metrics import LATENCY_METRICS, METRIC_NAMES, percentile_key
from fuselane.serving.bench_serve_sweep import Run
from fuselane.serving.loadgen import Endpoint, RequestRecord, wait_ready

if TYPE_CHECKING:  # imported where requests are sent, so that `fuselane --help` needs no httpx
    import httpx


def _comparison_rows(percentiles: Sequence[float], goodput: bool) -> list[tuple[str, str, str]]:
    """(summary key, row title, which direction is better)."""
    rows = [
        ("completed", "completed requests", "higher"),
        ("failed", "failed requests", "lower"),
        ("request_throughput", "request throughput (req/s)", "higher"),
        ("output_throughput", "output throughput (tok/s)", "higher"),
        ("total_token_throughput", "total token throughput (tok/s)", "higher"),
    ]
    if goodput:
        rows.append(("request_goodput", "goodput (req/s)", "higher"))
    for m in LATENCY_METRICS:
        rows.append((f"mean_{m}_ms", f"mean {METRIC_NAMES[m]} (ms)", "lower"))
        for p in percentiles:
            key = percentile_key(p)
            rows.append((f"{key}_{m}_ms", f"{key.upper()} {METRIC_NAMES[m]} (ms)", "lower"))
    return rows


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, int):
        return str(v)
    return f"{v:.2f}" if abs(v) < 1e5 else f"{v:.3g}"


def comparison_table(
    runs: Sequence[Run],
    baseline: str,
    percentiles: Sequence[float] = (50, 90, 99),
    goodput: bool = False,
) -> str:
    """Markdown: per sweep point, each metric of every endpoint and its ratio to `baseline`."""
    labels = list(dict.fromkeys(r.result.label for r in runs))
    others = [lb for lb in labels if lb != baseline]
    out = []
    for point in dict.fromkeys(r.point for r in runs):
        by_label = {r.result.label: r.summary for r in runs if r.point == point}
        base = by_label.get(baseline)
        head = ["metric", *labels, *(f"{o}/{baseline}" for o in others), "better"]
        out.append(f"### {point.name}\n")
        out.append("| " + " | ".join(head) + " |")
        out.append("|" + "---|" * len(head))
        for key, title, better in _comparison_rows(percentiles, goodput):
            cells = [title, *(_fmt(by_label.get(lb, {}).get(key)) for lb in labels)]
            for o in others:
                b = base.get(key) if base else None
                v = by_label.get(o, {}).get(key)
                cells.append(f"{v / b:.3f}" if b and v is not None else "-")
            cells.append(better)
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def write_plots(runs: Sequence[Run], out_dir: Path, percentiles: Sequence[float]) -> list[Path]:
    """latency.png (percentiles of each latency metric vs load, per endpoint) and
    throughput.png; the x axis is the offered request rate when every point has a finite one,
    else the achieved request throughput. Returns [] when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    offered = all(math.isfinite(r.point.request_rate) for r in runs)
    xlabel = "offered request rate (req/s)" if offered else "achieved request throughput (req/s)"

    def x(run: Run) -> float:
        return run.point.request_rate if offered else run.summary["request_throughput"]

    labels = list(dict.fromkeys(r.result.label for r in runs))
    styles = ["-", "--", ":", "-."]
    fig, axes = plt.subplots(2, 2, figsize=(11, 8), constrained_layout=True)
    for ax, metric in zip(axes.flat, LATENCY_METRICS, strict=True):
        for ci, label in enumerate(labels):
            mine = sorted((r for r in runs if r.result.label == label), key=x)
            for pi, p in enumerate(percentiles):
                key = f"{percentile_key(p)}_{metric}_ms"
                ax.plot(
                    [x(r) for r in mine],
                    [r.summary[key] for r in mine],
                    linestyle=styles[pi % len(styles)],
                    marker="o",
                    color=f"C{ci}",
                    label=f"{label} {percentile_key(p)}",
                )
        ax.set_title(f"{METRIC_NAMES[metric]} percentiles")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("ms")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    paths = [out_dir / "latency.png", out_dir / "throughput.png"]
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(7, 4.5), constrained_layout=True)
    for ci, label in enumerate(labels):
        mine = sorted((r for r in runs if r.result.label == label), key=x)
        ax.plot(
            [x(r) for r in mine],
            [r.summary["output_throughput"] for r in mine],
            marker="o",
            color=f"C{ci}",
            label=label,
        )
    ax.set_xlabel(xlabel)
    ax.set_ylabel("output tokens/s")
    ax.set_title("output token throughput")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(paths[1], dpi=110)
    plt.close(fig)
    return paths


def versions() -> dict[str, str]:
    found = {"python": platform.python_version(), "platform": platform.platform()}
    for dist in ("fuselane", "httpx", "tqdm", "matplotlib", "tokenizers"):
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return found


async def server_info(client: httpx.AsyncClient, ep: Endpoint) -> dict[str, Any]:
    """What the endpoint says about itself: `/v1/models` and, if it has one, `/version`."""
    import httpx

    info: dict[str, Any] = {"url": ep.base_url, "models": (await wait_ready(client, ep, 5))}
    try:
        resp = await client.get(ep.base_url.rstrip("/") + "/version", headers=dict(ep.headers))
        if resp.status_code == 200:
            info["version"] = resp.json()
    except (httpx.HTTPError, ValueError):
        pass
    return info


def load_request_log(path: str | Path) -> list[tuple[dict[str, Any], RequestRecord]]:
    """Read `requests.jsonl` back: (the run's point, the record) per line."""
    rows = []
    for line in Path(path).read_text().splitlines():
        d = json.loads(line)
        rows.append((d.pop("run"), RequestRecord.from_json(d)))
    return rows


def write_results(
    out_dir: Path,
    runs: Sequence[Run],
    args: Mapping[str, Any],
    info: Mapping[str, Any],
    baseline: str,
    percentiles: Sequence[float],
    goodput: Mapping[str, float],
) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    log = out_dir / "requests.jsonl"
    with log.open("w") as f:
        for i, run in enumerate(runs):
            tag = _run_tag(i, run)
            for rec in run.result.records:
                f.write(json.dumps({"run": tag, **rec.to_json()}) + "\n")
    results = {
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "versions": versions(),
        "args": dict(args),
        "servers": dict(info),
        "baseline": baseline,
        "request_log": log.name,
        "runs": [
            {
                **_run_tag(i, run),
                "model": run.result.model,
                "api": run.result.api,
                "burstiness": run.result.burstiness,
                "started_at": run.result.started_at,
                **run.summary,
            }
            for i, run in enumerate(runs)
        ],
    }
    paths = {
        "log": log,
        "results": out_dir / "results.json",
        "comparison": out_dir / "comparison.md",
    }
    paths["results"].write_text(json.dumps(results, indent=2, default=_json_default) + "\n")
    paths["comparison"].write_text(
        comparison_table(runs, baseline, percentiles, bool(goodput)) + "\n"
    )
    for p in write_plots(runs, out_dir, percentiles):
        paths[p.stem] = p
    return paths


def _run_tag(i: int, run: Run) -> dict[str, Any]:
    rate = run.point.request_rate
    return {
        "run": i,
        "label": run.result.label,
        "request_rate": "inf" if math.isinf(rate) else rate,
        "max_concurrency": run.point.max_concurrency,
    }


def _json_default(o: Any) -> Any:
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serializable: {type(o).__name__}")
