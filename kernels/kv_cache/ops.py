"""The KV-write entry points: custom ops (with fakes for torch.compile), the checked calls, the
unchecked call vLLM's layers after the first replay, and the start-up warm-up."""

from __future__ import annotations

import torch

from .._checks import FP8_E4M3, check_kernel_device
from .._launch import LaunchCache, use_custom_op
from .checks import _check_rope_args, _check_write_args
from .launch import _launch_rope, _launch_write
from .plan import _WRITE_ROWS_PER_PROGRAM


def kv_cache_update(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write key/value rows into the paged cache: one launch, no host sync, no allocation.

    key:          [T, Hkv, D] fp16/bf16/fp32, any strides but the last (a view of fused QKV)
    value:        [T, Hkv, D] same dtype
    key_cache:    [num_blocks, block_size, Hkv, D] key's dtype or float8_e4m3fn, any strides but
                  the last; block_size in 16/32/64, D in 64/80/96/128/256
    value_cache:  same shape and dtype as key_cache (may be a view of the same tensor)
    slot_mapping: [N] int32/int64 with N <= T: row i goes to slot slot_mapping[i]
                  (block slot // block_size, offset slot % block_size); < 0 writes nothing;
                  rows >= N are ignored; valid slots must be distinct and < num_blocks*block_size
    k_scale, v_scale: [1] (or 0-d) float32, required for an fp8 cache:
                  stored = e4m3(saturate(x * (1 / scale))); ignored otherwise
    """
    if use_custom_op(key):
        _kv_cache_update_op(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
        return
    _kv_cache_update_impl(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)


def _kv_cache_update_impl(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    fp8 = _check_write_args(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    check_kernel_device("key", key)
    _launch_write(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, fp8)


@torch.library.custom_op("fuselane::kv_cache_update", mutates_args=("key_cache", "value_cache"))
def _kv_cache_update_op(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """torch.library form of `kv_cache_update` (what torch.compile records)."""
    _kv_cache_update_impl(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)


def kv_cache_update_unchecked(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """`kv_cache_update` without its argument checks, for eager callers that passed the same
    kind of arguments through `kv_cache_update` once (vLLM's backend, layer by layer).

    A call with the same slot_mapping object, shapes and dtypes as an earlier one replays its
    launch with its own key, value, caches and scales (`WRITE_LAUNCHES`, a `LaunchCache`):
    vLLM's layers after the first of each step."""
    if use_custom_op(key):  # traced: the checked custom-op path
        kv_cache_update(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
        return
    # Everything the launch depends on besides the layer's own tensors (see LaunchCache).
    cache_key = (
        id(slot_mapping), key.shape, key.stride(), key.dtype, value.shape, value.stride(),
        value.dtype, key_cache.shape, key_cache.stride(), value_cache.shape, value_cache.stride(),
        key_cache.dtype, value_cache.dtype, k_scale is None, v_scale is None,
    )  # fmt: skip
    slots = (key, value, key_cache, value_cache, k_scale, v_scale)
    if WRITE_LAUNCHES.replay(cache_key, slots):
        return
    fp8 = key_cache.dtype == FP8_E4M3
    with WRITE_LAUNCHES.record(cache_key, slots, (slot_mapping,)):
        _launch_write(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, fp8)


# The unchecked write's recent launches: vLLM's layers after the first of a step replay the
# first one's (same slot mapping and shapes; their own key, value and caches).
WRITE_LAUNCHES = LaunchCache()


def warm_up_write(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    *,
    key_dtype: torch.dtype,
    slot_dtype: torch.dtype = torch.int64,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> int:
    """Compile (by launching once) every variant of the write kernel a serving run can meet for
    these caches: one launch per row bucket of the launch rule, on padding slots only (nothing
    is written). For a serving engine's start-up, outside any CUDA-graph capture: a variant
    first met mid-serving stalls that step for the compile. Returns the number of launches."""
    _, _, num_kv_heads, head_size = key_cache.shape
    sizes = [1] + [bound + 1 for bound, _ in _WRITE_ROWS_PER_PROGRAM[:-1]]
    for rows in sizes:
        key = torch.zeros(rows, num_kv_heads, head_size, dtype=key_dtype, device=key_cache.device)
        slots = torch.full((rows,), -1, dtype=slot_dtype, device=key_cache.device)
        kv_cache_update(key, key, key_cache, value_cache, slots, k_scale, v_scale)
    return len(sizes)


@_kv_cache_update_op.register_fake
def _kv_cache_update_fake(
    key, value, key_cache, value_cache, slot_mapping, k_scale=None, v_scale=None
):
    _check_write_args(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)


def rope_kv_cache_update(
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
    """Rotate query and key in place (RoPE) and write the rotated key and value into the cache,
    in one launch (vLLM's `do_rope_and_kv_cache_update`).

    positions:     [T] int32/int64, position of each token (row of cos_sin_cache)
    query:         [T, Hq, D] fp16/bf16/fp32, any strides but the last; rotated in place
    key, value:    [T, Hkv, D] same dtype; key rotated in place
    cos_sin_cache: [max_position, rot_dim] fp16/bf16/fp32 (may differ from query's dtype):
                   cos in [:, :rot_dim/2], sin in [:, rot_dim/2:]; rot_dim even, <= D; dims
                   >= rot_dim of each head are left as they are (partial rotary)
    is_neox:       True rotates the halves (i, i + rot_dim/2), False the pairs (2i, 2i+1) (gpt-j)
    key_cache, value_cache, slot_mapping, k_scale, v_scale: as for `kv_cache_update`; all T
                   rows of q and k are rotated, the first N = len(slot_mapping) are written.
    Math: fp32, rounded once to the input dtype; the cache gets the key as written back.
    """
    args = (positions, query, key, value, cos_sin_cache, is_neox, key_cache, value_cache,
            slot_mapping, k_scale, v_scale)  # fmt: skip
    if use_custom_op(key):
        _rope_kv_cache_update_op(*args)
    else:  # as kv_cache_update: no custom-op dispatch on eager calls
        _rope_kv_cache_update_impl(*args)


def _rope_kv_cache_update_impl(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    fp8 = _check_write_args(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    _check_rope_args(positions, query, key, cos_sin_cache, is_neox)
    check_kernel_device("key", key)
    _launch_rope(
        positions, query, key, value, cos_sin_cache, is_neox,
        key_cache, value_cache, slot_mapping, k_scale, v_scale, fp8,
    )  # fmt: skip


@torch.library.custom_op(
    "fuselane::rope_kv_cache_update", mutates_args=("query", "key", "key_cache", "value_cache")
)
def _rope_kv_cache_update_op(
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
    """torch.library form of `rope_kv_cache_update` (what torch.compile records)."""
    _rope_kv_cache_update_impl(
        positions, query, key, value, cos_sin_cache, is_neox, key_cache, value_cache,
        slot_mapping, k_scale, v_scale,
    )  # fmt: skip


@_rope_kv_cache_update_op.register_fake
def _rope_kv_cache_update_fake(
    positions, query, key, value, cos_sin_cache, is_neox, key_cache, value_cache, slot_mapping,
    k_scale=None, v_scale=None,
):  # fmt: skip
    _check_write_args(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    _check_rope_args(positions, query, key, cos_sin_cache, is_neox)
