"""The sweeps of `fuselane bench serve`: a sweep point (request rate x max concurrency), the
options every run of a sweep shares, and `run_sweep`, which runs every point against every
endpoint and summarizes each run."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fuselane.serving.bench_serve_metrics import summarize
from fuselane.serving.loadgen import Endpoint, LoadResult, RequestSpec, run_load

if TYPE_CHECKING:  # imported where requests are sent, so that `fuselane --help` needs no httpx
    import httpx


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
