"""Numerical checks of kernel calls against the torch references, off the hot path.

On a sampled fraction of calls (`FUSELANE_TELEMETRY_CHECK_RATE`) the instrumented call keeps
a small copy of what the kernel read and wrote, and a worker thread recomputes the result with
the kernel family's torch reference (`fuselane.kernels.*_reference`, the functions that define
the kernels' semantics) and compares:

- attention: one sequence of the batch per check (rotating through the batch), at most
  `MAX_ROWS` of its last query rows, with the KV pages of its block-table row gathered up to
  the step's `max_seq_len`; output vs `paged_attention_reference` in fp32 with the per-dtype
  tolerances of the kernel tests.
- kv_cache: up to `MAX_ROWS` rows spread over the batch: the cache rows at their slots vs the
  input rows (bit-exact; fp8 vs `quantize_e4m3_reference`, also bit-exact by design).
- rope_kv_cache: the same rows' q and k before (kept before the launch: the kernel rotates in
  place) and after vs `rotary_reference`, and the cache rows vs the rotated key.
- sampling: one row per check: the kept-token set of `process_logits_reference` (its size vs
  the kernel's `kept_count`, allowing one token or 1% at the boundary), the chosen token (in
  the kept set; the argmax for greedy rows) and its log-probability when the kernel returned
  one (vs the reference of the requested `logprobs_mode`).

What a check records (telemetry turns it into metrics): pass/fail, max absolute error, relative
error (max |a - e| / max |e|), NaN and inf elements where the reference is finite, and elements
outside tolerance.

Copies, not references: the snapshot is taken on the launching stream right after the kernel
(gathers and clones, no host sync), so later steps cannot change it. On a GPU it is copied to
pinned host memory with non-blocking copies and an event; the worker polls the event under the
CUDA-graph capture guard and computes on the CPU, so nothing it does can invalidate a capture
or wait on the step. Calls made during a CUDA-graph capture are never checked: a graph replays
its launches without Python, so no per-replay copy can be taken; checks come from eager calls
(on GPUs: prefill and mixed batches, decode batches beyond the captured sizes, and every call
under --enforce-eager).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from .numerics_attention import AttentionCheck, AttentionSnapshot
from .numerics_base import (
    MAX_PENDING,
    MAX_ROWS,
    Outcome,
    Snapshot,
    SnapshotTooLarge,
    compare,
)
from .numerics_kv import KVWriteCheck, KVWriteSnapshot, RopeKVWriteCheck, RopeKVWriteSnapshot
from .numerics_sampling import SamplingCheck, SamplingSnapshot

__all__ = [
    "CHECKS",
    "MAX_ROWS",
    "AttentionCheck",
    "AttentionSnapshot",
    "CheckWorker",
    "KVWriteCheck",
    "KVWriteSnapshot",
    "Outcome",
    "RopeKVWriteCheck",
    "RopeKVWriteSnapshot",
    "SamplingCheck",
    "SamplingSnapshot",
    "Snapshot",
    "SnapshotTooLarge",
    "compare",
]

CHECKS: dict[str, Callable[[], Any]] = {
    "attention": AttentionCheck,
    "kv_cache": KVWriteCheck,
    "rope_kv_cache": RopeKVWriteCheck,
    "sampling": SamplingCheck,
}


# ---------------------------------------------------------------------------------------------
# The worker
# ---------------------------------------------------------------------------------------------


class CheckWorker:
    """Runs checks on a daemon thread; `record(site, outcome_or_error)` receives each result."""

    def __init__(
        self,
        record: Callable[[int, Outcome | BaseException], None],
        guard: Callable[[], AbstractContextManager[bool]] | None = None,
        max_pending: int = MAX_PENDING,
    ) -> None:
        self._record = record
        self._guard = guard or (lambda: nullcontext(True))
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._thread = threading.Thread(target=self._run, name="fuselane-checks", daemon=True)
        self._thread.start()

    def submit(self, site: int, snapshot: Snapshot) -> bool:
        """Queue a check; False (dropped) when the worker is behind."""
        try:
            self._queue.put_nowait((site, snapshot))
            return True
        except queue.Full:
            return False

    def wait_idle(self, timeout: float) -> bool:
        """Wait until every queued check has been recorded (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._queue.unfinished_tasks == 0:
                return True
            time.sleep(0.01)
        return self._queue.unfinished_tasks == 0

    def stop(self, timeout: float = 5.0) -> None:
        try:
            self._queue.put((None, None), timeout=timeout)
        except queue.Full:
            return
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            site, snapshot = self._queue.get()
            try:
                if snapshot is None:
                    return
                while not snapshot.ready(self._guard):
                    time.sleep(0.005)
                try:
                    outcome = snapshot.check()
                except Exception as e:  # noqa: BLE001 - a broken check is reported, not fatal
                    outcome = e
                if outcome is not None:
                    self._record(site, outcome)
            finally:
                self._queue.task_done()
