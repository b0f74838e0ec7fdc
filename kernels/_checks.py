"""Input validation shared by every launcher.

Launchers call these before any launch so a bad argument fails on the host with a message that
names the argument, what was expected and what arrived. Nothing here reads device memory, so the
checks never make the host wait for the GPU.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

import torch

# fp8 e4m3 as vLLM stores it on NVIDIA GPUs ("fp8" / "fp8_e4m3" kv-cache dtype).
FP8_E4M3 = torch.float8_e4m3fn
FP8_E4M3_MAX = 448.0


def _fmt_dtypes(dtypes: Iterable[torch.dtype]) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def check_tensor(
    name: str,
    t: object,
    *,
    ndim: int | None = None,
    shape: Sequence[int | None] | None = None,
    dtypes: Iterable[torch.dtype] | None = None,
    device: torch.device | None = None,
    last_dim_contiguous: bool = False,
    contiguous: bool = False,
) -> torch.Tensor:
    """Check one tensor argument and return it.

    `shape` entries set to None are not checked. Raises ValueError naming `name`.
    """
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(t.shape)}")
    if shape is not None:
        if t.dim() != len(shape) or any(
            want is not None and want != got for want, got in zip(shape, t.shape, strict=True)
        ):
            want_s = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name}: expected shape {want_s}, got {list(t.shape)}")
    if dtypes is not None:
        allowed = tuple(dtypes)
        if t.dtype not in allowed:
            raise ValueError(f"{name}: expected dtype in ({_fmt_dtypes(allowed)}), got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {t.stride()}")
    if last_dim_contiguous and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(
            f"{name}: expected stride 1 in the last dimension, got strides {t.stride()}"
        )
    return t


def check_choice(name: str, value: object, allowed: Iterable[object]) -> None:
    """Raise ValueError if `value` is not one of `allowed`, listing the valid values."""
    allowed = tuple(allowed)
    if value not in allowed:
        raise ValueError(f"{name}: expected one of {list(allowed)}, got {value!r}")


def check_kernel_device(name: str, t: torch.Tensor) -> None:
    """Raise ValueError if the kernels cannot run on `t`'s device: a CPU tensor where Triton
    compiles for a GPU (the kernels run on the CPU only under Triton's interpreter). Fake and
    meta tensors (torch.compile's shape propagation) pass."""
    if t.device.type != "cpu" or isinstance(t, torch._subclasses.FakeTensor):
        return
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        raise ValueError(
            f"{name}: expected a CUDA tensor, got a CPU tensor; fuselane's kernels run on the "
            "CPU only under Triton's interpreter (TRITON_INTERPRET=1, set before fuselane is "
            "imported)"
        )
