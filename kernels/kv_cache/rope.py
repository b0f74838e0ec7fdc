"""The fused RoPE + KV write kernel: query and key rotated in place, rotated key and value
written into the cache, one launch."""

from __future__ import annotations

import triton
import triton.language as tl

from .fp8 import _inv_scale, _to_e4m3
from .write import _slot_offsets


@triton.jit
def _load_pairs(
    row,
    h_ok,
    H_P2: tl.constexpr,
    HALF: tl.constexpr,
    HALF_P2: tl.constexpr,
    IS_NEOX: tl.constexpr,
):
    """The rotary pairs (x1, x2), each [H_P2, HALF_P2], of the heads at `row` ([H_P2, 1]
    pointers to each head's dim 0): neox (i, i + HALF); gpt-j (2i, 2i + 1), loaded as one
    contiguous run of 2 * HALF elements (16-byte accesses) and split in registers."""
    i = tl.arange(0, HALF_P2)
    if IS_NEOX:
        mask = h_ok[:, None] & (i < HALF)[None, :]
        x1 = tl.load(row + i[None, :], mask=mask, other=0.0)
        x2 = tl.load(row + HALF + i[None, :], mask=mask, other=0.0)
    else:
        d = tl.arange(0, 2 * HALF_P2)
        x = tl.load(row + d[None, :], mask=h_ok[:, None] & (d < 2 * HALF)[None, :], other=0.0)
        x1, x2 = tl.split(tl.reshape(x, (H_P2, HALF_P2, 2)))
    return x1, x2


@triton.jit
def _store_pairs(
    row,
    x1,
    x2,
    mask_h,
    H_P2: tl.constexpr,
    HALF: tl.constexpr,
    HALF_P2: tl.constexpr,
    IS_NEOX: tl.constexpr,
):
    """Store the pairs `_load_pairs` loads (gpt-j: interleaved in registers, one contiguous
    store); mask_h [H_P2] selects the heads (and tokens) written."""
    i = tl.arange(0, HALF_P2)
    if IS_NEOX:
        mask = mask_h[:, None] & (i < HALF)[None, :]
        tl.store(row + i[None, :], x1, mask=mask)
        tl.store(row + HALF + i[None, :], x2, mask=mask)
    else:
        d = tl.arange(0, 2 * HALF_P2)
        x = tl.reshape(tl.join(x1, x2), (H_P2, 2 * HALF_P2))
        tl.store(row + d[None, :], x, mask=mask_h[:, None] & (d < 2 * HALF)[None, :])


@triton.jit(do_not_specialize=["num_slots"])
def _rope_kv_cache_update_kernel(
    positions_ptr,  # [T] int32/int64
    query_ptr,  # [T, Hq, D] fp16/bf16/fp32, rotated in place
    key_ptr,  # [T, Hkv, D] same dtype, rotated in place
    value_ptr,  # [T, Hkv, D] same dtype
    cos_sin_ptr,  # [max_position, ROT_DIM] fp16/bf16/fp32: cos half, then sin half
    key_cache_ptr,  # [num_blocks, block_size, Hkv, D] key dtype or fp8 e4m3
    value_cache_ptr,  # [num_blocks, block_size, Hkv, D] same dtype as key_cache
    slot_mapping_ptr,  # [N] int32/int64, N <= T; < 0 = padding
    k_scale_ptr,  # [1] fp32 (read only when FP8)
    v_scale_ptr,  # [1] fp32 (read only when FP8)
    num_slots,  # N
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_cos_sin_pos,
    stride_kc_block,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_block,
    stride_vc_slot,
    stride_vc_head,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    ROT_DIM: tl.constexpr,
    IS_NEOX: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    FP8: tl.constexpr,
    WRITE_CACHE: tl.constexpr,  # False: rotary only (the "separate kernels" baseline)
    Q_HEADS_P2: tl.constexpr,
    KV_HEADS_P2: tl.constexpr,
    HALF_ROT_P2: tl.constexpr,
    PASS_P2: tl.constexpr,  # next_power_of_2(HEAD_SIZE - ROT_DIM), 0 without a pass-through
    HEAD_SIZE_P2: tl.constexpr,
    EMULATE_E4M3: tl.constexpr,  # interpreter: round to e4m3 in fp32 before the cast
    OFFSETS_64: tl.constexpr,  # False: every offset fits in int32 (checked on the host)
    FLAT_SLOTS: tl.constexpr,  # both caches have block stride == BLOCK_SIZE * slot stride
):
    """One program per token: rotate its q and k heads, write k and v to the cache.

    Rotation of the pair (x1, x2) at dims (d1, d2) with c = cos[pos, i], s = sin[pos, i]:
        o1 = x1 * c - x2 * s,   o2 = x2 * c + x1 * s      (fp32, rounded once to x's dtype)
    neox pairs d1 = i, d2 = i + ROT_DIM/2; gpt-j pairs d1 = 2i, d2 = 2i + 1; i < ROT_DIM/2.
    The cache receives the key exactly as written back (rounded to its dtype, then quantized
    when the cache is fp8), so the cache and `key` agree as after vLLM's rotary + cache write.
    Every independent load is issued before the cos/sin load, which waits for the position
    (two round trips in all), and every load before the first store: the stores could alias
    the loads as far as the compiler knows, so loads placed after a store would wait for it.
    """
    HALF: tl.constexpr = ROT_DIM // 2
    if FP8 and WRITE_CACHE:
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
    tok = tl.program_id(0)
    pos = tl.load(positions_ptr + tok)
    if WRITE_CACHE:
        slot = tl.load(slot_mapping_ptr + tok, mask=tok < num_slots, other=-1)
    if OFFSETS_64:
        tok = tok.to(tl.int64)

    hq = tl.arange(0, Q_HEADS_P2)
    hq_ok = hq < NUM_Q_HEADS
    hk = tl.arange(0, KV_HEADS_P2)
    hk_ok = hk < NUM_KV_HEADS
    if OFFSETS_64:
        hq = hq.to(tl.int64)
        hk = hk.to(tl.int64)
    q_row = query_ptr + tok * stride_q_tok + hq[:, None] * stride_q_head
    k_row = key_ptr + tok * stride_k_tok + hk[:, None] * stride_k_head
    q1, q2 = _load_pairs(q_row, hq_ok, Q_HEADS_P2, HALF, HALF_ROT_P2, IS_NEOX)
    k1, k2 = _load_pairs(k_row, hk_ok, KV_HEADS_P2, HALF, HALF_ROT_P2, IS_NEOX)
    if WRITE_CACHE:
        dv = tl.arange(0, HEAD_SIZE_P2)
        v_mask = hk_ok[:, None] & (dv < HEAD_SIZE)[None, :]
        v = tl.load(
            value_ptr + tok * stride_v_tok + hk[:, None] * stride_v_head + dv[None, :],
            mask=v_mask,
            other=0.0,
        )
        if PASS_P2 > 0:
            dp = ROT_DIM + tl.arange(0, PASS_P2)
            p_mask = hk_ok[:, None] & (dp < HEAD_SIZE)[None, :]
            k_pass = tl.load(k_row + dp[None, :], mask=p_mask, other=0.0)
    # ptxas would otherwise sink the key/value/slot loads below the cos/sin load (to save
    # registers), which waits for the position: a third serial round trip. Nothing moves a
    # load across a barrier, so they stay in flight while the position arrives.
    tl.debug_barrier()
    i = tl.arange(0, HALF_ROT_P2)
    i_ok = i < HALF
    pos = pos.to(tl.int64) if OFFSETS_64 else pos.to(tl.int32)
    cs_row = cos_sin_ptr + pos * stride_cos_sin_pos
    cos = tl.load(cs_row + i, mask=i_ok, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cs_row + HALF + i, mask=i_ok, other=0.0).to(tl.float32)[None, :]

    q1f = q1.to(tl.float32)
    q2f = q2.to(tl.float32)
    k1f = k1.to(tl.float32)
    k2f = k2.to(tl.float32)
    dtype = q1.dtype
    q1r = (q1f * cos - q2f * sin).to(dtype)
    q2r = (q2f * cos + q1f * sin).to(dtype)
    k1r = (k1f * cos - k2f * sin).to(dtype)
    k2r = (k2f * cos + k1f * sin).to(dtype)
    _store_pairs(q_row, q1r, q2r, hq_ok, Q_HEADS_P2, HALF, HALF_ROT_P2, IS_NEOX)
    _store_pairs(k_row, k1r, k2r, hk_ok, KV_HEADS_P2, HALF, HALF_ROT_P2, IS_NEOX)

    if WRITE_CACHE:
        # Per head, not a scalar: Triton 3.9's interpreter turns a splatted scalar comparison
        # into an int32 mask, which tl.store refuses.
        ok = (hk * 0 + slot) >= 0
        slot = slot.to(tl.int64) if OFFSETS_64 else slot.to(tl.int32)
        kc_off = _slot_offsets(slot, stride_kc_block, stride_kc_slot, BLOCK_SIZE, FLAT_SLOTS)
        vc_off = _slot_offsets(slot, stride_vc_block, stride_vc_slot, BLOCK_SIZE, FLAT_SLOTS)
        kc_row = key_cache_ptr + kc_off + hk[:, None] * stride_kc_head
        vc_row = value_cache_ptr + vc_off + hk[:, None] * stride_vc_head
        if FP8:
            k_inv_scale = _inv_scale(k_scale)
            v_inv_scale = _inv_scale(v_scale)
            k1r = _to_e4m3(k1r, k_inv_scale, EMULATE_E4M3)
            k2r = _to_e4m3(k2r, k_inv_scale, EMULATE_E4M3)
            v = _to_e4m3(v, v_inv_scale, EMULATE_E4M3)
            if PASS_P2 > 0:
                k_pass = _to_e4m3(k_pass, k_inv_scale, EMULATE_E4M3)
        _store_pairs(kc_row, k1r, k2r, hk_ok & ok, KV_HEADS_P2, HALF, HALF_ROT_P2, IS_NEOX)
        if PASS_P2 > 0:
            tl.store(kc_row + dp[None, :], k_pass, mask=p_mask & ok[:, None])
        tl.store(vc_row + dv[None, :], v, mask=v_mask & ok[:, None])
