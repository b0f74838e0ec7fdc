"""Telemetry's settings: the FUSELANE_TELEMETRY* variables, validated, and the bounded label
values (kernel call sites, phases, implementations) and histogram buckets of its metrics."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from . import metrics_export

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
    """A bad FUSELANE_TELEMETRY* value; the message names the variable and what it takes."""


@dataclass(frozen=True)
class TelemetryConfig:
    enabled: bool = False
    timing_rate: float = DEFAULT_TIMING_RATE
    check_rate: float = DEFAULT_CHECK_RATE
    graph_probe_every: int = DEFAULT_GRAPH_PROBE_EVERY
    flush_interval_s: float = DEFAULT_FLUSH_S
    port: tuple[str, int] | None = None

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> TelemetryConfig:
        env = os.environ if environ is None else environ
        raw = env.get(ENV_VAR, "").strip().lower()
        if raw not in _ON + _OFF:
            raise TelemetryConfigError(
                f"{ENV_VAR}={env.get(ENV_VAR)!r}: expected one of {', '.join(_ON)} (on) or "
                f"{', '.join(repr(v) for v in _OFF)} (off)"
            )
        try:
            port = metrics_export.parse_port(env.get(metrics_export.PORT_ENV))
        except ValueError as e:
            raise TelemetryConfigError(str(e)) from None
        return cls(
            enabled=raw in _ON,
            timing_rate=_rate(env, TIMING_RATE_ENV, DEFAULT_TIMING_RATE),
            check_rate=_rate(env, CHECK_RATE_ENV, DEFAULT_CHECK_RATE),
            graph_probe_every=int(
                _number(env, GRAPH_PROBE_EVERY_ENV, DEFAULT_GRAPH_PROBE_EVERY, 1)
            ),
            flush_interval_s=_number(env, FLUSH_ENV, DEFAULT_FLUSH_S, 0.01),
            port=port,
        )


def _number(env: Any, name: str, default: float, low: float) -> float:
    return _bounded(env, name, default, low, math.inf, f"a number >= {low}")


def _rate(env: Any, name: str, default: float) -> float:
    return _bounded(env, name, default, 0.0, 1.0, "a fraction in [0, 1]")


def _bounded(env: Any, name: str, default: float, low: float, high: float, what: str) -> float:
    """`name`'s value as a finite float in [low, high] (unset or blank: `default`)."""
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not low <= value <= high or math.isinf(value):
        raise TelemetryConfigError(f"{name}={raw!r}: expected {what}")
    return value


def stride_for(rate: float) -> int:
    """Every how many calls a sample is taken at `rate` (0: never)."""
    return 0 if rate <= 0 else max(1, round(1.0 / rate))
