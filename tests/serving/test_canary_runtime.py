"""The canary's runtime on a real Ray cluster: what clients see when the custom arm is rolled
back, hangs or dies, and when a request is not what the ingress expects.

The same two tiny CPU engines as tests/serving/test_canary.py (its module fixture, started
afresh for this module). A hung replica is a custom replica process stopped with SIGSTOP (and
continued after); a rollback is the numerical-check rule, fired by a check failure reported to
the monitor the way a custom replica reports one. The last test kills the custom replica.
"""

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

pytest.importorskip("ray.serve.llm")
pytest.importorskip("vllm")

import httpx
import ray
from ray import serve

from fuselane.serving.canary import control
from fuselane.serving.canary.config import parse_config
from fuselane.serving.canary.router import ARM_HEADER, FAILOVER_HEADER

from .test_canary import (
    APP,
    _burst,
    _complete,
    _config,
    _set,
    canary,  # noqa: F401 - the module fixture, started for this module
)

pytestmark = [pytest.mark.slow, pytest.mark.extended]  # outside CI: a canary of its own


def _custom_replicas() -> list:
    return [
        ray.get_actor(a["name"], namespace=a["namespace"])
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith(f"SERVE_REPLICA::{APP}-custom#custom#")
    ]


@contextmanager
def _custom_hung() -> Iterator[None]:
    """The custom replicas stop answering (SIGSTOP) for the block: requests sent to them wait."""
    pids = [ray.get(a.__ray_call__.remote(lambda self: os.getpid())) for a in _custom_replicas()]
    assert pids, "no custom replica actor found"
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


async def _pinned_to_custom(port: int, n: int) -> list[tuple[int, str, str]]:
    body = {"model": "tiny", "prompt": "pinned", "max_tokens": 4, "temperature": 0}
    async with httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{port}", timeout=180, trust_env=False
    ) as ac:
        pin = {"x-fuselane-arm": "custom"}
        rs = await asyncio.gather(
            *(ac.post("/v1/completions", json=body, headers=pin) for _ in range(n))
        )
    return [(r.status_code, r.headers.get(ARM_HEADER), r.headers.get(FAILOVER_HEADER)) for r in rs]


async def _other_kinds(port: int) -> list[tuple[int, str, str, bool]]:
    """A streamed completion, a chat completion and a streamed chat (weight 1: to custom):
    (status, arm, failover reason, whole: a stream's last event `[DONE]` with no error event
    before it, a body's choice with its finish_reason)."""
    completion = {"model": "tiny", "prompt": "waiting", "max_tokens": 4, "stream": True}
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "waiting"}], "max_tokens": 4}
    async with httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{port}", timeout=180, trust_env=False
    ) as ac:

        async def one(path: str, body: dict) -> tuple[int, str, str, bool]:
            if body.get("stream"):
                async with ac.stream("POST", path, json=body) as r:
                    # Split on "\n" alone: an SSE event ends there, while str.splitlines()
                    # would also split inside the JSON at U+2028 and its kin.
                    text = (await r.aread()).decode()
                    data = [ln[6:] for ln in text.split("\n") if ln.startswith("data: ")]
                    whole = bool(data) and data[-1] == "[DONE]"
                    whole = whole and not any('"error"' in d for d in data[:-1])
            else:
                r = await ac.post(path, json=body)
                whole = r.status_code == 200 and r.json()["choices"][0]["finish_reason"] is not None
            return r.status_code, r.headers.get(ARM_HEADER), r.headers.get(FAILOVER_HEADER), whole

        return list(
            await asyncio.gather(
                one("/v1/completions", completion),
                one("/v1/chat/completions", chat),
                one("/v1/chat/completions", chat | {"stream": True}),
            )
        )


def _while_custom_hangs(
    port: int, action, n: int = 6, pinned: int = 0, other_kinds: bool = False
) -> tuple[list, float]:
    """Send `n` requests to custom (weight 1) and `pinned` pinned to it (and, with
    `other_kinds`, a streamed completion, a chat and a streamed chat), let them wait on the
    hung replica, run `action`; returns the results and how long after `action` the last one
    was answered."""

    async def nothing() -> list:
        return []

    async def run() -> tuple[list, float]:
        with _custom_hung():
            load = asyncio.gather(
                _burst(port, n, concurrency=n, max_tokens=4),
                _pinned_to_custom(port, pinned),
                _other_kinds(port) if other_kinds else nothing(),
            )
            await asyncio.sleep(2.0)
            assert not load.done()  # waiting on custom (first_response_timeout_s is 30 s)
            t0 = time.monotonic()
            await asyncio.to_thread(action)
            weighted, pins, others = await asyncio.wait_for(load, 20)
            return weighted + pins + others, time.monotonic() - t0

    return asyncio.run(run())


def test_bodies_not_sent_as_json_get_a_4xx_naming_the_media_type(canary):  # noqa: F811
    c = canary["client"]
    body = json.dumps({"model": "tiny", "prompt": "the kernel", "max_tokens": 2})
    chat = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
    for path, raw in (("/v1/completions", body), ("/v1/chat/completions", chat)):
        # What curl -d sends without -H: FastAPI handed the bytes on and the ingress said 500.
        for ctype in ("application/x-www-form-urlencoded", "text/plain"):
            r = c.post(path, content=raw, headers={"content-type": ctype})
            assert r.status_code == 415, r.text
            assert "application/json" in r.json()["error"]["message"]
        r = c.post(path, content="{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == 400, r.text
        assert "not valid JSON" in r.json()["error"]["message"]
        r = c.post(path, content=raw, headers={"content-type": "application/json; charset=utf-8"})
        assert r.status_code == 200, r.text
    r = c.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": "many"})
    assert r.status_code == 400 and "max_tokens" in r.text


def test_pin_to_custom_only_where_the_config_allows_it(canary):  # noqa: F811
    _set(1.0)
    c = canary["client"]
    r = _complete(c, headers={"x-fuselane-arm": "custom"})
    assert r.status_code == 403 and "allow_pin_custom" in r.text, r.text
    r = _complete(c, headers={"x-fuselane-arm": "stock"})
    assert r.status_code == 200 and r.headers[ARM_HEADER] == "stock"
    # Allowed (the ingress app alone is redeployed: the arms keep running).
    cfg = _config(canary["model"], canary["port"])
    cfg["routing"]["allow_pin_custom"] = True
    control.deploy(parse_config(cfg), wait_s=420)
    _set(0.0)  # no user traffic to custom: a pin is how custom is measured before it has any
    r = _complete(c, headers={"x-fuselane-arm": "custom"})
    assert r.status_code == 200 and r.headers[ARM_HEADER] == "custom", r.text


def test_rollback_sends_the_requests_waiting_on_custom_to_stock(canary):  # noqa: F811
    _set(1.0)
    assert _complete(canary["client"]).headers[ARM_HEADER] == "custom"
    monitor = serve.get_deployment_handle(control.MONITOR, app_name=APP)

    def numerical_checks_fail() -> None:
        # What a custom replica whose kernels fail their checks reports (engine.py).
        monitor.report_kernels.remote("test-replica", "custom", 2.0, 2.0, []).result(timeout_s=30)

    results, after = _while_custom_hangs(
        canary["port"], numerical_checks_fail, pinned=2, other_kinds=True
    )
    st = control.status(APP)
    assert st["rolled_back"] and st["rollback"]["reason"] == "numerical_checks", st["rollback"]
    # Re-sent to stock as soon as the ingress heard of the rollback (pinned ones, streams and
    # chats too: no byte had reached their clients), not answered by custom (or timed out)
    # once it answers again; each answer whole.
    assert results[:8] == [(200, "stock", "rollback")] * 8
    assert results[8:] == [(200, "stock", "rollback", True)] * 3
    assert after < 8, after
    after_rollback = asyncio.run(_burst(canary["port"], 10, concurrency=5, max_tokens=1))
    assert {arm for _, arm, _ in after_rollback} == {"stock"}
    r = _complete(canary["client"], headers={"x-fuselane-arm": "custom"})
    assert r.status_code == 503 and "rolled back" in r.text, r.text
    _set(1.0)  # the operator's action clears the rollback
    assert not control.status(APP)["rolled_back"]


def test_weight_zero_sends_the_requests_waiting_on_custom_to_stock(canary):  # noqa: F811
    _set(1.0)
    assert _complete(canary["client"]).headers[ARM_HEADER] == "custom"
    results, after = _while_custom_hangs(canary["port"], lambda: control.set_weight(APP, 0.0, 0.0))
    assert results == [(200, "stock", "weight_zero")] * 6
    assert after < 10, after
    assert not control.status(APP)["rolled_back"]
    # Weight 0 is no rollback: an allowed pin still reaches custom.
    r = _complete(canary["client"], headers={"x-fuselane-arm": "custom"})
    assert r.status_code == 200 and r.headers[ARM_HEADER] == "custom", r.text


def _stream_through_a_crash(port: int) -> tuple[list[str], list]:
    """A long stream from custom, cut by killing the custom replicas after its first chunk,
    while a burst of requests is in flight on them."""
    body = {"model": "tiny", "prompt": "the longest answer", "temperature": 0, "stream": True}
    body |= {"max_tokens": 400, "ignore_eos": True}

    async def run() -> tuple[list[str], list]:
        burst = asyncio.create_task(
            _burst(port, 30, concurrency=30, max_tokens=48, ignore_eos=True)
        )
        await asyncio.sleep(0.3)
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", timeout=180, trust_env=False
        ) as ac:
            async with ac.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200 and r.headers[ARM_HEADER] == "custom"
                lines = r.aiter_lines()
                events = []
                async for line in lines:
                    if line.startswith("data: "):
                        events.append(line[6:])
                        break
                for actor in _custom_replicas():
                    ray.kill(actor)
                events += [ln[6:] async for ln in lines if ln.startswith("data: ")]
        return events, await burst

    return asyncio.run(run())


def test_a_crash_cuts_streams_visibly_and_counts_once(canary):  # noqa: F811
    _set(1.0)
    # Enough custom outcomes in the window for the error-rate rule (min_requests 20) to judge.
    warm = asyncio.run(_burst(canary["port"], 30, concurrency=6, max_tokens=1))
    assert {arm for _, arm, _ in warm} == {"custom"}
    events, burst = _stream_through_a_crash(canary["port"])
    # The cut stream says so: an OpenAI error event last, and never `[DONE]`.
    assert len(events) >= 2 and "[DONE]" not in events, events[-3:]
    error = json.loads(events[-1])["error"]
    assert error["code"] == 500 and "custom" in error["message"]
    assert all(json.loads(e).get("error") is None for e in events[:-1])
    # Every request of the burst was retried on stock: no user saw the crash.
    assert [code for code, _, _ in burst] == [200] * 30
    # One crash is one failure for the rules, not one per request it had in flight.
    time.sleep(2.0)  # the ingress's reports
    st = control.status(APP)
    assert not st["rolled_back"], st["rollback"]
    custom = st["arms"]["custom"]
    assert custom["streams_cut"] >= 1 and custom["errors"] >= 10, custom
    assert custom["error_rate_window"] < 0.2, custom
    # The cut stream is counted per arm in Ray's Prometheus export.
    deadline = time.monotonic() + 30
    lines: list[str] = []
    while time.monotonic() < deadline and not lines:
        text = httpx.get(f"http://127.0.0.1:{canary['metrics_port']}/metrics", trust_env=False)
        lines = [
            ln
            for ln in text.text.splitlines()
            if ln.startswith("ray_fuselane_canary_streams_cut_total{") and 'arm="custom"' in ln
        ]
        time.sleep(1)
    assert lines and float(lines[0].rsplit(" ", 1)[1]) >= 1, lines
