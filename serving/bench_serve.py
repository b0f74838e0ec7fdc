"""`fuselane bench serve`: end-to-end serving benchmark of one or more OpenAI-compatible endpoints.

Typical use, the two arms as two vLLM servers (or the canary ingress with an arm header):

    fuselane bench serve stock=http://127.0.0.1:8001 custom=http://127.0.0.1:8002 \\
        --request-rate 1 2 4 inf --num-prompts 200 --input-len 512 --output-len 128 \\
        --goodput ttft:500 tpot:50 --out results/serve

Every sweep point (request rate x max concurrency) runs against each endpoint in turn with the
same requests. Written to `--out`: `requests.jsonl` (the request log, one line per request),
`results.json` (arguments, versions, server info, one summary per run computed from the log),
`comparison.md` (each metric of each endpoint next to the baseline's, with the ratio) and, when
matplotlib is installed, `latency.png` and `throughput.png`.

Metric definitions are `vllm bench serve`'s (vllm/benchmarks/serve.py, `calculate_metrics`), so
numbers can be set side by side with it:
- TTFT: send to first output chunk; E2EL: send to last output chunk;
- TPOT: (E2EL - TTFT) / (output tokens - 1), over requests with more than one output token;
- ITL: every gap between consecutive output chunks, pooled over requests;
- throughputs divide by the run's duration (first release to last completion): completed
  requests, output tokens (the usage field's), input + output tokens;
- goodput: completed requests per second meeting every SLO given (`ttft`, `tpot`, `e2el` in ms;
  TPOT counts as 0 for one-token outputs);
- mean, median, population std and linear-interpolation percentiles, in ms.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import math
import platform
import statistics
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fuselane.serving.datasets import (
    LengthSpec,
    LocalTokenizer,
    ServerTokenizer,
    Tokenizer,
    dataset_requests,
    load_dataset,
    synthetic_requests,
)
from fuselane.serving.loadgen import (
    Endpoint,
    LoadResult,
    RequestRecord,
    RequestSpec,
    make_client,
    resolve_model,
    run_load,
    wait_ready,
)

if TYPE_CHECKING:  # imported where requests are sent, so that `fuselane --help` needs no httpx
    import httpx

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
METRIC_NAMES = {
    "ttft": "TTFT",
    "tpot": "TPOT",
    "itl": "ITL",
    "e2el": "E2EL",
}
GOODPUT_KEYS = ("ttft", "tpot", "e2el")


# ----------------------------------------------------------------------------------- metrics


def percentile(values: Sequence[float], p: float) -> float:
    """numpy.percentile's default (linear interpolation between closest ranks); 0 if empty,
    as vLLM reports an empty metric."""
    if not values:
        return 0.0
    xs = sorted(values)
    rank = (len(xs) - 1) * p / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def percentile_key(p: float) -> str:
    """vLLM's key spelling: p99, p99.9."""
    return f"p{int(p)}" if int(p) == p else f"p{p}"


def output_tokens(rec: RequestRecord) -> int:
    """The server's completion token count; the chunk count only if the server sent no usage."""
    return rec.completion_tokens if rec.completion_tokens is not None else len(rec.chunk_s)


def input_tokens(rec: RequestRecord) -> int:
    """The server's prompt token count, else the planned one (0 if unknown)."""
    if rec.prompt_tokens is not None:
        return rec.prompt_tokens
    return rec.prompt_len or 0


def summarize(
    records: Sequence[RequestRecord],
    duration_s: float,
    percentiles: Sequence[float] = (50, 90, 99),
    goodput: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """The metrics of one run, computed from its request log (keys as in vLLM's result JSON)."""
    done = [r for r in records if r.ok]
    ttfts = [r.chunk_s[0] for r in done]
    e2els = [r.chunk_s[-1] for r in done]
    itls = [gap for r in done for gap in r.itl_s]
    tpots, all_tpots = [], []
    for r in done:
        n = output_tokens(r)
        tpot = (r.chunk_s[-1] - r.chunk_s[0]) / (n - 1) if n > 1 else 0.0
        if n > 1:
            tpots.append(tpot)
        all_tpots.append(tpot)  # vLLM: one-token outputs meet any TPOT SLO
    total_in = sum(input_tokens(r) for r in done)
    total_out = sum(output_tokens(r) for r in done)
    good = 0
    if goodput:
        per_req = {"ttft": ttfts, "tpot": all_tpots, "e2el": e2els}
        for i in range(len(done)):
            if all(per_req[k][i] <= slo_ms / 1000.0 for k, slo_ms in goodput.items()):
                good += 1
    dur = duration_s if duration_s > 0 else float("nan")
    out: dict[str, Any] = {
        "duration": duration_s,
        "requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(done) / dur,
        "request_goodput": good / dur if goodput else None,
        "output_throughput": total_out / dur,
        "total_token_throughput": (total_in + total_out) / dur,
        # Requests whose output count fell back to chunks (no usage field from the server).
        "output_tokens_without_usage": sum(1 for r in done if r.completion_tokens is None),
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        out[f"mean_{name}_ms"] = statistics.fmean(values) * 1000 if values else 0.0
        out[f"median_{name}_ms"] = percentile(values, 50) * 1000
        out[f"std_{name}_ms"] = statistics.pstdev(values) * 1000 if values else 0.0
        for p in percentiles:
            out[f"{percentile_key(p)}_{name}_ms"] = percentile(values, p) * 1000
    out.update(_peaks(done))
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            key = f"{r.status}: {r.error[:120]}"
            errors[key] = errors.get(key, 0) + 1
    out["errors"] = errors
    return out


def _peaks(done: Sequence[RequestRecord]) -> dict[str, float]:
    """vLLM's peak output chunks per one-second bucket and peak requests active in a bucket."""
    if not done:
        return {"max_output_tokens_per_s": 0.0, "max_concurrent_requests": 0}
    t0 = min(r.start_s for r in done)
    n = math.ceil(max(r.start_s + r.chunk_s[-1] for r in done) - t0) + 1
    tokens, active = [0] * n, [0] * n
    for r in done:
        for c in r.chunk_s:
            tokens[int(r.start_s + c - t0)] += 1
        for s in range(int(r.start_s - t0), int(r.start_s + r.chunk_s[-1] - t0) + 1):
            active[s] += 1
    return {"max_output_tokens_per_s": float(max(tokens)), "max_concurrent_requests": max(active)}


def parse_goodput(pairs: Iterable[str]) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for pair in pairs:
        name, sep, value = pair.partition(":")
        try:
            ms = float(value) if sep else math.nan
        except ValueError:
            ms = math.nan
        if name not in GOODPUT_KEYS or math.isnan(ms) or ms < 0:
            raise ValueError(
                f"bad SLO {pair!r}: write NAME:MS with NAME one of {', '.join(GOODPUT_KEYS)} "
                "and MS a non-negative number of milliseconds, e.g. ttft:500"
            )
        slos[name] = ms
    return slos


# ----------------------------------------------------------------------------------- sweeps


@dataclass(frozen=True)
class SweepPoint:
    request_rate: float = math.inf
    max_concurrency: int | None = None

    @property
    def name(self) -> str:
        rate = "inf" if math.isinf(self.request_rate) else f"{self.request_rate:g}"
        conc = "unlimited" if self.max_concurrency is None else str(self.max_concurrency)
        return f"rate={rate} req/s, concurrency={conc}"


@dataclass
class Run:
    point: SweepPoint
    result: LoadResult
    summary: dict[str, Any]


@dataclass
class SweepOptions:
    api: str = "completions"
    burstiness: float = 1.0
    percentiles: Sequence[float] = (50, 90, 99)
    goodput: Mapping[str, float] = field(default_factory=dict)
    ignore_eos: bool = True
    max_duration_s: float | None = None
    request_timeout_s: float = 300.0
    warmup: int = 1
    seed: int = 0
    progress: bool = True
    extra_body: Mapping[str, Any] = field(default_factory=dict)


async def run_sweep(
    endpoints: Sequence[Endpoint],
    requests: Sequence[RequestSpec],
    points: Sequence[SweepPoint],
    opts: SweepOptions,
    client: httpx.AsyncClient,
) -> list[Run]:
    """Each point against each endpoint in turn, same requests and arrival times. Endpoints are
    interleaved per point and the first one rotates from point to point, so neither a drift of
    the machine over the sweep nor going first favours one endpoint."""
    runs: list[Run] = []
    for ep in endpoints:
        if opts.warmup > 0:
            # Not measured: first requests pay for lazy initialisation on some servers.
            warm = [RequestSpec(r.prompt, r.output_len, r.prompt_len) for r in requests[:1]]
            await run_load(
                ep,
                warm * opts.warmup,
                api=opts.api,  # type: ignore[arg-type]
                max_concurrency=1,
                request_timeout_s=opts.request_timeout_s,
                ignore_eos=opts.ignore_eos,
                extra_body=opts.extra_body,
                client=client,
            )
    for k, point in enumerate(points):
        shift = k % len(endpoints)
        for ep in [*endpoints[shift:], *endpoints[:shift]]:
            result = await run_load(
                ep,
                requests,
                api=opts.api,  # type: ignore[arg-type]
                request_rate=point.request_rate,
                burstiness=opts.burstiness,
                max_concurrency=point.max_concurrency,
                max_duration_s=opts.max_duration_s,
                request_timeout_s=opts.request_timeout_s,
                ignore_eos=opts.ignore_eos,
                extra_body=opts.extra_body,
                seed=opts.seed,
                progress=opts.progress,
                client=client,
            )
            summary = summarize(result.records, result.duration_s, opts.percentiles, opts.goodput)
            summary["not_sent"] = result.not_sent
            runs.append(Run(point, result, summary))
    return runs


# ----------------------------------------------------------------------------------- reports


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


# ----------------------------------------------------------------------------------- CLI


def _endpoint_spec(text: str) -> tuple[str, str]:
    label, sep, url = text.partition("=")
    if not sep:
        label, url = "", text
    if not url.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(
            f"{text!r}: write LABEL=URL or URL with an http(s) URL, "
            "e.g. stock=http://127.0.0.1:8001"
        )
    if not label:
        label = url.split("://", 1)[1].rstrip("/")
    elif not all(c.isalnum() or c in "-_." for c in label):
        raise argparse.ArgumentTypeError(f"label {label!r}: use letters, digits, '-', '_', '.'")
    return label, url.rstrip("/")


def _header_spec(text: str) -> tuple[str | None, str, str]:
    left, sep, value = text.partition("=")
    label, colon, name = left.rpartition(":")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(
            f"{text!r}: write NAME=VALUE (every endpoint) or LABEL:NAME=VALUE (one endpoint), "
            "e.g. custom:x-fuselane-arm=custom"
        )
    return (label if colon else None), name.strip(), value


def _rate(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if not v > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a request rate is a number > 0 or 'inf'")
    return v


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected an integer >= 1")
    return v


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if not v > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number > 0")
    return v


def _length(text: str) -> LengthSpec:
    try:
        return LengthSpec.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _percentile_arg(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if not 0 <= v <= 100:
        raise argparse.ArgumentTypeError(f"{text!r}: a percentile is a number from 0 to 100")
    return v


def _goodput_arg(text: str) -> str:
    try:
        parse_goodput([text])
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return text


DESCRIPTION = """\
Load one or more OpenAI-compatible endpoints (vLLM servers, the fuselane canary ingress) with
streaming requests and report TTFT, TPOT, ITL, end-to-end latency, throughput and goodput with
the definitions of `vllm bench serve`, plus a comparison of every endpoint with the baseline.

Each ENDPOINT is LABEL=URL (or a bare URL), URL without /v1, e.g.
  fuselane bench serve stock=http://127.0.0.1:8001 custom=http://127.0.0.1:8002 \\
      --request-rate 2 4 inf --num-prompts 200 --input-len 256:1024 --output-len 128
For the canary ingress, give it twice with an arm header each:
  fuselane bench serve stock=http://127.0.0.1:8000 custom=http://127.0.0.1:8000 \\
      --header stock:x-fuselane-arm=stock --header custom:x-fuselane-arm=custom
A fixed-concurrency run: --request-rate inf --max-concurrency 8 (both take lists: the sweep
is every rate with every concurrency).
"""


def configure_parser(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument(
        "endpoints",
        nargs="+",
        type=_endpoint_spec,
        metavar="ENDPOINT",
        help="LABEL=URL or URL, URL without /v1 (give endpoints before list options)",
    )
    g = p.add_argument_group("load")
    g.add_argument(
        "--num-prompts",
        type=_positive_int,
        default=100,
        metavar="N",
        help="requests per run (default 100)",
    )
    g.add_argument(
        "--request-rate",
        type=_rate,
        nargs="+",
        default=[math.inf],
        metavar="R",
        help="requests/s to sweep; 'inf' sends all at once (default inf)",
    )
    g.add_argument(
        "--burstiness",
        type=_positive_float,
        default=1.0,
        metavar="B",
        help="gamma shape of the arrival gaps: 1 Poisson, <1 burstier, >1 more even (default 1)",
    )
    g.add_argument(
        "--max-concurrency",
        type=_positive_int,
        nargs="+",
        default=[None],
        metavar="C",
        help="requests in flight at most, to sweep (default no cap)",
    )
    g.add_argument(
        "--max-duration",
        type=_positive_float,
        default=None,
        metavar="S",
        help="stop releasing requests S seconds into each run",
    )
    g.add_argument(
        "--request-timeout",
        type=_positive_float,
        default=300.0,
        metavar="S",
        help="a request is failed after S seconds (default 300)",
    )
    g.add_argument(
        "--warmup",
        type=int,
        default=1,
        metavar="N",
        help="unmeasured requests per endpoint before the sweep (default 1)",
    )
    g.add_argument(
        "--ready-timeout",
        type=_positive_float,
        default=60.0,
        metavar="S",
        help="wait up to S seconds for each endpoint's /v1/models (default 60)",
    )
    g.add_argument("--seed", type=int, default=0, help="prompts and arrival times (default 0)")
    g = p.add_argument_group("requests")
    g.add_argument(
        "--api",
        choices=("completions", "chat"),
        default="completions",
        help="streaming /v1/completions or /v1/chat/completions (default completions)",
    )
    g.add_argument(
        "--model", default=None, help="model name to request (default: the first each server lists)"
    )
    g.add_argument(
        "--header",
        type=_header_spec,
        action="append",
        default=[],
        metavar="[LABEL:]NAME=VALUE",
        help="extra request header (repeatable)",
    )
    g.add_argument(
        "--input-len",
        type=_length,
        default=None,
        metavar="N|LO:HI",
        help="prompt tokens, fixed or uniform over LO..HI (default 128)",
    )
    g.add_argument(
        "--output-len",
        type=_length,
        default=None,
        metavar="N|LO:HI",
        help="max tokens, fixed or uniform (default 128; with --dataset: the "
        "dataset's own lengths)",
    )
    g.add_argument(
        "--dataset",
        default=None,
        metavar="FILE",
        help="prompts from a .jsonl ({'prompt', 'output_tokens'} a line) or a ShareGPT .json file",
    )
    g.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH",
        help="tokenizer.json or model dir for prompt lengths (default: the first "
        "server's /tokenize)",
    )
    g.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="let generation stop at EOS (default: exactly the asked length, vLLM's ignore_eos)",
    )
    g = p.add_argument_group("report")
    g.add_argument(
        "--goodput",
        nargs="+",
        type=_goodput_arg,
        default=[],
        metavar="NAME:MS",
        help="SLOs for goodput, e.g. ttft:500 tpot:50 (names: ttft, tpot, e2el)",
    )
    g.add_argument(
        "--percentiles",
        type=_percentile_arg,
        nargs="+",
        default=[50.0, 90.0, 99.0],
        metavar="P",
        help="latency percentiles (default 50 90 99)",
    )
    g.add_argument(
        "--baseline",
        default=None,
        metavar="LABEL",
        help="endpoint the others are compared with (default: 'stock' if given, else the first)",
    )
    g.add_argument(
        "--out",
        default="bench-serve-results",
        metavar="DIR",
        help="output folder (default ./bench-serve-results)",
    )
    g.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.set_defaults(func=cmd_bench_serve)
    return p


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `serve` on the `fuselane bench` subparsers (`parser.add_subparsers()`'s result);
    the handler is `args.func(args) -> int`."""
    p = subparsers.add_parser(
        "serve",
        help="end-to-end serving benchmark of OpenAI endpoints (stock vs custom)",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    return configure_parser(p)


def build_parser() -> argparse.ArgumentParser:
    """Standalone parser: `python -m fuselane.serving.bench_serve ...`."""
    return configure_parser(
        argparse.ArgumentParser(
            prog="fuselane bench serve",
            description=DESCRIPTION,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    )


def _fail(msg: str) -> int:
    sys.stderr.write(f"fuselane bench serve: error: {msg}\n")
    return 2


def _endpoints_from_args(args: argparse.Namespace) -> list[Endpoint]:
    labels = [lb for lb, _ in args.endpoints]
    dup = sorted({lb for lb in labels if labels.count(lb) > 1})
    if dup:
        raise ValueError(f"endpoint label {dup[0]!r} is used twice: give each LABEL=URL once")
    headers: dict[str, dict[str, str]] = {lb: {} for lb in labels}
    for label, name, value in args.header:
        if label is not None and label not in headers:
            raise ValueError(
                f"--header names endpoint {label!r}, which is not one of: {', '.join(labels)}"
            )
        for lb in [label] if label is not None else labels:
            headers[lb][name] = value
    return [Endpoint(lb, url, args.model, headers[lb]) for lb, url in args.endpoints]


async def _tokenizer(
    args: argparse.Namespace, client: httpx.AsyncClient, ep: Endpoint, model: str
) -> Tokenizer | None:
    if args.tokenizer:
        return LocalTokenizer(args.tokenizer)
    tok = ServerTokenizer(client, ep.base_url, model, ep.headers)
    if await tok.available():
        return tok
    sys.stderr.write(
        f"note: {ep.label} has no /tokenize route and no --tokenizer was given: prompt lengths "
        "are approximate (the server's usage counts are still exact)\n"
    )
    return None


async def _bench(args: argparse.Namespace, endpoints: list[Endpoint], baseline: str) -> int:
    goodput = parse_goodput(args.goodput)
    points = [SweepPoint(rate, conc) for rate in args.request_rate for conc in args.max_concurrency]
    opts = SweepOptions(
        api=args.api,
        burstiness=args.burstiness,
        percentiles=args.percentiles,
        goodput=goodput,
        ignore_eos=args.ignore_eos,
        max_duration_s=args.max_duration,
        request_timeout_s=args.request_timeout,
        warmup=max(args.warmup, 0),
        seed=args.seed,
        progress=args.progress,
    )
    async with make_client(None, args.request_timeout) as client:
        info = {}
        for ep in endpoints:
            await wait_ready(client, ep, args.ready_timeout)
            info[ep.label] = await server_info(client, ep)
        first = endpoints[0]
        model = await resolve_model(client, first)
        tok = await _tokenizer(args, client, first, model)
        if args.dataset:
            requests = await dataset_requests(
                load_dataset(args.dataset), args.num_prompts, args.output_len, tok, args.seed
            )
        else:
            requests = await synthetic_requests(
                args.num_prompts,
                args.input_len or LengthSpec(128),
                args.output_len or LengthSpec(128),
                tok,
                args.seed,
            )
        runs = await run_sweep(endpoints, requests, points, opts, client)
    arg_record = {k: v for k, v in vars(args).items() if k != "func"}
    arg_record["endpoints"] = {ep.label: ep.base_url for ep in endpoints}
    arg_record["header"] = [list(h) for h in args.header]
    for k in ("input_len", "output_len"):
        arg_record[k] = str(arg_record[k]) if arg_record[k] is not None else None
    arg_record["request_rate"] = [r if math.isfinite(r) else "inf" for r in args.request_rate]
    paths = write_results(
        Path(args.out), runs, arg_record, info, baseline, args.percentiles, goodput
    )
    print(comparison_table(runs, baseline, args.percentiles, bool(goodput)))
    failed = sum(r.summary["failed"] for r in runs)
    if failed:
        print(f"{failed} request(s) failed; reasons are in {paths['results']} (errors)")
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    if "latency" not in paths:
        print("note: install matplotlib for latency.png and throughput.png")
    return 0


def cmd_bench_serve(args: argparse.Namespace) -> int:
    """The `fuselane bench serve` handler: 0 on success, 1 if a server fails us, 2 on usage."""
    try:
        endpoints = _endpoints_from_args(args)
    except ValueError as exc:
        return _fail(str(exc))
    labels = [ep.label for ep in endpoints]
    baseline = args.baseline or ("stock" if "stock" in labels else labels[0])
    if baseline not in labels:
        return _fail(f"--baseline {baseline!r} is not an endpoint label ({', '.join(labels)})")
    if args.dataset and args.input_len is not None:
        return _fail("--input-len and --dataset exclude each other: the dataset gives prompts")
    if args.dataset and not Path(args.dataset).is_file():
        return _fail(f"--dataset {args.dataset}: no such file")
    if args.tokenizer and not Path(args.tokenizer).exists():
        return _fail(f"--tokenizer {args.tokenizer}: no such file or directory")
    try:
        import httpx
    except ImportError:
        sys.stderr.write("fuselane bench serve needs httpx: pip install 'fuselane[serve]'\n")
        return 1
    try:
        return asyncio.run(_bench(args, endpoints, baseline))
    except (RuntimeError, ValueError, FileNotFoundError, httpx.HTTPError) as exc:
        sys.stderr.write(f"fuselane bench serve: {exc}\n")
        return 1


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
