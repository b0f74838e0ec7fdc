"""Clients of the canary: OpenAI requests over HTTP, and the one outcome each answer is.

An answer is judged by what the client received, nothing else:

- `ok`: a 200 with a complete answer: the JSON of a completion (or chat completion) whose first
  choice has its text and a `finish_reason`, or a stream that ends with `data: [DONE]` after a
  chunk with a `finish_reason`;
- `error`: an answer that says it failed: a status >= 400, or a stream whose last event is an
  OpenAI error object (the canary ends a stream that way when its arm dies mid-answer);
- `truncated`: a 200 that passes for success but is not complete: a stream without `[DONE]` and
  without an error event, no `finish_reason`, a body that is not a completion's JSON;
- `lost`: no answer at all: the connection failed or broke mid-body, or the client's timeout
  ran out (a hung request ends here, after `timeout_s`).

`Load` runs clients back to back from a thread of its own, so a test or the soak can kill
nodes and replicas while it runs.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import threading
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from fuselane.serving.canary.demo import PHRASES

Kind = Literal["completions", "chat"]
Outcome = Literal["ok", "error", "truncated", "lost"]
OUTCOMES: tuple[Outcome, ...] = ("ok", "error", "truncated", "lost")
ROUTES: dict[str, str] = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
ARM_HEADER = "x-fuselane-arm"  # fuselane.serving.canary.router's names, without importing Ray
FAILOVER_HEADER = "x-fuselane-failover"
PIN_HEADER = "x-fuselane-arm"
# Server-sent events end their lines at CR, LF or CRLF, and nowhere else.
_SSE_LINE_END = re.compile(r"\r\n|\r|\n")

PROMPTS = (*PHRASES, "the cache stores every block", "a request waits on the queue")


@dataclass(frozen=True)
class Request:
    """One request: endpoint, streamed or not, greedy (temperature 0) or sampled."""

    kind: Kind
    stream: bool
    greedy: bool
    prompt: int  # index into PROMPTS
    max_tokens: int = 12
    ignore_eos: bool = False
    session: str | None = None  # the canary's sticky key (x-session-id)

    @property
    def key(self) -> tuple[str, int, int]:
        """What fixes a greedy answer: streamed or whole, the text is the same."""
        return (self.kind, self.prompt, self.max_tokens)

    def body(self, model: str) -> dict[str, Any]:
        body: dict[str, Any] = {"model": model, "max_tokens": self.max_tokens}
        if self.kind == "chat":
            body["messages"] = [{"role": "user", "content": PROMPTS[self.prompt]}]
        else:
            body["prompt"] = PROMPTS[self.prompt]
        body |= {"temperature": 0.0} if self.greedy else {"temperature": 0.8, "top_p": 0.95}
        if self.stream:
            body["stream"] = True
        if self.ignore_eos:
            body["ignore_eos"] = True
        return body

    def headers(self) -> dict[str, str]:
        return {"x-session-id": self.session} if self.session else {}


def mix(seed: int, max_tokens: int = 12) -> Iterator[Request]:
    """An endless mix: completions and chats, streamed and whole, greedy and sampled, in equal
    shares, on the prompts above."""
    rng = random.Random(seed)
    while True:
        yield Request(
            kind=rng.choice(("completions", "chat")),
            stream=rng.random() < 0.5,
            greedy=rng.random() < 0.5,
            prompt=rng.randrange(len(PROMPTS)),
            max_tokens=max_tokens,
        )


@dataclass
class Record:
    """What one request got. Times are `time.time()` (comparable with the canary's rollback
    time); `answered_at` is when the response headers came (the arm was chosen by then)."""

    client: int
    request: Request
    sent_at: float
    done_at: float = 0.0
    answered_at: float | None = None
    status: int | None = None
    arm: str | None = None
    failover: str | None = None
    outcome: Outcome = "lost"
    detail: str = ""
    text: str | None = None  # the answer's text, where complete


def _choice_text(kind: str, choice: Mapping[str, Any], stream: bool) -> str | None:
    if kind == "completions":
        return choice.get("text")
    part = choice.get("delta" if stream else "message") or {}
    return part.get("content") or ""


def judge_body(kind: str, raw: bytes) -> tuple[Outcome, str, str | None]:
    """A whole (not streamed) 200 answer."""
    try:
        data = json.loads(raw)
        choice = data["choices"][0]
    except (ValueError, KeyError, IndexError, TypeError):
        return "truncated", f"200 without a completion's JSON ({len(raw)} bytes)", None
    text = _choice_text(kind, choice, stream=False)
    if text is None or not choice.get("finish_reason"):
        return "truncated", "200 without text or finish_reason", None
    return "ok", "", text


def judge_stream(kind: str, events: list[str]) -> tuple[Outcome, str, str | None]:
    """A streamed 200 answer, from its `data:` payloads in order."""
    if events and events[-1] != "[DONE]":
        try:
            error = json.loads(events[-1]).get("error")
        except ValueError:
            error = None
        if error:
            return "error", f"stream ended with an error event: {error.get('message', '')}", None
        return "truncated", f"stream without [DONE] or error event ({len(events)} events)", None
    if not events:
        return "truncated", "stream with no event", None
    parts, finished = [], False
    for payload in events[:-1]:
        try:
            chunk = json.loads(payload)
        except ValueError:
            return "truncated", f"stream event that is not JSON: {payload[:80]}", None
        if chunk.get("error"):
            return "error", "error event before [DONE]", None
        for choice in chunk.get("choices") or []:
            parts.append(_choice_text(kind, choice, stream=True) or "")
            finished = finished or bool(choice.get("finish_reason"))
    if not finished:
        return "truncated", "stream with [DONE] but no finish_reason", None
    return "ok", "", "".join(parts)


async def sse_data(response: httpx.Response) -> AsyncIterator[str]:
    """The `data:` payloads of an event stream, in order. Not `aiter_lines`: like
    `str.splitlines` it also ends lines at U+0085, U+2028 and other characters that a model's
    text can hold raw inside an event's JSON (the tiny model's does), and cuts the event."""
    buf = ""
    async for text in response.aiter_text():
        *lines, buf = _SSE_LINE_END.split(buf + text)
        for line in lines:
            if line.startswith("data: "):
                yield line[6:]
    if buf.startswith("data: "):
        yield buf[6:]


async def send(
    client: httpx.AsyncClient,
    request: Request,
    *,
    client_id: int = 0,
    model: str = "tiny",
    headers: Mapping[str, str] | None = None,
) -> Record:
    """Send one request and judge its answer; never raises for what the server or the network
    did (that is the record's outcome)."""
    rec = Record(client_id, request, sent_at=time.time())
    route = ROUTES[request.kind]
    hdrs = {**request.headers(), **(headers or {})}
    try:
        if request.stream:
            async with client.stream("POST", route, json=request.body(model), headers=hdrs) as r:
                _answered(rec, r)
                if r.status_code != 200:
                    await r.aread()
                    rec.outcome, rec.detail = "error", f"{r.status_code}: {r.text[:200]}"
                else:
                    events = [data async for data in sse_data(r)]
                    rec.outcome, rec.detail, rec.text = judge_stream(request.kind, events)
        else:
            r = await client.post(route, json=request.body(model), headers=hdrs)
            _answered(rec, r)
            if r.status_code != 200:
                rec.outcome, rec.detail = "error", f"{r.status_code}: {r.text[:200]}"
            else:
                rec.outcome, rec.detail, rec.text = judge_body(request.kind, r.content)
    except httpx.HTTPError as e:  # timeouts, refused or broken connections, cut bodies
        rec.outcome, rec.detail = "lost", f"{type(e).__name__}: {e}"[:300]
    rec.done_at = time.time()
    return rec


def _answered(rec: Record, r: httpx.Response) -> None:
    rec.answered_at = time.time()
    rec.status = r.status_code
    rec.arm = r.headers.get(ARM_HEADER)
    rec.failover = r.headers.get(FAILOVER_HEADER)


@dataclass
class Load:
    """`clients` clients sending `mix` requests back to back through `base_url`, from a thread
    of their own, until `stop()`; `records` grows as answers come."""

    base_url: str
    clients: int
    model: str = "tiny"
    timeout_s: float = 120.0
    seed: int = 0
    max_tokens: int = 12
    records: list[Record] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="canary-load", daemon=True)

    def start(self) -> Load:
        self._thread.start()
        return self

    def stop(self) -> list[Record]:
        """Stop sending; the requests in flight end first (each within `timeout_s`)."""
        self._stop.set()
        self._thread.join(self.timeout_s + 30)
        if self._thread.is_alive():
            raise RuntimeError(f"the load's clients did not end within {self.timeout_s + 30:g}s")
        return list(self.records)

    def __enter__(self) -> Load:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        if not self._stop.is_set():
            self.stop()

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        limits = httpx.Limits(max_connections=2 * self.clients)
        async with httpx.AsyncClient(
            base_url=self.base_url, timeout=self.timeout_s, limits=limits, trust_env=False
        ) as http:
            await asyncio.gather(*(self._client(http, i) for i in range(self.clients)))

    async def _client(self, http: httpx.AsyncClient, i: int) -> None:
        for request in mix(self.seed * 1000 + i, self.max_tokens):
            if self._stop.is_set():
                return
            self.records.append(await send(http, request, client_id=i, model=self.model))


async def greedy_answers(
    base_url: str, requests: list[Request], model: str = "tiny", timeout_s: float = 120.0
) -> dict[tuple[str, int, int], str]:
    """Stock's greedy answer to each distinct request (pinned to stock, whole, one at a time):
    the reference a greedy answer from either arm is compared with."""
    out: dict[tuple[str, int, int], str] = {}
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, trust_env=False) as http:
        for req in requests:
            if req.key in out:
                continue
            whole = Request(req.kind, False, True, req.prompt, req.max_tokens)
            rec = await send(http, whole, model=model, headers={PIN_HEADER: "stock"})
            if rec.outcome != "ok" or rec.arm != "stock" or rec.text is None:
                raise RuntimeError(f"no greedy reference from stock for {req.key}: {rec.detail}")
            out[req.key] = rec.text
    return out


def every_greedy_request(max_tokens: int = 12) -> list[Request]:
    """One greedy request per endpoint and prompt: the keys `mix` can produce."""
    return [
        Request(kind, False, True, p, max_tokens)
        for kind in ("completions", "chat")
        for p in range(len(PROMPTS))
    ]
