"""Kernel launches with less host time than `kernel[grid](...)`.

vLLM runs attention and the KV write eagerly, layer by layer, for every batch its full CUDA
graphs do not cover (prefill and mixed steps). There host time per launch adds up to step time
once it exceeds the GPU's time per layer. Triton 3.6's `JITFunction.run` spends tens of
microseconds per launch beyond the launch itself: it re-reads knobs, stringifies the options
for its cache key, re-checks the kernel's global values and, because its launch hooks are a
`HookChain` that is never None, builds launch metadata (a dict of every argument) and calls two
empty hook chains from C on every launch (measured: .notes/host-overhead.md).

`launch(fn, grid, *args, **kwargs)` does what `fn[grid](*args, **kwargs)` does. The first call
of each variant goes through `fn[grid]` (compiling it if needed) and keeps the compiled kernel
under the argument specialization Triton's own binder computes (dtypes, 16-byte alignment,
integer widths and divisibility, constexpr values) plus the launch options; later calls with the
same specialization launch that kernel directly. Any registered launch hook (a profiler such as
Proton) or the interpreter sends every call through `fn[grid]`.

`LaunchCache` goes one step further for vLLM's layer loop: it records the launches of one call
and replays them for calls that differ only in the addresses of some tensors (each layer's own
query, caches and output), leaving out everything between the call and the driver.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import triton
from triton import knobs

_HOOKS = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
# False sends every launch through `fn[grid]` (the host-overhead benchmark's baseline).
DIRECT = True
_compile_only = False


def next_pow2(n: int) -> int:
    """`triton.next_power_of_2` for host code (0 -> 0). Triton's is a JIT-callable whose host
    call costs microseconds, several per launch."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def cdiv(a: int, b: int) -> int:
    """`triton.cdiv` for host code (ceil(a / b) for b > 0)."""
    return -(-a // b)


def use_custom_op(t: object) -> bool:
    """Whether a kernel entry point should go through its torch custom op (what torch.compile
    records, with a fake implementation for shape propagation) rather than launch directly:
    while compiling, or for meta / fake tensors. Eager calls skip the op's dispatcher, tens of
    microseconds of host time per call."""
    if torch.compiler.is_compiling():
        return True
    return isinstance(t, torch.Tensor) and (
        t.device.type == "meta" or isinstance(t, torch._subclasses.FakeTensor)
    )


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class _Compiled:
    """Compiled variants of one @triton.jit function, by specialization key."""

    __slots__ = ("fn", "variants")

    def __init__(self, fn: triton.JITFunction) -> None:
        self.fn = fn
        self.variants: dict[tuple, Any] = {}


_BY_FN: dict[int, _Compiled] = {}


def _hooked() -> bool:
    return any(getattr(h, "calls", h) for h in _HOOKS)


def launch(fn: triton.JITFunction, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """`fn[grid](*args, **kwargs)`, with the per-call overhead of JITFunction.run removed for
    variants launched before in this process."""
    recording = current_recording()
    if _compile_only and not _interpreting():
        fn.warmup(*args, grid=grid, **kwargs)
        if recording is not None:
            recording.broken = True
        return
    if not DIRECT or _interpreting() or _hooked():
        fn[grid](*args, **kwargs)
        if recording is not None:
            if _interpreting():
                recording.add_call(fn, grid, list(args), kwargs)
            else:  # a launch hook (a profiler) must see every launch
                recording.broken = True
        return
    compiled = _BY_FN.get(id(fn))
    if compiled is None or compiled.fn is not fn:
        compiled = _BY_FN[id(fn)] = _Compiled(fn)
    device = torch.cuda.current_device()
    caches = fn.device_caches.get(device)
    if caches is None:  # Triton builds its binder on the first launch on a device
        kernel = fn[grid](*args, **kwargs)
        compiled.variants[_key(fn, device, args, kwargs)] = kernel
        if recording is not None:
            recording.broken = True
        return
    bound_args, specialization, options = caches[4](*args, **kwargs)
    key = (device, tuple(specialization), tuple(options.items()))
    kernel = compiled.variants.get(key)
    if kernel is None:
        kernel = compiled.variants[key] = fn[grid](*args, **kwargs)
        if recording is not None:
            recording.add_direct(kernel, grid, list(bound_args.values()))
        return
    gx = grid[0]
    gy = grid[1] if len(grid) > 1 else 1
    gz = grid[2] if len(grid) > 2 else 1
    kernel.run(
        gx, gy, gz, torch._C._cuda_getCurrentRawStream(device), kernel.function,
        kernel.packed_metadata, None, None, None, *bound_args.values(),
    )  # fmt: skip
    if recording is not None:
        recording.add_direct(kernel, grid, list(bound_args.values()))


class _Recording:
    """The launches made inside `LaunchCache.record`, in order."""

    __slots__ = ("broken", "launches")

    def __init__(self) -> None:
        # (compiled kernel or None, JIT function or None, grid, argument list, kwargs)
        self.launches: list[tuple[Any, Any, tuple[int, int, int], list, dict | None]] = []
        self.broken = False  # a launch that must not be replayed (a hook's, a compile-only)

    def add_direct(self, kernel: Any, grid: tuple[int, ...], args: list) -> None:
        self.launches.append((kernel, None, _grid3(grid), args, None))

    def add_call(self, fn: Any, grid: tuple[int, ...], args: list, kwargs: dict) -> None:
        self.launches.append((None, fn, _grid3(grid), args, kwargs))


# The recording in progress, per thread: a launch another thread makes meanwhile is not this
# call's and must not be replayed with its tensors.
_state = threading.local()


def current_recording() -> _Recording | None:
    """The recording this thread is making (None: none)."""
    return getattr(_state, "recording", None)


def _grid3(grid: tuple[int, ...]) -> tuple[int, int, int]:
    return (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)


class LaunchCache:
    """Recorded launches of one entry point, replayed for calls that differ from the recorded
    one only in the addresses of some tensors.

    vLLM calls attention and the KV write once per layer, every layer of a step with the same
    metadata tensors, shapes and options; only the layer's own tensors (query, key/value,
    caches, output, scales) differ. The first layer's call launches as usual and is recorded;
    the other layers' calls put their tensors' addresses into the recorded argument lists and
    launch the compiled kernels directly: no launch plan, no argument list to build, no Triton
    binder, no pointer lookups in the driver.

    The caller's `key` must determine everything about a call except the addresses of its
    `slots` tensors: the slots' shapes, strides and dtypes, every host int, float and flag, and
    the identity (`id`) of each other tensor the call passes (its `fixed` tensors). An entry
    keeps its fixed tensors alive, so their ids cannot be reused while it exists. A recording
    is kept only when every tensor argument of every launch is one of its slots or fixed
    tensors (a tensor derived from a slot, replayed as the recorded one, would read another
    layer's data), no launch went through a hook, and no tensor fills two slots. A replay
    whose slot address lacks the 16-byte alignment the kernel was compiled for launches
    normally instead.
    """

    __slots__ = ("_entries", "hits", "max_entries")

    def __init__(self, max_entries: int = 32) -> None:
        self._entries: dict[tuple, tuple] = {}
        self.max_entries = max_entries
        self.hits = 0  # calls replayed

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()

    def replay(self, key: tuple, slots: tuple[torch.Tensor | None, ...]) -> bool:
        """Launch the recording under `key` with `slots` (False: none, or not replayable)."""
        entry = self._entries.get(key)
        if entry is None or _hooked():
            return False
        launches, aligned, stream_device, _fixed = entry
        ptrs: list[int | None] = []
        for t, needs_alignment in zip(slots, aligned, strict=True):
            if t is None:
                ptrs.append(None)
                continue
            p = t.data_ptr()
            if needs_alignment and p & 15:
                return False
            ptrs.append(p)
        stream = None if stream_device is None else _raw_stream(stream_device)
        for kernel, fn, grid, template, kwargs, positions in launches:
            args = template.copy()
            if kernel is None:
                for i, j in positions:
                    args[i] = slots[j]
                fn[grid](*args, **kwargs)
            else:
                for i, j in positions:
                    args[i] = ptrs[j]
                kernel.run(
                    grid[0], grid[1], grid[2], stream, kernel.function, kernel.packed_metadata,
                    None, None, None, *args,
                )  # fmt: skip
        self.hits += 1
        return True

    @contextlib.contextmanager
    def record(
        self,
        key: tuple,
        slots: tuple[torch.Tensor | None, ...],
        fixed: tuple[torch.Tensor | None, ...],
    ) -> Iterator[None]:
        """Record the launches made inside, under `key`, if they can be replayed."""
        if current_recording() is not None:  # nested: the outer recording holds these launches
            yield
            return
        rec = _state.recording = _Recording()
        try:
            yield
        finally:
            _state.recording = None
        entry = _entry(rec, slots, fixed)
        if entry is not None:
            if len(self._entries) >= self.max_entries:
                # Keys name one step's metadata tensors: old steps' entries never hit again.
                self._entries.clear()
            self._entries[key] = entry


def _entry(
    rec: _Recording,
    slots: tuple[torch.Tensor | None, ...],
    fixed: tuple[torch.Tensor | None, ...],
) -> tuple | None:
    """A cache entry for `rec` (None: not replayable): per launch the argument list with the
    slots' places emptied and fixed tensors as addresses, and those places."""
    if rec.broken or not rec.launches:
        return None
    slot_of: dict[int, int] = {}
    for j, t in enumerate(slots):
        if t is not None:
            if id(t) in slot_of:
                return None
            slot_of[id(t)] = j
    fixed_ids = {id(t) for t in fixed if t is not None}
    launches = []
    direct = False
    for kernel, fn, grid, args, kwargs in rec.launches:
        if kwargs and any(isinstance(v, torch.Tensor) for v in kwargs.values()):
            return None
        template = list(args)
        positions = []
        for i, a in enumerate(template):
            if not isinstance(a, torch.Tensor):
                continue
            j = slot_of.get(id(a))
            if j is not None:
                positions.append((i, j))
                template[i] = None
            elif id(a) not in fixed_ids:
                return None
            elif kernel is not None:
                # The driver otherwise asks CUDA about each tensor pointer on every launch.
                template[i] = a.data_ptr()
        direct = direct or kernel is not None
        launches.append((kernel, fn, grid, template, kwargs, tuple(positions)))
    # A direct launch's kernel was specialized on its pointers' 16-byte alignment.
    aligned = tuple(direct and t is not None and t.data_ptr() % 16 == 0 for t in slots)
    device = _current_device() if direct else None
    return (tuple(launches), aligned, device, tuple(fixed))


def _current_device() -> int:
    return torch.cuda.current_device()


def _raw_stream(device: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device)


@contextlib.contextmanager
def compile_only(workers: int) -> Iterator[None]:
    """Inside: `launch` compiles the kernel variant it is given instead of running it, on
    `workers` threads at once (Triton's async compile mode; most of a compile is LLVM and ptxas,
    which run outside the GIL); on exit every compile has finished. For start-up warm-ups, where
    compiling one variant after another costs seconds per kernel."""
    from triton.runtime._async_compile import AsyncCompileMode

    global _compile_only
    with ThreadPoolExecutor(max_workers=workers) as pool, AsyncCompileMode(pool):
        _compile_only = True
        try:
            yield
        finally:
            _compile_only = False


def _key(fn: triton.JITFunction, device: int, args: tuple, kwargs: dict) -> tuple:
    """The key `launch` looks variants up by (after `fn[grid]` created the binder)."""
    _, specialization, options = fn.device_caches[device][4](*args, **kwargs)
    return (device, tuple(specialization), tuple(options.items()))


def variants(fn: triton.JITFunction) -> int:
    """Variants of `fn` kept for direct launch (tests)."""
    compiled = _BY_FN.get(id(fn))
    return 0 if compiled is None else len(compiled.variants)
