"""Torch references that define the KV write's and the fused RoPE's semantics."""

from __future__ import annotations

import torch

from .._checks import FP8_E4M3, FP8_E4M3_MAX
from .args import KVWrite, Rotary, flat_rope_write, flat_write
from .checks import _check_rope_args, _check_write_args


def quantize_e4m3_reference(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3(saturate(x * (1 / scale))), round to nearest even: x any float dtype, scale one fp32
    element -> float8_e4m3fn. (vLLM divides; the two differ by at most one fp32 ulp before the
    rounding to e4m3's 3 mantissa bits.)"""
    y = x.float() * torch.reciprocal(scale.reshape(()).float())
    return y.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_E4M3)


def kv_write_reference(write: KVWrite) -> None:
    """Reference for `ops.kv_write` (same arguments, same validation); syncs with the device."""
    fp8 = _check_write_args(write)
    key, value, key_cache, value_cache = write.key, write.value, write.key_cache, write.value_cache
    slot_mapping = write.slot_mapping
    num_rows = slot_mapping.shape[0]
    slots = slot_mapping.long()
    rows = (slots >= 0).nonzero().squeeze(1)
    slots = slots[rows]
    block_size = key_cache.shape[1]
    block, offset = slots // block_size, slots % block_size
    k = key[:num_rows][rows]
    v = value[:num_rows][rows]
    if fp8:  # index_put through byte views: not every torch build indexes float8 tensors
        key_cache = key_cache.view(torch.uint8)
        value_cache = value_cache.view(torch.uint8)
        k = quantize_e4m3_reference(k, write.k_scale).view(torch.uint8)
        v = quantize_e4m3_reference(v, write.v_scale).view(torch.uint8)
    key_cache[block, offset] = k
    value_cache[block, offset] = v


def rotary_reference(
    positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor, is_neox: bool
) -> torch.Tensor:
    """x rotated (new tensor, x's dtype): x [T, H, D], positions [T], cos_sin_cache [P, rot_dim].

    vLLM's RotaryEmbedding.forward_static semantics, computed in fp32 and rounded once.
    """
    rot_dim = cos_sin_cache.shape[1]
    half = rot_dim // 2
    cos_sin = cos_sin_cache.index_select(0, positions.long()).float()
    cos, sin = cos_sin[:, None, :half], cos_sin[:, None, half:]
    x_rot = x[..., :rot_dim].float()
    if is_neox:
        x1, x2 = x_rot[..., :half], x_rot[..., half:]
    else:
        x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if is_neox:
        out = torch.cat((o1, o2), dim=-1)
    else:
        out = torch.stack((o1, o2), dim=-1).flatten(-2)
    return torch.cat((out.to(x.dtype), x[..., rot_dim:]), dim=-1)


def rope_kv_write_reference(rotary: Rotary, write: KVWrite) -> None:
    """Reference for `ops.rope_kv_write`: rotate q and k in place, then the plain write."""
    _check_write_args(write)
    _check_rope_args(rotary, write)
    positions, cos_sin_cache, is_neox = rotary.positions, rotary.cos_sin_cache, rotary.is_neox
    rotary.query.copy_(rotary_reference(positions, rotary.query, cos_sin_cache, is_neox))
    write.key.copy_(rotary_reference(positions, write.key, cos_sin_cache, is_neox))
    kv_write_reference(write)


kv_cache_update_reference = flat_write(kv_write_reference, "kv_cache_update_reference")
rope_kv_cache_update_reference = flat_rope_write(
    rope_kv_write_reference, "rope_kv_cache_update_reference"
)
