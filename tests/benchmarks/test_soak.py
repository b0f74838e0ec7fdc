"""The soak's judges, without a canary: how `clients` reads an answer (the soak's zeros rest on
it) and what `canary_soak.Schedule` does with a rollback (nothing clears one)."""

import argparse
import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import pytest

from fuselane.benchmarks.soak import canary_soak, report
from fuselane.benchmarks.soak.clients import Record, Request, judge_body, judge_stream, sse_data


def _chunk(text: str, finish: str | None = None) -> str:
    return json.dumps({"choices": [{"index": 0, "text": text, "finish_reason": finish}]})


def test_a_stream_without_done_or_error_event_is_truncated():
    events = [_chunk("the"), _chunk(" kernel")]
    outcome, detail, text = judge_stream("completions", events)
    assert (outcome, text) == ("truncated", None) and "without [DONE]" in detail
    assert judge_stream("completions", [])[0] == "truncated"
    # [DONE] without any finish_reason is no whole answer either.
    assert judge_stream("completions", [_chunk("x"), "[DONE]"])[0] == "truncated"


def test_a_stream_ending_with_an_error_event_is_an_error():
    cut = json.dumps({"error": {"message": "the custom arm failed", "code": 500}})
    outcome, detail, _ = judge_stream("completions", [_chunk("the"), cut])
    assert outcome == "error" and "the custom arm failed" in detail
    # An error event before [DONE] is an error too, not an answer.
    assert judge_stream("completions", [cut, "[DONE]"])[0] == "error"
    whole = [_chunk("the"), _chunk(" end", "length"), "[DONE]"]
    assert judge_stream("completions", whole) == ("ok", "", "the end")


def test_a_whole_answer_without_finish_reason_is_truncated():
    body = {"choices": [{"index": 0, "text": "the kernel", "finish_reason": None}]}
    assert judge_body("completions", json.dumps(body).encode())[0] == "truncated"
    assert judge_body("completions", b'{"choices": [{"text": "cut')[0] == "truncated"
    body["choices"][0]["finish_reason"] = "length"
    assert judge_body("completions", json.dumps(body).encode()) == ("ok", "", "the kernel")
    chat = {"choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}]}
    assert judge_body("chat", json.dumps(chat).encode()) == ("ok", "", "hi")


class _Chunks(httpx.AsyncByteStream):
    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for c in self.chunks:
            yield c


def test_line_separators_inside_an_events_json_do_not_cut_it():
    # The tiny model's sampled text holds U+2028 and U+0085 raw (json.dumps with
    # ensure_ascii=False, as vLLM writes its events); only CR and LF end an SSE line.
    texts = ["a\u2028b", "c\u0085d", "e"]
    finish = [None, None, "length"]
    raw = "".join(
        f"data: {json.dumps(json.loads(_chunk(t, f)), ensure_ascii=False)}\n\n"
        for t, f in zip(texts, finish, strict=True)
    )
    raw += "data: [DONE]\r\n\r\n"
    data = raw.encode()
    # Cut the bytes anywhere, a multi-byte character too: the reader joins them again.
    chunks = [data[i : i + 7] for i in range(0, len(data), 7)]

    async def read() -> list[str]:
        r = httpx.Response(200, stream=_Chunks(chunks))
        return [e async for e in sse_data(r)]

    events = asyncio.run(read())
    assert len(events) == 4 and events[-1] == "[DONE]"
    assert judge_stream("completions", events) == ("ok", "", "a\u2028bc\u0085de")
    # What `str.splitlines` (httpx's aiter_lines) makes of it: cut events, a "truncated" answer.
    split = [ln[6:] for ln in raw.splitlines() if ln.startswith("data: ")]
    assert judge_stream("completions", split)[0] == "truncated"


class _Watch:
    def __init__(self, rollbacks: list[dict]) -> None:
        self.rollbacks = rollbacks
        self.snapshots: list[dict] = []
        self.errors: list[str] = []
        self.last = {"replicas": {"custom": {"running": 1}}}  # custom runs again


def _args(**kw: object) -> argparse.Namespace:
    base = {
        "minutes": 10.0,
        "kill_every_s": 120.0,
        "fault": "sampling",
        "after_fault_s": 60.0,
        "fault_phase_s": 300.0,
    }
    return argparse.Namespace(**(base | kw))


def test_the_soak_never_clears_a_rollback_and_fails_on_one_not_from_the_fault(monkeypatch):
    from fuselane.serving.canary import control

    cleared: list[object] = []
    monkeypatch.setattr(control, "set_weight", lambda *a, **k: cleared.append(a))
    redeployed: list[object] = []
    monkeypatch.setattr(canary_soak.chaos, "redeploy_custom", lambda c: redeployed.append(c) or 0)
    watch = _Watch([])
    sched = canary_soak.Schedule(_args(), config=None, watch=watch)
    # Four kills in ten minutes, then the fault after them.
    assert [round(m - sched.start) for m in sched.kill_marks] == [120, 240, 360, 480]
    t = sched.start + 221.4
    watch.rollbacks.append({"at": t, "reason": "error_rate", "detail": "custom error rate"})
    sched.step()
    assert cleared == [] and redeployed == []  # left in force: the run reports it
    assert [rb["at"] for rb in sched.unexpected_rollbacks()] == [t]
    assert sched.rollback_spans() == [(t, float("inf"))]
    figs = report.figures([], {}, sched.rollback_spans(), unexpected_rollbacks=1)
    assert figs["rollbacks_not_from_the_fault"] == 1
    assert "rollbacks_not_from_the_fault" in report.MUST_BE_ZERO
    # The fault's own rollback is expected; the run stops 60 s after it.
    sched.fault = {"family": "sampling", "injected_at": sched.start + 600}
    caught = sched.start + 640
    watch.rollbacks.append({"at": caught, "reason": "numerical_checks", "detail": "1 > 0"})
    sched.step()
    assert sched.fault["caught_at"] == caught and len(redeployed) == 1
    assert [rb["at"] for rb in sched.unexpected_rollbacks()] == [t]


def test_custom_answers_between_kills_are_counted():
    def rec(at: float, arm: str = "custom", outcome: str = "ok") -> Record:
        r = Record(0, Request("completions", False, True, 0), sent_at=at - 1)
        r.answered_at, r.done_at, r.arm, r.outcome = at, at + 1, arm, outcome
        return r

    records = [rec(10), rec(130), rec(131), rec(250), rec(250, outcome="error"), rec(260, "stock")]
    figs = report.figures(
        records, {}, [], kill_intervals=[(120, 240), (240, 300)], kill_phase=(0, 300)
    )
    ph = figs["kill_phase"]
    assert ph["custom_ok"] == 4 and ph["custom_ok_before_the_first_kill"] == 1
    assert ph["custom_ok_after_each_kill"] == [2, 1] and ph["custom_ok_in_its_last_60s"] == 1


@pytest.mark.parametrize("every, kills", [(0.0, 0), (120.0, 4), (200.0, 2)])
def test_kill_schedule(every, kills):
    sched = canary_soak.Schedule(_args(kill_every_s=every), config=None, watch=_Watch([]))
    assert len(sched.kill_marks) == kills
    sched.kills = [{"at": m, "killed": True} for m in sched.kill_marks]
    spans = sched.kill_intervals()  # a healthy run (no kills) has none
    assert len(spans) == kills and all(a < b for a, b in spans)
    assert not spans or spans[-1][1] == sched.kill_end
