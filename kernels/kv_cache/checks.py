"""Argument checks of the KV-write entry points: host-side, never reading device data."""

from __future__ import annotations

import os

import torch

from .._checks import FP8_E4M3, check_choice, check_kernel_device, check_tensor
from .args import KVWrite, Rotary

SUPPORTED_HEAD_SIZES = (64, 80, 96, 128, 256)
SUPPORTED_BLOCK_SIZES = (16, 32, 64)
INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _check_scale(name: str, scale: object, device: torch.device) -> None:
    check_tensor(name, scale, dtypes=(torch.float32,), device=device)
    if scale.numel() != 1:
        raise ValueError(
            f"{name}: expected one element (a per-tensor scale), got shape {list(scale.shape)}"
        )


def _check_write_args(write: KVWrite) -> bool:
    """Validate the write's arguments (shapes, dtypes, devices, strides); True if the cache is fp8.

    Reads no device memory: slot values (range, uniqueness) are the caller's contract.
    """
    key, value, key_cache, value_cache = write.key, write.value, write.key_cache, write.value_cache
    slot_mapping, k_scale, v_scale = write.slot_mapping, write.k_scale, write.v_scale
    check_tensor("key", key, ndim=3, dtypes=INPUT_DTYPES, last_dim_contiguous=True)
    check_kernel_device("key", key)
    num_tokens, num_kv_heads, head_size = key.shape
    device = key.device
    check_choice("head_size (key.shape[2])", head_size, SUPPORTED_HEAD_SIZES)
    check_tensor(
        "value",
        value,
        shape=(num_tokens, num_kv_heads, head_size),
        dtypes=(key.dtype,),
        device=device,
        last_dim_contiguous=True,
    )
    check_tensor("key_cache", key_cache, ndim=4, dtypes=(key.dtype, FP8_E4M3), device=device)
    check_tensor(
        "key_cache",
        key_cache,
        shape=(None, None, num_kv_heads, head_size),
        last_dim_contiguous=True,
    )
    check_choice("block_size (key_cache.shape[1])", key_cache.shape[1], SUPPORTED_BLOCK_SIZES)
    check_tensor(
        "value_cache",
        value_cache,
        shape=tuple(key_cache.shape),
        dtypes=(key_cache.dtype,),
        device=device,
        last_dim_contiguous=True,
    )
    check_tensor(
        "slot_mapping", slot_mapping, ndim=1, dtypes=INDEX_DTYPES, device=device, contiguous=True
    )
    if slot_mapping.shape[0] > num_tokens:
        raise ValueError(
            f"slot_mapping: expected at most key.shape[0] = {num_tokens} entries (one per key "
            f"row written), got {slot_mapping.shape[0]}"
        )
    fp8 = key_cache.dtype == FP8_E4M3
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is None:
            if fp8:
                raise ValueError(
                    f"{name}: expected a one-element float32 tensor for an fp8 cache "
                    f"(stored = saturate(x / {name})), got None"
                )
        else:
            _check_scale(name, scale, device)
    return fp8


def _check_rope_args(rotary: Rotary, write: KVWrite) -> int:
    """Validate the rotary part of the fused call (key itself is checked by _check_write_args);
    returns rot_dim."""
    positions, query, cos_sin_cache = rotary.positions, rotary.query, rotary.cos_sin_cache
    is_neox = rotary.is_neox
    num_tokens, _, head_size = write.key.shape
    device = write.key.device
    check_tensor(
        "query",
        query,
        shape=(num_tokens, None, head_size),
        dtypes=(write.key.dtype,),
        device=device,
        last_dim_contiguous=True,
    )
    check_tensor(
        "positions",
        positions,
        shape=(num_tokens,),
        dtypes=INDEX_DTYPES,
        device=device,
        contiguous=True,
    )
    check_tensor(
        "cos_sin_cache",
        cos_sin_cache,
        ndim=2,
        dtypes=INPUT_DTYPES,
        device=device,
        last_dim_contiguous=True,
    )
    rot_dim = cos_sin_cache.shape[1]
    if rot_dim < 2 or rot_dim % 2 or rot_dim > head_size:
        raise ValueError(
            f"cos_sin_cache: expected an even rot_dim (shape[1]) in [2, head_size={head_size}], "
            f"got {rot_dim}"
        )
    if not isinstance(is_neox, bool):
        raise ValueError(f"is_neox: expected a bool, got {type(is_neox).__name__}")
    return rot_dim
