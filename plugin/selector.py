"""Which attention backend a layer gets: the policy behind `FUSELANE_KERNELS` and `CUSTOM`.

vLLM asks the platform once per distinct layer configuration (`AttentionSelectorConfig`:
head size, dtype, kv-cache dtype, block size, sinks, sliding window, ...). `register()` puts
`make_chooser(selection)` in front of that question (`vllm_compat.install_backend_chooser`):

1. `--attention-backend CUSTOM` (or `LLM(attention_backend="CUSTOM")`): fuselane's backend if
   `validate_configuration` accepts the configuration, else a ValueError with the reasons, as
   vLLM's CUDA platform does for an explicitly selected backend. This also holds on the CPU
   platform, whose own selection ignores the flag.
2. No backend named and `attention` in FUSELANE_KERNELS: fuselane's backend if it accepts the
   configuration; otherwise a warning with the reasons and vLLM's own choice (fallback).
3. Another backend named explicitly: that backend; FUSELANE_KERNELS' `attention` yields.
4. Whenever vLLM's own choice stands and `kv_cache` is requested: the stock backend with only
   its KV write replaced (`kv_write.kv_write_backend_path`), if the kernel can write its cache;
   otherwise a warning with the reasons.

Every outcome is logged once per configuration with the fuselane kernels it activates, so the
engine log says which kernels run.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from . import BACKEND_PATH, vllm_compat
from .config import ENV_VAR, KernelSelection

CUSTOM = "CUSTOM"

# Whether this process chose fuselane's backend because CUSTOM was named: then a kernel
# variant that fails its start-up warm-up stops the engine instead of being switched off.
_custom_named = False


def custom_named() -> bool:
    """Whether fuselane's backend was named (`--attention-backend CUSTOM`) in this process."""
    return _custom_named


def interpreter_reasons() -> list[str]:
    """Why Triton's interpreter cannot run fuselane's kernels in this process (empty: it can).

    The interpreter must be chosen before Triton is imported: `triton.language`'s own
    `@triton.jit` helpers are built for the mode in force then. Engine processes that vLLM
    spawns inherit TRITON_INTERPRET from `register()`; a process that imported Triton first
    (vLLM's in-process engine, VLLM_ENABLE_V1_MULTIPROCESSING=0) needs it set at start.
    """
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        return []
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(tl.cdiv, InterpretedFunction):
        return []
    return [
        "Triton was imported in this process before TRITON_INTERPRET=1 was set, so its "
        "interpreter cannot run fuselane's kernels here; start the process with "
        "TRITON_INTERPRET=1 (or let vLLM run its engine in a separate process, the default)"
    ]


def fuselane_backend_reasons(selection: KernelSelection, selector_config: Any) -> list[str]:
    """Why fuselane's attention backend cannot serve this configuration (empty: it can)."""
    try:
        backend_cls = vllm_compat.resolve_class_path(BACKEND_PATH)
    except ImportError as e:
        return [f"fuselane's attention backend is unavailable: {type(e).__name__}: {e}"]
    reasons = vllm_compat.validate_backend(backend_cls, selector_config)
    reasons += interpreter_reasons()
    if not selection.backend_writes_kv_cache and not vllm_compat.vllm_triton_available():
        reasons.append(
            f"{ENV_VAR} leaves out kv_cache, so the KV write would be vLLM's TRITON_ATTN "
            f"kernel, which vLLM does not run on the {vllm_compat.platform_name()} platform; "
            "add kv_cache"
        )
    return reasons


def _describe(selector_config: Any) -> str:
    fields = ("head_size", "dtype", "kv_cache_dtype", "block_size", "has_sink")
    return ", ".join(f"{f}={vllm_compat.selector_field(selector_config, f)}" for f in fields)


def make_chooser(selection: KernelSelection) -> vllm_compat.Chooser:
    """The chooser for `vllm_compat.install_backend_chooser`, bound to `selection`."""
    log = vllm_compat.get_logger()
    said: set[tuple[str, str]] = set()

    def once(level: Callable[..., None], key: str, msg: str, *args: Any) -> None:
        if (key, msg) not in said:
            said.add((key, msg))
            level(msg, *args)

    def choose(
        original: Callable[[], str],
        selected_backend: Any,
        selector_config: Any,
        num_heads: int | None,
    ) -> str:
        name = vllm_compat.backend_enum_name(selected_backend)
        key = repr(selector_config)
        wants_fuselane = name == CUSTOM or (name is None and selection.attention)
        if wants_fuselane:
            reasons = fuselane_backend_reasons(selection, selector_config)
            if not reasons:
                if name == CUSTOM:
                    global _custom_named
                    _custom_named = True
                kernels = ["attention"]
                if selection.backend_writes_kv_cache:
                    kernels.append("kv_cache")
                once(
                    log.info,
                    key,
                    "fuselane: attention backend CUSTOM (%s) for %s; fuselane kernels active: %s",
                    BACKEND_PATH,
                    _describe(selector_config),
                    ", ".join(kernels),
                )
                return BACKEND_PATH
            if name == CUSTOM:
                raise ValueError(
                    f"Selected backend CUSTOM (fuselane, {BACKEND_PATH}) is not valid for this "
                    f"configuration. Reason: {reasons}"
                )
            once(
                log.warning,
                key,
                "fuselane: attention refused for %s: %s; vLLM selects its own backend",
                _describe(selector_config),
                "; ".join(reasons),
            )
        elif name is not None and selection.attention:
            once(
                log.warning,
                key,
                "fuselane: --attention-backend %s was given, so %s's attention is not applied",
                name,
                ENV_VAR,
            )
        stock_path = original()
        if not selection.kv_cache:
            return stock_path
        from . import kv_write

        kv_path, reasons = kv_write.kv_write_backend_path(stock_path, selector_config)
        if kv_path is not None:
            reasons = interpreter_reasons()
            kv_path = None if reasons else kv_path
        if kv_path is None:
            once(
                log.warning,
                key,
                "fuselane: kv_cache refused for %s with %s: %s; fuselane kernels active: none",
                _describe(selector_config),
                stock_path,
                "; ".join(reasons),
            )
            return stock_path
        once(
            log.info,
            key,
            "fuselane: vLLM's %s with fuselane's KV write (%s) for %s; fuselane kernels "
            "active: kv_cache",
            stock_path,
            kv_path,
            _describe(selector_config),
        )
        return kv_path

    return choose
