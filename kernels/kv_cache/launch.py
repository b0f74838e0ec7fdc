"""Host launchers of the write and RoPE + write kernels: addressing, launch configuration."""

from __future__ import annotations

from .._launch import cdiv, launch, next_pow2
from .args import KVWrite, Rotary
from .checks import _interpreting
from .plan import (
    _WRITE_LOAD_EVICTION,
    _cache_strides,
    _flat_slots,
    _needs_int64,
    _offset_bound,
    _rope_num_warps,
    _write_launch_config,
)
from .rope import _rope_kv_cache_update_kernel
from .write import _kv_cache_update_kernel


def _launch_write(
    write: KVWrite,
    fp8: bool,
    *,
    rows_per_program: int | None = None,
    num_warps: int | None = None,
    offsets_64: bool = False,
    flat_slots: bool = True,
    load_eviction: str | None = None,
    emulate_e4m3: bool | None = None,
) -> None:
    """Launch the write on validated arguments. The keyword arguments override the rule (the
    benchmark's sweep and the tests use them; the serving path never passes them):
    `offsets_64=True` / `flat_slots=False` force the general int64 / block-and-offset
    addressing where the rule would pick the short one (never the reverse);
    `emulate_e4m3=True` rounds to e4m3 in fp32 on the GPU too (to time what it costs)."""
    key, value, key_cache, value_cache = write.key, write.value, write.key_cache, write.value_cache
    slot_mapping, k_scale, v_scale = write.slot_mapping, write.k_scale, write.v_scale
    num_rows = slot_mapping.shape[0]
    if num_rows == 0:
        return
    _, num_kv_heads, head_size = key.shape
    row_elems = num_kv_heads * head_size
    rows, tile, warps = _write_launch_config(num_rows, row_elems, rows_per_program)
    grid = (cdiv(num_rows, rows), cdiv(row_elems, tile))
    rows_touched = grid[0] * rows  # masked rows past N still form addresses
    offsets_64 = offsets_64 or _needs_int64(
        _offset_bound(key, rows_touched),
        _offset_bound(value, rows_touched),
        _offset_bound(key_cache),
        _offset_bound(value_cache),
    )
    # Without fp8 the scale pointers are never read; pass any tensor so the signature is fixed.
    k_scale_arg = k_scale if fp8 else slot_mapping
    v_scale_arg = v_scale if fp8 else slot_mapping
    launch(
        _kv_cache_update_kernel,
        grid,
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        k_scale_arg,
        v_scale_arg,
        num_rows,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        *_cache_strides(key_cache),
        *_cache_strides(value_cache),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_SIZE=head_size,
        BLOCK_SIZE=key_cache.shape[1],
        ROWS_PER_PROGRAM=rows,
        TILE=tile,
        FP8=fp8,
        EMULATE_E4M3=fp8 and (_interpreting() if emulate_e4m3 is None else emulate_e4m3),
        OFFSETS_64=offsets_64,
        FLAT_SLOTS=flat_slots and _flat_slots(key_cache, value_cache),
        LOAD_EVICTION=_WRITE_LOAD_EVICTION if load_eviction is None else load_eviction,
        num_warps=num_warps or warps,
    )


def _launch_rope(
    rotary: Rotary,
    write: KVWrite,
    fp8: bool,
    *,
    write_cache: bool = True,
    offsets_64: bool = False,
    flat_slots: bool = True,
) -> None:
    """Launch the fused rotary + write on validated arguments (write_cache=False: rotary only,
    the benchmark's separate-kernel baseline; offsets_64 / flat_slots as for `_launch_write`)."""
    positions, query, cos_sin_cache = rotary.positions, rotary.query, rotary.cos_sin_cache
    key, value, key_cache, value_cache = write.key, write.value, write.key_cache, write.value_cache
    slot_mapping, k_scale, v_scale = write.slot_mapping, write.k_scale, write.v_scale
    num_tokens, num_kv_heads, head_size = key.shape
    if num_tokens == 0:
        return
    num_q_heads = query.shape[1]
    rot_dim = cos_sin_cache.shape[1]
    pass_dims = head_size - rot_dim
    q_heads_p2 = next_pow2(num_q_heads)
    half_rot_p2 = next_pow2(rot_dim // 2)
    offsets_64 = offsets_64 or _needs_int64(
        *(_offset_bound(t) for t in (query, key, value, cos_sin_cache, key_cache, value_cache))
    )
    k_scale_arg = k_scale if fp8 else slot_mapping
    v_scale_arg = v_scale if fp8 else slot_mapping
    launch(
        _rope_kv_cache_update_kernel,
        (num_tokens,),
        positions,
        query,
        key,
        value,
        cos_sin_cache,
        key_cache,
        value_cache,
        slot_mapping,
        k_scale_arg,
        v_scale_arg,
        slot_mapping.shape[0],
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        cos_sin_cache.stride(0),
        *_cache_strides(key_cache),
        *_cache_strides(value_cache),
        NUM_Q_HEADS=num_q_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_SIZE=head_size,
        ROT_DIM=rot_dim,
        IS_NEOX=rotary.is_neox,
        BLOCK_SIZE=key_cache.shape[1],
        FP8=fp8,
        WRITE_CACHE=write_cache,
        Q_HEADS_P2=q_heads_p2,
        KV_HEADS_P2=next_pow2(num_kv_heads),
        HALF_ROT_P2=half_rot_p2,
        PASS_P2=next_pow2(pass_dims) if pass_dims > 0 else 0,
        HEAD_SIZE_P2=next_pow2(head_size),
        EMULATE_E4M3=fp8 and _interpreting(),
        OFFSETS_64=offsets_64,
        FLAT_SLOTS=flat_slots and _flat_slots(key_cache, value_cache),
        num_warps=_rope_num_warps(q_heads_p2, half_rot_p2),
    )
