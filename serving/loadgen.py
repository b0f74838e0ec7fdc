"""Async load generator for OpenAI-compatible servers (vLLM's OpenAI server, the canary ingress).

One call, `await run_load(endpoint, requests, ...)`, sends the requests to one endpoint with
streaming `/v1/completions` (or `/v1/chat/completions`), paced by a request rate (Poisson, or
gamma-distributed gaps with vLLM's `burstiness`) and/or capped at a number in flight, and returns
a `LoadResult`: one `RequestRecord` per request sent (send time, the arrival time of every
token-bearing chunk, the server's usage counts, HTTP status, error), from which every metric is
computed (`fuselane.serving.bench_serve.summarize`).

Timing follows `vllm bench serve` (vllm/benchmarks/lib/endpoint_request_func.py): a request's
clock starts when it is sent (after any wait for a concurrency slot), TTFT is the first chunk
that carries output, ITLs are the gaps between such chunks, end-to-end latency ends at the last
one (the trailing usage chunk carries no token and does not count). Output token counts come
from the usage field (`stream_options.include_usage`), not from counting chunks: a chunk may
carry several tokens.

Traffic goes only to the endpoint's base URL; the client ignores proxy environment variables.

    from fuselane.serving.loadgen import Endpoint, RequestSpec, run_load
    ep = Endpoint("custom", "http://127.0.0.1:8000", headers={"x-arm": "custom"})
    result = await run_load(ep, [RequestSpec("Hello", 16)] * 20, request_rate=4.0)
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import json
import math
import random
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # httpx is imported where requests are sent: the CLI loads without it
    import httpx

Api = Literal["completions", "chat"]
ROUTES: dict[str, str] = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
# Error bodies are kept in the log; a few hundred characters say what went wrong.
_MAX_ERROR_CHARS = 500


@dataclass(frozen=True)
class Endpoint:
    """One server to load. `base_url` has no `/v1` (`http://127.0.0.1:8001`); `model` None
    means the first model the server lists; `headers` go with every request (an arm header of
    the canary ingress, an API key)."""

    label: str
    base_url: str
    model: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class RequestSpec:
    """What to send: a prompt (text, or token ids for completions), `output_len` as max tokens,
    and the planned prompt token count if known (the server's count is recorded as well)."""

    prompt: str | list[int]
    output_len: int
    prompt_len: int | None = None


@dataclass
class RequestRecord:
    """The log entry of one request. Times are seconds; `arrival_s` (when the schedule released
    it) and `start_s` (when it was sent) count from the run's start, `chunk_s` (each chunk that
    carried output) from `start_s`."""

    index: int
    label: str
    arrival_s: float
    start_s: float
    output_len: int
    prompt_len: int | None = None
    chunk_s: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None  # usage.prompt_tokens
    completion_tokens: int | None = None  # usage.completion_tokens
    status: int = 0  # HTTP status; 0 when no response came
    error: str = ""
    finish_reason: str | None = None
    text: str = ""
    headers: dict[str, str] = field(default_factory=dict)  # the response's x-* headers

    @property
    def ok(self) -> bool:
        # vLLM counts a request as successful only if some output arrived.
        return self.status == 200 and not self.error and bool(self.chunk_s)

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_s[0] if self.ok else None

    @property
    def e2el_s(self) -> float | None:
        return self.chunk_s[-1] if self.ok else None

    @property
    def itl_s(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_s, self.chunk_s[1:], strict=False)]

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["ok"], d["ttft_s"], d["e2el_s"] = self.ok, self.ttft_s, self.e2el_s
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> RequestRecord:
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass
class LoadResult:
    """One run against one endpoint. `duration_s` spans from just before the first request was
    released to the end of the last one (vLLM's benchmark duration); `not_sent` counts requests
    skipped because `max_duration_s` passed."""

    label: str
    base_url: str
    model: str
    api: str
    request_rate: float
    burstiness: float
    max_concurrency: int | None
    started_at: str
    duration_s: float
    records: list[RequestRecord]
    not_sent: int = 0


def arrival_times(
    num: int, request_rate: float, burstiness: float = 1.0, seed: int = 0
) -> list[float]:
    """Release time (s from the start) of each request, as `vllm bench serve` schedules them.

    Gaps are gamma-distributed with shape `burstiness` and mean 1/rate (burstiness 1: Poisson
    arrivals; < 1 burstier, > 1 more even, inf evenly spaced), then scaled so the last request
    goes out at num/rate exactly, which keeps throughput comparable across seeds.
    """
    if num <= 0:
        return []
    if not request_rate > 0:
        raise ValueError(f"request_rate must be > 0 (inf: all at once), got {request_rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * num
    rng = random.Random(seed)
    if math.isinf(burstiness):
        gaps = [1.0 / request_rate] * num
    else:
        theta = 1.0 / (request_rate * burstiness)
        gaps = [rng.gammavariate(burstiness, theta) for _ in range(num)]
    times = []
    t = 0.0
    for g in gaps:
        t += g
        times.append(t)
    scale = (num / request_rate) / times[-1] if times[-1] > 0 else 1.0
    return [x * scale for x in times]


class Progress:
    """A progress bar on stderr: tqdm when installed, else a plain line redrawn at most every
    half second (and always at the end)."""

    def __init__(self, total: int, desc: str, enabled: bool = True) -> None:
        self.total, self.desc, self.enabled, self.done = total, desc, enabled, 0
        self._bar: Any = None
        self._last = 0.0
        if enabled:
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, desc=desc, unit="req", file=sys.stderr)
            except ImportError:
                self._bar = None

    def update(self, n: int = 1) -> None:
        self.done += n
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(n)
            return
        now = time.monotonic()
        if now - self._last >= 0.5 or self.done >= self.total:
            self._last = now
            width = 30
            filled = width * self.done // max(self.total, 1)
            bar = "#" * filled + "." * (width - filled)
            sys.stderr.write(f"\r{self.desc} [{bar}] {self.done}/{self.total}")
            sys.stderr.flush()

    def close(self) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
        else:
            sys.stderr.write("\n")
            sys.stderr.flush()


def make_client(max_connections: int | None = None, timeout_s: float = 300.0) -> httpx.AsyncClient:
    """An httpx client for load: no proxies from the environment (traffic goes to the given URLs
    only), no pool wait limit (the pacing decides when requests go out)."""
    import httpx

    return httpx.AsyncClient(
        trust_env=False,
        limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=None),
        timeout=httpx.Timeout(timeout_s, pool=None),
    )


async def wait_ready(
    client: httpx.AsyncClient, endpoint: Endpoint, timeout_s: float = 60.0
) -> dict[str, Any]:
    """Poll `GET /v1/models` until it answers (bounded by `timeout_s`); return its JSON."""
    import httpx

    url = endpoint.base_url.rstrip("/") + "/v1/models"
    deadline = time.monotonic() + timeout_s
    last = ""
    while True:
        try:
            resp = await client.get(url, headers=dict(endpoint.headers), timeout=10.0)
            if resp.status_code == 200:
                return resp.json()
            last = f"HTTP {resp.status_code}: {resp.text[:200]}"
        except httpx.HTTPError as exc:
            last = f"{type(exc).__name__}: {exc}"
        if time.monotonic() >= deadline:
            raise RuntimeError(
                f"endpoint {endpoint.label} ({url}) not ready after {timeout_s:g}s: {last}"
            )
        await asyncio.sleep(0.5)


async def resolve_model(client: httpx.AsyncClient, endpoint: Endpoint) -> str:
    if endpoint.model:
        return endpoint.model
    models = await wait_ready(client, endpoint, timeout_s=10.0)
    data = models.get("data") or []
    if not data:
        raise RuntimeError(f"endpoint {endpoint.label} lists no models at /v1/models")
    return str(data[0]["id"])


def _payload(model: str, spec: RequestSpec, api: str, ignore_eos: bool, extra: Mapping) -> dict:
    body: dict[str, Any] = {
        "model": model,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if api == "chat":
        if not isinstance(spec.prompt, str):
            raise ValueError("the chat API takes text prompts, not token ids")
        body["messages"] = [{"role": "user", "content": spec.prompt}]
        body["max_completion_tokens"] = spec.output_len
    else:
        body["prompt"] = spec.prompt
        body["max_tokens"] = spec.output_len
    if ignore_eos:
        # vLLM's extension: generate exactly max_tokens so both arms do the same work.
        body["ignore_eos"] = True
    body.update(extra)
    return body


def _carries_output(choice: Mapping[str, Any], api: str) -> bool:
    """Whether a streamed choice counts as output, as vLLM's bench decides: any completions
    choice; a chat delta with content, or an empty content without the opening `role`."""
    if api != "chat":
        return True
    delta = choice.get("delta")
    if not isinstance(delta, dict):
        return False
    if any(delta.get(k) for k in ("content", "reasoning", "tool_calls", "function_call")):
        return True
    return delta.get("content") == "" and "role" not in delta


def _error_text(body: bytes) -> str:
    try:
        msg = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        msg = body.decode("utf-8", "replace")
    return str(msg)[:_MAX_ERROR_CHARS]


async def _send(
    client: httpx.AsyncClient,
    url: str,
    headers: Mapping[str, str],
    body: dict,
    api: str,
    rec: RequestRecord,
    t_start: float,
    timeout_s: float,
) -> None:
    """Send one streaming request and fill `rec` in place (never raises for server errors)."""
    parts: list[str] = []
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", url, json=body, headers=dict(headers)) as resp:
                rec.status = resp.status_code
                rec.headers = {k: v for k, v in resp.headers.items() if k.startswith("x-")}
                if resp.status_code != 200:
                    rec.error = _error_text(await resp.aread())
                    return
                async for line in resp.aiter_lines():
                    # SSE: "data: {json}" lines; comments (":") and blank lines are skipped.
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    now = time.perf_counter()
                    obj = json.loads(data)
                    if "error" in obj:  # an error raised after the stream began
                        err = obj["error"]
                        rec.error = str(err.get("message", err) if isinstance(err, dict) else err)
                        break
                    choices = obj.get("choices")
                    if choices and _carries_output(choices[0], api):
                        rec.chunk_s.append(now - t_start)
                        c = choices[0]
                        parts.append(
                            (c.get("delta") or {}).get("content") or ""
                            if api == "chat"
                            else c.get("text") or ""
                        )
                        rec.finish_reason = c.get("finish_reason") or rec.finish_reason
                    if usage := obj.get("usage"):
                        rec.completion_tokens = usage.get("completion_tokens")
                        rec.prompt_tokens = usage.get("prompt_tokens")
        if not rec.chunk_s and not rec.error:
            rec.error = "the stream ended without any output chunk"
    except TimeoutError:
        rec.error = f"timed out after {timeout_s:g}s"
    except Exception as exc:  # noqa: BLE001 - a broken response fails its request, not the run
        rec.error = f"{type(exc).__name__}: {exc}"[:_MAX_ERROR_CHARS]
    finally:
        rec.text = "".join(parts)


async def run_load(
    endpoint: Endpoint,
    requests: Sequence[RequestSpec],
    *,
    api: Api = "completions",
    request_rate: float = math.inf,
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    max_duration_s: float | None = None,
    request_timeout_s: float = 300.0,
    ignore_eos: bool = True,
    extra_body: Mapping[str, Any] | None = None,
    seed: int = 0,
    progress: bool = False,
    on_record: Callable[[RequestRecord], None] | None = None,
    client: httpx.AsyncClient | None = None,
) -> LoadResult:
    """Send `requests` (in order) to `endpoint`; return the log of every request sent.

    Pacing: requests are released on `arrival_times(len(requests), request_rate, burstiness,
    seed)` (rate inf: all at once) and then wait for one of `max_concurrency` slots (None: no
    cap); a fixed-concurrency run is `request_rate=inf, max_concurrency=C`.
    Bounds: the count of `requests`; no request is released after `max_duration_s` (the rest
    count in `not_sent`); each request is abandoned (and logged as failed) after
    `request_timeout_s`. Failed requests (HTTP errors, a prompt over the model's length, a
    dropped connection) are logged with status and message, never lost.
    `ignore_eos` asks vLLM for exactly `output_len` tokens; `extra_body` is merged into every
    request body (e.g. `{"temperature": 0}`); `on_record` is called as each request finishes;
    `progress` draws a bar on stderr. Pass `client` to reuse connections across runs.
    """
    if api not in ROUTES:
        raise ValueError(f"api must be one of {sorted(ROUTES)}, got {api!r}")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1 or None, got {max_concurrency}")
    own_client = client is None
    if client is None:
        client = make_client(max_concurrency, request_timeout_s)
    try:
        model = await resolve_model(client, endpoint)
        schedule = arrival_times(len(requests), request_rate, burstiness, seed)
        url = endpoint.base_url.rstrip("/") + ROUTES[api]
        headers = {"Content-Type": "application/json", **endpoint.headers}
        bodies = [_payload(model, s, api, ignore_eos, extra_body or {}) for s in requests]
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        desc = f"{endpoint.label} rate={request_rate:g}" + (
            f" conc={max_concurrency}" if max_concurrency else ""
        )
        bar = Progress(len(requests), desc, enabled=progress)
        records: list[RequestRecord] = []

        late: list[int] = []  # released, but a concurrency slot freed only after the deadline

        async def one(i: int, arrival: float) -> None:
            if sem is not None:
                await sem.acquire()
            try:
                t_start = time.perf_counter()
                if max_duration_s is not None and t_start - t0 > max_duration_s:
                    late.append(i)
                    return
                rec = RequestRecord(
                    index=i,
                    label=endpoint.label,
                    arrival_s=arrival,
                    start_s=t_start - t0,
                    output_len=requests[i].output_len,
                    prompt_len=requests[i].prompt_len,
                )
                records.append(rec)
                await _send(client, url, headers, bodies[i], api, rec, t_start, request_timeout_s)
            finally:
                if sem is not None:
                    sem.release()
            bar.update()
            if on_record is not None:
                on_record(rec)

        started_at = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
        t0 = time.perf_counter()
        tasks: list[asyncio.Task] = []
        not_sent = 0
        for i, due in enumerate(schedule):
            if max_duration_s is not None and due > max_duration_s:
                not_sent = len(schedule) - i
                break
            delay = due - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            if max_duration_s is not None and time.perf_counter() - t0 > max_duration_s:
                not_sent = len(schedule) - i
                break
            tasks.append(asyncio.create_task(one(i, time.perf_counter() - t0)))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        bar.close()
        records.sort(key=lambda r: r.index)
        return LoadResult(
            label=endpoint.label,
            base_url=endpoint.base_url,
            model=model,
            api=api,
            request_rate=request_rate,
            burstiness=burstiness,
            max_concurrency=max_concurrency,
            started_at=started_at,
            duration_s=duration,
            records=records,
            not_sent=not_sent + len(late),
        )
    finally:
        if own_client:
            await client.aclose()
