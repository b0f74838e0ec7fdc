"""Everything that runs inside a vLLM process: the entry point, backend, sampler hook, telemetry.

`register()` is the `vllm.general_plugins` entry point. vLLM calls it in every process it starts
(API server, engine core, workers), before any model is built. It is small and lazy: it reads
`FUSELANE_KERNELS`, refuses a process the selected kernels cannot run in (no GPU and no working
Triton interpreter), registers fuselane's backend as `AttentionBackendEnum.CUSTOM`, and installs
the backend chooser (`plugin/selector.py`); nothing from `fuselane.kernels` is imported until
vLLM asks for a fuselane class. Calling it again in the same process does nothing.
`unregister()` undoes every change, for tests.
"""

from __future__ import annotations

from collections.abc import Callable

from .config import (
    ENV_VAR,
    HOPPER_ENV_VAR,
    FuselaneConfigError,
    KernelSelection,
    check_indices_from_env,
    hopper_kernels_from_env,
    interpreter_problem,
    kernels_from_env,
)

BACKEND_PATH = "fuselane.plugin.backend.FuselaneAttentionBackend"

__all__ = [
    "BACKEND_PATH",
    "ENV_VAR",
    "FuselaneConfigError",
    "KernelSelection",
    "active_selection",
    "register",
    "unregister",
]

# This process's registration: the selection read by register() and the undo callbacks.
_selection: KernelSelection | None = None
_undo: list[Callable[[], None]] = []


def register() -> None:
    """Entry point (`vllm.general_plugins`): idempotent. Raises FuselaneConfigError on an
    invalid FUSELANE_KERNELS or a process the selected kernels cannot run in."""
    global _selection
    selection = kernels_from_env()  # raises FuselaneConfigError, stopping vLLM's start-up
    check_indices = check_indices_from_env()  # likewise
    hopper = hopper_kernels_from_env()  # likewise
    if _selection is not None:
        return
    # Without a GPU the kernels run under Triton's interpreter. Choosing it here sets
    # TRITON_INTERPRET for the engine processes vLLM spawns from this one, before they import
    # Triton (the kernel modules themselves are not imported yet).
    import torch

    from fuselane.kernels import use_interpreter_without_gpu

    use_interpreter_without_gpu()
    if check_indices:  # unset leaves the process's choice (a test's, say) as it is
        from fuselane.kernels import index_checks

        index_checks.enable(True)

    from . import selector, telemetry, vllm_compat

    # An in-process engine imported Triton before this ran, so the interpreter chosen above
    # comes too late for it: say so now, not as an InterpreterError at the first request.
    problem = interpreter_problem(
        selection,
        gpu=torch.cuda.is_available(),
        engine_in_process=vllm_compat.engine_runs_in_process(),
    )
    if problem is not None:
        raise FuselaneConfigError(problem)
    if not hopper:
        # Whatever FUSELANE_KERNELS says: `--attention-backend CUSTOM` runs the attention
        # kernels too. Triton is imported under the interpreter choice made above; the
        # backend's warm-up logs the switch once per process.
        from fuselane.kernels import attention as attn_kernels

        attn_kernels.disable_hopper_kernels(f"{HOPPER_ENV_VAR}=0")
        _undo.append(attn_kernels.enable_hopper_kernels)

    # Validates FUSELANE_TELEMETRY* / FUSELANE_FAULT_INJECT (a bad value stops the start, like a
    # bad FUSELANE_KERNELS) and, with telemetry on and a GPU, hooks CUDA-graph capture/replay
    # before vLLM captures anything.
    telemetry.prepare()

    _undo.append(vllm_compat.register_custom_backend(BACKEND_PATH))
    _undo.append(vllm_compat.install_backend_chooser(selector.make_chooser(selection)))
    if selection.sampling:
        undo_sampler = _install_sampler(selection)
        if undo_sampler is not None:
            _undo.append(undo_sampler)
    _selection = selection
    vllm_compat.get_logger().info(
        "fuselane plugin registered: %s=%r requests [%s]; the CUSTOM attention backend is %s",
        ENV_VAR,
        selection.raw,
        selection.describe(),
        BACKEND_PATH,
    )


def _install_sampler(selection: KernelSelection) -> Callable[[], None] | None:
    """Install the sampler hook (the undo function, or None where there was nothing to hook)."""
    from . import sampler_hook

    return sampler_hook.install(selection)


def unregister() -> None:
    """Undo `register()` in this process (restores vLLM's registry, selector and sampler)."""
    global _selection
    while _undo:
        _undo.pop()()
    _selection = None


def active_selection() -> KernelSelection:
    """The selection `register()` read, or the environment's when the plugin is not registered."""
    return _selection if _selection is not None else kernels_from_env()
