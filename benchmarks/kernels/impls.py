"""What a family module hands the `fuselane bench kernels` runner: the implementations of a case.

A family module's `prepare(ctx, case)` builds the inputs of one case and returns a `Prepared`:
its implementations (fuselane first, then every peer that can run it), each with a `setup`
that returns the call to time and, where the output can be checked, a check to run after one
call. The runner decides what runs when (FlashInfer rows wait for their JIT build), checks,
times and records.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from fuselane.benchmarks.kernels import attention_workload, kv_cache_workload
from fuselane.benchmarks.kernels.peers import Peers

Check = Callable[[], tuple[bool, str]]
Setup = Callable[[], tuple[Callable[[], object], Check | None]]


@dataclass
class Impl:
    name: str  # the row's `impl`
    peer: str  # "fuselane", "vllm", "flashinfer" or "torch"
    setup: Setup
    warm: str | None = None  # FlashInfer JIT module this call needs (see peers.FlashInferWarmup)
    extra: dict[str, object] = field(default_factory=dict)


@dataclass
class Prepared:
    impls: list[Impl]
    nbytes: float | None = None  # bytes moved by one call (bandwidth-bound sections)
    flops: float | None = None  # floating-point operations of one call (compute-bound sections)
    extra: dict[str, object] = field(default_factory=dict)  # fields of every row of the case


@dataclass
class Context:
    """What every family module needs to build a case."""

    device: torch.device
    peers: Peers
    grid: str  # grid.GRIDS: sizes buffers that serve several cases
    note: Callable[[str], None]
    cache: dict[str, object] = field(default_factory=dict)  # large buffers kept across cases

    def keep(self, key: str, make: Callable[[], object]) -> object:
        """The buffer stored under `key`, made by `make()` if absent; keeps only one per prefix
        (the part before ':'), so a new model's KV pool replaces the previous model's."""
        if key not in self.cache:
            prefix = key.split(":", 1)[0]
            for old in [k for k in self.cache if k.split(":", 1)[0] == prefix]:
                del self.cache[old]
            self.cache[key] = make()
        return self.cache[key]


def generator(device: torch.device, seed: int, on_device: bool = False) -> torch.Generator:
    """A seeded generator on the CPU (inputs drawn there and moved, as the bench scripts do)
    or on `device` (for helpers that draw on the device)."""
    return torch.Generator(device=device if on_device else "cpu").manual_seed(seed)


@contextlib.contextmanager
def bench_scripts_on(device: torch.device) -> Iterator[None]:
    """Point the bench scripts' input builders at `device` for the duration of a run.

    The `DEVICE` constants of their workload modules exist for exactly this (every module of a
    script reads its family's at call time); the interpreter smoke run builds its inputs on the
    CPU.
    """
    modules = (attention_workload, kv_cache_workload)
    saved = [m.DEVICE for m in modules]
    for m in modules:
        m.DEVICE = device.type
    try:
        yield
    finally:
        for m, value in zip(modules, saved, strict=True):
            m.DEVICE = value
