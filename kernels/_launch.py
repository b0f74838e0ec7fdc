"""Kernel launches with less host time than `kernel[grid](...)`.

vLLM runs attention and the KV write eagerly, layer by layer, for every batch its full CUDA
graphs do not cover (prefill and mixed steps). There host time per launch adds up to step time
once it exceeds the GPU's time per layer. Triton 3.6's `JITFunction.run` spends tens of
microseconds per launch beyond the launch itself: it re-reads knobs, stringifies the options
for its cache key, re-checks the kernel's global values and, because its launch hooks are a
`HookChain` that is never None, builds launch metadata (a dict of every argument) and calls two
empty hook chains from C on every launch (measured: docs/tuning/host-overhead.md).

`launch(fn, grid, *args, **kwargs)` does what `fn[grid](*args, **kwargs)` does. The first call
of each variant goes through `fn[grid]` (compiling it if needed) and keeps the compiled kernel
under the argument specialization Triton's own binder computes (dtypes, 16-byte alignment,
integer widths and divisibility, constexpr values) plus the launch options; later calls with the
same specialization launch that kernel directly. Any registered launch hook (a profiler such as
Proton) or the interpreter sends every call through `fn[grid]`. The direct launch uses the
compiled kernel's private launcher convention (Triton 3.6 to 3.9 share it); at start-up,
`checking_direct_launches` runs each variant's first direct launch beside `fn[grid]` on copies
of its arguments, and a kernel whose two launches differ goes back to `fn[grid]`.

`LaunchCache` goes one step further for vLLM's layer loop: it records the launches of one call
and replays them for calls that differ only in the addresses of some tensors (each layer's own
query, caches and output), leaving out everything between the call and the driver.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterable, Iterator
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
    """Compiled variants of one @triton.jit function, by specialization key, and what the
    start-up check of its direct launches found."""

    __slots__ = ("checked", "fallback", "fn", "variants")

    def __init__(self, fn: triton.JITFunction) -> None:
        self.fn = fn
        self.variants: dict[tuple, Any] = {}
        self.checked: set[tuple] = set()  # variants whose direct launch matched `fn[grid]`
        self.fallback: str | None = None  # why this kernel launches through `fn[grid]` only


_BY_FN: dict[int, _Compiled] = {}


def _hooked() -> bool:
    return any(getattr(h, "calls", h) for h in _HOOKS)


def _compiled(fn: triton.JITFunction) -> _Compiled:
    compiled = _BY_FN.get(id(fn))
    if compiled is None or compiled.fn is not fn:
        compiled = _BY_FN[id(fn)] = _Compiled(fn)
    return compiled


def _run_direct(kernel: Any, grid: tuple[int, int, int], stream: int, args: Any) -> None:
    """The launch `JITFunction.run` ends with, minus its launch metadata and hooks: the one
    place that depends on the compiled kernel's private launcher signature (checked at
    start-up, `checking_direct_launches`)."""
    kernel.run(
        grid[0], grid[1], grid[2], stream, kernel.function, kernel.packed_metadata,
        None, None, None, *args,
    )  # fmt: skip


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
    compiled = _compiled(fn)
    if compiled.fallback is not None:  # its direct launch failed the start-up check
        fn[grid](*args, **kwargs)
        if recording is not None:
            recording.add_call(fn, grid, list(args), kwargs)
        return
    device = torch.cuda.current_device()
    caches = fn.device_caches.get(device)
    launched = None
    if caches is None:  # Triton builds its binder on the first launch on a device
        launched = fn[grid](*args, **kwargs)
        caches = fn.device_caches[device]
    bound_args, specialization, options = caches[4](*args, **kwargs)
    key = (device, tuple(specialization), tuple(options.items()))
    kernel = compiled.variants.get(key)
    if kernel is None:  # a new variant: compiled (if need be) and launched by Triton
        if _late_variant_hook is not None and not _checking:
            _late_variant_hook(kernel_name(fn), variant_difference(fn, key, compiled.variants))
        if launched is None:
            launched = fn[grid](*args, **kwargs)
        kernel = compiled.variants[key] = launched
    if _checking and key not in compiled.checked:
        _check(compiled, kernel, key, _grid3(grid), args, kwargs)
        if compiled.fallback is not None:
            if launched is None:
                fn[grid](*args, **kwargs)
            if recording is not None:
                recording.add_call(fn, grid, list(args), kwargs)
            return
    if launched is None:
        _run_direct(kernel, _grid3(grid), _raw_stream(device), bound_args.values())
    if recording is not None:
        recording.add_direct(kernel, grid, list(bound_args.values()))


# Called with (kernel name, `variant_difference`) for each variant first launched outside a
# start-up warm-up's check, once one is installed (`report_late_variants`).
_late_variant_hook: Callable[[str, str], None] | None = None


def report_late_variants(hook: Callable[[str, str], None] | None) -> None:
    """From now on (None: no longer) call `hook(kernel name, what differs)` for every kernel
    variant first launched outside `checking_direct_launches`. A serving engine installs it
    after its start-up warm-up: such a variant was compiled (or loaded) while serving, and
    the difference from the variants warmed says which argument the warm-up did not cover."""
    global _late_variant_hook
    _late_variant_hook = hook


def variant_difference(fn: Any, key: tuple, known: Iterable[tuple]) -> str:
    """`key` (device, specialization, launch options) against the known variant of `fn` it
    differs from in fewest places: each differing argument or option as `name: new (known
    had old)`, or "no variant known" for a kernel's first."""
    names = list(getattr(fn, "arg_names", ()))  # Triton's binder: one entry per parameter
    _, spec, options = key
    best: list[str] | None = None
    for _, other_spec, other_options in known:
        diff = [
            f"{names[i] if i < len(names) else f'arg {i}'}: {a} (known had {b})"
            for i, (a, b) in enumerate(zip(spec, other_spec, strict=False))
            if a != b
        ]
        if len(spec) != len(other_spec):
            diff.append(f"{len(spec)} arguments (known had {len(other_spec)})")
        old = dict(other_options)
        diff += [f"{k}: {v} (known had {old.get(k)})" for k, v in options if old.get(k) != v]
        if best is None or len(diff) < len(best):
            best = diff
    if best is None:
        return "no variant known"
    return "; ".join(best) or "same specialization on another device"


# ---------------------------------------------------------------------------------------------
# The start-up check of the direct launch path
# ---------------------------------------------------------------------------------------------

_checking = False
# Tensors above this size are shared by the two launches of a check instead of copied (a KV
# cache: read-only in the warm-up's launches, which write their own small outputs).
CHECK_COPY_MAX_BYTES = 256 << 20
# (kernel name, reason) of every kernel switched to `fn[grid]` in this process, in order.
_fallbacks: list[tuple[str, str]] = []


@contextlib.contextmanager
def checking_direct_launches() -> Iterator[None]:
    """Inside (a start-up warm-up, outside CUDA-graph capture): the first direct launch of each
    kernel variant is also run through `fn[grid]`, each on its own copies of the tensor
    arguments, and the copies compared bit for bit. A kernel whose direct launch raises or
    differs launches through `fn[grid]` from then on (`direct_launch_fallbacks`): the direct
    path calls the compiled kernel's launcher with Triton's private argument convention, which
    a Triton release may change."""
    global _checking
    _checking = True
    try:
        yield
    finally:
        _checking = False


def direct_launch_fallbacks() -> list[tuple[str, str]]:
    """(kernel name, reason) of each kernel whose direct launch failed its start-up check."""
    return list(_fallbacks)


def kernel_name(fn: Any) -> str:
    inner = getattr(fn, "fn", fn)
    return getattr(inner, "__name__", repr(fn))


def _check(compiled: _Compiled, kernel: Any, key: tuple, grid, args, kwargs) -> None:
    fn, device = compiled.fn, key[0]

    def normal(a: list) -> None:
        fn[grid](*a, **kwargs)

    def direct(a: list) -> None:
        bound, specialization, options = fn.device_caches[device][4](*a, **kwargs)
        if (device, tuple(specialization), tuple(options.items())) != key:
            raise RuntimeError("the argument copies specialize to another variant")
        _run_direct(kernel, grid, _raw_stream(device), bound.values())

    reason = compare_launches(list(args), normal, direct)
    if reason is None:
        compiled.checked.add(key)
    else:
        compiled.fallback = reason
        _fallbacks.append((kernel_name(fn), reason))


def compare_launches(
    args: list, normal: Callable[[list], None], direct: Callable[[list], None]
) -> str | None:
    """Run `normal(args)` and `direct(args)`, each on its own copies of the tensor arguments
    (same strides and address alignment; tensors over CHECK_COPY_MAX_BYTES shared), and
    compare the copies bit for bit. Returns why the two differ, or None."""
    a, copies_a = _copies(args)
    b, _ = _copies(args)
    normal(a)
    try:
        direct(b)
    except Exception as e:  # noqa: BLE001 - any failure of the direct path is a finding
        return f"direct launch raised {type(e).__name__}: {e}"
    for i in copies_a:
        if not _same_bits(a[i], b[i]):
            return f"direct launch wrote different values into argument {i}"
    return None


def _copies(args: list) -> tuple[list, list[int]]:
    out = list(args)
    copied = []
    for i, t in enumerate(args):
        if isinstance(t, torch.Tensor) and t.numel() > 0:
            c = _copy_like(t)
            if c is not None:
                out[i] = c
                copied.append(i)
    return out, copied


def _copy_like(t: torch.Tensor) -> torch.Tensor | None:
    """A copy of `t` with its shape, strides and address modulo 256 (Triton specializes on
    16-byte alignment), or None where it is shared: over the size cap, or with overlapping
    elements (a zero stride)."""
    if 0 in t.stride() and t.numel() > 1:
        return None
    span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
    nbytes = span * t.element_size()
    if nbytes > CHECK_COPY_MAX_BYTES:
        return None
    raw = torch.empty(nbytes + 256, dtype=torch.uint8, device=t.device)
    shift = (t.data_ptr() - raw.data_ptr()) % 256
    c = raw[shift : shift + nbytes].view(t.dtype).as_strided(t.shape, t.stride())
    return c.copy_(t)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (NaN payloads included), for any dtype."""
    if a.dtype == torch.bool:
        return torch.equal(a, b)
    a, b = a.contiguous().reshape(-1), b.contiguous().reshape(-1)
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


class _Recording:
    """The launches made inside `LaunchCache.record`, in order."""

    __slots__ = ("broken", "kept", "launches")

    def __init__(self) -> None:
        # Tensors made inside the recorded call that its replays read as they are (see
        # `keep_with_recording`): fixed tensors the caller could not name in advance.
        self.kept: list[torch.Tensor] = []
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


@contextlib.contextmanager
def unrecorded() -> Iterator[None]:
    """Launches made inside are left out of this thread's recording: work a call does once for
    the calls that replay it (the first layer of a step), which the replays must not repeat."""
    recording = current_recording()
    _state.recording = None
    try:
        yield
    finally:
        _state.recording = recording


def keep_with_recording(t: torch.Tensor) -> None:
    """Let the recording in progress (if any) pass `t` to its replays as it is: a tensor the
    recorded call made or found that stays valid for every call its key matches."""
    recording = current_recording()
    if recording is not None:
        recording.kept.append(t)


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
    the identity (`id`) of each other tensor the call passes (its `fixed` tensors; `fixed`
    may also hold other objects whose `id` the key names). An entry keeps its fixed objects
    alive, so their ids cannot be reused while it exists. A recording
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
                _run_direct(kernel, grid, stream, args)
        self.hits += 1
        return True

    @contextlib.contextmanager
    def record(
        self,
        key: tuple,
        slots: tuple[torch.Tensor | None, ...],
        fixed: tuple[object | None, ...],
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
        entry = _entry(rec, slots, fixed + tuple(rec.kept))
        if entry is not None:
            if len(self._entries) >= self.max_entries:
                # Keys name one step's metadata tensors: old steps' entries never hit again.
                self._entries.clear()
            self._entries[key] = entry


def _entry(
    rec: _Recording,
    slots: tuple[torch.Tensor | None, ...],
    fixed: tuple[object | None, ...],
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
    compiling one variant after another costs seconds per kernel. A failed compile raises
    nothing here: the variant's next launch compiles it again and raises there, where the
    warm-up knows which variant it is."""
    from triton.runtime._async_compile import AsyncCompileMode

    global _compile_only
    with (
        ThreadPoolExecutor(max_workers=workers) as pool,
        AsyncCompileMode(pool, ignore_errors=True),
    ):
        _compile_only = True
        try:
            yield
        finally:
            _compile_only = False


def variants(fn: triton.JITFunction) -> int:
    """Variants of `fn` kept for direct launch (tests)."""
    compiled = _BY_FN.get(id(fn))
    return 0 if compiled is None else len(compiled.variants)
