"""The KV-write entry points: custom ops (with fakes for torch.compile), the checked calls, the
unchecked call vLLM's layers after the first replay, and the start-up warm-up. Each comes in
the bundled form (`kv_write(write)`, `rope_kv_write(rotary, write)`) and the flat form users
and vLLM's call sites know (`kv_cache_update`, `rope_kv_cache_update`, `args.flat_write`)."""

from __future__ import annotations

import torch

from .. import index_checks
from .._checks import FP8_E4M3, check_kernel_device
from .._launch import LaunchCache, use_custom_op
from .args import KVWrite, Rotary, flat_rope_write, flat_write
from .checks import _check_rope_args, _check_write_args
from .launch import _launch_rope, _launch_write
from .plan import _WRITE_ROWS_PER_PROGRAM


def _checked_write(write: KVWrite) -> None:
    fp8 = _check_write_args(write)
    check_kernel_device("key", write.key)
    _check_indices(write)
    _launch_write(write, fp8)


def _check_indices(write: KVWrite, rotary: Rotary | None = None) -> None:
    if index_checks.enabled():  # FUSELANE_CHECK_INDICES: the device-side indices, synced
        index_checks.check_slots(write.slot_mapping, write.key_cache)
        if write.fp8:
            index_checks.check_scales(write.k_scale, write.v_scale)
        if rotary is not None:
            index_checks.check_positions(rotary.positions, rotary.cos_sin_cache)


# torch.library form of `kv_write` (what torch.compile records): the flat form, `KVWrite.fields`.
_kv_cache_update_op = torch.library.custom_op(
    "fuselane::kv_cache_update", mutates_args=("key_cache", "value_cache")
)(flat_write(_checked_write, "kv_cache_update_op"))


def _check_write_only(write: KVWrite) -> None:
    _check_write_args(write)


_kv_cache_update_op.register_fake(flat_write(_check_write_only, "kv_cache_update_fake"))


def kv_write(write: KVWrite) -> None:
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
    (the fields of `write`, a `KVWrite`; the flat form `kv_cache_update` takes them in order)
    """
    if use_custom_op(write.key):
        _kv_cache_update_op(*write.fields())
        return
    _checked_write(write)


def kv_write_unchecked(write: KVWrite) -> None:
    """`kv_write` without its argument checks, for eager callers that passed the same kind of
    arguments through `kv_write` once (vLLM's backend, layer by layer).

    A call with the same slot_mapping object, shapes and dtypes as an earlier one replays its
    launch with its own key, value, caches and scales (`WRITE_LAUNCHES`, a `LaunchCache`):
    vLLM's layers after the first of each step."""
    if use_custom_op(write.key):  # traced: the checked custom-op path
        kv_write(write)
        return
    _check_indices(write)
    w = write
    key, value, key_cache, value_cache = w.key, w.value, w.key_cache, w.value_cache
    # Everything the launch depends on besides the layer's own tensors (see LaunchCache).
    cache_key = (
        id(w.slot_mapping), key.shape, key.stride(), key.dtype, value.shape, value.stride(),
        value.dtype, key_cache.shape, key_cache.stride(), value_cache.shape, value_cache.stride(),
        key_cache.dtype, value_cache.dtype, w.k_scale is None, w.v_scale is None,
    )  # fmt: skip
    slots = (key, value, key_cache, value_cache, w.k_scale, w.v_scale)
    if WRITE_LAUNCHES.replay(cache_key, slots):
        return
    with WRITE_LAUNCHES.record(cache_key, slots, (w.slot_mapping,)):
        _launch_write(write, key_cache.dtype == FP8_E4M3)


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
        kv_write(KVWrite(key, key, key_cache, value_cache, slots, k_scale, v_scale))
    return len(sizes)


def _op_arguments(rotary: Rotary, write: KVWrite) -> tuple:
    """The rope op's arguments, in vLLM's order."""
    r, w = rotary, write
    return (r.positions, r.query, w.key, w.value, r.cos_sin_cache, r.is_neox, *w.fields()[2:])


def _checked_rope_write(rotary: Rotary, write: KVWrite) -> None:
    fp8 = _check_write_args(write)
    _check_rope_args(rotary, write)
    check_kernel_device("key", write.key)
    _check_indices(write, rotary)
    _launch_rope(rotary, write, fp8)


# torch.library form of `rope_kv_write` (what torch.compile records): the flat form, vLLM's
# argument order (`_op_arguments`).
_rope_kv_cache_update_op = torch.library.custom_op(
    "fuselane::rope_kv_cache_update", mutates_args=("query", "key", "key_cache", "value_cache")
)(flat_rope_write(_checked_rope_write, "rope_kv_cache_update_op"))


def _check_rope_write_only(rotary: Rotary, write: KVWrite) -> None:
    _check_write_args(write)
    _check_rope_args(rotary, write)


_rope_kv_cache_update_op.register_fake(
    flat_rope_write(_check_rope_write_only, "rope_kv_cache_update_fake")
)


def rope_kv_write(rotary: Rotary, write: KVWrite) -> None:
    """Rotate query and key in place (RoPE) and write the rotated key and value into the cache,
    in one launch (vLLM's `do_rope_and_kv_cache_update`).

    positions:     [T] int32/int64, position of each token (row of cos_sin_cache)
    query:         [T, Hq, D] fp16/bf16/fp32, any strides but the last; rotated in place
    key, value:    [T, Hkv, D] same dtype; key rotated in place
    cos_sin_cache: [max_position, rot_dim] fp16/bf16/fp32 (may differ from query's dtype):
                   cos in [:, :rot_dim/2], sin in [:, rot_dim/2:]; rot_dim even, <= D; dims
                   >= rot_dim of each head are left as they are (partial rotary)
    is_neox:       True rotates the halves (i, i + rot_dim/2), False the pairs (2i, 2i+1) (gpt-j)
    key_cache, value_cache, slot_mapping, k_scale, v_scale: as for `kv_write`; all T rows of q
                   and k are rotated, the first N = len(slot_mapping) are written.
    (`rotary` holds positions, query, cos_sin_cache, is_neox; `write` the rest. The flat form
    `rope_kv_cache_update` takes them in vLLM's order.)
    Math: fp32, rounded once to the input dtype; the cache gets the key as written back.
    """
    if use_custom_op(write.key):
        _rope_kv_cache_update_op(*_op_arguments(rotary, write))
    else:  # as kv_write: no custom-op dispatch on eager calls
        _checked_rope_write(rotary, write)


kv_cache_update = flat_write(kv_write, "kv_cache_update")
kv_cache_update_unchecked = flat_write(kv_write_unchecked, "kv_cache_update_unchecked")
rope_kv_cache_update = flat_rope_write(rope_kv_write, "rope_kv_cache_update")
