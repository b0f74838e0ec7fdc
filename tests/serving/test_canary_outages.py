"""A custom replica's crash against the shipped CPU config's rules, without Ray: the ingress's
routing (`CanaryIngress._start`, on fake arm handles and a fake clock) reports its outcomes to
the monitor (`CanaryMonitor.report`) as it does in a canary.

One crash of a healthy custom arm (the failed attempt in flight, then the retry after the
cooldown that meets the replica Serve is still starting) must not roll it back: it is one
outage, counted once. An arm that keeps failing must be rolled back within a stated number
of requests (server errors) or of seconds (a crash loop: `rollback.max_outage_s`)."""

import asyncio
from typing import Any

import pytest

pytest.importorskip("ray.serve.llm")

from ray.exceptions import ActorDiedError

from fuselane.serving.canary import monitor as monitor_mod
from fuselane.serving.canary import router as router_mod
from fuselane.serving.canary.config import load_config
from fuselane.serving.canary.demo import DEFAULT_CONFIG
from fuselane.serving.canary.ray_compat import CompletionRequest, ErrorResponse

from .test_canary_rules import _Metrics

ANSWER = {"id": "c", "object": "text_completion", "created": 0, "model": "tiny"}


def _answer() -> Any:
    """A whole completion, as custom's or stock's handle yields it."""
    from fuselane.serving.canary.ray_compat import NON_STREAMING_RESPONSE_TYPES

    (completion,) = [t for t in NON_STREAMING_RESPONSE_TYPES if t.__name__ == "CompletionResponse"]
    choice = {"index": 0, "text": "ok", "finish_reason": "length"}
    usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
    return completion.model_validate({**ANSWER, "choices": [choice], "usage": usage})


class _Gen:
    """An arm handle's response generator: its first item, or the exception it raises."""

    def __init__(self, item: Any) -> None:
        self.item = item

    async def __anext__(self) -> Any:
        if isinstance(self.item, BaseException):
            raise self.item
        return self.item

    def cancel(self) -> None:
        pass


class _IngressMetrics:
    def request(self, *args: object) -> None:
        pass

    def stream_cut(self, *args: object) -> None:
        pass

    def failover(self, *args: object) -> None:
        pass


class Canary:
    """The ingress's routing and the monitor, on the shipped CPU config, with a clock that the
    test moves (`now`, seconds)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, **rollback: float) -> None:
        """`rollback`: settings that replace the shipped config's."""
        self.now = 1000.0
        monkeypatch.setattr(router_mod.time, "monotonic", lambda: self.now)
        monkeypatch.setattr(monitor_mod.time, "monotonic", lambda: self.now)
        monkeypatch.setattr(monitor_mod, "MonitorMetrics", _Metrics)
        data = load_config(DEFAULT_CONFIG, check_paths=False, check_engine=False)
        self.config = data.model_copy(
            update={
                "routing": data.routing.model_copy(update={"weight": 1.0}),
                "rollback": data.rollback.model_copy(update=rollback),
            }
        )
        cls = monitor_mod.CanaryMonitor.func_or_class
        self.monitor = cls(self.config.model_dump(mode="json"))
        ing = object.__new__(router_mod.CanaryIngress)
        ing.config = self.config
        ing._weight, ing._rolled_back, ing._epoch = 1.0, False, 0
        ing._cooldown_until, ing._incident_at, ing._outage_since = 0.0, None, None
        ing._outcomes, ing._metrics = [], _IngressMetrics()
        self.ingress = ing
        self.custom: Any = None  # what custom's next attempt gets

        def call(arm: str, body: Any, method: str, info: Any) -> _Gen:
            return _Gen(self.custom if arm == "custom" else _answer())

        ing._call = call

    def request(self) -> str:
        """One request routed to custom (weight 1); reports to the monitor. Returns the arm
        that answered."""
        ing = self.ingress

        async def go() -> str:
            ing._changed = asyncio.Event()
            body = CompletionRequest(model="tiny", prompt="p", max_tokens=4)
            att = await ing._start("custom", "weighted", body, "completions", None)
            if att.arm == "custom":
                ing._record("custom", "ok", 1.0)
            return att.arm

        arm = asyncio.run(go())
        outcomes, ing._outcomes = ing._outcomes, []
        state = asyncio.run(self.monitor.report([tuple(o) for o in outcomes], []))
        ing._set_state(state["weight"], state["shadow_fraction"], state["rolled_back"], 0)
        return arm

    @property
    def rollback(self) -> dict | None:
        return self.monitor.rollback


def _healthy(c: Canary, n: int = 20) -> None:
    """`n` answers from custom at the CPU arm's pace (a few a minute)."""
    c.custom = _answer()
    for _ in range(n):
        assert c.request() == "custom"
        c.now += 6.0


def _crash(c: Canary, retries: int) -> None:
    """A replica's crash under a request, then `retries` retries after each cooldown that meet
    no live replica (Serve is starting another), then custom answers again."""
    c.custom = ActorDiedError()
    assert c.request() == "stock"  # the request in flight goes to stock, and for the cooldown
    c.now += 1.0
    assert c.request() == "stock"  # custom's traffic too (failover: cooldown)
    for _ in range(retries):
        c.now += c.config.failover.cooldown_s + 1
        assert c.request() == "stock"
    c.now += c.config.failover.cooldown_s + 1
    c.custom = _answer()
    assert c.request() == "custom" or c.rollback is not None


def test_one_crash_counts_once_however_long_the_restart(monkeypatch):
    # The audit's case, with the settings the CPU config had: 20 answers, a crash, a retry
    # after the cooldown while the replica restarts. Counted per attempt it was 2 of 22,
    # "custom error rate 0.091 > 0.05 over the last 22 custom requests".
    c = Canary(monkeypatch, min_requests=20, max_error_rate=0.05)
    _healthy(c)
    _crash(c, retries=3)
    assert c.rollback is None, c.rollback
    assert c.ingress._outage_since is None  # custom answered: the outage is over
    assert c.monitor.judge.arms["custom"].attempts(c.now) == 22  # 21 answers + 1 outage
    st = asyncio.run(c.monitor.status())
    assert st["arms"]["custom"]["errors"] == 4  # every failed attempt is in the tallies


def test_the_shipped_cpu_config_keeps_a_healthy_arm_through_replica_kills(monkeypatch):
    c = Canary(monkeypatch)  # serving/configs/canary-cpu-tiny.yaml as shipped
    _healthy(c)
    _crash(c, retries=2)  # one crash
    assert c.rollback is None, c.rollback
    # The soak's pace: four kills in ten minutes, about 8 custom answers between them.
    for _ in range(3):
        _healthy(c, 7)
        _crash(c, retries=2)
    assert c.rollback is None, c.rollback


def test_an_arm_that_answers_errors_is_rolled_back_within_a_few_requests(monkeypatch):
    server_error = ErrorResponse.model_validate(
        {"error": {"message": "engine failed", "type": "InternalServerError", "code": 500}}
    )

    def failed_until_rollback(c: Canary) -> int:
        c.custom = server_error
        sent = 0
        while c.rollback is None and sent < 100:
            assert c.request() == "stock"  # retried on stock, and counted one by one
            sent += 1
        return sent

    # Shipped config (min_requests 20, max_error_rate 0.2): after 20 answers, the 6th error
    # (6 of 26); a fresh arm that fails every request, at its 20th.
    c = Canary(monkeypatch)
    _healthy(c)
    assert failed_until_rollback(c) == 6 and c.rollback["reason"] == "error_rate"
    assert "over the last 26 custom requests" in c.rollback["detail"], c.rollback
    c = Canary(monkeypatch)
    assert failed_until_rollback(c) == c.config.rollback.min_requests == 20


def test_a_crash_loop_is_rolled_back_once_it_outlasts_max_outage_s(monkeypatch):
    c = Canary(monkeypatch)
    limit = c.config.rollback.max_outage_s
    f = c.config.failover
    assert limit is not None and limit > f.cooldown_s + f.first_response_timeout_s
    _healthy(c)
    # Every replica Serve starts dies at its first request: custom never answers again.
    c.custom = ActorDiedError()
    start, sent = c.now, 0
    while c.rollback is None and sent < 100:
        c.request()
        sent += 1
        c.now += f.cooldown_s + 1  # each retry waits out the cooldown of the last failure
    assert c.rollback is not None and c.rollback["reason"] == "error_rate"
    assert "custom answered nothing for" in c.rollback["detail"], c.rollback
    # Rolled back at the first failed retry past the limit: within one cooldown of it.
    assert c.now - start <= limit + 2 * (f.cooldown_s + 1)
    assert sent <= limit // (f.cooldown_s + 1) + 2


def test_a_second_crash_after_custom_answered_again_is_a_second_outage(monkeypatch):
    c = Canary(monkeypatch, min_requests=20, max_error_rate=0.05)
    _healthy(c)
    _crash(c, retries=1)
    assert c.rollback is None  # 1 outage in 22 attempts
    c.now += 6.0
    c.custom = ActorDiedError()  # another crash, after custom answered again: a new outage
    c.request()
    assert c.rollback is not None and "over the last 23" in c.rollback["detail"], c.rollback


def test_max_outage_s_must_outlast_one_restart():
    from fuselane.serving.canary.config import CanaryConfigError, parse_config

    base = {"model": {"id": "tiny", "source": "/m"}}
    failover = {"cooldown_s": 30, "first_response_timeout_s": 60}
    with pytest.raises(CanaryConfigError, match=r"rollback.max_outage_s: 90 would roll back"):
        parse_config(base | {"failover": failover, "rollback": {"max_outage_s": 90}})
    ok = parse_config(base | {"failover": failover, "rollback": {"max_outage_s": None}})
    assert ok.rollback.max_outage_s is None
