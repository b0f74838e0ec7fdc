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
"""

from __future__ import annotations

import contextlib
import os
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
    if _compile_only and not _interpreting():
        fn.warmup(*args, grid=grid, **kwargs)
        return
    if not DIRECT or _interpreting() or _hooked():
        fn[grid](*args, **kwargs)
        return
    compiled = _BY_FN.get(id(fn))
    if compiled is None or compiled.fn is not fn:
        compiled = _BY_FN[id(fn)] = _Compiled(fn)
    device = torch.cuda.current_device()
    caches = fn.device_caches.get(device)
    if caches is None:  # Triton builds its binder on the first launch on a device
        kernel = fn[grid](*args, **kwargs)
        compiled.variants[_key(fn, device, args, kwargs)] = kernel
        return
    bound_args, specialization, options = caches[4](*args, **kwargs)
    key = (device, tuple(specialization), tuple(options.items()))
    kernel = compiled.variants.get(key)
    if kernel is None:
        compiled.variants[key] = fn[grid](*args, **kwargs)
        return
    gx = grid[0]
    gy = grid[1] if len(grid) > 1 else 1
    gz = grid[2] if len(grid) > 2 else 1
    kernel.run(
        gx, gy, gz, torch._C._cuda_getCurrentRawStream(device), kernel.function,
        kernel.packed_metadata, None, None, None, *bound_args.values(),
    )  # fmt: skip


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
