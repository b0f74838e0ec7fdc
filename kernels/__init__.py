"""fuselane's Triton kernels and the torch references that define their meaning.

This package imports torch and triton only. On a machine without a CUDA device the kernels run
under Triton's interpreter: it has to be chosen before any `@triton.jit` function is defined,
so it is chosen here, once, when the package is first imported (an explicit TRITON_INTERPRET
setting is left as the user set it).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
