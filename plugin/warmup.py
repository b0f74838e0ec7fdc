"""Kernel compilation at engine start-up, before the first request.

Triton compiles a kernel variant the first time it is launched. A variant first met while
serving stalls that step for the compile (seconds; vLLM's JIT monitor warns about it): a batch
shape the start-up never produced (a mixed prefill + decode step, a new split count, a row bucket
of the KV write). So the first eager call of each layer configuration launches every variant
the launch rules can choose (`attention.warm_up`, `kv_cache.warm_up_write`) on a one-token
batch, outside any CUDA-graph capture: first with the kernels compiled instead of run, several
at once (`kernels._launch.compile_only`), then launched once each (module loads). Compiled
variants are cached on disk by Triton, so a restart pays only the module loads. No-op off CUDA
(the interpreter compiles nothing).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Hashable

import torch

from . import telemetry
from . import vllm_compat as vc

# Compile threads: a compile is mostly LLVM and ptxas, outside the GIL.
COMPILE_WORKERS = max(1, min(8, os.cpu_count() or 1))

_DONE: set[Hashable] = set()
_LOCK = threading.Lock()


def once(kind: str, key: Hashable, device: torch.device, compile_all: Callable[[], int]) -> bool:
    """Run `compile_all` (returns the number of variants launched) the first time `key` is seen
    on a CUDA device in this process, unless a CUDA graph is being captured; log what it did.
    Returns False only when a capture deferred it (the caller asks again on a later call)."""
    if device.type != "cuda":
        return True
    if torch.cuda.is_current_stream_capturing():
        return False
    with _LOCK:
        if key in _DONE:
            return True
        _DONE.add(key)
    from fuselane.kernels import _launch

    start = time.perf_counter()
    with _launch.compile_only(COMPILE_WORKERS):
        launched = compile_all()
    compiled = time.perf_counter()
    # Then launch each variant once, now compiling nothing (a variant whose compile failed
    # compiles again and raises here, where the warm-up can switch it off): a first launch
    # still loads the module and, on a machine without Triton's disk cache, builds the
    # launcher (measured: 0.4-0.9 s per kernel, benchmarks/results/startup-h100-2026-11-22.json).
    # Each variant's first direct launch is checked against Triton's own launch.
    fallbacks_before = len(_launch.direct_launch_fallbacks())
    with _launch.checking_direct_launches():
        compile_all()
    for name, reason in _launch.direct_launch_fallbacks()[fallbacks_before:]:
        vc.get_logger().warning(
            "fuselane: kernel %s launches through Triton's launcher (slower on the host): its "
            "direct launch failed the start-up check (%s)",
            name,
            reason,
        )
        telemetry.count_direct_launch_fallback(name)
    _launch.report_late_variants(_warn_late_variant)
    vc.get_logger().info(
        "fuselane: %s kernels compiled for %d launch configurations in %.1f s (%d threads) and "
        "loaded in %.1f s (start-up, before serving)",
        kind,
        launched,
        compiled - start,
        COMPILE_WORKERS,
        time.perf_counter() - compiled,
    )
    return True


def _warn_late_variant(kernel: str, difference: str) -> None:
    # Not an error: the launch goes on (after a compile, or a load from Triton's disk cache),
    # but a warm-up that covered it would have spared that step the wait; the difference names
    # the argument the warm-up did not produce.
    vc.get_logger().warning(
        "fuselane: kernel %s met a variant its start-up warm-up did not launch (%s)",
        kernel,
        difference,
    )


_SAID: set[Hashable] = set()


def say_once(key: Hashable, msg: str, *args: object) -> None:
    """Log `msg` as a warning the first time `key` is seen in this process."""
    with _LOCK:
        if key in _SAID:
            return
        _SAID.add(key)
    vc.get_logger().warning(msg, *args)


def reset() -> None:
    """Forget what was compiled and said (tests)."""
    from fuselane.kernels import _launch

    _launch.report_late_variants(None)
    with _LOCK:
        _DONE.clear()
        _SAID.clear()
