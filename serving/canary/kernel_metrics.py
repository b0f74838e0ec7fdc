"""fuselane's kernel metrics, from a replica's vLLM engine to Ray's Prometheus export.

The plugin's telemetry runs in vLLM's EngineCore process, a child of the Serve replica that
Ray knows nothing about, and writes its `fuselane_*` metrics with `prometheus_client`. Each
arm replica gives its engine a fresh `PROMETHEUS_MULTIPROC_DIR` before starting it (a reused
directory double-counts: docs/notes/telemetry.md), so those metrics land in files that the replica
reads here (`read_samples`) and mirrors into Ray's export (`RayMirror`), with an `arm` label.

The engine's `fuselane_build_info` (value 1, the build as labels: plugin/build_info.py) comes
along with the rest: the monitor reads each arm's builds from it (`builds`), for the status, the
dashboard (through the mirror) and the rollback record.

Mirroring: counters stay counters (Ray is given the increments); gauges, and every series of
a histogram (`_bucket` with its `le` label, `_count`, `_sum`), become gauges holding the
engine's cumulative values, on which PromQL's `rate()` and `histogram_quantile()` work as on
the originals. Ray prefixes names with `ray_`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

PREFIX = "fuselane_"
BUILD_INFO = "fuselane_build_info"
# Set by the replica for its engine; an operator's own value is left alone (and not wiped).
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


@dataclass(frozen=True)
class Sample:
    family: str  # the metric family (`fuselane_attention_launches`)
    kind: str  # counter, gauge, histogram, summary, ...
    name: str  # the series (`fuselane_attention_launches_total`, `..._bucket`)
    labels: tuple[tuple[str, str], ...]
    value: float

    def label(self, key: str) -> str | None:
        return dict(self.labels).get(key)


def fresh_multiproc_dir(arm: str) -> str:
    """A new, empty directory for one replica's engine (its own, so nothing double-counts).

    Named after the replica's pid: directories of replicas that died without cleaning up
    (`ray.kill`, a crash) are removed here, by the next replica on the node."""
    tmp = tempfile.gettempdir()
    for name in os.listdir(tmp):
        parts = name.split("-")
        if name.startswith("fuselane-metrics-") and len(parts) >= 4 and parts[3].isdigit():
            if not _alive(int(parts[3])):
                shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"fuselane-metrics-{arm}-{os.getpid()}-")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_dir(path: str | None) -> None:
    if path:
        shutil.rmtree(path, ignore_errors=True)


def read_samples(path: str, prefix: str = PREFIX) -> list[Sample]:
    """Every `prefix*` series the engine processes wrote under `path` (summed across them)."""
    if not path or not os.path.isdir(path):
        return []
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=path)
    out = []
    for family in registry.collect():
        if not family.name.startswith(prefix):
            continue
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            labels = tuple(sorted((k, str(v)) for k, v in s.labels.items()))
            out.append(Sample(family.name, family.type, s.name, labels, float(s.value)))
    return out


def check_failures(
    samples: Iterable[Sample], family: str, result_label: str, fail_values: Iterable[str]
) -> tuple[float, float]:
    """(failed, total) numerical checks: the counter `family` split by `result_label`."""
    fails = set(fail_values)
    failed = total = 0.0
    names = {family, family + "_total"}
    for s in samples:
        if s.family not in names and s.name not in names:
            continue
        if not s.name.endswith("_total"):
            continue
        total += s.value
        if s.label(result_label) in fails:
            failed += s.value
    return failed, total


def summary(samples: Iterable[Sample]) -> list[dict[str, Any]]:
    """A compact, picklable view for status tables: no histogram buckets."""
    return [
        {"name": s.name, "labels": dict(s.labels), "value": s.value}
        for s in samples
        if not s.name.endswith("_bucket")
    ]


def builds(samples: Iterable[Mapping[str, Any]]) -> list[dict[str, str]]:
    """The builds in a replica's `summary` (the labels of its `fuselane_build_info` at 1)."""
    return [dict(s["labels"]) for s in samples if s["name"] == BUILD_INFO and s["value"] > 0]


def arm_builds(
    reports: Mapping[str, Mapping[str, Any]], now: float, fresh_s: float
) -> dict[str, list[dict[str, Any]]]:
    """Per arm, the builds of its replicas' reports (`{replica: {arm, samples, at}}`, as the
    monitor keeps them) no older than `fresh_s` at `now`, with their replica counts, most
    replicas first: `{"custom": [{"build": labels, "replicas": 2}, ...], "stock": []}`. An older
    report is a replica that is gone (restarted, redeployed): its build is no longer the arm's."""
    count: Counter[tuple[str, tuple[tuple[str, str], ...]]] = Counter()
    for rep in reports.values():
        if now - rep["at"] <= fresh_s:
            for labels in builds(rep["samples"]):
                count[(rep["arm"], tuple(sorted(labels.items())))] += 1
    return {
        arm: [
            {"build": dict(labels), "replicas": n}
            for (a, labels), n in count.most_common()
            if a == arm
        ]
        for arm in ("stock", "custom")
    }


def build_id(labels: Mapping[str, str] | None) -> str:
    """A build in a few characters, `VERSION/KERNEL_HASH` (what a metric label can carry: one
    value per build rolled out, never per request); "unknown" without build info."""
    if not labels:
        return "unknown"
    return f"{labels.get('version', '?')}/{labels.get('kernels', '?')}"


def format_builds(st: Mapping[str, Any]) -> str:
    """The status's builds per arm (`CanaryMonitor.status`), one line each, for the CLI."""
    from fuselane.plugin.build_info import describe

    lines = ["builds (the arms' engines' fuselane_build_info):"]
    for arm in ("stock", "custom"):
        found = (st.get("builds") or {}).get(arm) or []
        if not found:
            lines.append(f"  {arm:<7} none reported (no fuselane kernels, or telemetry off)")
        for b in found:
            n = b["replicas"]
            lines.append(f"  {arm:<7} {describe(b['build'])}, {n} replica{'s' * (n != 1)}")
    for r in (st.get("rollbacks") or [])[-1:]:
        lines.append(f"  last rollback: from custom build {r.get('build', 'unknown')}")
    return "\n".join(lines)


class RayMirror:
    """Mirrors samples into `ray.util.metrics`, created lazily per series name."""

    def __init__(self, arm: str) -> None:
        self.arm = arm
        self._metrics: dict[tuple[str, tuple[str, ...]], Any] = {}
        self._last: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}

    def _metric(self, kind: str, name: str, keys: tuple[str, ...]) -> Any:
        from ray.util.metrics import Counter, Gauge

        key = (name, keys)
        if key not in self._metrics:
            cls = Counter if kind == "counter" else Gauge
            self._metrics[key] = cls(
                name, description=f"fuselane kernel metric {name}", tag_keys=(*keys, "arm")
            )
        return self._metrics[key]

    def update(self, samples: Iterable[Sample]) -> None:
        for s in samples:
            keys = tuple(k for k, _ in s.labels)
            tags = {**dict(s.labels), "arm": self.arm}
            if s.kind == "counter" and s.name.endswith("_total"):
                last = self._last.get((s.name, s.labels), 0.0)
                delta = s.value - last
                if delta > 0:
                    self._metric("counter", s.name, keys).inc(delta, tags=tags)
                self._last[(s.name, s.labels)] = max(last, s.value)
            else:
                self._metric("gauge", s.name, keys).set(s.value, tags=tags)
