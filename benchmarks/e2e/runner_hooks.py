"""Wrapping vLLM's GPU model runner classes in the process that runs them.

The offline engine's measurements inside the engine (the CUDA-graph capture timer, the step
timer) wrap methods of the model runner classes. They are installed in the offline worker's
process before `LLM()` and take effect when a runner module is imported (an import hook), not
by importing it here: vLLM forks its engine core from this process while CUDA is not yet
initialized (its default start method), and the core inherits the hook and imports the runner
itself. Under spawn the hook is lost and the wrapped figures are missing from the report.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import types
from collections.abc import Callable, Iterable
from typing import Any

# vLLM's GPU model runners: V1 and V2 (0.26 runs V2 on GPUs, V1 with VLLM_USE_V2_MODEL_RUNNER=0;
# vLLM's CPU runner subclasses V1's).
RUNNER_MODULES = ("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.model_runner")


def wrap_on_import(names: Iterable[str], wrap: Callable[[types.ModuleType], str]) -> dict[str, str]:
    """`wrap(module)` for each module of `names` now if it is imported, else right after its
    first import in whichever process imports it. `wrap` must never raise (it runs inside
    vLLM's import) and says what it did. Returns per module: what `wrap` said, or "on import"."""
    done, pending = {}, []
    for name in names:
        module = sys.modules.get(name)
        if module is None:
            pending.append(name)
            done[name] = "on import"
        else:
            done[name] = wrap(module)
    if pending:
        sys.meta_path.insert(0, OnImport(pending, wrap))
    return done


class OnImport(importlib.abc.MetaPathFinder):
    """Calls `then(module)` right after each of `names` is first imported, in whichever
    process imports it."""

    def __init__(self, names: list[str], then: Callable[[types.ModuleType], object]) -> None:
        self.names, self.then = set(names), then

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in self.names:
            return None
        self.names.discard(fullname)  # the lookup below must not come back here
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then(module: types.ModuleType) -> None:
            exec_module(module)
            self.then(module)

        spec.loader.exec_module = exec_then  # type: ignore[method-assign]
        return spec
