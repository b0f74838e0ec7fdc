"""Backend choice (plugin/selector.py) and the capability hooks vLLM validates with.

The chooser is called the way vLLM's selector calls the platform, with vLLM's own
`AttentionSelectorConfig`; `original` stands for the platform's own choice.
"""

from __future__ import annotations

import logging

import pytest
import torch

from fuselane.plugin import BACKEND_PATH
from fuselane.plugin.config import parse_kernels

CPU_ATTN = "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"
TRITON_ATTN = "vllm.v1.attention.backends.triton_attn.TritonAttentionBackend"


def selector_config(**overrides):
    from vllm.v1.attention.selector import AttentionSelectorConfig

    fields = dict(head_size=64, dtype=torch.float16, kv_cache_dtype="auto", block_size=None)
    fields.update(overrides)
    return AttentionSelectorConfig(**fields)


class _Logs(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture
def logs():
    # vLLM's loggers do not propagate to the root logger, so listen on fuselane's directly.
    from fuselane.plugin.vllm_compat import LOGGER_NAME

    handler = _Logs()
    logger = logging.getLogger(LOGGER_NAME)
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.DEBUG)
    yield handler.lines
    logger.removeHandler(handler)
    logger.setLevel(old_level)


def choose(kernels: str | None, selected, cfg, stock: str = CPU_ATTN) -> str:
    from fuselane.plugin.selector import make_chooser

    calls = []

    def original() -> str:
        calls.append(1)
        return stock

    return make_chooser(parse_kernels(kernels))(original, selected, cfg, None)


def custom():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return AttentionBackendEnum.CUSTOM


def test_custom_selects_fuselane(logs):
    assert choose(None, custom(), selector_config()) == BACKEND_PATH
    assert any("fuselane kernels active: attention, kv_cache" in line for line in logs)


def test_custom_with_an_unsupported_configuration_raises_the_reasons():
    with pytest.raises(ValueError, match=r"not valid for this configuration.*head_size not"):
        choose(None, custom(), selector_config(head_size=48))


def test_env_attention_selects_fuselane_without_a_flag():
    assert choose("attention,kv_cache", None, selector_config()) == BACKEND_PATH


def test_env_attention_falls_back_with_the_reasons(logs):
    cfg = selector_config(head_size=48, kv_cache_dtype="fp8_e5m2")
    assert choose("all", None, cfg) == CPU_ATTN
    refusal = [line for line in logs if "attention refused" in line]
    assert refusal and "head_size not supported" in refusal[0]
    assert "kv_cache_dtype not supported" in refusal[0]


def test_no_kernels_requested_keeps_vllm_choice():
    assert choose(None, None, selector_config()) == CPU_ATTN
    assert choose("none", None, selector_config()) == CPU_ATTN
    assert choose("sampling", None, selector_config()) == CPU_ATTN


def test_explicit_other_backend_wins(logs):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    assert choose("attention", AttentionBackendEnum.FLASH_ATTN, selector_config()) == CPU_ATTN
    assert any("--attention-backend FLASH_ATTN was given" in line for line in logs)


def test_attention_without_kv_cache_needs_vllms_triton_write(logs):
    # On the CPU vLLM runs none of its Triton kernels, so TRITON_ATTN's KV write is unavailable.
    assert choose("attention", None, selector_config()) == CPU_ATTN
    assert any("leaves out kv_cache" in line for line in logs)


def test_kv_cache_only_swaps_the_write_of_a_flash_layout_backend(logs):
    assert choose("kv_cache", None, selector_config(), stock=TRITON_ATTN) == (
        "fuselane.plugin.kv_write.KVWrite_TRITON_ATTN"
    )
    assert any("fuselane kernels active: kv_cache" in line for line in logs)


def test_kv_cache_only_refuses_other_layouts(logs):
    assert choose("kv_cache", None, selector_config(), stock=CPU_ATTN) == CPU_ATTN
    assert any("CPU_ATTN keeps a cache layout" in line for line in logs)


def test_kv_cache_only_refuses_unsupported_head_size(logs):
    assert choose("kv_cache", None, selector_config(head_size=48), stock=TRITON_ATTN) == (
        TRITON_ATTN
    )
    assert any("kv_cache: head_size 48" in line for line in logs)


# --- capability hooks, as vLLM's validate_configuration applies them -------------------------


def _reasons(cfg, capability=None):
    from vllm.platforms.interface import DeviceCapability

    from fuselane.plugin.backend import FuselaneAttentionBackend

    cap = DeviceCapability(*capability) if capability else None
    return FuselaneAttentionBackend.validate_configuration(device_capability=cap, **cfg._asdict())


def test_supported_configurations_validate():
    assert _reasons(selector_config()) == []
    assert _reasons(selector_config(dtype=torch.bfloat16, head_size=128), (9, 0)) == []
    assert _reasons(selector_config(kv_cache_dtype="fp8", head_size=128), (9, 0)) == []
    assert _reasons(selector_config(has_sink=True, has_sliding_window=True, block_size=128)) == []


@pytest.mark.parametrize(
    ("overrides", "capability", "reason"),
    [
        ({"head_size": 32}, None, "head_size not supported"),
        ({"kv_cache_dtype": "fp8_e5m2"}, None, "kv_cache_dtype not supported"),
        ({"kv_cache_dtype": "int8_per_token_head"}, None, "kv_cache_dtype not supported"),
        ({"kv_cache_dtype": "float16", "dtype": torch.bfloat16}, None, "differs from the model"),
        ({"kv_cache_dtype": "fp8"}, (8, 0), "fp8 KV cache needs compute capability"),
        ({}, (7, 5), "compute capability not supported"),
        ({"block_size": 24}, None, "block_size not supported"),
        ({"use_mla": True}, None, "MLA not supported"),
        ({"attn_type": "encoder_only"}, None, "attention type encoder_only not supported"),
        ({"use_non_causal": True}, None, "non-causal attention not supported"),
        ({"use_mm_prefix": True}, None, "partial multimodal token full attention"),
        ({"use_sparse": True}, None, "sparse not supported"),
    ],
)
def test_unsupported_configurations_are_refused(overrides, capability, reason):
    reasons = _reasons(selector_config(**overrides), capability)
    assert any(reason in r for r in reasons), reasons


def test_dtypes_follow_the_kernels():
    from fuselane.kernels import attention
    from fuselane.plugin.backend import FuselaneAttentionBackend

    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        expected = dtype in attention.SUPPORTED_Q_DTYPES
        assert FuselaneAttentionBackend.supports_dtype(dtype) is expected, dtype


def test_kernel_block_sizes_split_larger_cache_blocks():
    from fuselane.plugin.backend import FuselaneAttentionBackend

    assert FuselaneAttentionBackend.get_supported_kernel_block_sizes() == [16, 32, 64]
    # The CPU platform's default cache block (128) is served as kernel blocks of 64.
    assert FuselaneAttentionBackend.supports_block_size(128)
    assert not FuselaneAttentionBackend.supports_block_size(8)
