"""Test-wide set-up: kernels run under the Triton interpreter when no GPU is present."""

from fuselane.kernels import use_interpreter_without_gpu

# Must happen before any module defines a @triton.jit function.
use_interpreter_without_gpu()
