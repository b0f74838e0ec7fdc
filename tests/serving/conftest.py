"""Shared set-up of the canary tests: Ray's metrics port, scraped by a real Prometheus, and a
steady load to read the dashboards under."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import pytest

from tests import prometheus

# Ray's /metrics takes a while to render while two engines load the two cores: a scrape
# gets as long as its interval.
SCRAPE_INTERVAL_S = 2
# How often Ray's workers hand their application metrics to the metrics agent (Ray's default
# is 10 s): a canary test's burst of traffic lasts seconds, and `rate()` needs two points.
RAY_SYSTEM_CONFIG = {"metrics_report_interval_ms": 1000}


@dataclass
class RayMetrics:
    port: int  # for ray.init(_metrics_export_port=...)
    prom: prometheus.PrometheusServer | None  # None without the Prometheus binary


@pytest.fixture(scope="module")
def ray_metrics(tmp_path_factory) -> Iterator[RayMetrics]:
    """A port for the module's Ray metrics export and a Prometheus scraping it from before Ray
    starts, so that it holds the whole run (the dashboards' panel checks query it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    prom = None
    if prometheus.available():
        prom = prometheus.PrometheusServer(
            {"ray": [f"127.0.0.1:{port}"]},
            tmp_path_factory.mktemp("ray-prometheus"),
            scrape_interval=f"{SCRAPE_INTERVAL_S}s",
        ).start()
    try:
        yield RayMetrics(port, prom)
    finally:
        if prom is not None:
            prom.stop()


@contextmanager
def steady_load(client: httpx.Client, pause_s: float = 0.3) -> Iterator[None]:
    """Requests one after another through the ingress while the block runs: the dashboards are
    checked under traffic, as they are read in production (rates need it: a run's bursts of
    seconds give rate() few points). The pause keeps shadow copies to a slow custom arm from
    queueing up (they would hold up the shutdown)."""
    stop = threading.Event()

    def run() -> None:
        i = 0
        while not stop.wait(pause_s):
            body = {"model": "tiny", "prompt": f"steady load {i}", "max_tokens": 8}
            client.post("/v1/completions", json=body)
            i += 1

    loader = threading.Thread(target=run, daemon=True)
    loader.start()
    try:
        yield
    finally:
        stop.set()
        loader.join(timeout=120)
