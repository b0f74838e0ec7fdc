"""Kernel latency and launch accounting that stay truthful when vLLM replays CUDA graphs.

Three pieces, used by `plugin/telemetry.py`:

- `GraphTracker`: launch counts under CUDA graphs. A host-side counter never runs when a graph
  is replayed, so the tracker wraps `torch.cuda.CUDAGraph.capture_begin / capture_end / replay`
  (class attributes, undone by `uninstall`): an instrumented call made while a graph is being
  captured is recorded against that graph, and every `replay()` adds the graph's recorded calls
  to the per-site replay counts. Counts are therefore exact (every replay of every captured
  call) at no device cost; vLLM's V1 and V2 runners and torch.compile's graph trees all
  capture and replay through `torch.cuda.CUDAGraph`. The same wrappers make a capture guard:
  CUDA calls from the telemetry threads (copies, event queries) must not run while any thread
  captures (vLLM captures in the default "global" mode, where such calls invalidate the
  capture), so `cuda_calls()` holds a lock that `capture_begin` waits for, and reports False
  while a capture is under way.
- `DeviceProbes`: device-side latency. One-thread Triton probe kernels are launched before and
  after the instrumented kernel (and captured with it). The begin probe stores `%globaltimer`
  (ns, the same clock on every SM) in its slot; the end probe reads the clock, counts the
  slot's executions and, every `stride`-th one, appends (slot, start, end) to a ring buffer in
  device memory. A background thread copies the ring to pinned host memory on a side stream
  (non-blocking, guarded as above) and turns entries claimed before its previous pass into
  latencies; the step is never synchronized. Under graphs only every `probe_every`-th
  captured call of a (kernel, phase) gets probes, which bounds the cost of the extra graph
  nodes (~0.55 us each on an H200); eager calls get probes only when the host-side sampler
  picks them.
- `HostTimer`: CPU engines run the kernels under Triton's interpreter, where a launch returns
  when the kernel has finished: there the host clock around the launch is the kernel's time
  (interpreter time, not GPU time), and no probe is launched.

What a device sample measures: from the begin probe's clock read to the end probe's, minus the
same span of an empty probe pair measured at start-up (eager and under graph replay
separately), i.e. the kernel plus one inter-kernel gap (graph replay: ~0.5 us). For eager
launches the host's own launch gap is included when the GPU waits for the host (a CPU-bound
step); graph-replayed samples carry the `launch="graph"` label and have no such gap.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

# Probe slots: [0, num_sites) are the eager slots (one per site), then one slot per probed
# captured call; the last slot is the warm-up slot. 4096 covers vLLM's ~70 captured batch
# sizes x 4 kernels x a few probed layers with room to spare.
MAX_SLOTS = 4096
# Ring entries: (slot, start_ns, end_ns, tag). At the default rates a 1 s drain interval sees a
# few hundred samples; overflow is counted, never blocks.
RING_SIZE = 8192
ENTRY_WORDS = 4
# Empty probe pairs timed at start-up (eager, and replayed in a private graph) to measure the
# probes' own share of a sample.
CALIBRATION_PAIRS = 32
CALIBRATION_REPLAYS = 4
# The drain waits at most this long for its own small copy to land before trying again later.
COPY_WAIT_S = 0.05


class HostTimer:
    """Host clock around a launch that completes before it returns (Triton's interpreter)."""

    now = staticmethod(time.perf_counter)


# ---------------------------------------------------------------------------------------------
# CUDA graphs: capture/replay accounting and the capture guard
# ---------------------------------------------------------------------------------------------


class GraphTracker:
    """Counts replayed executions of instrumented calls; guards CUDA calls from other threads.

    `graph_cls` is the class whose methods are wrapped (default `torch.cuda.CUDAGraph`; tests
    pass a stand-in with the same method names).
    """

    def __init__(self, num_sites: int, graph_cls: type | None = None) -> None:
        self.num_sites = num_sites
        self.replayed = [0] * num_sites  # executions through replay(), per site
        self.unaccounted_captures = 0  # instrumented calls captured outside a tracked capture
        self._graph_cls = graph_cls
        self._lock = threading.Lock()
        self._captures = 0  # captures under way in any thread
        self._tls = threading.local()
        # graph -> ((site, calls per replay), ...); weak so a freed graph takes its entry along
        self._graph_sites: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._originals: dict[str, Callable[..., Any]] = {}

    # --- installation ------------------------------------------------------------------------

    def install(self) -> None:
        cls = self._graph_cls if self._graph_cls is not None else torch.cuda.CUDAGraph
        self._graph_cls = cls
        if self._originals:
            return
        tracker = self
        begin, end, run = cls.capture_begin, cls.capture_end, cls.replay
        self._originals = {"capture_begin": begin, "capture_end": end, "replay": run}
        # Methods the class inherits (e.g. from torch's C++ base) are deleted again on uninstall.
        self._own = {name for name in self._originals if name in vars(cls)}

        def capture_begin(graph: Any, *args: Any, **kwargs: Any) -> Any:
            with tracker._lock:  # waits for a telemetry thread's CUDA calls to finish
                tracker._captures += 1
            tracker._tls.graph = graph
            tracker._tls.calls = Counter()
            try:
                return begin(graph, *args, **kwargs)
            except BaseException:
                tracker._end_capture()
                raise

        def capture_end(graph: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return end(graph, *args, **kwargs)
            finally:
                calls = getattr(tracker._tls, "calls", None)
                if getattr(tracker._tls, "graph", None) is graph and calls is not None:
                    try:
                        tracker._graph_sites[graph] = tuple(sorted(calls.items()))
                    except TypeError:  # not weak-referenceable: keep it for the process
                        tracker._graph_sites_strong()[id(graph)] = tuple(sorted(calls.items()))
                tracker._end_capture()

        def replay(graph: Any, *args: Any, **kwargs: Any) -> Any:
            sites = tracker._graph_sites.get(graph)
            if sites is None:
                sites = tracker._graph_sites_strong().get(id(graph))
            if sites:
                counts = tracker.replayed
                for site, n in sites:
                    counts[site] += n
            return run(graph, *args, **kwargs)

        cls.capture_begin = capture_begin
        cls.capture_end = capture_end
        cls.replay = replay

    def uninstall(self) -> None:
        if self._graph_cls is None or not self._originals:
            return
        for name, fn in self._originals.items():
            if name in self._own:
                setattr(self._graph_cls, name, fn)
            else:
                delattr(self._graph_cls, name)
        self._originals = {}

    def _graph_sites_strong(self) -> dict[int, tuple[tuple[int, int], ...]]:
        d = getattr(self, "_strong", None)
        if d is None:
            d = self._strong = {}
        return d

    def _end_capture(self) -> None:
        self._tls.graph = None
        self._tls.calls = None
        with self._lock:
            self._captures = max(0, self._captures - 1)

    # --- used by the instrumented call and the telemetry threads -----------------------------

    def note_captured_call(self, site: int) -> int:
        """Record a call made during a capture on this thread; return its index among the
        capture's calls of `site` (0, 1, ...), or -1 when the capture is not tracked (begun
        before `install`, or through an API other than torch.cuda.CUDAGraph)."""
        calls = getattr(self._tls, "calls", None)
        if calls is None:
            self.unaccounted_captures += 1
            return -1
        k = calls[site]
        calls[site] = k + 1
        return k

    @property
    def capturing(self) -> bool:
        return self._captures > 0

    @contextmanager
    def cuda_calls(self) -> Iterator[bool]:
        """Hold off captures while the body makes CUDA calls; yields False (make none) when a
        capture is already under way."""
        with self._lock:
            yield self._captures == 0


# ---------------------------------------------------------------------------------------------
# Device probes
# ---------------------------------------------------------------------------------------------

_probe_kernels: tuple[Any, Any] | None = None


def probe_kernels() -> tuple[Any, Any]:
    """(begin, end) probe kernels, defined on first use (triton is imported only then)."""
    global _probe_kernels
    if _probe_kernels is not None:
        return _probe_kernels
    import triton
    import triton.language as tl

    @triton.jit
    def _globaltimer():
        # Nanoseconds, one clock for all SMs (unlike %clock64): start and end probes may run on
        # different SMs.
        return tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
        )

    # No specialization on the runtime ints: Triton would otherwise compile other variants for
    # slot == 1 or slot % 16 == 0 at first use, possibly inside a graph capture.
    # What a probe costs is its serialized round trips to memory (measured on an H200: 3.5 us
    # per pair in a graph when the pair made five, vs 0.53 us for an empty kernel). So the begin
    # probe only stores (no round trip), the end probe issues its load and its counter atomic
    # together (one round trip) and claims a ring entry (a second one) only when sampled. The
    # atomics are relaxed: kernel boundaries order the two probes of a slot, and the drain reads
    # only entries claimed a whole drain earlier, so no store needs ordering.
    @triton.jit(do_not_specialize=["slot"])
    def _probe_begin_kernel(state_ptr, slot, MAX_SLOTS: tl.constexpr):
        # state: [0, MAX_SLOTS) executions per slot, [MAX_SLOTS, 2 MAX_SLOTS) start times,
        # [2 MAX_SLOTS] ring head. Scalar stores and atomics run on one thread (Triton
        # predicates them).
        tl.store(state_ptr + MAX_SLOTS + slot, _globaltimer())

    @triton.jit(do_not_specialize=["slot", "stride"])
    def _probe_end_kernel(
        state_ptr, ring_ptr, slot, stride, MAX_SLOTS: tl.constexpr, RING: tl.constexpr
    ):
        t_end = _globaltimer()  # first: as close to the kernel's end as this probe gets
        t_start = tl.load(state_ptr + MAX_SLOTS + slot, volatile=True)
        n = tl.atomic_add(state_ptr + slot, 1, sem="relaxed")  # executions before this one
        if n % stride == 0:
            idx = tl.atomic_add(state_ptr + 2 * MAX_SLOTS, 1, sem="relaxed")
            entry = ring_ptr + (idx % RING) * 4
            tl.store(entry + 0, slot.to(tl.int64))
            tl.store(entry + 1, t_start)
            tl.store(entry + 2, t_end)
            tl.store(entry + 3, idx + 1)  # the tag: which claim wrote this entry

    _probe_kernels = (_probe_begin_kernel, _probe_end_kernel)
    return _probe_kernels


class DeviceProbes:
    """Probe state of one CUDA device: counters, start times and the sample ring.

    Create it on an eager (non-capturing) call: it allocates and warms the probe kernels up,
    which must not happen inside a capture.
    """

    def __init__(self, device: torch.device, num_sites: int, tracker: GraphTracker) -> None:
        if num_sites >= MAX_SLOTS - 1:
            raise ValueError(f"num_sites: expected < {MAX_SLOTS - 1}, got {num_sites}")
        self.device = device
        self.num_sites = num_sites
        self.tracker = tracker
        self.state = torch.zeros(2 * MAX_SLOTS + 1, dtype=torch.int64, device=device)
        self.ring = torch.zeros(RING_SIZE, ENTRY_WORDS, dtype=torch.int64, device=device)
        self._h_head = torch.zeros(1, dtype=torch.int64, pin_memory=True)
        self._h_ring = torch.zeros(RING_SIZE, ENTRY_WORDS, dtype=torch.int64, pin_memory=True)
        self._copy_stream = torch.cuda.Stream(device)
        self._copy_done = torch.cuda.Event()
        # slot -> site; eager slots map to themselves
        self.slot_site: list[int] = list(range(num_sites))
        self.slots_exhausted = 0  # captured calls left unprobed for want of a slot
        self.ring_dropped = 0  # samples overwritten before a drain read them
        self._consumed = 0
        # Ring head seen by the previous drain: entries below it were claimed at least one drain
        # interval ago, so their end probes have long finished and every store is visible.
        self._settled = 0
        self._begin, self._end = probe_kernels()
        warm = MAX_SLOTS - 1  # compile and load both kernels now, outside any capture
        self.begin(warm)
        self.end(warm, 1)
        torch.cuda.synchronize(device)
        # What an empty probe pair reads, eager and under graph replay: subtracted from every
        # sample of that kind, so a sample is the kernel plus one launch gap, not plus two
        # probe halves and two gaps (which on a ~1 us kernel doubles it).
        self.eager_floor_s = self._calibrate(graph=False)
        self.graph_floor_s = self._calibrate(graph=True)
        self.state.zero_()
        self.ring.zero_()

    def _calibrate(self, graph: bool) -> float:
        """Median seconds between an empty pair's probes (0.0 if it cannot be measured)."""
        slot = MAX_SLOTS - 1
        self.state.zero_()

        def pairs() -> None:
            for _ in range(CALIBRATION_PAIRS):
                self.begin(slot)
                self.end(slot, 1)

        try:
            if graph:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    pairs()
                self.state.zero_()
                for _ in range(CALIBRATION_REPLAYS):
                    g.replay()
            else:
                pairs()
            torch.cuda.synchronize(self.device)
        except RuntimeError:  # a device or driver without graph capture: no correction
            torch.cuda.synchronize(self.device)
            return 0.0
        head = min(int(self.state[2 * MAX_SLOTS]), RING_SIZE)
        entries = self.ring[:head].cpu()
        gaps = (entries[:, 2] - entries[:, 1]).double()
        return float(gaps.median()) / 1e9 if head else 0.0

    def graph_slot(self, site: int) -> int | None:
        """A new slot for one probed captured call of `site`, or None when none is left."""
        slot = len(self.slot_site)
        if slot >= MAX_SLOTS - 1:
            self.slots_exhausted += 1
            return None
        self.slot_site.append(site)
        return slot

    def begin(self, slot: int) -> None:
        self._begin[(1,)](self.state, slot, MAX_SLOTS=MAX_SLOTS, num_warps=1)

    def end(self, slot: int, stride: int) -> None:
        """`stride`: record every stride-th execution of this slot (1: every one)."""
        self._end[(1,)](
            self.state, self.ring, slot, stride, MAX_SLOTS=MAX_SLOTS, RING=RING_SIZE, num_warps=1
        )

    def drain(self, final: bool = False) -> list[tuple[int, bool, float]]:
        """New samples as (site, from_graph, seconds). Called from the telemetry thread;
        `final=True` also reads the entries claimed since the previous drain, for a caller that
        has synchronized the device (benchmarks, shutdown)."""
        with self.tracker.cuda_calls() as ok:
            if not ok:
                return []
            with torch.cuda.device(self.device), torch.cuda.stream(self._copy_stream):
                self._h_head.copy_(self.state[2 * MAX_SLOTS :], non_blocking=True)
                self._h_ring.copy_(self.ring, non_blocking=True)
                self._copy_done.record(self._copy_stream)
            deadline = time.monotonic() + COPY_WAIT_S
            while not self._copy_done.query():
                if time.monotonic() > deadline:
                    return []  # try again at the next drain; the copy lands meanwhile
                time.sleep(1e-4)
            head = int(self._h_head[0])
            ring = self._h_ring.numpy().copy()
        return self._parse(head, ring, final)

    def _parse(self, head: int, ring: Any, final: bool = False) -> list[tuple[int, bool, float]]:
        """Samples from the entries claimed before the previous drain (`_settled`; all of them
        when `final`); the newer ones are read at the next drain, when they have settled."""
        out = []
        idx = self._consumed
        limit = head if final else min(self._settled, head)
        if idx < head - RING_SIZE:  # overwritten by newer samples before we read them
            self.ring_dropped += head - RING_SIZE - idx
            idx = head - RING_SIZE
        while idx < limit:
            slot, start, end, tag = (int(v) for v in ring[idx % RING_SIZE])
            if tag != idx + 1:  # lapped while this copy was taken
                self.ring_dropped += 1
            elif 0 <= slot < len(self.slot_site) and end >= start:
                from_graph = slot >= self.num_sites
                floor = self.graph_floor_s if from_graph else self.eager_floor_s
                seconds = max(0.0, (end - start) / 1e9 - floor)
                out.append((self.slot_site[slot], from_graph, seconds))
            idx += 1
        self._consumed = max(idx, self._consumed)
        self._settled = head
        return out
