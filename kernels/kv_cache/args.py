"""The argument bundles of the KV write, and the flat public signatures written once.

Inside the package a write travels as a `KVWrite` (what goes where in the cache) and a fused
RoPE + write as a `Rotary` and a `KVWrite`. The flat forms users and vLLM's call sites know
(`kv_cache_update(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)`,
`rope_kv_cache_update(positions, query, key, value, cos_sin_cache, is_neox, ...)`) are defined
here once, for the checked, unchecked and reference entry points alike; the custom ops take the
same fields in the same order (`KVWrite.fields`, `Rotary.fields`) at the `torch.library`
boundary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .._checks import FP8_E4M3


@dataclass(frozen=True)
class KVWrite:
    """Key/value rows and where they go in the paged cache.

    key, value:   [T, Hkv, D] fp16/bf16/fp32, any strides but the last
    key_cache, value_cache: [num_blocks, block_size, Hkv, D] key's dtype or float8_e4m3fn
    slot_mapping: [N] int32/int64, N <= T: row i goes to slot slot_mapping[i] (< 0: not written)
    k_scale, v_scale: [1] float32 per-tensor scales, required for an fp8 cache
    """

    key: torch.Tensor
    value: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    slot_mapping: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @property
    def fp8(self) -> bool:
        return self.key_cache.dtype == FP8_E4M3

    def fields(self) -> tuple:
        """The fields in order: the custom op's arguments."""
        return (self.key, self.value, self.key_cache, self.value_cache, self.slot_mapping,
                self.k_scale, self.v_scale)  # fmt: skip


@dataclass(frozen=True)
class Rotary:
    """The rotary embedding fused into a write: positions [T], query [T, Hq, D] (rotated in
    place with the write's key), cos_sin_cache [max_position, rot_dim], is_neox."""

    positions: torch.Tensor
    query: torch.Tensor
    cos_sin_cache: torch.Tensor
    is_neox: bool


def flat_write(bundled: Callable[[KVWrite], None], name: str) -> Callable[..., None]:
    """`name`, the flat form of `bundled(write)`."""

    def call(
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> None:
        return bundled(KVWrite(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale))

    return _named(call, bundled, name)


def flat_rope_write(bundled: Callable[[Rotary, KVWrite], None], name: str) -> Callable[..., None]:
    """`name`, the flat form of `bundled(rotary, write)` (vLLM's argument order)."""

    def call(
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        is_neox: bool,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> None:
        return bundled(
            Rotary(positions, query, cos_sin_cache, is_neox),
            KVWrite(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale),
        )

    return _named(call, bundled, name)


def _named(call: Callable, bundled: Callable, name: str) -> Callable:
    call.__name__ = call.__qualname__ = name
    call.__module__ = bundled.__module__
    call.__doc__ = bundled.__doc__
    return call
