"""Test-wide set-up: kernels run under the Triton interpreter when no GPU is present."""

import os

import torch

# Must happen before any module defines a @triton.jit function.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
