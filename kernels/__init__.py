"""fuselane's Triton kernels and the torch references that define their meaning.

This package imports torch and triton only, and importing it changes no process-wide setting.
On a machine without a CUDA device the kernels run under Triton's interpreter, which has to be
chosen before any `@triton.jit` function is defined: the places that start work call
`use_interpreter_without_gpu()` first (the vLLM plugin's entry point, the `fuselane` command,
the tests). Families: `attention`, `kv_cache`, `sampling`.
"""

from __future__ import annotations

import os


def use_interpreter_without_gpu() -> bool:
    """Choose Triton's interpreter for this process and the ones it starts when no CUDA device
    is visible (TRITON_INTERPRET=1; a value the user set is left as it is). Call before the
    kernel modules are imported. Returns whether the interpreter is chosen."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
