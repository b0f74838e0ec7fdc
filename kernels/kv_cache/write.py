"""The paged KV write kernel: key/value rows into their cache slots, one launch."""

from __future__ import annotations

import triton
import triton.language as tl

from .fp8 import _inv_scale, _to_e4m3


@triton.jit
def _slot_offsets(
    slot,
    stride_block,
    stride_slot,
    BLOCK_SIZE: tl.constexpr,
    FLAT_SLOTS: tl.constexpr,
):
    """Element offset of cache slot `slot`: block slot // BLOCK_SIZE, offset slot % BLOCK_SIZE.
    FLAT_SLOTS (stride_block == BLOCK_SIZE * stride_slot, vLLM's default layouts): that is
    slot * stride_slot, one multiply on the path from the slot's arrival to the store."""
    if FLAT_SLOTS:
        off = slot * stride_slot
    else:
        off = (slot // BLOCK_SIZE) * stride_block + (slot % BLOCK_SIZE) * stride_slot
    return off


@triton.jit(do_not_specialize=["num_rows"])
def _kv_cache_update_kernel(
    key_ptr,  # [T, Hkv, D] fp16/bf16/fp32, last dim contiguous
    value_ptr,  # [T, Hkv, D] same dtype
    key_cache_ptr,  # [num_blocks, block_size, Hkv, D] key dtype or fp8 e4m3
    value_cache_ptr,  # [num_blocks, block_size, Hkv, D] same dtype as key_cache
    slot_mapping_ptr,  # [N] int32/int64, N <= T; < 0 = padding
    k_scale_ptr,  # [1] fp32 (read only when FP8)
    v_scale_ptr,  # [1] fp32 (read only when FP8)
    num_rows,  # N
    stride_key_tok,
    stride_key_head,
    stride_value_tok,
    stride_value_head,
    stride_kc_block,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_block,
    stride_vc_slot,
    stride_vc_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    ROWS_PER_PROGRAM: tl.constexpr,  # tokens per program (power of two)
    TILE: tl.constexpr,  # (head, dim) elements per program (power of two)
    FP8: tl.constexpr,
    EMULATE_E4M3: tl.constexpr,  # interpreter: round to e4m3 in fp32 before the cast
    OFFSETS_64: tl.constexpr,  # False: every offset fits in int32 (checked on the host)
    FLAT_SLOTS: tl.constexpr,  # both caches have block stride == BLOCK_SIZE * slot stride
    LOAD_EVICTION: tl.constexpr,  # eviction policy of the key/value loads ("" or "evict_first")
):
    """Program (r, c) copies tokens [r*ROWS, (r+1)*ROWS) x flat (head, dim) range [c*TILE, ...).

    Every load is independent of the others and issued first (scales, slots, key, value), so
    they are in flight together: one memory round trip. Only the stores wait for the slot, and
    between its arrival and the store there is one multiply (FLAT_SLOTS, int32 offsets).
    Padding rows are read and not written (no branch, so no second round trip before the data
    loads).
    """
    if FP8:
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
    ROW_ELEMS: tl.constexpr = NUM_KV_HEADS * HEAD_SIZE
    rows = tl.program_id(0) * ROWS_PER_PROGRAM + tl.arange(0, ROWS_PER_PROGRAM)
    row_ok = rows < num_rows
    slot = tl.load(slot_mapping_ptr + rows, mask=row_ok, other=-1)

    # Flat index over (head, dim) of one token; D is a constexpr so // and % are a shift or a
    # multiply-high, and runs of 16 along dim stay contiguous (16-byte accesses).
    cols = tl.program_id(1) * TILE + tl.arange(0, TILE)
    col_ok = cols < ROW_ELEMS
    head = cols // HEAD_SIZE
    dim = cols % HEAD_SIZE
    if OFFSETS_64:
        rows = rows.to(tl.int64)
        head = head.to(tl.int64)
    load_mask = row_ok[:, None] & col_ok[None, :]
    k = tl.load(
        key_ptr + rows[:, None] * stride_key_tok + (head * stride_key_head + dim)[None, :],
        mask=load_mask,
        other=0.0,
        eviction_policy=LOAD_EVICTION,
    )
    v = tl.load(
        value_ptr + rows[:, None] * stride_value_tok + (head * stride_value_head + dim)[None, :],
        mask=load_mask,
        other=0.0,
        eviction_policy=LOAD_EVICTION,
    )

    # Padding is tested on the slot as loaded (int64 -2^32 must not become slot 0 in int32).
    store_mask = (slot >= 0)[:, None] & col_ok[None, :]
    slot = slot.to(tl.int64) if OFFSETS_64 else slot.to(tl.int32)
    k_dst = _slot_offsets(slot, stride_kc_block, stride_kc_slot, BLOCK_SIZE, FLAT_SLOTS)
    v_dst = _slot_offsets(slot, stride_vc_block, stride_vc_slot, BLOCK_SIZE, FLAT_SLOTS)
    k_dst = k_dst[:, None] + (head * stride_kc_head + dim)[None, :]
    v_dst = v_dst[:, None] + (head * stride_vc_head + dim)[None, :]
    if FP8:
        k = _to_e4m3(k, _inv_scale(k_scale), EMULATE_E4M3)
        v = _to_e4m3(v, _inv_scale(v_scale), EMULATE_E4M3)
    tl.store(key_cache_ptr + k_dst, k, mask=store_mask)
    tl.store(value_cache_ptr + v_dst, v, mask=store_mask)
