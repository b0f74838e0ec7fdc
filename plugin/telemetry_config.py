"""Telemetry's settings: the FUSELANE_TELEMETRY* variables, validated, and the bounded label
values (kernel call sites, phases, implementations) and histogram buckets of its metrics.

Every bad value is refused when the settings are read (at `register()`, and by the canary's
config check for its arms), with the variable, the value and what it takes: a value that
parses but cannot work (a flush period of 1e300 s, a host that cannot be bound) would otherwise
fail later, away from its cause."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

from .config import host_problem
from .metrics_export import PORT_ENV

ENV_VAR = "FUSELANE_TELEMETRY"
TIMING_RATE_ENV = "FUSELANE_TELEMETRY_TIMING_RATE"
CHECK_RATE_ENV = "FUSELANE_TELEMETRY_CHECK_RATE"
GRAPH_PROBE_EVERY_ENV = "FUSELANE_TELEMETRY_GRAPH_PROBE_EVERY"
FLUSH_ENV = "FUSELANE_TELEMETRY_FLUSH_S"

DEFAULT_TIMING_RATE = 0.01
DEFAULT_CHECK_RATE = 0.001
# One probed call per kernel and phase in a 32-layer model's graph: each probe pair is two extra
# graph nodes (~0.55 us each on an H200), so density, not the sampling rate, is the cost.
DEFAULT_GRAPH_PROBE_EVERY = 32
DEFAULT_FLUSH_S = 1.0
# Counts reach the metrics only at a flush: beyond an hour the dashboards show nothing useful.
MIN_FLUSH_S, MAX_FLUSH_S = 0.01, 3600.0
# FUSELANE_TELEMETRY_PORT without a host: this machine only (the metrics name kernels and
# rates, nothing to publish on every interface by default).
DEFAULT_PORT_HOST = "127.0.0.1"

ATTENTION, KV_CACHE, ROPE_KV_CACHE, SAMPLING = "attention", "kv_cache", "rope_kv_cache", "sampling"
KERNELS = (ATTENTION, KV_CACHE, ROPE_KV_CACHE, SAMPLING)
PREFILL, DECODE, MIXED, UNKNOWN = "prefill", "decode", "mixed", "unknown"
PHASES = (PREFILL, DECODE, MIXED, UNKNOWN)
FUSELANE, STOCK = "fuselane", "stock"
IMPLS = (FUSELANE, STOCK)
SITES: tuple[tuple[str, str, str], ...] = tuple(
    (k, p, i) for k in KERNELS for p in PHASES for i in IMPLS
)
SITE_INDEX = {site: n for n, site in enumerate(SITES)}

_ON = ("1", "on", "true", "yes")
_OFF = ("", "0", "off", "false", "no")

# Latency buckets (s): 1 us (a small GPU kernel) to 10 s (an interpreted kernel on a CPU).
LATENCY_BUCKETS = (*(m * 10.0**e for e in range(-6, 1) for m in (1, 2, 5)), 10.0)
# Error buckets: exact (le="0": bit-exact copies) through gross corruption.
ERROR_BUCKETS = (0.0, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 0.1, 1.0, 10.0, 100.0)
# Observed errors are clamped here so that histogram sums stay finite.
ERROR_CAP = 1e30


class TelemetryConfigError(ValueError):
    """A bad FUSELANE_TELEMETRY* value; the message names the variable, the value and what it
    takes, and `variable` the variable."""

    def __init__(self, message: str, variable: str) -> None:
        super().__init__(message)
        self.variable = variable


@dataclass(frozen=True)
class TelemetryConfig:
    enabled: bool = False
    timing_rate: float = DEFAULT_TIMING_RATE
    check_rate: float = DEFAULT_CHECK_RATE
    graph_probe_every: int = DEFAULT_GRAPH_PROBE_EVERY
    flush_interval_s: float = DEFAULT_FLUSH_S
    port: tuple[str, int] | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> TelemetryConfig:
        env = os.environ if environ is None else environ
        raw = env.get(ENV_VAR, "").strip().lower()
        if raw not in _ON + _OFF:
            raise TelemetryConfigError(
                f"{ENV_VAR}={env.get(ENV_VAR)!r}: expected one of {', '.join(_ON)} (on) or "
                f"{', '.join(repr(v) for v in _OFF)} (off)",
                ENV_VAR,
            )
        return cls(
            enabled=raw in _ON,
            timing_rate=_rate(env, TIMING_RATE_ENV, DEFAULT_TIMING_RATE),
            check_rate=_rate(env, CHECK_RATE_ENV, DEFAULT_CHECK_RATE),
            graph_probe_every=_integer(env, GRAPH_PROBE_EVERY_ENV, DEFAULT_GRAPH_PROBE_EVERY, 1),
            flush_interval_s=_bounded(
                env,
                FLUSH_ENV,
                DEFAULT_FLUSH_S,
                MIN_FLUSH_S,
                MAX_FLUSH_S,
                f"a number of seconds in [{MIN_FLUSH_S:g}, {MAX_FLUSH_S:g}]",
            ),
            port=parse_port(env.get(PORT_ENV)),
        )


def parse_port(value: str | None) -> tuple[str, int] | None:
    """`FUSELANE_TELEMETRY_PORT`: `PORT` (bound on 127.0.0.1), `HOST:PORT` or `[IPv6]:PORT`;
    None when unset or blank. The host is checked here: a bad one would otherwise surface as
    "ports taken" when the server cannot bind."""
    raw = (value or "").strip()
    if not raw:
        return None
    expected = (
        f"expected PORT (1-65535, bound on {DEFAULT_PORT_HOST}) or HOST:PORT, HOST being "
        f"an IP address ([...] for IPv6) or a host name"
    )
    if raw.startswith("["):
        host, bracket, port = raw[1:].partition("]")
        ok = bool(bracket) and port.startswith(":") and ":" in host
        port = port[1:]
    else:
        host, _, port = raw.rpartition(":")
        ok = ":" not in host
    number = int(port) if ok and port.isdigit() else -1
    if not 0 < number < 65536:
        raise TelemetryConfigError(f"{PORT_ENV}={value!r}: {expected}", PORT_ENV)
    if not host:
        return (DEFAULT_PORT_HOST, number)
    problem = host_problem(host)
    if problem is not None:
        raise TelemetryConfigError(f"{PORT_ENV}={value!r}: {problem}; {expected}", PORT_ENV)
    return (host, number)


def _rate(env: Mapping[str, str], name: str, default: float) -> float:
    return _bounded(env, name, default, 0.0, 1.0, "a fraction in [0, 1]")


def _integer(env: Mapping[str, str], name: str, default: int, low: int) -> int:
    return int(_bounded(env, name, default, low, math.inf, f"an integer >= {low}", int))


def _bounded(
    env: Mapping[str, str],
    name: str,
    default: float,
    low: float,
    high: float,
    what: str,
    kind: type[int] | type[float] = float,
) -> float:
    """`name`'s value as a finite `kind` in [low, high] (unset or blank: `default`). An integer
    variable refuses `2.7` rather than truncating it."""
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = kind(raw)
    except ValueError:
        value = math.nan
    if not low <= value <= high or math.isinf(value):
        raise TelemetryConfigError(f"{name}={raw!r}: expected {what}", name)
    return value


def stride_for(rate: float) -> int:
    """Every how many calls a sample is taken at `rate` (0: never)."""
    return 0 if rate <= 0 else max(1, round(1.0 / rate))
