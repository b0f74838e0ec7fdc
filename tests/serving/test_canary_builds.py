"""Each arm's build in the canary: read from the replicas' kernel metrics
(`fuselane_build_info`), shown by `fuselane canary status`, and named by a rollback (record,
log line, metric label). The monitor's class is driven directly, as in test_canary_rules.py
(no Ray cluster); on a real cluster, with the engines' own build info: test_demo.py."""

import asyncio
import logging

import pytest

from fuselane.plugin.build_info import LABELS, build_info
from fuselane.serving.canary import kernel_metrics as km
from fuselane.serving.canary import monitor as monitor_mod

from .test_canary_rules import monitor  # noqa: F401 - the fixture `mon` wraps

BUILD = {
    "version": "0.1.0",
    "kernels": "4164097a0bf3",
    "triton": "3.6.0",
    "torch": "2.13.0",
    "vllm": "0.32.0",
    "cuda": "none",
}
NEXT = BUILD | {"kernels": "99aa00bb11cc"}


def _summary(build: dict[str, str]) -> list[dict]:
    """A replica's kernel-metrics report (`kernel_metrics.summary`) with its build."""
    return [
        {"name": "fuselane_kernel_launches_total", "labels": {"kernel": "kv_write"}, "value": 9.0},
        {"name": km.BUILD_INFO, "labels": dict(build), "value": 1.0},
    ]


@pytest.fixture
def mon(monitor):  # noqa: F811 - the imported fixture, by name
    """The rules tests' monitor (weight 1, no numerical-check failure allowed)."""
    return monitor


def test_build_labels_are_the_plugins():
    assert set(BUILD) == set(LABELS) == set(build_info())  # this process's own build too
    assert km.build_id(BUILD) == "0.1.0/4164097a0bf3" and km.build_id(None) == "unknown"


def test_arm_builds_count_live_replicas_most_first():
    reports = {
        "c1": {"arm": "custom", "samples": _summary(BUILD), "at": 100.0},
        "c2": {"arm": "custom", "samples": _summary(NEXT), "at": 100.0},  # a rollout under way
        "c3": {"arm": "custom", "samples": _summary(NEXT), "at": 100.0},
        "s1": {"arm": "stock", "samples": [], "at": 100.0},  # vLLM's kernels: no build
        "gone": {"arm": "custom", "samples": _summary(BUILD), "at": 30.0},
    }
    assert km.arm_builds(reports, now=110.0, fresh_s=60.0) == {
        "stock": [],
        "custom": [{"build": NEXT, "replicas": 2}, {"build": BUILD, "replicas": 1}],
    }
    # A replica that stopped reporting (redeployed, dead) is no longer the arm's build.
    assert km.arm_builds(reports, now=165.0, fresh_s=60.0)["custom"] == []


def test_status_shows_each_arms_build(mon):
    for replica, build in (("c1", BUILD), ("c2", BUILD), ("c3", NEXT)):
        asyncio.run(mon.report_kernels(replica, "custom", 0.0, 10.0, _summary(build)))
    asyncio.run(mon.report_kernels("s1", "stock", 0.0, 0.0, []))
    st = asyncio.run(mon.status())
    assert st["builds"]["custom"] == [
        {"build": BUILD, "replicas": 2},
        {"build": NEXT, "replicas": 1},
    ]
    text = km.format_builds(st)
    assert "stock   none reported" in text
    assert "custom  fuselane 0.1.0 kernels 4164097a0bf3 (triton 3.6.0" in text
    assert "2 replicas" in text and "kernels 99aa00bb11cc" in text and "1 replica\n" not in text
    mon.kernel_samples["c3"]["at"] -= monitor_mod.BUILD_FRESH_S + 1
    assert asyncio.run(mon.status())["builds"]["custom"] == [{"build": BUILD, "replicas": 2}]


def test_a_rollback_names_the_build_it_rolled_back_from(mon, caplog):
    with caplog.at_level(logging.WARNING, logger="ray.serve"):
        asyncio.run(mon.report_kernels("c1", "custom", 0.0, 4.0, _summary(BUILD)))
        assert mon.rollback is None
        # A failed numerical check on the custom replica: the rule fires.
        asyncio.run(mon.report_kernels("c1", "custom", 1.0, 5.0, _summary(BUILD)))
    st = asyncio.run(mon.status())
    assert st["rollback"]["reason"] == "numerical_checks"
    assert st["rollback"]["build"] == "0.1.0/4164097a0bf3" and st["rollback"]["build_info"] == BUILD
    assert mon.metrics.tags == [{"reason": "numerical_checks", "build": "0.1.0/4164097a0bf3"}]
    line = "custom arm rolled back from build 0.1.0/4164097a0bf3: numerical_checks"
    assert any(line in r.getMessage() for r in caplog.records), caplog.text
    assert "last rollback: from custom build 0.1.0/4164097a0bf3" in km.format_builds(st)


def test_a_rollback_without_build_info_says_unknown(mon):
    asyncio.run(mon.report_kernels("c1", "custom", 2.0, 2.0, []))
    assert mon.rollback["build"] == "unknown" and mon.rollback["build_info"] is None
    assert mon.metrics.tags[0]["build"] == "unknown"
