"""A real Prometheus server for tests: Debian's `prometheus` binary on 127.0.0.1.

    with PrometheusServer({"vllm": ["127.0.0.1:8000"]}, tmp_path) as prom:
        prom.wait_for_targets_up()
        value = prom.wait_for_value('sum(fuselane_kernel_launches_total)', lambda v: v > 0)

The server gets a generated config (one scrape job per entry of `jobs`: job name -> targets,
`host:port`, scraped at `scrape_interval` on `metrics_path`), its own storage directory and a
free port, in its own process group (killed on `stop()` / context exit). Queries go through
the HTTP API (`/api/v1/query`, `/api/v1/series`, `/api/v1/targets`) with `httpx`. Dashboards,
canary and telemetry tests share it; it knows nothing about fuselane.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

BINARY = os.environ.get("FUSELANE_TEST_PROMETHEUS", "/usr/bin/prometheus")
START_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def available() -> bool:
    """Whether the Prometheus binary is installed (tests skip without it)."""
    return shutil.which(BINARY) is not None or Path(BINARY).is_file()


def config_text(
    jobs: Mapping[str, Sequence[str]],
    scrape_interval: str = "1s",
    metrics_path: str = "/metrics",
    extra_scrape_configs: Sequence[Mapping[str, Any]] = (),
) -> str:
    """The prometheus.yml for `jobs` (JSON is valid YAML, so no YAML library is needed)."""
    scrape_configs = [
        {
            "job_name": name,
            "scrape_interval": scrape_interval,
            "scrape_timeout": scrape_interval,
            "metrics_path": metrics_path,
            "static_configs": [{"targets": list(targets)}],
        }
        for name, targets in jobs.items()
    ]
    scrape_configs += [dict(c) for c in extra_scrape_configs]
    return json.dumps(
        {
            "global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval},
            "scrape_configs": scrape_configs,
        },
        indent=2,
    )


class PrometheusError(RuntimeError):
    pass


class PrometheusServer:
    """One Prometheus process; usable as a context manager."""

    def __init__(
        self,
        jobs: Mapping[str, Sequence[str]],
        workdir: str | os.PathLike[str],
        *,
        scrape_interval: str = "1s",
        metrics_path: str = "/metrics",
        extra_scrape_configs: Sequence[Mapping[str, Any]] = (),
        binary: str = BINARY,
    ) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_path = self.workdir / "prometheus.yml"
        self.config_path.write_text(
            config_text(jobs, scrape_interval, metrics_path, extra_scrape_configs)
        )
        self.storage = self.workdir / "data"
        self.log_path = self.workdir / "prometheus.log"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.binary = binary
        self.proc: subprocess.Popen | None = None
        self._client = httpx.Client(base_url=self.url, timeout=10.0, trust_env=False)

    # --- lifecycle ---------------------------------------------------------------------------

    def start(self, timeout: float = START_TIMEOUT_S) -> PrometheusServer:
        cmd = [
            self.binary,
            f"--config.file={self.config_path}",
            f"--storage.tsdb.path={self.storage}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--storage.tsdb.retention.time=1h",
            "--log.level=warn",
        ]
        with self.log_path.open("w") as log:
            # Own session: stop() signals exactly this process.
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise PrometheusError(f"prometheus exited ({self.proc.returncode}):\n{self.log()}")
            try:
                if self._client.get("/-/ready").status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise PrometheusError(f"prometheus not ready in {timeout} s:\n{self.log()}")
            time.sleep(0.2)

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
            except ProcessLookupError:
                pass
        self._client.close()

    def __enter__(self) -> PrometheusServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log(self, tail: int = 4000) -> str:
        try:
            return self.log_path.read_text()[-tail:]
        except OSError:
            return ""

    # --- HTTP API ----------------------------------------------------------------------------

    def _api(self, path: str, **params: Any) -> Any:
        r = self._client.get(f"/api/v1/{path}", params=params)
        body = r.json()
        if body.get("status") != "success":
            raise PrometheusError(f"{path} {params}: {body.get('error', body)}")
        return body["data"]

    def query(self, promql: str) -> list[dict[str, Any]]:
        """Instant query: [{"metric": {labels}, "value": float}] (vector results)."""
        data = self._api("query", query=promql)
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": float(data["result"][1])}]
        return [{"metric": s["metric"], "value": float(s["value"][1])} for s in data["result"]]

    def value(self, promql: str) -> float | None:
        """The single value of an instant query, None when it returns no series."""
        result = self.query(promql)
        if not result:
            return None
        if len(result) > 1:
            raise PrometheusError(f"{promql}: {len(result)} series, expected one")
        return result[0]["value"]

    def by_labels(self, promql: str, *labels: str) -> dict[tuple[str, ...], float]:
        """Instant query results keyed by the values of `labels`."""
        return {
            tuple(s["metric"].get(k, "") for k in labels): s["value"] for s in self.query(promql)
        }

    def series(self, match: str) -> list[dict[str, str]]:
        return self._api("series", **{"match[]": match})

    def targets(self) -> list[dict[str, Any]]:
        return self._api("targets")["activeTargets"]

    # --- waiting -----------------------------------------------------------------------------

    def wait_for_targets_up(self, timeout: float = 60.0) -> None:
        """Until every configured target has been scraped successfully."""
        deadline = time.monotonic() + timeout
        while True:
            targets = self.targets()
            if targets and all(t["health"] == "up" for t in targets):
                return
            if time.monotonic() > deadline:
                raise PrometheusError(f"targets not up in {timeout} s: {targets}")
            time.sleep(0.5)

    def wait_for(
        self,
        promql: str,
        predicate: Callable[[list[dict[str, Any]]], bool],
        timeout: float = 30.0,
    ) -> list[dict[str, Any]]:
        """Query until `predicate(result)` holds; return that result (raise on timeout)."""
        deadline = time.monotonic() + timeout
        while True:
            result = self.query(promql)
            if predicate(result):
                return result
            if time.monotonic() > deadline:
                raise PrometheusError(f"{promql}: condition not met in {timeout} s; last {result}")
            time.sleep(0.5)

    def wait_for_value(
        self, promql: str, predicate: Callable[[float], bool], timeout: float = 30.0
    ) -> float:
        """Like `wait_for` for a query returning one series."""
        result = self.wait_for(promql, lambda r: len(r) == 1 and predicate(r[0]["value"]), timeout)
        return result[0]["value"]

    def wait_for_scrape_after(self, job: str, t: float, timeout: float = 30.0) -> None:
        """Until every target of `job` has been scraped (successfully) after wall time `t`."""
        deadline = time.monotonic() + timeout
        while True:
            targets = [x for x in self.targets() if x["labels"].get("job") == job]
            if targets and all(
                x["health"] == "up" and _rfc3339(x["lastScrape"]) > t for x in targets
            ):
                return
            if time.monotonic() > deadline:
                raise PrometheusError(f"job {job}: no scrape after {t} in {timeout} s: {targets}")
            time.sleep(0.3)


def _rfc3339(text: str) -> float:
    """Seconds since the epoch of an RFC 3339 timestamp with up to nanosecond precision."""
    from datetime import datetime

    m = re.fullmatch(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d)?", text)
    if m is None:
        raise PrometheusError(f"unparsable timestamp {text!r}")
    tz = m.group(3) or "Z"
    stamp = datetime.fromisoformat(m.group(1) + ("+00:00" if tz == "Z" else tz))
    return stamp.timestamp() + float("0" + (m.group(2) or ".0"))
