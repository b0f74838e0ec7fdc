"""fuselane's KV-cache write inside vLLM: the impl mixin and the stock backends it can serve.

`FuselaneKVWriteMixin` gives an `AttentionImpl` fuselane's `do_kv_cache_update` and
`do_rope_and_kv_cache_update` (both through `fuselane.kernels.kv_cache`). It is used twice:

- by fuselane's own attention impl (`plugin/backend.py`), and
- for `FUSELANE_KERNELS=kv_cache` without `attention`: vLLM picks its stock backend as usual,
  and the selector swaps in a subclass of it whose impl differs only in the KV write
  (`kv_write_backend_path`). Only stock backends whose cache the kernel writes byte for byte
  qualify (`KV_WRITE_STOCK_BACKENDS`: the flash/Triton logical layout, K and V halves of
  `[num_blocks, num_kv_heads, block_size, 2 * head_size]`, per-tensor fp8 scales). The
  subclass keeps the stock name, since vLLM looks layers' backends up by name
  (`AttentionBackendEnum[backend.get_name()]`).

The subclasses are made on first use and reachable by dotted path
(`fuselane.plugin.kv_write.KVWrite_FLASH_ATTN`), which is what vLLM's selector returns and
resolves in each process.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from fuselane.kernels import kv_cache as kv_kernels

from . import telemetry
from . import vllm_compat as vc

# Stock backends whose cache layout and fp8 semantics equal the kernel's (vLLM 0.32/0.33 read
# `kv_cache.transpose(1, 2).split(head_size, dim=-1)` in both; fp8 = e4m3 with per-tensor
# fp32 scales, stored = saturate(x / scale)).
KV_WRITE_STOCK_BACKENDS = ("TRITON_ATTN", "FLASH_ATTN")
# vLLM's --kv-cache-dtype values the kernel writes ("auto" = the model dtype).
SUPPORTED_KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3")
_NAMED_CACHE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
# Native e4m3 conversions (fp8e4nv) need sm89+ in Triton.
FP8_MIN_CAPABILITY = (8, 9)
_CLASS_PREFIX = "KVWrite_"


def kv_write_reasons(
    head_size: int,
    dtype: torch.dtype,
    kv_cache_dtype: str | None,
    block_size: int | None,
    device_capability: Any,
) -> list[str]:
    """Why the KV kernel cannot write this layer's cache (empty: it can)."""
    reasons = []
    if head_size not in kv_kernels.SUPPORTED_HEAD_SIZES:
        reasons.append(
            f"kv_cache: head_size {head_size} not in {list(kv_kernels.SUPPORTED_HEAD_SIZES)}"
        )
    if dtype not in kv_kernels.INPUT_DTYPES:
        reasons.append(f"kv_cache: dtype {dtype} not supported")
    kv_dtype = kv_cache_dtype or "auto"
    if kv_dtype not in SUPPORTED_KV_CACHE_DTYPES:
        reasons.append(
            f"kv_cache: kv_cache_dtype {kv_dtype!r} not in {list(SUPPORTED_KV_CACHE_DTYPES)}"
        )
    elif kv_dtype in _NAMED_CACHE_DTYPES and _NAMED_CACHE_DTYPES[kv_dtype] != dtype:
        reasons.append(
            f"kv_cache: kv_cache_dtype {kv_dtype!r} differs from the model dtype {dtype} "
            "(the kernel stores the input dtype or fp8)"
        )
    elif vc.is_fp8_kv_cache(kv_dtype):
        if not vc.platform_fp8_is_e4m3fn():
            reasons.append("kv_cache: this platform's fp8 is not float8_e4m3fn")
        if device_capability is not None and _cap(device_capability) < FP8_MIN_CAPABILITY:
            reasons.append(
                f"kv_cache: fp8 needs compute capability >= {FP8_MIN_CAPABILITY}, "
                f"got {_cap(device_capability)}"
            )
    if block_size is not None and not any(
        block_size % s == 0 for s in kv_kernels.SUPPORTED_BLOCK_SIZES
    ):
        reasons.append(
            f"kv_cache: block_size {block_size} is no multiple of "
            f"{list(kv_kernels.SUPPORTED_BLOCK_SIZES)}"
        )
    return reasons


def _cap(device_capability: Any) -> tuple[int, int]:
    return (int(device_capability.major), int(device_capability.minor))


# Telemetry seams: plain calls when telemetry is off and no fault is injected. The phase (None)
# is the step's, noted by the metadata builder.
_KV_WRITE = telemetry.seam(telemetry.KV_CACHE)
_ROPE_KV_WRITE = telemetry.seam(telemetry.ROPE_KV_CACHE)
_KV_WRITE_STOCK = telemetry.seam(telemetry.KV_CACHE, impl=telemetry.STOCK)


class FuselaneKVWriteMixin:
    """KV write through fuselane's kernels, for an AttentionImpl of the flash/Triton layout.

    Expects the impl attributes vLLM's impls set: `head_size`, `kv_cache_dtype`, `attn_type`.
    `_fuselane_kv_write` (default True) switches back to the next class's write, which is how
    fuselane's attention backend keeps vLLM's write for `FUSELANE_KERNELS=attention`.
    """

    _fuselane_kv_write: bool = True
    _fuselane_write_checked: bool = False  # set on the instance after its first write
    # The last cache split into K/V views (a weak reference: a cache vLLM replaces, e.g. on
    # wake-up, is not kept alive) and its views; vLLM hands a layer the same cache every step.
    _fuselane_views_of: Any = None
    _fuselane_views: Any = None
    _fuselane_fp8_of: Any = None  # (kv_cache_dtype, is fp8)

    def _fuselane_caches(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """key_cache, value_cache `[num_blocks, block_size, Hkv, D]` views (fp8 retyped)."""
        views_of = self._fuselane_views_of
        if views_of is not None and views_of() is kv_cache:
            return self._fuselane_views
        key_cache, value_cache = vc.split_kv_cache(kv_cache, self.head_size)
        if self._fuselane_fp8 and key_cache.dtype != torch.float8_e4m3fn:
            key_cache = key_cache.view(torch.float8_e4m3fn)
            value_cache = value_cache.view(torch.float8_e4m3fn)
        self._fuselane_views_of = weakref.ref(kv_cache)
        self._fuselane_views = (key_cache, value_cache)
        return key_cache, value_cache

    @property
    def _fuselane_fp8(self) -> bool:
        known = self._fuselane_fp8_of
        if known is None or known[0] != self.kv_cache_dtype:
            known = self._fuselane_fp8_of = (
                self.kv_cache_dtype,
                vc.is_fp8_kv_cache(self.kv_cache_dtype),
            )
        return known[1]

    def _fuselane_scales(self, layer: Any) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if not self._fuselane_fp8:
            return None, None
        return vc.layer_kv_scales(layer)

    def _writes_no_cache(self) -> bool:
        return vc.is_encoder_attention(self.attn_type)

    def do_kv_cache_update(
        self,
        layer: Any,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write key/value `[T, Hkv, D]` rows to their slots (`slot_mapping [N]`, N <= T)."""
        if not self._fuselane_kv_write:  # vLLM's write, observed at the same seam
            return _KV_WRITE_STOCK(
                None, super().do_kv_cache_update, layer, key, value, kv_cache, slot_mapping
            )
        if self._writes_no_cache():
            return None
        key_cache, value_cache = self._fuselane_caches(kv_cache)
        k_scale, v_scale = self._fuselane_scales(layer)
        self._fuselane_write(
            kv_kernels.KVWrite(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
        )
        return None

    def _fuselane_write(self, write: kv_kernels.KVWrite) -> None:
        """fuselane's write into the caches' K/V views, through the telemetry seam."""
        # Validated on this layer's first call only (as the attention call; host time per
        # layer is step time on vLLM's eager path).
        if self._fuselane_write_checked:
            _KV_WRITE(None, kv_kernels.kv_write_unchecked, write)
        else:
            _KV_WRITE(None, kv_kernels.kv_write, write)
        self._fuselane_write_checked = True

    def fused_rope_kvcache_supported(self) -> bool:
        """vLLM fuses RoPE into the KV write only where this says so (0.33: ROCm pass only)."""
        if not self._fuselane_kv_write:
            return super().fused_rope_kvcache_supported()
        return not self._writes_no_cache()

    def do_rope_and_kv_cache_update(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        is_neox: bool,
        kv_cache: torch.Tensor,
        layer_slot_mapping: torch.Tensor,
    ) -> None:
        """Rotate query `[T, Hq, D]` and key `[T, Hkv, D]` in place, write key/value: one launch."""
        if not self._fuselane_kv_write:
            return super().do_rope_and_kv_cache_update(
                layer, query, key, value, positions, cos_sin_cache, is_neox, kv_cache,
                layer_slot_mapping,
            )  # fmt: skip
        key_cache, value_cache = self._fuselane_caches(kv_cache)
        k_scale, v_scale = self._fuselane_scales(layer)
        _ROPE_KV_WRITE(
            None,
            kv_kernels.rope_kv_write,
            kv_kernels.Rotary(positions, query, cos_sin_cache, is_neox),
            kv_kernels.KVWrite(
                key, value, key_cache, value_cache, layer_slot_mapping, k_scale, v_scale
            ),
        )
        return None


# ---------------------------------------------------------------------------------------------
# Stock backends with only the KV write replaced
# ---------------------------------------------------------------------------------------------

_made: dict[str, type] = {}


def kv_write_backend(stock_name: str) -> type:
    """The subclass of stock backend `stock_name` (e.g. "FLASH_ATTN") with fuselane's KV write."""
    if stock_name not in KV_WRITE_STOCK_BACKENDS:
        raise ValueError(
            f"stock_name: expected one of {list(KV_WRITE_STOCK_BACKENDS)}, got {stock_name!r}"
        )
    cls = _made.get(stock_name)
    if cls is not None:
        return cls
    stock = vc.backend_class_for_name(stock_name)
    stock_impl = stock.get_impl_cls()
    stock_builder = stock.get_builder_cls()

    impl = type(f"FuselaneKVWrite{stock_impl.__name__}", (FuselaneKVWriteMixin, stock_impl), {})
    impl.__module__ = __name__

    def builder_init(self, kv_cache_spec, layer_names, vllm_config, device, *args, **kw):
        stock_builder.__init__(self, kv_cache_spec, layer_names, vllm_config, device, *args, **kw)
        self._fuselane_decode_query_len = vc.decode_query_len(vllm_config)

    def build(self, common_prefix_len, common_attn_metadata, *args, **kw):
        # The step's phase for telemetry's labels (a no-op when telemetry is off).
        telemetry.note_step(
            common_attn_metadata.query_start_loc_cpu, self._fuselane_decode_query_len
        )
        return stock_builder.build(self, common_prefix_len, common_attn_metadata, *args, **kw)

    builder = type(
        f"FuselaneKVWrite{stock_builder.__name__}",
        (stock_builder,),
        {"__init__": builder_init, "build": build},
    )
    builder.__module__ = __name__
    kernel_sizes = tuple(kv_kernels.SUPPORTED_BLOCK_SIZES)

    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:
        # The stock kernel's sizes narrowed to the write kernel's (vLLM splits a larger cache
        # block into kernel blocks of one of these).
        return [s for s in kernel_sizes if stock.supports_block_size(s)]

    name = f"{_CLASS_PREFIX}{stock_name}"
    cls = type(
        name,
        (stock,),
        {
            "__module__": __name__,
            "__qualname__": name,
            "__doc__": f"vLLM's {stock_name} backend with fuselane's KV-cache write.",
            "get_impl_cls": staticmethod(lambda: impl),
            "get_builder_cls": staticmethod(lambda: builder),
            "get_supported_kernel_block_sizes": staticmethod(get_supported_kernel_block_sizes),
        },
    )
    _made[stock_name] = cls
    return cls


def kv_write_backend_path(stock_path: str, selector_config: Any) -> tuple[str | None, list[str]]:
    """(dotted path of the KV-write subclass for the stock backend at `stock_path`, reasons).

    The path is None, with the reasons, when the kernel cannot write that backend's cache.
    """
    try:
        stock = vc.resolve_class_path(stock_path)
    except ImportError as e:
        return None, [f"cannot import {stock_path}: {e}"]
    stock_name = stock.get_name()
    if stock_name not in KV_WRITE_STOCK_BACKENDS:
        return None, [
            f"{stock_name} keeps a cache layout fuselane's write does not produce "
            f"(it serves {list(KV_WRITE_STOCK_BACKENDS)})"
        ]
    reasons = kv_write_reasons(
        vc.selector_field(selector_config, "head_size"),
        vc.selector_field(selector_config, "dtype"),
        vc.selector_field(selector_config, "kv_cache_dtype"),
        vc.selector_field(selector_config, "block_size"),
        vc.device_capability(),
    )
    if vc.selector_field(selector_config, "use_mla", False):
        reasons.append("kv_cache: MLA caches are not supported")
    if reasons:
        return None, reasons
    return f"{__name__}.{_CLASS_PREFIX}{stock_name}", []


def __getattr__(name: str) -> Any:
    # `KVWrite_<STOCK>` resolves lazily, so vLLM can import it by path in any process.
    if name.startswith(_CLASS_PREFIX) and name[len(_CLASS_PREFIX) :] in KV_WRITE_STOCK_BACKENDS:
        return kv_write_backend(name[len(_CLASS_PREFIX) :])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
