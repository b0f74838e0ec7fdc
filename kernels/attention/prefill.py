"""Paged attention, prefill side: FlashAttention-style tiles over a paged KV cache.

Handles the sequences of a batch whose query is long (prefill chunks; in a mixed batch every
sequence with query_len > the decode kernel's limit). One program per (q block, kv head): the
rows of its Q tile are `BLOCK_Q` query positions x the `GROUP = Hq // Hkv` query heads of that
kv head (row r = position r // GROUP, head r % GROUP), so each K/V tile feeds every head of
the group. The q block of a program is found on the device by a binary search over
cu_seqlens_q (vLLM's find_seq_idx layout: sequence s owns the blocks starting at
cu_seqlens_q[s] // BLOCK_Q + s), so a mixed batch needs no host-side plan and no sync.

Causal work is bounded, not masked: the key loop of a q block stops at its last query token,
and only the tiles that cross the diagonal (or the sliding window's left edge) build a mask;
the tiles in between run mask-free (`decode._attend_range`, shared with the decode
kernel). Within a sequence the programs take the q blocks from the last (heaviest) to the first
so that the lightest blocks fill the tail of the launch; with `HEAD_FAST` the kv head is the
fast grid axis, so every head's heaviest blocks go first (the default keeps one head's blocks
together, sharing its K/V in L2).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from .._launch import launch, next_pow2
from .decode import LOG2E, NEG_BIG, _attend_range, _fp8_logit_scale, _fp8_query, layout_strides

if TYPE_CHECKING:
    from .args import AttentionOptions, PagedBatch
    from .plan import PrefillConfig

# Largest grid extent on CUDA's second axis.
MAX_GRID_YZ = 65535


# num_seqs varies per batch: not specialized (no new variant mid-serving for 1 or 16 sequences).
@triton.jit(do_not_specialize=["num_seqs"])
def _prefill_kernel(
    q_ptr,  # [num_tokens, Hq, D] fp16/bf16
    k_ptr,  # [num_blocks, PAGE, Hkv, D] q's dtype or fp8 e4m3 (last dim contiguous)
    v_ptr,  # [num_blocks, PAGE, Hkv, D] same dtype as k
    out_ptr,  # [num_tokens, Hq, D] q's dtype
    cu_q_ptr,  # [num_seqs + 1] int32
    seq_lens_ptr,  # [num_seqs] int32, KV length including the new tokens
    bt_ptr,  # [num_seqs, max_blocks] int32
    sinks_ptr,  # [Hq] fp32 (read only if USE_SINKS)
    k_scale_ptr,  # [1] fp32 (read only if KV_FP8)
    v_scale_ptr,  # [1] fp32 (read only if KV_FP8)
    scale,
    softcap,
    num_seqs,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    GROUP: tl.constexpr,  # Hq // Hkv
    BLOCK_Q: tl.constexpr,  # query positions per program = BLOCK_M // GROUP
    BLOCK_M: tl.constexpr,  # rows of the Q tile (power of two >= GROUP)
    BLOCK_N: tl.constexpr,  # KV tokens per loop step
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    PAGE: tl.constexpr,
    MIN_Q: tl.constexpr,  # sequences with query_len <= MIN_Q belong to the decode kernel
    SLIDING_WINDOW: tl.constexpr,  # 0: off; else query p sees keys k with p - k < SLIDING_WINDOW
    USE_SOFTCAP: tl.constexpr,
    USE_SINKS: tl.constexpr,
    KV_FP8: tl.constexpr,
    HEAD_FAST: tl.constexpr,  # grid (Hkv, q blocks) instead of (q blocks, Hkv)
    UPCAST_DOT: tl.constexpr,
    OFFSETS_FROM_TILE: tl.constexpr,  # see `_attend_tiles` and `offsets_from_tile`
):
    if HEAD_FAST:
        kv_head = tl.program_id(0)
        qb_global = tl.program_id(1)
    else:
        qb_global = tl.program_id(0)
        kv_head = tl.program_id(1)

    # Largest seq with cu[seq] // BLOCK_Q + seq <= qb_global (binary search, as vLLM's
    # find_seq_idx): the grid's upper bound num_tokens // BLOCK_Q + num_seqs covers every block.
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(cu_q_ptr + mid) // BLOCK_Q + mid
        if first_block <= qb_global:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    local = qb_global - (q_start // BLOCK_Q + seq)
    if local * BLOCK_Q >= q_len:  # a spare program of the upper-bound grid
        return
    if MIN_Q > 0:
        if q_len <= MIN_Q:  # a decode / verify row: the decode kernel of this call owns it
            return
    qb = tl.cdiv(q_len, BLOCK_Q) - 1 - local  # heaviest (last) block first
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = seq_len - q_len

    Q_BF16: tl.constexpr = q_ptr.dtype.element_ty == tl.bfloat16
    qk_scale = scale
    if KV_FP8:
        qk_scale = _fp8_logit_scale(scale, k_scale_ptr, Q_BF16)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_PAD)
    offs_t = tl.arange(0, BLOCK_N)
    d_ok = offs_d < HEAD_SIZE
    p0 = qb * BLOCK_Q
    p_last = tl.minimum(p0 + BLOCK_Q, q_len) - 1  # last real position of this block
    pos = p0 + offs_m // GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (pos <= p_last)
    pos = tl.minimum(pos, p_last)  # padding rows repeat the last real row (never stored)
    head = kv_head * GROUP + offs_m % GROUP
    tok = (q_start + pos).to(tl.int64)
    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=d_ok[None, :],
        other=0.0,
    )
    if KV_FP8:
        q = _fp8_query(q, scale, Q_BF16)
    q_abs = ctx + pos

    m_i = tl.full([BLOCK_M], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if USE_SINKS:
        m_i = tl.load(sinks_ptr + head).to(tl.float32) * LOG2E
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)

    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_ptr + kv_head.to(tl.int64) * stride_kh
    v_base = v_ptr + kv_head.to(tl.int64) * stride_vh
    EVEN_D: tl.constexpr = HEAD_SIZE == HEAD_PAD
    # Keys of the block's queries ctx + p0 .. ctx + p_last: window edge and diagonal tiles
    # masked, the interior unmasked; tiles above the diagonal are never visited.
    acc, l_i, m_i = _attend_range(
        acc, l_i, m_i, q, k_base, v_base, bt_row, 0, tl.cdiv(seq_len, BLOCK_N), ctx + p0,
        ctx + p_last, q_abs, seq_len, qk_scale, softcap, stride_kb, stride_ks, stride_vb,
        stride_vs, offs_d, d_ok, offs_t, PAGE, BLOCK_M, BLOCK_N, EVEN_D, SLIDING_WINDOW,
        USE_SOFTCAP, KV_FP8, UPCAST_DOT, OFFSETS_FROM_TILE,
    )  # fmt: skip

    if KV_FP8:
        acc = acc * tl.load(v_scale_ptr)
    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


def prefill_grid(
    num_tokens: int, num_seqs: int, num_kv_heads: int, block_q: int, head_fast: bool
) -> tuple[tuple[int, int], bool]:
    """(grid, head_fast) of a prefill launch: an upper bound on the q blocks of the batch
    (`num_tokens // block_q + num_seqs`, what the kernels' block search assumes) by kv heads,
    kv head fastest if asked and the q blocks fit CUDA's second grid axis."""
    num_q_blocks = num_tokens // block_q + num_seqs
    head_fast = head_fast and num_q_blocks <= MAX_GRID_YZ
    grid = (num_kv_heads, num_q_blocks) if head_fast else (num_q_blocks, num_kv_heads)
    return grid, head_fast


# Rows per warp above which the KV loop derives pages and slots from the token index
# (`_attend_tiles`): the 128-row 4-warp tile, already short of registers, ran 4-12% slower with
# offsets held across the loop (Llama-3-70B at TP 8, S = 1k-8k; Mistral-7B S = 1k-2k); the
# 256-row 16-warp and the head-size-256 tiles ran 1-4% faster with them
# (kv-loop-offsets-ab-h200-2026-11-27.json).
OFFSETS_FROM_TILE_MAX_ROWS_PER_WARP = 16


def offsets_from_tile(config: PrefillConfig) -> bool:
    """Whether the prefill kernel of `config` takes the KV loop's page offsets from the tile."""
    return config.block_m // config.num_warps <= OFFSETS_FROM_TILE_MAX_ROWS_PER_WARP


def launch_prefill(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    batch: PagedBatch,
    options: AttentionOptions,
    config: PrefillConfig,
    *,
    upcast_dot: bool,
) -> None:
    """Launch the prefill kernel over every q block of the batch (validated arguments; the
    config comes from `plan.plan_launch` and depends only on shapes)."""
    cu_seqlens_q, seq_lens, block_table = batch.cu_seqlens_q, batch.seq_lens, batch.block_table
    sinks, k_scale, v_scale = options.sinks, options.k_scale, options.v_scale
    softcap = float(options.softcap)
    num_seqs = seq_lens.shape[0]
    num_tokens, num_q_heads, head_size = q.shape
    num_kv_heads = key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    block_q = config.block_m // group
    kv_fp8 = key_cache.dtype == torch.float8_e4m3fn
    dummy = seq_lens
    grid, head_fast = prefill_grid(num_tokens, num_seqs, num_kv_heads, block_q, config.head_fast)
    launch(
        _prefill_kernel,
        grid,
        q,
        key_cache,
        value_cache,
        out,
        cu_seqlens_q,
        seq_lens,
        block_table,
        sinks if sinks is not None else dummy,
        k_scale if kv_fp8 else dummy,
        v_scale if kv_fp8 else dummy,
        float(options.scale),
        softcap if softcap > 0 else 1.0,
        num_seqs,
        *layout_strides(q, out, key_cache, value_cache, block_table),
        GROUP=group,
        BLOCK_Q=block_q,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        HEAD_SIZE=head_size,
        HEAD_PAD=next_pow2(head_size),
        PAGE=key_cache.shape[1],
        MIN_Q=config.min_q,
        SLIDING_WINDOW=options.window,
        USE_SOFTCAP=softcap > 0,
        USE_SINKS=sinks is not None,
        KV_FP8=kv_fp8,
        HEAD_FAST=head_fast,
        UPCAST_DOT=upcast_dot,
        OFFSETS_FROM_TILE=offsets_from_tile(config),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
