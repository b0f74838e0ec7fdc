"""The metrics of `fuselane bench serve`: one run's summary computed from its request log
(`summarize`), the percentile helpers, and the goodput SLO parser.

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

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from fuselane.serving.loadgen import RequestRecord

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
METRIC_NAMES = {
    "ttft": "TTFT",
    "tpot": "TPOT",
    "itl": "ITL",
    "e2el": "E2EL",
}
GOODPUT_KEYS = ("ttft", "tpot", "e2el")


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
