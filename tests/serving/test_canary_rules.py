"""The canary's plain-Python core, hardened: pins, the rollback rules' windows and incidents,
the latency rule for interpreted kernels, shadow failure reasons, the ingress's body reading.
No Ray cluster: the monitor's class is driven directly (its Ray metrics replaced)."""

import asyncio
import json

import pytest

from fuselane.serving.canary import monitor as monitor_mod
from fuselane.serving.canary.config import CanaryConfig, RollbackSpec
from fuselane.serving.canary.rollback import Outcome, RollbackJudge
from fuselane.serving.canary.shadow import PairResult, failure_reason, run_pair
from fuselane.serving.canary.split import PinRefused, choose_arm


def test_pin_never_selects_a_custom_arm_that_is_not_allowed_or_rolled_back():
    assert choose_arm(0.5, pin="stock").arm == "stock"
    assert choose_arm(0.5, pin="stock", rolled_back=True).arm == "stock"
    with pytest.raises(PinRefused, match=r"routing\.allow_pin_custom") as e:
        choose_arm(0.5, pin="custom")  # off unless the config enables it
    assert e.value.status == 403
    d = choose_arm(0.0, pin=" Custom ", allow_pin_custom=True)
    assert (d.arm, d.how) == ("custom", "pinned")
    with pytest.raises(PinRefused, match="rolled back") as e:
        choose_arm(0.5, pin="custom", allow_pin_custom=True, rolled_back=True)
    assert e.value.status == 503
    with pytest.raises(ValueError, match="unknown arm"):
        choose_arm(0.5, pin="canary", allow_pin_custom=True)


def test_rule_windows_age_out():
    judge = RollbackJudge(RollbackSpec(min_requests=10, max_error_rate=0.1))
    for _ in range(10):
        judge.add_outcome("custom", False, None, now=0.0)
    assert judge.judge(now=1.0).reason == "error_rate"
    # The default window is ten minutes: failures older than that no longer decide.
    assert judge.judge(now=601.0) is None
    assert judge.arms["custom"].attempts(601.0) == 0
    judge.add_agreement(0.0, now=601.0)
    assert judge.agreement.values(1300.0) == []


class _Metrics:
    """MonitorMetrics without Ray: records the rollbacks (their reasons; `tags`: every label)."""

    def __init__(self) -> None:
        self.rolled: list[str] = []
        self.tags: list[dict[str, str]] = []
        outer = self

        class _Counter:
            def inc(self, value: float, tags: dict) -> None:
                outer.rolled.append(tags["reason"])
                outer.tags.append(dict(tags))

        class _Gauge:
            def set(self, value: float) -> None:
                pass

        self.rollbacks, self.agreement = _Counter(), _Gauge()

    def state(self, *args: object) -> None:
        pass


@pytest.fixture
def monitor(monkeypatch):
    monkeypatch.setattr(monitor_mod, "MonitorMetrics", _Metrics)
    config = {
        "model": {"id": "tiny", "source": "/m"},
        "routing": {"weight": 1.0},
        "rollback": {"min_requests": 20, "max_error_rate": 0.2, "max_latency_ratio": 3.0},
    }
    cls = monitor_mod.CanaryMonitor.func_or_class
    return cls(CanaryConfig.model_validate(config).model_dump(mode="json"))


def _report(monitor, outcomes=(), comparisons=()) -> dict:
    return asyncio.run(
        monitor.report([tuple(o) for o in outcomes], [tuple(c) for c in comparisons])
    )


def test_one_replica_crash_counts_once_in_the_error_rule(monitor):
    _report(monitor, [Outcome("custom", "ok", 0.1, None, 0) for _ in range(30)])
    # A crash: the first failure opens the incident, the 39 attempts in flight on the replica
    # were retried on stock and folded into it (judged=False), as the ingress reports them.
    crash = [Outcome("custom", "error", None, None, 0)]
    crash += [Outcome("custom", "error", None, None, 0, judged=False) for _ in range(39)]
    crash += [Outcome("stock", "ok", 0.1, "unavailable", 0) for _ in range(40)]
    state = _report(monitor, crash)
    assert not state["rolled_back"] and monitor.metrics.rolled == []
    st = asyncio.run(monitor.status())
    assert st["arms"]["custom"]["errors"] == 40  # every attempt is in the tallies
    assert st["arms"]["custom"]["error_rate_window"] == pytest.approx(1 / 31)
    # A stream cut is an error of the arm's too, and shown on its own.
    _report(monitor, [Outcome("custom", "stream_cut", None, None, 0)])
    st = asyncio.run(monitor.status())
    assert st["arms"]["custom"]["streams_cut"] == 1 and st["arms"]["custom"]["errors"] == 41


def test_latency_rule_for_interpreted_kernels_is_off_unless_set(monitor):
    # The CPU demo: interpreted kernels, custom p50 25.5 s against stock 0.15 s.
    asyncio.run(monitor.report_kernels("r1", "custom", 0.0, 0.0, [], True))
    slow = [Outcome("custom", "ok", 25.5, None, 0) for _ in range(25)]
    fast = [Outcome("stock", "ok", 0.15, None, 0) for _ in range(25)]
    assert not _report(monitor, slow + fast)["rolled_back"]
    st = asyncio.run(monitor.status())
    assert st["latency_rule"] == {"custom_interpreted": True, "max_ratio": None}
    # A config with a ratio for interpreted kernels.
    judge = RollbackJudge(RollbackSpec(min_requests=20, max_latency_ratio_interpreted=100.0))
    judge.custom_interpreted = True
    for _ in range(25):
        judge.add_outcome("custom", True, 25.5)
        judge.add_outcome("stock", True, 0.15)
    b = judge.judge()
    assert b.reason == "latency_ratio" and "170.00 > 100 (interpreted kernels)" in b.detail
    judge.custom_interpreted = False  # compiled kernels: max_latency_ratio (3) as before
    assert "> 3" in judge.judge().detail


def test_every_shadow_failure_has_a_reason(monitor):
    assert failure_reason(TimeoutError()) == "TimeoutError: TimeoutError()"
    assert failure_reason(RuntimeError("custom: 500 boom")) == "RuntimeError: custom: 500 boom"

    async def answer(arm: str, body: dict) -> dict:
        if arm == "custom":
            raise TimeoutError()
        return {"choices": [{"token_ids": [1], "logprobs": {"token_logprobs": [-0.1]}}]}

    body = {"model": "tiny", "prompt": "p", "max_tokens": 4}
    pair = asyncio.run(run_pair(answer, body, False, 8, 0))
    assert pair.agreement is None and pair.error == "TimeoutError: TimeoutError()"
    _report(monitor, comparisons=[pair, PairResult(None, None, 0.0, 0, "RuntimeError: x")])
    sh = asyncio.run(monitor.status())["shadow"]
    assert sh["errors"] == 2 and sh["error_types"] == {"TimeoutError": 1, "RuntimeError": 1}
    assert sh["last_error"] == "RuntimeError: x"


def _request(body: bytes, content_type: str | None):
    from starlette.requests import Request

    headers = [(b"content-type", content_type.encode())] if content_type else []

    async def receive() -> dict:
        return {"type": "http.request", "body": body, "more_body": False}

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers}
    return Request(scope, receive)


def test_ingress_reads_only_json_bodies():
    pytest.importorskip("ray.serve.llm")
    from fastapi.exceptions import RequestValidationError
    from starlette.responses import JSONResponse

    from fuselane.serving.canary.ray_compat import CompletionRequest
    from fuselane.serving.canary.router import read_body

    good = json.dumps({"model": "tiny", "prompt": "the kernel", "max_tokens": 8}).encode()
    cases = [
        (good, None, 415),  # the README's curl without -H: FastAPI gave a 500
        (b"model=tiny&prompt=x", "application/x-www-form-urlencoded", 415),
        (good, "text/plain", 415),
        (b"{not json", "application/json", 400),
        (b"\xff\xfe", "application/json; charset=utf-8", 400),
    ]
    for raw, ctype, status in cases:
        r = asyncio.run(read_body(_request(raw, ctype), CompletionRequest))
        assert isinstance(r, JSONResponse) and r.status_code == status, (ctype, raw)
        err = json.loads(r.body)["error"]
        assert err["code"] == status and "application/json" in err["message"]
    body = asyncio.run(read_body(_request(good, "application/json"), CompletionRequest))
    assert body.prompt == "the kernel" and body.max_tokens == 8
    with pytest.raises(RequestValidationError) as e:
        bad = json.dumps({"model": "tiny", "prompt": "x", "max_tokens": "many"}).encode()
        asyncio.run(read_body(_request(bad, "application/json"), CompletionRequest))
    assert e.value.errors()[0]["loc"] == ("body", "max_tokens")


def test_kernels_interpreted_reads_the_arm_environment():
    pytest.importorskip("ray.serve.llm")
    from fuselane.serving.canary.engine import kernels_interpreted

    assert not kernels_interpreted({"FUSELANE_KERNELS": "none", "TRITON_INTERPRET": "1"})
    assert not kernels_interpreted({})
    assert kernels_interpreted({"FUSELANE_KERNELS": "attention", "TRITON_INTERPRET": "1"})
