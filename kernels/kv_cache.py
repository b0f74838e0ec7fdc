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

Launch rule (no autotuning): see `_write_launch_config` and `_rope_num_warps`; not yet measured
on a GPU (benchmarks/kernels/bench_kv_cache.py sweeps the alternatives in its `kv_write_sweep`
section, which is where the table gets its numbers).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ._checks import FP8_E4M3, FP8_E4M3_MAX, check_choice, check_tensor

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

    The fp32 -> fp8 cast after this only drops zero bits, so the stored byte is the same on the
    GPU (cvt.rn.satfinite) and in Triton's interpreter (whose own cast rounds ties up and can
    lose the carry into the exponent). Cost: ~8 integer/float ops per element.
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
def _quantize_e4m3(x, inv_scale):
    """e4m3 value of saturate(x * inv_scale) as fp32; inv_scale = 1 / scale (see _inv_scale)."""
    y = x.to(tl.float32) * inv_scale
    y = tl.maximum(y, -_E4M3_MAX, propagate_nan=tl.PropagateNan.ALL)
    y = tl.minimum(y, _E4M3_MAX, propagate_nan=tl.PropagateNan.ALL)
    return _round_to_e4m3_grid(y)


@triton.jit
def _inv_scale(scale_ptr):
    """1 / scale, IEEE-rounded, once per program: the per-element work is then one multiply
    instead of a ~15-instruction IEEE division. x * (1/scale) is within one fp32 ulp of
    x / scale (what vLLM computes, itself with an approximate division), far below e4m3's
    2^-4 rounding step; the reference computes the same product, so the bytes match exactly."""
    return tl.math.div_rn(1.0, tl.load(scale_ptr).to(tl.float32))


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
):
    """Program (r, c) copies tokens [r*ROWS, (r+1)*ROWS) x flat (head, dim) range [c*TILE, ...).

    The slot, key and value loads do not depend on each other, so they are in flight together;
    only the stores wait for the slot. Padding rows are read and not written (no branch, so no
    second round trip to memory before the data loads).
    """
    ROW_ELEMS: tl.constexpr = NUM_KV_HEADS * HEAD_SIZE
    rows = tl.program_id(0) * ROWS_PER_PROGRAM + tl.arange(0, ROWS_PER_PROGRAM)
    row_ok = rows < num_rows
    slot = tl.load(slot_mapping_ptr + rows, mask=row_ok, other=-1).to(tl.int64)

    # Flat index over (head, dim) of one token; D is a constexpr so // and % are a shift or a
    # multiply-high, and runs of 16 along dim stay contiguous (16-byte accesses).
    cols = tl.program_id(1) * TILE + tl.arange(0, TILE)
    col_ok = cols < ROW_ELEMS
    head = (cols // HEAD_SIZE).to(tl.int64)
    dim = cols % HEAD_SIZE
    rows64 = rows.to(tl.int64)
    load_mask = row_ok[:, None] & col_ok[None, :]

    k = tl.load(
        key_ptr + rows64[:, None] * stride_key_tok + (head * stride_key_head + dim)[None, :],
        mask=load_mask,
        other=0.0,
    )
    v = tl.load(
        value_ptr + rows64[:, None] * stride_value_tok + (head * stride_value_head + dim)[None, :],
        mask=load_mask,
        other=0.0,
    )

    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    store_mask = (slot >= 0)[:, None] & col_ok[None, :]
    k_dst = (block * stride_kc_block + offset * stride_kc_slot)[:, None] + (
        head * stride_kc_head + dim
    )[None, :]
    v_dst = (block * stride_vc_block + offset * stride_vc_slot)[:, None] + (
        head * stride_vc_head + dim
    )[None, :]
    if FP8:
        k_inv_scale = _inv_scale(k_scale_ptr)
        v_inv_scale = _inv_scale(v_scale_ptr)
        k = _quantize_e4m3(k, k_inv_scale).to(key_cache_ptr.dtype.element_ty)
        v = _quantize_e4m3(v, v_inv_scale).to(value_cache_ptr.dtype.element_ty)
    tl.store(key_cache_ptr + k_dst, k, mask=store_mask)
    tl.store(value_cache_ptr + v_dst, v, mask=store_mask)


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
):
    """One program per token: rotate its q and k heads, write k and v to the cache.

    Rotation of the pair (x1, x2) at dims (d1, d2) with c = cos[pos, i], s = sin[pos, i]:
        o1 = x1 * c - x2 * s,   o2 = x2 * c + x1 * s      (fp32, rounded once to x's dtype)
    neox pairs d1 = i, d2 = i + ROT_DIM/2; gpt-j pairs d1 = 2i, d2 = 2i + 1; i < ROT_DIM/2.
    The cache receives the key exactly as written back (rounded to its dtype, then quantized
    when the cache is fp8), so the cache and `key` agree as after vLLM's rotary + cache write.
    Every load is issued before the first store: the stores could alias the loads as far as the
    compiler knows, so loads placed after a store would wait for it.
    """
    HALF: tl.constexpr = ROT_DIM // 2
    tok = tl.program_id(0)
    tok64 = tok.to(tl.int64)
    pos = tl.load(positions_ptr + tok).to(tl.int64)

    i = tl.arange(0, HALF_ROT_P2)
    i_ok = i < HALF
    if IS_NEOX:
        d1 = i
        d2 = i + HALF
    else:
        d1 = 2 * i
        d2 = 2 * i + 1

    hq = tl.arange(0, Q_HEADS_P2).to(tl.int64)
    q_mask = (hq < NUM_Q_HEADS)[:, None] & i_ok[None, :]
    q_row = query_ptr + tok64 * stride_q_tok + hq[:, None] * stride_q_head
    hk = tl.arange(0, KV_HEADS_P2).to(tl.int64)
    hk_ok = hk < NUM_KV_HEADS
    k_mask = hk_ok[:, None] & i_ok[None, :]
    k_row = key_ptr + tok64 * stride_k_tok + hk[:, None] * stride_k_head

    q1 = tl.load(q_row + d1[None, :], mask=q_mask, other=0.0)
    q2 = tl.load(q_row + d2[None, :], mask=q_mask, other=0.0)
    k1 = tl.load(k_row + d1[None, :], mask=k_mask, other=0.0)
    k2 = tl.load(k_row + d2[None, :], mask=k_mask, other=0.0)
    cs_row = cos_sin_ptr + pos * stride_cos_sin_pos
    cos = tl.load(cs_row + i, mask=i_ok, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cs_row + HALF + i, mask=i_ok, other=0.0).to(tl.float32)[None, :]
    if WRITE_CACHE:
        slot = tl.load(slot_mapping_ptr + tok, mask=tok < num_slots, other=-1).to(tl.int64)
        dv = tl.arange(0, HEAD_SIZE_P2)
        v_mask = hk_ok[:, None] & (dv < HEAD_SIZE)[None, :]
        v = tl.load(
            value_ptr + tok64 * stride_v_tok + hk[:, None] * stride_v_head + dv[None, :],
            mask=v_mask,
            other=0.0,
        )
        if PASS_P2 > 0:
            dp = ROT_DIM + tl.arange(0, PASS_P2)
            p_mask = hk_ok[:, None] & (dp < HEAD_SIZE)[None, :]
            k_pass = tl.load(k_row + dp[None, :], mask=p_mask, other=0.0)
        if FP8:
            k_inv_scale = _inv_scale(k_scale_ptr)
            v_inv_scale = _inv_scale(v_scale_ptr)

    q1f = q1.to(tl.float32)
    q2f = q2.to(tl.float32)
    k1f = k1.to(tl.float32)
    k2f = k2.to(tl.float32)
    dtype = q1.dtype
    tl.store(q_row + d1[None, :], (q1f * cos - q2f * sin).to(dtype), mask=q_mask)
    tl.store(q_row + d2[None, :], (q2f * cos + q1f * sin).to(dtype), mask=q_mask)
    k1r = (k1f * cos - k2f * sin).to(dtype)
    k2r = (k2f * cos + k1f * sin).to(dtype)
    tl.store(k_row + d1[None, :], k1r, mask=k_mask)
    tl.store(k_row + d2[None, :], k2r, mask=k_mask)

    if WRITE_CACHE:
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        ok = slot >= 0
        kc_row = (
            key_cache_ptr
            + block * stride_kc_block
            + offset * stride_kc_slot
            + hk[:, None] * stride_kc_head
        )
        vc_row = (
            value_cache_ptr
            + block * stride_vc_block
            + offset * stride_vc_slot
            + hk[:, None] * stride_vc_head
        )
        if FP8:
            cache_ty = key_cache_ptr.dtype.element_ty
            tl.store(
                kc_row + d1[None, :],
                _quantize_e4m3(k1r, k_inv_scale).to(cache_ty),
                mask=k_mask & ok,
            )
            tl.store(
                kc_row + d2[None, :],
                _quantize_e4m3(k2r, k_inv_scale).to(cache_ty),
                mask=k_mask & ok,
            )
            if PASS_P2 > 0:
                k_pass_q = _quantize_e4m3(k_pass, k_inv_scale).to(cache_ty)
                tl.store(kc_row + dp[None, :], k_pass_q, mask=p_mask & ok)
            tl.store(
                vc_row + dv[None, :], _quantize_e4m3(v, v_inv_scale).to(cache_ty), mask=v_mask & ok
            )
        else:
            tl.store(kc_row + d1[None, :], k1r, mask=k_mask & ok)
            tl.store(kc_row + d2[None, :], k2r, mask=k_mask & ok)
            if PASS_P2 > 0:
                tl.store(kc_row + dp[None, :], k_pass, mask=p_mask & ok)
            tl.store(vc_row + dv[None, :], v, mask=v_mask & ok)


# ----------------------------------------------------------------------------------------------
# Launch rules (no autotuning: a process start must not re-tune, see DESIGN.md habit 5)
# ----------------------------------------------------------------------------------------------

# Tokens per program for the plain write, keyed by the number of rows N (first bound >= N wins).
# Small N is launch-bound: one token per program keeps each program's latency minimal and uses
# every SM; large N is bandwidth-bound: several tokens per program amortize the per-program
# index math and scheduling. Not yet measured on GPU (the bench's kv_write_sweep section times
# 1/2/4/8/16 tokens per program x 2/4/8 warps at 1..32768 tokens on Hkv=8, D=128, bf16).
_WRITE_ROWS_PER_PROGRAM: tuple[tuple[int, int], ...] = (
    (512, 1),
    (4096, 2),
    (16384, 4),
    (1 << 62, 8),
)
# Elements of K (and as many of V) one program moves per tensor: bounds the registers (8192 bf16
# elements over 256 threads is 32 per thread per tensor) for large Hkv * D.
_WRITE_MAX_TILE_ELEMS = 8192
# Warps: one 16-byte access per thread per tensor per row needs ROWS * TILE / 8 threads; 4 warps
# cover a 1024-element tile (Hkv=8, D=128), 8 warps anything larger.
_WRITE_WARPS_SMALL, _WRITE_WARPS_LARGE, _WRITE_WARPS_THRESHOLD = 4, 8, 2048


def _write_launch_config(
    num_rows: int, row_elems: int, rows_per_program: int | None = None
) -> tuple[int, int, int]:
    """(rows per program, tile, warps) for the plain write; see the tables above."""
    if rows_per_program is None:
        rows_per_program = next(r for bound, r in _WRITE_ROWS_PER_PROGRAM if num_rows <= bound)
    tile = min(
        triton.next_power_of_2(row_elems), max(16, _WRITE_MAX_TILE_ELEMS // rows_per_program)
    )
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
) -> None:
    """Launch the write on validated arguments. `rows_per_program`/`num_warps` override the rule
    (the benchmark's sweep uses them); the serving path never passes them."""
    num_rows = slot_mapping.shape[0]
    if num_rows == 0:
        return
    _, num_kv_heads, head_size = key.shape
    row_elems = num_kv_heads * head_size
    rows, tile, warps = _write_launch_config(num_rows, row_elems, rows_per_program)
    grid = (triton.cdiv(num_rows, rows), triton.cdiv(row_elems, tile))
    # Without fp8 the scale pointers are never read; pass any tensor so the signature is fixed.
    k_scale_arg = k_scale if fp8 else slot_mapping
    v_scale_arg = v_scale if fp8 else slot_mapping
    _kv_cache_update_kernel[grid](
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
) -> None:
    """Launch the fused rotary + write on validated arguments (write_cache=False: rotary only,
    the benchmark's separate-kernel baseline)."""
    num_tokens, num_kv_heads, head_size = key.shape
    if num_tokens == 0:
        return
    num_q_heads = query.shape[1]
    rot_dim = cos_sin_cache.shape[1]
    pass_dims = head_size - rot_dim
    q_heads_p2 = triton.next_power_of_2(num_q_heads)
    half_rot_p2 = triton.next_power_of_2(rot_dim // 2)
    k_scale_arg = k_scale if fp8 else slot_mapping
    v_scale_arg = v_scale if fp8 else slot_mapping
    _rope_kv_cache_update_kernel[(num_tokens,)](
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
        KV_HEADS_P2=triton.next_power_of_2(num_kv_heads),
        HALF_ROT_P2=half_rot_p2,
        PASS_P2=triton.next_power_of_2(pass_dims) if pass_dims > 0 else 0,
        HEAD_SIZE_P2=triton.next_power_of_2(head_size),
        num_warps=_rope_num_warps(q_heads_p2, half_rot_p2),
    )


@torch.library.custom_op("fuselane::kv_cache_update", mutates_args=("key_cache", "value_cache"))
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
    fp8 = _check_write_args(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    _check_kernel_device(key)
    _launch_write(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, fp8)


@kv_cache_update.register_fake
def _kv_cache_update_fake(
    key, value, key_cache, value_cache, slot_mapping, k_scale=None, v_scale=None
):
    _check_write_args(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)


@torch.library.custom_op(
    "fuselane::rope_kv_cache_update", mutates_args=("query", "key", "key_cache", "value_cache")
)
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
    fp8 = _check_write_args(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    _check_rope_args(positions, query, key, cos_sin_cache, is_neox)
    _check_kernel_device(key)
    _launch_rope(
        positions, query, key, value, cos_sin_cache, is_neox,
        key_cache, value_cache, slot_mapping, k_scale, v_scale, fp8,
    )  # fmt: skip


@rope_kv_cache_update.register_fake
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
