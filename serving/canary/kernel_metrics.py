"""fuselane's kernel metrics, from a replica's vLLM engine to Ray's Prometheus export.

The plugin's telemetry runs in vLLM's EngineCore process, a child of the Serve replica that
Ray knows nothing about, and writes its `fuselane_*` metrics with `prometheus_client`. Each
arm replica gives its engine a fresh `PROMETHEUS_MULTIPROC_DIR` before starting it (a reused
directory double-counts: docs/notes/telemetry.md), so those metrics land in files that the replica
reads here (`read_samples`) and mirrors into Ray's export (`RayMirror`), with an `arm` label.

Mirroring: counters stay counters (Ray is given the increments); gauges, and every series of
a histogram (`_bucket` with its `le` label, `_count`, `_sum`), become gauges holding the
engine's cumulative values, on which PromQL's `rate()` and `histogram_quantile()` work as on
the originals. Ray prefixes names with `ray_`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

PREFIX = "fuselane_"
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
