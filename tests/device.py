"""Where kernel tests run: the GPU when there is one, else the CPU under Triton's interpreter.

Tests draw inputs on the CPU from a seeded generator and move them to DEVICE, so the same seed
gives the same inputs on both, and the same test file checks the compiled kernels on a GPU.
"""

from __future__ import annotations

import dataclasses
from typing import TypeVar

import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

T = TypeVar("T")


def on_device(x: T) -> T:
    """`x` with every tensor on DEVICE: a tensor, or a dataclass of tensors (a parameter bundle)
    as a new instance; None and other values pass through."""
    if isinstance(x, torch.Tensor):
        return x.to(DEVICE)  # type: ignore[return-value]
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        moved = {f.name: on_device(getattr(x, f.name)) for f in dataclasses.fields(x) if f.init}
        return dataclasses.replace(x, **moved)
    return x
