"""Engine runs in fresh processes, shared by the plugin and serving tests.

Every engine runs in a process of its own (tests/plugin/engine_runner.py), with the plugin
loaded through the installed entry point, so each sees its own FUSELANE_KERNELS and nothing
leaks into the test process. `once` lets the fixtures of several test folders share one run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

if TYPE_CHECKING:
    import pytest

T = TypeVar("T")

HERE = Path(__file__).resolve().parent
RUNNER = HERE / "engine_runner.py"
ENGINE_TIMEOUT_S = 600
# Session-wide values by (pytest's base temp dir, key): see `once`.
_ONCE: dict[tuple[str, str], Any] = {}


def engine_dtype() -> str:
    """float32 where fuselane's attention kernel takes it (token-identical greedy output);
    float16 otherwise (the kernel's CPU-runnable dtype; comparisons then allow near-ties)."""
    from fuselane.kernels import attention

    return "float32" if torch.float32 in attention.SUPPORTED_Q_DTYPES else "float16"


# dtype: (logprob atol, near-tie margin); see test_engine.py for where the numbers come from.
TOLERANCE = {
    "float32": (1e-4, 1e-3),
    "float16": (5e-2, 4e-2),
}


def compared_prefix(stock: dict, i: int) -> int:
    """Greedy steps of prompt i to compare token for token: all of them, or, where the two best
    stock logprobs of a step are closer than the dtype's near-tie margin, the steps before it."""
    _, tie = TOLERANCE[engine_dtype()]
    for step, top2 in enumerate(stock["top2"][i]):
        if len(top2) == 2 and top2[0] - top2[1] < tie:
            return step
    return len(stock["greedy"][i])


def engine_env(kernels: str | None, **extra: str) -> dict[str, str]:
    """The environment of an engine process: a small CPU KV cache, the Triton interpreter."""
    env = dict(os.environ)
    env.pop("FUSELANE_KERNELS", None)
    env.update(VLLM_CPU_KVCACHE_SPACE="1", TRITON_INTERPRET="1", TOKENIZERS_PARALLELISM="false")
    if kernels is not None:
        env["FUSELANE_KERNELS"] = kernels
    env.update(extra)
    return env


def run_engine(
    model: Path, out_dir: Path, name: str, kernels: str | None, *args: str, dtype: str = ""
) -> tuple[dict, str]:
    """Run engine_runner.py in a fresh process; return (its JSON result, its log)."""
    out = out_dir / f"{name}.json"
    dtype = dtype or engine_dtype()
    proc = subprocess.run(
        [sys.executable, str(RUNNER), str(model), str(out), "--dtype", dtype, *args],
        env=engine_env(kernels),
        capture_output=True,
        text=True,
        timeout=ENGINE_TIMEOUT_S,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"engine {name} failed (exit {proc.returncode}):\n{log[-6000:]}"
    return json.loads(out.read_text()), log


def once(tmp_path_factory: pytest.TempPathFactory, key: str, make: Callable[[], T]) -> T:
    """`make()` once per pytest session, whichever folder's fixture asks first.

    A session fixture belongs to its conftest: tests/golden reuses tests/plugin's fixtures, and
    pytest would run them once for each folder. Each engine takes minutes under Triton's
    interpreter, so the fixtures keep their values here instead (a failure too, so that a
    broken engine is not started twice)."""
    k = (str(tmp_path_factory.getbasetemp()), key)
    if k not in _ONCE:
        try:
            _ONCE[k] = make()
        except Exception as e:  # noqa: BLE001 - kept and raised again for the next asker
            _ONCE[k] = e
    value = _ONCE[k]
    if isinstance(value, Exception):
        raise value
    return value
