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
the tiles in between run mask-free. Within a sequence the programs take the q blocks from the
last (heaviest) to the first so that the lightest blocks fill the tail of the launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_decode import LOG2E, NEG_BIG, _logits_log2, _mma


@triton.jit
def _prefill_tiles(
    acc,
    l_i,
    m_i,
    q,
    k_base,
    v_base,
    bt_row,
    t_lo,
    t_hi,
    q_abs,
    seq_len,
    qk_scale,
    softcap,
    stride_kb,
    stride_ks,
    stride_vb,
    stride_vs,
    offs_d,
    d_ok,
    offs_t,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    EVEN_D: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    KV_FP8: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    """Online-softmax update of (acc, l_i, m_i) over the KV tiles [t_lo, t_hi).

    MASKED=False is the hot loop: every key of every tile is visible to every row (the caller
    guarantees it), so neither the loads nor the scores carry a mask.
    """
    for j in range(t_lo, t_hi):
        offs_n = j * BLOCK_N + offs_t
        if MASKED:
            n_ok = offs_n < seq_len  # slots past seq_len may hold garbage or NaN: never read
            phys = tl.load(bt_row + offs_n // PAGE, mask=n_ok, other=0).to(tl.int64)
        else:
            phys = tl.load(bt_row + offs_n // PAGE).to(tl.int64)
        slot = offs_n % PAGE
        k_ptrs = k_base + (phys * stride_kb + slot * stride_ks)[:, None] + offs_d[None, :]
        v_ptrs = v_base + (phys * stride_vb + slot * stride_vs)[:, None] + offs_d[None, :]
        if MASKED:
            kv_mask = n_ok[:, None] & d_ok[None, :]
            k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
        elif EVEN_D:
            k = tl.load(k_ptrs)
        else:
            k = tl.load(k_ptrs, mask=d_ok[None, :], other=0.0)
        if KV_FP8:
            k = k.to(q.dtype)
        qk = _mma(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), UPCAST_DOT)
        s = _logits_log2(qk, qk_scale, softcap, USE_SOFTCAP)
        if MASKED:
            ok = offs_n[None, :] <= q_abs[:, None]  # causal; implies key < seq_len
            if SLIDING_WINDOW > 0:
                ok = ok & (q_abs[:, None] - offs_n[None, :] < SLIDING_WINDOW)
            s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED:
            v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
        elif EVEN_D:
            v = tl.load(v_ptrs)
        else:
            v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
        if KV_FP8:
            v = v.to(q.dtype)
        acc = _mma(p.to(v.dtype), v, acc * alpha[:, None], UPCAST_DOT)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
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
    UPCAST_DOT: tl.constexpr,
):
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

    qk_scale = scale
    if KV_FP8:
        qk_scale = scale * tl.load(k_scale_ptr)

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
    q_abs = ctx + pos

    m_i = tl.full([BLOCK_M], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if USE_SINKS:
        m_i = tl.load(sinks_ptr + head).to(tl.float32) * LOG2E
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)

    # Keys of this block: [kv_lo, a_hi]. Keys in [full_lo, a_lo] are visible to every row
    # (causal: k <= a_lo <= each row; window: a_hi - k < W), so their tiles need no mask.
    a_lo = ctx + p0
    a_hi = ctx + p_last
    kv_lo = 0
    full_lo = 0
    if SLIDING_WINDOW > 0:
        kv_lo = tl.maximum(a_lo - SLIDING_WINDOW + 1, 0)
        full_lo = tl.maximum(a_hi - SLIDING_WINDOW + 1, 0)
    t_lo = kv_lo // BLOCK_N
    t_hi = tl.cdiv(a_hi + 1, BLOCK_N)
    u_lo = tl.cdiv(full_lo, BLOCK_N)  # first tile that starts at or after full_lo
    u_hi = tl.maximum(tl.minimum((a_lo + 1) // BLOCK_N, t_hi), u_lo)  # tiles ending <= a_lo

    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_ptr + kv_head.to(tl.int64) * stride_kh
    v_base = v_ptr + kv_head.to(tl.int64) * stride_vh
    EVEN_D: tl.constexpr = HEAD_SIZE == HEAD_PAD
    if SLIDING_WINDOW > 0:  # tiles at the window's left edge
        acc, l_i, m_i = _prefill_tiles(
            acc, l_i, m_i, q, k_base, v_base, bt_row, t_lo, u_lo, q_abs, seq_len, qk_scale,
            softcap, stride_kb, stride_ks, stride_vb, stride_vs, offs_d, d_ok, offs_t,
            PAGE, BLOCK_M, BLOCK_N, True, EVEN_D, SLIDING_WINDOW, USE_SOFTCAP, KV_FP8,
            UPCAST_DOT,
        )  # fmt: skip
    acc, l_i, m_i = _prefill_tiles(
        acc, l_i, m_i, q, k_base, v_base, bt_row, u_lo, u_hi, q_abs, seq_len, qk_scale,
        softcap, stride_kb, stride_ks, stride_vb, stride_vs, offs_d, d_ok, offs_t,
        PAGE, BLOCK_M, BLOCK_N, False, EVEN_D, SLIDING_WINDOW, USE_SOFTCAP, KV_FP8,
        UPCAST_DOT,
    )  # fmt: skip
    acc, l_i, m_i = _prefill_tiles(  # tiles crossing the diagonal
        acc, l_i, m_i, q, k_base, v_base, bt_row, u_hi, t_hi, q_abs, seq_len, qk_scale,
        softcap, stride_kb, stride_ks, stride_vb, stride_vs, offs_d, d_ok, offs_t,
        PAGE, BLOCK_M, BLOCK_N, True, EVEN_D, SLIDING_WINDOW, USE_SOFTCAP, KV_FP8,
        UPCAST_DOT,
    )  # fmt: skip

    if KV_FP8:
        acc = acc * tl.load(v_scale_ptr)
    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


def launch_prefill(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    sinks: torch.Tensor | None,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    *,
    scale: float,
    softcap: float,
    sliding_window: int,
    block_m: int,
    block_n: int,
    min_q: int,
    num_warps: int,
    num_stages: int,
    upcast_dot: bool,
) -> None:
    """Launch the prefill kernel over every q block of the batch (validated arguments; the
    config comes from `attention.plan_launch` and depends only on shapes)."""
    num_seqs = seq_lens.shape[0]
    num_tokens, num_q_heads, head_size = q.shape
    num_kv_heads = key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    block_q = block_m // group
    kv_fp8 = key_cache.dtype == torch.float8_e4m3fn
    dummy = seq_lens
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _prefill_kernel[grid](
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
        scale,
        softcap if softcap > 0 else 1.0,
        num_seqs,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        block_table.stride(0),
        GROUP=group,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        HEAD_SIZE=head_size,
        HEAD_PAD=triton.next_power_of_2(head_size),
        PAGE=key_cache.shape[1],
        MIN_Q=min_q,
        SLIDING_WINDOW=sliding_window,
        USE_SOFTCAP=softcap > 0,
        USE_SINKS=sinks is not None,
        KV_FP8=kv_fp8,
        UPCAST_DOT=upcast_dot,
        num_warps=num_warps,
        num_stages=num_stages,
    )
