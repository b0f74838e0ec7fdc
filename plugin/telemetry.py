"""Per-kernel telemetry: launch counts, device-side latency and numerical checks, in Prometheus.

Switched by environment variables (read once per process, at the first instrumented call):

- `FUSELANE_TELEMETRY` (default off): `1`/`on`/`true`/`yes` turns it on; off costs one branch
  per call and launches nothing;
- `FUSELANE_TELEMETRY_TIMING_RATE` (0.01): fraction of calls whose latency is measured;
- `FUSELANE_TELEMETRY_CHECK_RATE` (0.001): fraction of calls recomputed with the reference;
- `FUSELANE_TELEMETRY_GRAPH_PROBE_EVERY` (32): in a CUDA graph, every n-th captured call of a
  (kernel, phase) carries timing probes (the others are counted, not timed);
- `FUSELANE_TELEMETRY_FLUSH_S` (1.0): how often counts and samples move into the metrics;
- `FUSELANE_TELEMETRY_PORT` (unset): `[host:]port` to also serve this process's metrics there;
- `FUSELANE_FAULT_INJECT` (none): TEST ONLY, corrupt these families' outputs (`faults.py`).

Metrics (prometheus_client; `plugin/metrics_export.py` says how they reach `/metrics`):

- `fuselane_kernel_launches_total{kernel, phase, impl}`: launcher calls that ran, exact, CUDA-graph
  replays included;
- `fuselane_kernel_latency_seconds{kernel, phase, impl, launch}`: sampled device-side latency
  (`launch` = eager or graph; host time of the synchronous interpreter launch on CPU engines);
- `fuselane_numerical_checks_total{kernel, phase, impl, result}`: checks by `result` = pass / fail /
  error (the check itself broke);
- `fuselane_numerical_max_abs_error{...}` and `fuselane_numerical_max_rel_error_ratio{...}`:
  histograms of each check's max absolute and relative error;
- `fuselane_numerical_nonfinite_total{..., kind}`: NaN / inf output elements where the reference
  is finite; `fuselane_numerical_mismatched_elements_total{...}`: elements outside tolerance;
- `fuselane_telemetry_dropped_total{kernel, reason}`: samples and checks given up (ring overflow,
  check queue full, snapshot too large, probe slots exhausted, capture not tracked);
- `fuselane_telemetry_sample_rate_ratio{what}`: the configured timing and check rates.

Labels: `kernel` = attention, kv_cache, rope_kv_cache, sampling (one per launcher; attention's
launcher may issue a split-KV reduce launch too, counted as one call); `phase` = prefill, decode,
mixed (unknown when no step was noted); `impl` = fuselane, or stock where vLLM's own kernel is
observed at the same seam.

Call sites use a `Seam` per kernel, made once at import:

    _ATTENTION = telemetry.seam("attention")
    ...
    _ATTENTION(md.phase, attn_kernels.paged_attention, query[:n], key_cache, ...)

A seam calls `fn(*args, **kwargs)` and returns its result; with telemetry off and no fault
injected that is all it does. The phase of a step is noted once per step by the attention
metadata builder (`note_step`); a seam given `phase=None` uses it.

Per call with telemetry on: the host counts eager calls (exact); CUDA-graph replays are counted
by `kernel_timing.GraphTracker`; a sampled call is timed (device probes on GPUs, host clock under
Triton's interpreter); a sampled eager call keeps a snapshot for `numerics` (never under graph
capture). A background thread moves counts and samples into the metrics every
`FUSELANE_TELEMETRY_FLUSH_S`; nothing waits for the GPU.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import weakref
from collections import Counter, deque
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch

from . import build_info, faults, kernel_timing, metrics_export, numerics
from .telemetry_config import (
    ATTENTION,
    DECODE,
    ERROR_CAP,
    FUSELANE,
    IMPLS,
    KERNELS,
    KV_CACHE,
    MIXED,
    PHASES,
    PREFILL,
    ROPE_KV_CACHE,
    SAMPLING,
    SITE_INDEX,
    SITES,
    STOCK,
    UNKNOWN,
    TelemetryConfig,
    TelemetryConfigError,
    stride_for,
)
from .telemetry_metrics import kernel_metrics

log = logging.getLogger("vllm.plugins.fuselane.telemetry")

__all__ = [
    "ATTENTION",
    "DECODE",
    "FUSELANE",
    "KV_CACHE",
    "MIXED",
    "PHASES",
    "PREFILL",
    "ROPE_KV_CACHE",
    "SAMPLING",
    "SITES",
    "SITE_INDEX",
    "STOCK",
    "Seam",
    "Telemetry",
    "TelemetryConfig",
    "TelemetryConfigError",
    "config",
    "count_direct_launch_fallback",
    "flush",
    "get",
    "graph_tracker",
    "kernel_metrics",
    "note_step",
    "phase_of",
    "prepare",
    "reset",
    "seam",
    "step_phase",
    "stride_for",
]


_step_phase = UNKNOWN


def phase_of(query_start_loc_cpu: torch.Tensor, decode_query_len: int = 1) -> str:
    """decode / prefill / mixed from a step's host `query_start_loc [num_reqs + 1]`.

    A request is decoding when it has at most `decode_query_len` query tokens (1, or 1 +
    speculative tokens); padding requests (0 tokens) count as decoding.
    """
    lens = query_start_loc_cpu[1:] - query_start_loc_cpu[:-1]
    if lens.numel() == 0:
        return UNKNOWN
    decoding = int((lens <= decode_query_len).sum())
    if decoding == lens.numel():
        return DECODE
    return PREFILL if decoding == 0 else MIXED


def note_step(query_start_loc_cpu: torch.Tensor, decode_query_len: int = 1) -> str | None:
    """Record the phase of the step being built (metadata builders call it once per step);
    returns it, or None without doing anything when telemetry is off."""
    global _step_phase
    if get() is None:
        return None
    _step_phase = phase_of(query_start_loc_cpu, decode_query_len)
    return _step_phase


def step_phase() -> str:
    return _step_phase


def _first_tensor(args: tuple[Any, ...]) -> torch.Tensor | None:
    """The launch's device comes from its first tensor argument (stock seams pass the impl and
    the layer first)."""
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
    return None


# ---------------------------------------------------------------------------------------------
# The per-process telemetry state
# ---------------------------------------------------------------------------------------------


class Telemetry:
    """Counts, samples and checks of this process; `flush()` moves them into the metrics."""

    def __init__(self, config: TelemetryConfig, graph_cls: type | None = None) -> None:
        self.config = config
        self.pid = os.getpid()
        self.metrics = kernel_metrics()
        self.route = metrics_export.announce(config.port)
        n = len(SITES)
        self.calls = [0] * n  # eager calls that ran, per site (host-side: exact)
        self._flushed_calls = [0] * n
        self._flushed_replays = [0] * n
        self.samples: deque[tuple[int, bool, float]] = deque()  # (site, graph, seconds)
        self.dropped: Counter[tuple[str, str]] = Counter()
        self._flushed_dropped: Counter[tuple[str, str]] = Counter()
        self.timing_stride = stride_for(config.timing_rate)
        self.check_stride = stride_for(config.check_rate)
        # In a graph only every graph_probe_every-th call has probes; each of those records every
        # graph_stride-th replay, so about timing_rate of all graph calls are timed.
        self.graph_stride = stride_for(min(1.0, config.timing_rate * config.graph_probe_every))
        self.tracker = graph_tracker(graph_cls)
        self.probes: kernel_timing.DeviceProbes | None = None
        self._probes_failed = False
        self.checker = numerics.CheckWorker(self._record_check, self._guard)
        self._said: Counter[str] = Counter()
        self._flush_lock = threading.Lock()
        self._stop = threading.Event()
        self.metrics.rates.labels("timing").set(config.timing_rate)
        self.metrics.rates.labels("check").set(config.check_rate)
        info = build_info.build_info()
        self.metrics.build.labels(*(info[k] for k in build_info.LABELS)).set(1)
        self._thread = threading.Thread(target=self._loop, name="fuselane-telemetry", daemon=True)
        self._thread.start()
        log.info(
            "fuselane telemetry on (pid %d): timing rate %g, check rate %g, graph probes every "
            "%d calls, flush every %g s; metrics: %s",
            self.pid,
            config.timing_rate,
            config.check_rate,
            config.graph_probe_every,
            config.flush_interval_s,
            self.route,
        )

    # --- the instrumented call ---------------------------------------------------------------

    def run(
        self,
        site: int,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        fault: Callable[..., None] | None,
        check: Any,
    ) -> Any:
        first = _first_tensor(args)
        if first is not None and first.is_cuda:
            return self._run_cuda(site, fn, args, kwargs, fault, check, first.device)
        n = self.calls[site]
        checked = check is not None and self.check_stride and n % self.check_stride == 0
        pre = self._before(site, check, args, kwargs) if checked else None
        if self.timing_stride and n % self.timing_stride == 0:
            # Triton's interpreter runs the kernel inside the call: host time is kernel time.
            t0 = kernel_timing.HostTimer.now()
            result = fn(*args, **kwargs)
            self.samples.append((site, False, kernel_timing.HostTimer.now() - t0))
        else:
            result = fn(*args, **kwargs)
        return self._after_eager(site, n, result, fault, check if checked else None, pre, args,
                                 kwargs)  # fmt: skip

    def _run_cuda(self, site, fn, args, kwargs, fault, check, device) -> Any:
        tracker = self.tracker
        if tracker is not None and torch.cuda.is_current_stream_capturing():
            # Captured, not run: counted at each replay by the tracker. No check can copy
            # per replay, so none is taken; probes only on every graph_probe_every-th call.
            k = tracker.note_captured_call(site)
            if k < 0:
                self.dropped[(SITES[site][0], "capture_not_tracked")] += 1
            slot = None
            probes = self.probes
            if probes and k >= 0 and self.graph_stride and k % self.config.graph_probe_every == 0:
                slot = probes.graph_slot(site)
                if slot is None:
                    self.dropped[(SITES[site][0], "probe_slots_exhausted")] += 1
            if slot is not None:
                probes.begin(slot)
                result = fn(*args, **kwargs)
                probes.end(slot, self.graph_stride)
            else:
                result = fn(*args, **kwargs)
            if fault is not None:
                fault(result, *args, **kwargs)
            return result
        if self.probes is None and not self._probes_failed and self.timing_stride:
            self._make_probes(device)
        n = self.calls[site]
        checked = check is not None and self.check_stride and n % self.check_stride == 0
        pre = self._before(site, check, args, kwargs) if checked else None
        probes = self.probes
        if probes and self.timing_stride and n % self.timing_stride == 0:
            probes.begin(site)  # eager slot == site, every probed call recorded
            result = fn(*args, **kwargs)
            probes.end(site, 1)
        else:
            result = fn(*args, **kwargs)
        return self._after_eager(site, n, result, fault, check if checked else None, pre, args,
                                 kwargs)  # fmt: skip

    def _after_eager(self, site, n, result, fault, check, pre, args, kwargs) -> Any:
        """An eager call's bookkeeping once the kernel ran: its count, the injected fault, the
        snapshot of a checked call (`check` None: not checked)."""
        self.calls[site] = n + 1
        if fault is not None:
            fault(result, *args, **kwargs)
        if check is not None:
            self._snapshot(site, check, pre, result, args, kwargs)
        return result

    def _make_probes(self, device: torch.device) -> None:
        try:
            self.probes = kernel_timing.DeviceProbes(device, len(SITES), self.tracker)
        except Exception as e:  # noqa: BLE001 - no probes (e.g. no %globaltimer): counts only
            self._probes_failed = True
            log.warning("fuselane telemetry: device timing unavailable (%s); counting only", e)

    def _before(self, site: int, check: Any, args: tuple, kwargs: dict) -> Any:
        if check.before is None:
            return None
        try:
            return check.before(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - a check must never break the serving path
            self._warn_once(f"before:{site}", "fuselane telemetry: snapshot failed: %r", e)
            return None

    def _snapshot(self, site: int, check: Any, pre: Any, result: Any, args, kwargs) -> None:
        kernel = SITES[site][0]
        try:
            snap = check.after(pre, result, *args, **kwargs)
        except numerics.SnapshotTooLarge:
            self.dropped[(kernel, "check_too_large")] += 1
            return
        except Exception as e:  # noqa: BLE001 - a check must never break the serving path
            self._record_check(site, e)
            return
        if snap is not None and not self.checker.submit(site, snap):
            self.dropped[(kernel, "check_queue_full")] += 1

    def _guard(self) -> Any:
        tracker = self.tracker
        if tracker is None:
            return nullcontext(True)
        return tracker.cuda_calls()

    # --- results -----------------------------------------------------------------------------

    def _record_check(self, site: int, outcome: numerics.Outcome | BaseException) -> None:
        m, labels = self.metrics, SITES[site]
        if isinstance(outcome, BaseException):
            m.child(m.checks, *labels, "error").inc()
            self._warn_once(
                f"error:{labels[0]}", "fuselane telemetry: %s check failed to run: %r", labels[0],
                outcome,
            )  # fmt: skip
            return
        m.child(m.checks, *labels, "pass" if outcome.passed else "fail").inc()
        m.child(m.abs_error, *labels).observe(min(outcome.max_abs, ERROR_CAP))
        m.child(m.rel_error, *labels).observe(min(outcome.max_rel, ERROR_CAP))
        if outcome.nan:
            m.child(m.nonfinite, *labels, "nan").inc(outcome.nan)
        if outcome.inf:
            m.child(m.nonfinite, *labels, "inf").inc(outcome.inf)
        if outcome.mismatched:
            m.child(m.mismatched, *labels).inc(outcome.mismatched)
        if not outcome.passed:
            key = f"fail:{labels[0]}"
            self._said[key] += 1
            k = self._said[key]
            if k <= 5 or k % 100 == 0:
                log.warning(
                    "fuselane telemetry: numerical check FAILED (%s, %s, %s; failure %d): %s",
                    *labels,
                    k,
                    outcome.detail,
                )

    def _warn_once(self, key: str, msg: str, *args: Any) -> None:
        if not self._said[key]:
            log.warning(msg, *args)
        self._said[key] += 1

    # --- moving counts and samples into the metrics ------------------------------------------

    def flush(self) -> None:
        with self._flush_lock:
            m = self.metrics
            replays = self.tracker.replayed if self.tracker is not None else None
            for site, labels in enumerate(SITES):
                calls = self.calls[site]
                delta = calls - self._flushed_calls[site]
                self._flushed_calls[site] = calls
                if replays is not None:
                    r = replays[site]
                    delta += r - self._flushed_replays[site]
                    self._flushed_replays[site] = r
                if delta:
                    m.child(m.launches, *labels).inc(delta)
            samples = self.samples
            while samples:
                site, graph, seconds = samples.popleft()
                m.child(m.latency, *SITES[site], "graph" if graph else "eager").observe(seconds)
            if self.probes:
                for site, graph, seconds in self.probes.drain():
                    m.child(m.latency, *SITES[site], "graph" if graph else "eager").observe(seconds)
                if self.probes.ring_dropped:
                    self.dropped[("all", "timing_ring_overflow")] += self.probes.ring_dropped
                    self.probes.ring_dropped = 0
            for key, value in list(self.dropped.items()):
                delta = value - self._flushed_dropped[key]
                if delta:
                    m.child(m.dropped, *key).inc(delta)
                    self._flushed_dropped[key] = value

    def _loop(self) -> None:
        while not self._stop.wait(self.config.flush_interval_s):
            try:
                self.flush()
            except Exception as e:  # noqa: BLE001 - keep flushing; say it once
                self._warn_once("flush", "fuselane telemetry: flush failed: %r", e)

    def close(self, timeout: float = 5.0) -> None:
        """Finish queued checks, flush and stop the threads."""
        self.checker.wait_idle(timeout)
        self._stop.set()
        self._thread.join(timeout)
        self.checker.stop(timeout)
        self.flush()


# ---------------------------------------------------------------------------------------------
# Process singleton and seams
# ---------------------------------------------------------------------------------------------

_instance: Telemetry | None = None
_config: TelemetryConfig | None = None
_lock = threading.Lock()
_seams: weakref.WeakSet[Seam] = weakref.WeakSet()


def config() -> TelemetryConfig:
    """This process's configuration (read from the environment on first use)."""
    global _config
    if _config is None:
        _config = TelemetryConfig.from_env()
    return _config


def get() -> Telemetry | None:
    """This process's telemetry, created on first use; None when FUSELANE_TELEMETRY is off."""
    global _instance
    inst = _instance
    if inst is not None and inst.pid == os.getpid():
        return inst
    if not config().enabled:
        return None
    with _lock:
        if _instance is None or _instance.pid != os.getpid():  # new, or inherited by fork
            _instance = Telemetry(config())
            atexit.register(_instance.flush)
        return _instance


_tracker: kernel_timing.GraphTracker | None = None


def graph_tracker(graph_cls: type | None = None) -> kernel_timing.GraphTracker | None:
    """The process's CUDA-graph tracker, installed on first use; None without CUDA."""
    global _tracker
    if _tracker is None and (graph_cls is not None or torch.cuda.is_available()):
        _tracker = kernel_timing.GraphTracker(len(SITES), graph_cls)
        _tracker.install()
    return _tracker


def count_direct_launch_fallback(kernel: str) -> None:
    """Count a kernel switched to Triton's launcher by the start-up check (telemetry on)."""
    if get() is None:
        return
    m = kernel_metrics()
    m.child(m.direct_fallbacks, kernel).inc()


def prepare() -> None:
    """Early, cheap set-up from the plugin entry point (every vLLM process): validates the
    variables and, with telemetry on and a GPU present, installs the CUDA-graph hooks before
    vLLM can capture anything (no threads, no metrics yet). Raises TelemetryConfigError or
    ValueError on a bad value."""
    cfg = config()
    faults.faults_from_env()
    if cfg.enabled:
        graph_tracker()


def reset() -> None:
    """Forget the configuration and close this process's telemetry (tests): the next call
    re-reads the environment."""
    global _instance, _config, _step_phase, _tracker
    with _lock:
        inst, _instance, _config = _instance, None, None
    if inst is not None and inst.pid == os.getpid():
        inst.close()
    if _tracker is not None:
        _tracker.uninstall()
        _tracker = None
    _step_phase = UNKNOWN
    for s in list(_seams):
        s._plan = None


def flush(timeout: float = 5.0) -> None:
    """Wait for queued checks and flush now (tests; the background thread does it otherwise)."""
    inst = _instance
    if inst is not None and inst.pid == os.getpid():
        inst.checker.wait_idle(timeout)
        inst.flush()


_DIRECT = object()


class Seam:
    """One instrumented call site kind: `seam(phase, fn, *args, **kwargs)` runs fn."""

    __slots__ = ("__weakref__", "_plan", "check", "impl", "kernel")

    def __init__(self, kernel: str, impl: str = FUSELANE, check: bool = True) -> None:
        if kernel not in KERNELS:
            raise ValueError(f"kernel: expected one of {list(KERNELS)}, got {kernel!r}")
        if impl not in IMPLS:
            raise ValueError(f"impl: expected one of {list(IMPLS)}, got {impl!r}")
        self.kernel, self.impl, self.check = kernel, impl, check
        self._plan: Any = None
        _seams.add(self)

    def __call__(self, phase: str | None, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        plan = self._plan
        if plan is None:
            plan = self._plan = self._make_plan()
        if plan is _DIRECT:
            return fn(*args, **kwargs)
        tel, fault, check = plan
        if tel is None:  # fault injection with telemetry off
            result = fn(*args, **kwargs)
            fault(result, *args, **kwargs)
            return result
        key = (self.kernel, phase or _step_phase, self.impl)
        site = SITE_INDEX.get(key)
        if site is None:
            site = SITE_INDEX[(self.kernel, UNKNOWN, self.impl)]
        return tel.run(site, fn, args, kwargs, fault, check)

    def _make_plan(self) -> Any:
        tel = get()
        fault = None
        if self.impl == FUSELANE:  # only fuselane's own kernels are ever corrupted
            families = faults.faults_from_env()
            fault = faults.corrupter_for(self.kernel, families)
            if fault is not None:
                log.warning(
                    "fuselane: %s is set: %s output is deliberately CORRUPTED (test only)",
                    faults.ENV_VAR,
                    self.kernel,
                )
        if tel is None and fault is None:
            return _DIRECT
        check = numerics.CHECKS[self.kernel]() if (self.check and self.impl == FUSELANE) else None
        return (tel, fault, check)


def seam(kernel: str, impl: str = FUSELANE, check: bool = True) -> Seam:
    """A call-site wrapper for `kernel` (see the module docstring)."""
    return Seam(kernel, impl, check)
