"""pytest plugin (`--cpu-platform`): vLLM's CPU platform for a CUDA build of vLLM on a machine
without a GPU.

vLLM picks its platform from how it was built; a CUDA wheel (the GPU machine's 0.26) on a CPU
box finds no device and the tests' configs fail ("Failed to infer device type"). Setting the
platform before anything asks for it lets vLLM's attention tests run on the CPU: fuselane's
kernels under Triton's interpreter, vLLM's reference on torch. Stock GPU backends do not run
there. Loaded before vLLM's conftest imports vLLM.
"""

from __future__ import annotations

import vllm.platforms as platforms
from vllm.platforms.cpu import CpuPlatform

if not hasattr(platforms, "_current_platform"):
    raise RuntimeError(
        f"vllm {getattr(platforms, '__file__', '?')} keeps its platform elsewhere: "
        "--cpu-platform does not know this vLLM"
    )
platforms._current_platform = CpuPlatform()
