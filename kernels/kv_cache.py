"""KV-cache update: write new key/value rows into vLLM's paged cache in one launch.

Two operations, each with a torch reference beside it that defines its meaning:

- `kv_cache_update`: vLLM's `do_kv_cache_update` (what `triton_reshape_and_cache_flash` does for
  the flash/Triton layout): row `i < len(slot_mapping)` of key/value goes to cache slot
  `slot_mapping[i]`, i.e. block `slot // block_size`, offset `slot % block_size`; a negative slot
  is a padding token and writes nothing. Key rows past `len(slot_mapping)` are ignored (vLLM's
  V1 runner pads key for CUDA graphs and passes the unpadded slot mapping).
- `rope_kv_cache_update`: vLLM's `do_rope_and_kv_cache_update` hook: rotate query and key in
  place with the rotary embedding (neox or gpt-j pairs, `cos_sin_cache[pos] = [cos | sin]`,
  partial rotary leaves the tail of each head as it is), then write the rotated key and the
  value into the cache, all in one launch.

Cache layout, as vLLM's flash/Triton backends see it: key_cache and value_cache are each
`[num_blocks, block_size, num_kv_heads, head_size]`, any strides but the last (vLLM passes
`kv_cache.transpose(1, 2).split(head_size, dim=-1)` views of one tensor, so K and V of one head
interleave in memory, and the block/head strides depend on the KV-cache layout it picked).

Cache dtypes: the input dtype (fp16, bf16, fp32), or fp8 e4m3 with per-tensor fp32 scales:
`stored = e4m3(saturate(x * (1 / scale), +-448))`, round to nearest even: vLLM's kernel computes
x / scale, which differs by at most one fp32 ulp before the rounding to e4m3.

Launch rule (no autotuning): `_write_launch_config` (tokens per program and warps, from the H200
sweep of run 1; benchmarks/kernels/bench_kv_cache.py's `kv_write_sweep` section re-measures it)
and `_rope_num_warps`. Addressing is picked on the host from shapes and strides alone: int32
offsets unless some offset could pass 2^31 (then int64), and slot * slot_stride where the block
stride is block_size * slot_stride (else block and offset); see `_launch_write`.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from ._checks import FP8_E4M3, FP8_E4M3_MAX, check_choice, check_kernel_device, check_tensor
from ._launch import LaunchCache, cdiv, launch, next_pow2, use_custom_op

SUPPORTED_HEAD_SIZES = (64, 80, 96, 128, 256)
SUPPORTED_BLOCK_SIZES = (16, 32, 64)
INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)

_E4M3_MAX = tl.constexpr(FP8_E4M3_MAX)
# e4m3 has 3 mantissa bits and its smallest normal exponent is -6: below 2^-6 the spacing stays
# 2^-9 (subnormals). In fp32 bits: exponent field of 2^-6, and the shift that makes an fp32
# sum's last mantissa bit (2^-23 relative) worth 2^-3 relative: 23 - 3 = 20.
_F32_EXP_MASK = tl.constexpr(0x7F800000)
_F32_SIGN_BIT = tl.constexpr(-2147483648)  # 0x80000000 as an int32
_E4M3_MIN_NORMAL_EXP_BITS = tl.constexpr((127 - 6) << 23)
_E4M3_SPACING_SHIFT = tl.constexpr(20 << 23)


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _round_to_e4m3_grid(y):
    """Round fp32 `y` (|y| <= 448) to the nearest e4m3 value, ties to even; result still fp32.

    Interpreter only (see `_to_e4m3`): the fp32 -> fp8 cast after this only drops zero bits, so
    Triton's interpreter (whose own cast rounds ties up and can lose the carry into the
    exponent) stores the byte the GPU's cvt.rn.satfinite stores. ~8 integer/float ops/element.
    Formula: with 2^e the power of two of |y| (at least 2^-6), c = 2^(e+20) makes the last
    mantissa bit of the fp32 sum |y| + c worth 2^(e-3), e4m3's spacing at exponent e; fp32
    addition rounds to nearest even and subtracting c again is exact. The sign is copied back
    bitwise so that -0.0 stays -0.0 (torch stores 0x80 for it).
    """
    bits = y.to(tl.int32, bitcast=True)
    a = tl.abs(y)
    exp_bits = tl.maximum(a.to(tl.int32, bitcast=True) & _F32_EXP_MASK, _E4M3_MIN_NORMAL_EXP_BITS)
    c = (exp_bits + _E4M3_SPACING_SHIFT).to(tl.float32, bitcast=True)
    r = (a + c) - c
    return (r.to(tl.int32, bitcast=True) | (bits & _F32_SIGN_BIT)).to(tl.float32, bitcast=True)


@triton.jit
def _to_e4m3(x, inv_scale, EMULATE: tl.constexpr):
    """e4m3(saturate(x * inv_scale, +-448)), ties to even, as float8e4nv; inv_scale = 1 / scale.

    GPU (EMULATE=False): one fp32 multiply, then the native cast, which Triton lowers to
    cvt.rn.satfinite.e4m3x2.f32 (SASS `F2FP.SATFINITE.E4M3.F32.PACK_AB`, two elements per
    instruction: round to nearest even, +-inf and |y| > 448 saturate to +-448, NaN stays NaN):
    the saturation is the cast's own, so no clamp is needed. Interpreter (EMULATE=True): Triton
    3.6's interpreter casts with ties rounded up and can lose the carry into the exponent
    (124.3 -> 64), so y is clamped and rounded to the e4m3 grid in fp32 first.
    """
    y = x.to(tl.float32) * inv_scale
    if EMULATE:
        y = tl.maximum(y, -_E4M3_MAX, propagate_nan=tl.PropagateNan.ALL)
        y = tl.minimum(y, _E4M3_MAX, propagate_nan=tl.PropagateNan.ALL)
        y = _round_to_e4m3_grid(y)
    return y.to(tl.float8e4nv)


@triton.jit
def _inv_scale(scale):
    """1 / scale (fp32), IEEE-rounded, once per program: the per-element work is then one
    multiply instead of a ~15-instruction IEEE division. x * (1/scale) is within one fp32 ulp of
    x / scale (what vLLM computes, itself with an approximate division), far below e4m3's
    2^-4 rounding step; the reference computes the same product, so the bytes match exactly.
    The division has a slow-path subroutine call the compiler does not move loads across, so
    every load of the program is issued before it (the scales first of all)."""
    return tl.math.div_rn(1.0, scale.to(tl.float32))


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


# ----------------------------------------------------------------------------------------------
# Launch rules (no autotuning: it would re-run at every process start and delay the first request)
# ----------------------------------------------------------------------------------------------

# Tokens per program for the plain write, keyed by the number of rows N (first bound >= N wins).
# Measured on an H200 (fuselane run 1, 2026-11-21; bench_kv_cache.py's kv_write_sweep: CUDA-graph
# replay, median of 50 replays of 20 calls; Hkv=8, D=128, page 16, bf16; docs/tuning/kv_cache.md):
#   1 token      1 or 2 tokens/program at 2-8 warps: 1.38-1.57 us, the rule's setting 1.33 us and
#                1.42 us in two sections of the same run (noise ~0.09 us) -> 1 token, 4 warps
#   256 tokens   1-4 tokens/program 1.82-1.96 us; 8 or 16: 2.26-3.23 us -> 1
#   4096 tokens  8 tokens x 8 warps 5.78 us best (2 x 4, the old rule, 5.87; 16 x 8 5.82) -> 8
#   32768 tokens every setting 68.3-71.4 us, within noise; 8 x 8 69.0 -> 8
# Between 512 and 4096 nothing was measured yet; the sweep now also times 1024 and 2048 tokens.
_WRITE_ROWS_PER_PROGRAM: tuple[tuple[int, int], ...] = (
    (512, 1),
    (2048, 2),
    (1 << 62, 8),
)
# Elements of K (and as many of V) one program moves per tensor: bounds the registers (8192 bf16
# elements over 256 threads is 32 per thread per tensor) for large Hkv * D.
_WRITE_MAX_TILE_ELEMS = 8192
# Warps: one 16-byte access per thread per tensor per row needs ROWS * TILE / 8 threads; 4 warps
# cover a 2048-element program (e.g. 2 tokens of Hkv=8, D=128), 8 warps anything larger (the
# measured best at 4096 tokens, 8 tokens x 8 warps).
_WRITE_WARPS_SMALL, _WRITE_WARPS_LARGE, _WRITE_WARPS_THRESHOLD = 4, 8, 2048
# Key/value loads: read once, so they may be evicted first; cache stores keep the default policy
# (the attention kernel reads the new rows right after). "" = default. Unmeasured: the sweep
# times both at every size.
_WRITE_LOAD_EVICTION = ""


def _write_launch_config(
    num_rows: int, row_elems: int, rows_per_program: int | None = None
) -> tuple[int, int, int]:
    """(rows per program, tile, warps) for the plain write; see the tables above."""
    if rows_per_program is None:
        rows_per_program = next(r for bound, r in _WRITE_ROWS_PER_PROGRAM if num_rows <= bound)
    tile = min(next_pow2(row_elems), max(16, _WRITE_MAX_TILE_ELEMS // rows_per_program))
    warps = (
        _WRITE_WARPS_SMALL
        if rows_per_program * tile <= _WRITE_WARPS_THRESHOLD
        else _WRITE_WARPS_LARGE
    )
    return rows_per_program, tile, warps


def _rope_num_warps(q_heads_p2: int, half_rot_p2: int) -> int:
    """4 warps while each q half-tile is <= 2048 elements (Hq=32, rot=128), else 8. Not yet
    measured on GPU."""
    return 4 if q_heads_p2 * half_rot_p2 <= 2048 else 8


# ----------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _check_scale(name: str, scale: object, device: torch.device) -> None:
    check_tensor(name, scale, dtypes=(torch.float32,), device=device)
    if scale.numel() != 1:
        raise ValueError(
            f"{name}: expected one element (a per-tensor scale), got shape {list(scale.shape)}"
        )


def _check_write_args(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> bool:
    """Validate the write's arguments (shapes, dtypes, devices, strides); True if the cache is fp8.

    Reads no device memory: slot values (range, uniqueness) are the caller's contract.
    """
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


def _check_kernel_device(key: torch.Tensor) -> None:
    """The kernel needs CUDA tensors unless Triton's interpreter runs it (CPU tensors then)."""
    if not _interpreting() and key.device.type != "cuda":
        raise ValueError(f"key: expected a CUDA tensor, got device {key.device}")


def _check_rope_args(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: object,
) -> int:
    """Validate the rotary part of the fused call (key itself is checked by _check_write_args);
    returns rot_dim."""
    num_tokens, _, head_size = key.shape
    device = key.device
    check_tensor(
        "query",
        query,
        shape=(num_tokens, None, head_size),
        dtypes=(key.dtype,),
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


def _cache_strides(cache: torch.Tensor) -> tuple[int, int, int]:
    return cache.stride(0), cache.stride(1), cache.stride(2)


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------

_INT32_MAX = 2**31 - 1


def _offset_bound(t: torch.Tensor, rows: int | None = None) -> int:
    """An upper bound of |element offset| the kernels form from t's first element: `rows` rows
    along dim 0 (default t's own), every other dim padded to twice its size (the power-of-two
    tiles' masked lanes: next_power_of_2(n) < 2n). Valid slots and positions are the caller's
    contract (< num_blocks * block_size, < max_position), so they stay inside these bounds."""
    shape = t.shape
    return _shape_offset_bound(shape, t.stride(), shape[0] if rows is None else rows)


@functools.lru_cache(maxsize=4096)
def _shape_offset_bound(shape: tuple[int, ...], stride: tuple[int, ...], rows: int) -> int:
    # Memoized: every layer of every step asks about the same few shapes (host time per
    # launch is step time on vLLM's eager path).
    bound = max(max(rows, shape[0]) - 1, 0) * abs(stride[0])
    return bound + sum((2 * n - 1) * abs(st) for n, st in zip(shape[1:], stride[1:], strict=True))


def _needs_int64(*bounds: int) -> bool:
    """True unless every offset bound fits in int32 (then the kernels compute offsets in int32:
    ~40% fewer instructions in the write kernel, and one multiply from slot to store)."""
    return max(bounds) > _INT32_MAX


def _flat_slots(key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """Block stride == block_size * slot stride in both caches (vLLM's default NHD layouts, not
    HND or cross-layer ones): slot * slot_stride addresses the slot without a division."""
    return all(
        c.shape[0] <= 1 or c.stride(0) == c.shape[1] * c.stride(1) for c in (key_cache, value_cache)
    )


def _launch_write(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
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
    fp8: bool,
    *,
    write_cache: bool = True,
    offsets_64: bool = False,
    flat_slots: bool = True,
) -> None:
    """Launch the fused rotary + write on validated arguments (write_cache=False: rotary only,
    the benchmark's separate-kernel baseline; offsets_64 / flat_slots as for `_launch_write`)."""
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
        IS_NEOX=is_neox,
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
    _check_kernel_device(key)
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
    _check_kernel_device(key)
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


# ----------------------------------------------------------------------------------------------
# References (plain torch; they define the semantics the kernels must match)
# ----------------------------------------------------------------------------------------------


def quantize_e4m3_reference(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3(saturate(x * (1 / scale))), round to nearest even: x any float dtype, scale one fp32
    element -> float8_e4m3fn. (vLLM divides; the two differ by at most one fp32 ulp before the
    rounding to e4m3's 3 mantissa bits.)"""
    y = x.float() * torch.reciprocal(scale.reshape(()).float())
    return y.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_E4M3)


def kv_cache_update_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Reference for `kv_cache_update` (same arguments, same validation); syncs with the device."""
    fp8 = _check_write_args(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
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
        k = quantize_e4m3_reference(k, k_scale).view(torch.uint8)
        v = quantize_e4m3_reference(v, v_scale).view(torch.uint8)
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


def rope_kv_cache_update_reference(
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
    """Reference for `rope_kv_cache_update`: rotate q and k in place, then the plain write."""
    _check_write_args(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    _check_rope_args(positions, query, key, cos_sin_cache, is_neox)
    query.copy_(rotary_reference(positions, query, cos_sin_cache, is_neox))
    key.copy_(rotary_reference(positions, key, cos_sin_cache, is_neox))
    kv_cache_update_reference(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
