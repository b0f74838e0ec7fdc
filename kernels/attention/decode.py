"""Paged attention, decode side: flash-decoding over a paged KV cache, plus its split merge.

Handles the sequences of a batch whose query is short (decode rows, query_len 1, and
speculative-verify rows, query_len 2-8). One program per (sequence, kv head, split): the
`GROUP = Hq // Hkv` query heads of that kv head and up to `QPOS` query positions are packed into
the rows of one tile, so every K/V tile is read from memory once for all of them. Each program
walks its share of the sequence's KV tiles (`TILE_N` tokens, i.e. several pages, per step,
gathered through the block table) with an fp32 online softmax in base 2. With one split it
writes the normalized output; with several it writes a partial (m, l, acc) into the workspace,
and the last program of its (sequence, kv head) to finish merges the partials (an atomic
counter per (sequence, kv head), reset by that program, so the next launch finds it at zero:
no extra launch, CUDA-graph safe). `_splitkv_reduce_kernel` is the same merge as a second
launch (kept for comparison in the benchmark, `DecodeConfig.fused_reduce=False`).

The KV loop runs in three phases per query chunk: tiles at the sliding window's left edge
(masked), interior tiles that every query row sees whole (no mask at all: no load predicate,
no score select), and the tiles that reach the query's own position or the sequence's end
(masked). `_attend_tiles` is that loop body; the prefill kernel uses it too.

Balanced split (`BALANCED`, `DecodeConfig.split_budget > 0`): instead of (sequence, kv head,
split) the grid is (kv head, item), and each program reads the (sequence, piece, pieces) it
owns from the batch's schedule (`balance.balanced_schedule`, written on the device once per
step): a long sequence among short ones is cut into several pieces, a short one stays whole
and writes its output directly.

CUDA graphs: the grid and every constexpr depend only on the batch shape. Each program reads
its sequence's lengths on the device and derives its own KV range from them; a split whose
range is empty still writes a neutral partial (m = -1e30, l = 0, acc = 0) and counts itself.

The entry point, the argument checks and the torch reference are in `attention.py`; the
prefill kernel is in `prefill.py`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from .._launch import launch, next_pow2
from .balance import ENTRY, balanced_schedule

if TYPE_CHECKING:
    from .args import AttentionOptions, PagedBatch
    from .plan import AttentionWorkspace, DecodeConfig

# log2(e): logits are kept in base-2 units so the softmax uses exp2 (one MUFU op).
LOG2E = tl.constexpr(1.4426950408889634)
# Finite stand-in for -inf as the running maximum: exp2(m_old - m_new) stays finite (no
# -inf - -inf = NaN) even for a row whose every key so far was masked out.
NEG_BIG = tl.constexpr(-1.0e30)


@triton.jit
def _tanh(x):
    # tanh(x) = 1 - 2 / (exp(2x) + 1): one exponential, saturates cleanly at +-1 for any |x|
    # (the two-exponential form gives inf / inf = NaN for |x| > ~44). Same form as vLLM's
    # apply_softcap.
    return 1.0 - 2.0 / (tl.math.exp2(x * (2.0 * LOG2E)) + 1.0)


# An fp8 cache meets a bf16 q in fp16: e4m3 -> fp16 is one conversion instruction per two values
# on sm_89+ (cvt.rn.f16x2.e4m3x2, exact), e4m3 -> bf16 three (through fp16 and fp32), and those
# conversions, not memory, had set the fp8 decode kernel's speed (~40% of the copy ceiling on an
# H200, benchmarks/results/kernels-h200-2026-11-26-part2-decode_fp8-before.json). q is scaled by
# FP8_Q_SCALE on the way (|q| up to 2^23 stays finite; values below 2^-6 lose only bits far
# below bf16's own rounding) and the logit scale by its inverse; P meets V in fp16 as well.
FP8_Q_SCALE = tl.constexpr(1.0 / 256.0)


@triton.jit
def _fp8_query(q, scale, Q_BF16: tl.constexpr):
    """q as an fp8 cache's tiles meet it (see FP8_Q_SCALE): a bf16 q (Q_BF16) in fp16, scaled.

    The multiplier is made a run-time value (`scale / scale`, scale > 0 and finite): with a
    constant, LLVM rewrote fp16(fp32(q) * 2^-8) as fp16(q) * 2^-8 in half precision (exact
    for a power of two, except that fp16(q) overflows first: NaN outputs for |q| > 65504 on an
    H200), which is the overflow the scaling is there to avoid."""
    if Q_BF16:
        q = (q.to(tl.float32) * ((scale / scale) * FP8_Q_SCALE)).to(tl.float16)
    return q


@triton.jit
def _fp8_logit_scale(scale, k_scale_ptr, Q_BF16: tl.constexpr):
    """The logit scale with k's per-tensor scale folded in (value = stored * scale) and, for a
    bf16 q, `_fp8_query`'s scaling undone."""
    qk_scale = scale * tl.load(k_scale_ptr)
    if Q_BF16:
        qk_scale = qk_scale / FP8_Q_SCALE
    return qk_scale


@triton.jit
def _mma(a, b, acc, UPCAST: tl.constexpr):
    """acc + a @ b with fp32 accumulation.

    UPCAST is set only under the Triton interpreter: Triton 3.6's interpreter multiplies the raw
    uint16 bits of bfloat16 operands in tl.dot, so there the operands are widened to fp32 first
    (exact for fp16/bf16 values). Compiled GPU code always takes the plain tl.dot.
    """
    if UPCAST:
        # ieee: fp32 products, not tf32, so fp32 inputs keep fp32 accuracy on a GPU too.
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _attend_tiles(
    acc,  # [BLOCK_M, HEAD_PAD] fp32 running numerator
    l_i,  # [BLOCK_M] fp32 running denominator
    m_i,  # [BLOCK_M] fp32 running max, base-2 logit units
    q,  # [BLOCK_M, HEAD_PAD] q dtype
    k_base,  # K cache pointer at this kv head
    v_base,
    bt_row,  # block-table row of the sequence
    t_lo,  # KV tiles [t_lo, t_hi) of TILE_N tokens
    t_hi,
    q_abs,  # [BLOCK_M] int32 absolute position of each row's query token
    seq_len,
    qk_scale,  # fp32 softmax scale (k's fp8 scale folded in)
    softcap,
    stride_kb,
    stride_ks,
    stride_vb,
    stride_vs,
    offs_d,  # arange(0, HEAD_PAD)
    d_ok,  # offs_d < HEAD_SIZE
    offs_t,  # arange(0, TILE_N)
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    MASKED: tl.constexpr,
    EVEN_D: tl.constexpr,  # HEAD_SIZE is a power of two: no head-dim mask
    SLIDING_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    KV_FP8: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    OFFSETS_FROM_TILE: tl.constexpr,  # pages and slots from the offset in the tile (see below)
):
    """Online-softmax update of (acc, l_i, m_i) over the KV tiles [t_lo, t_hi).

    Logits in base 2: s2 = log2(e) * s. Without soft cap s = qk_scale * qk, so the row max is
    taken on the raw dot products and one FMA per element gives s2 - m:
    p = exp2(qk * c - m_new) with c = qk_scale * log2(e). With soft cap
    s = softcap * tanh(qk_scale * qk / softcap).
    MASKED=False is the hot loop: the caller guarantees that every key of every tile is below
    seq_len and visible to every row, so neither the loads nor the scores carry a mask.
    """
    c = qk_scale * LOG2E
    # A tile is whole pages: a token's page within the tile and its slot in the page depend on
    # its offset in the tile alone (an arange, known >= 0: shifts and masks), computed once.
    # Derived from the token index they cost signed divisions and 64-bit address arithmetic per
    # element and tile wherever the compiler cannot prove the first tile >= 0 (every split
    # variant of the decode kernel), but hold no registers across the loop, which the prefill
    # kernel's 32-rows-per-warp tile needs (docs/tuning/attention.md, "The schedule, once per
    # step" and "KV-loop offsets in the prefill kernel").
    tl.static_assert(TILE_N % PAGE == 0)
    if OFFSETS_FROM_TILE:
        page_in_tile = offs_t // PAGE
        tile_slot = offs_t % PAGE
    for j in range(t_lo, t_hi):
        offs_n = j * TILE_N + offs_t
        # Block-table entries of the tile (TILE_N // PAGE distinct pages), then row addresses.
        if OFFSETS_FROM_TILE:
            bt_tile = bt_row + j * (TILE_N // PAGE) + page_in_tile
            slot = tile_slot
        else:
            bt_tile = bt_row + offs_n // PAGE
            slot = offs_n % PAGE
        if MASKED:
            n_ok = offs_n < seq_len  # slots past seq_len may hold garbage or NaN: never read
            phys = tl.load(bt_tile, mask=n_ok, other=0).to(tl.int64)
        else:
            phys = tl.load(bt_tile).to(tl.int64)
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
        qk = _mma(q, tl.trans(k), tl.zeros([BLOCK_M, TILE_N], tl.float32), UPCAST_DOT)
        if MASKED:
            ok = offs_n[None, :] <= q_abs[:, None]  # causal; implies key < seq_len
            if SLIDING_WINDOW > 0:
                ok = ok & (q_abs[:, None] - offs_n[None, :] < SLIDING_WINDOW)
        if USE_SOFTCAP:
            s = (softcap * LOG2E) * _tanh(qk * (qk_scale / softcap))
            if MASKED:
                s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.math.exp2(s - m_new[:, None])
        else:
            if MASKED:
                qk = tl.where(ok, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1) * c)  # c > 0: max(c * qk) = c * max(qk)
            p = tl.math.exp2(qk * c - m_new[:, None])
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
def _attend_range(
    acc,
    l_i,
    m_i,
    q,
    k_base,
    v_base,
    bt_row,
    lo,  # this program's tiles [lo, hi)
    hi,
    a_lo,  # absolute positions of the first and last query token of the tile's rows
    a_hi,
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
    TILE_N: tl.constexpr,
    EVEN_D: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    KV_FP8: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    OFFSETS_FROM_TILE: tl.constexpr,
):
    """`_attend_tiles` over the tiles [lo, hi) that queries a_lo..a_hi may see, in three phases.

    Keys the rows see: [kv_lo, a_hi] (kv_lo: the window start of a_lo). Keys in [full_lo, a_lo]
    are visible to every row (causal: k <= a_lo; window: a_hi - k < W), so the tiles wholly
    inside that range run unmasked; the tiles before it (window edge) and after it (the
    diagonal, the only ones that can reach past seq_len) run masked. Tiles past a_hi are never
    visited.
    """
    kv_lo = 0
    full_lo = 0
    if SLIDING_WINDOW > 0:
        kv_lo = tl.maximum(a_lo - SLIDING_WINDOW + 1, 0)
        full_lo = tl.maximum(a_hi - SLIDING_WINDOW + 1, 0)
    t_lo = kv_lo // TILE_N
    t_hi = tl.cdiv(a_hi + 1, TILE_N)
    u_lo = tl.cdiv(full_lo, TILE_N)  # first tile that starts at or after full_lo
    u_hi = tl.maximum(tl.minimum((a_lo + 1) // TILE_N, t_hi), u_lo)  # tiles ending <= a_lo
    if SLIDING_WINDOW > 0:  # window edge
        acc, l_i, m_i = _attend_tiles(
            acc, l_i, m_i, q, k_base, v_base, bt_row, tl.maximum(t_lo, lo),
            tl.minimum(u_lo, hi), q_abs, seq_len, qk_scale, softcap, stride_kb, stride_ks,
            stride_vb, stride_vs, offs_d, d_ok, offs_t, PAGE, BLOCK_M, TILE_N, True, EVEN_D,
            SLIDING_WINDOW, USE_SOFTCAP, KV_FP8, UPCAST_DOT, OFFSETS_FROM_TILE,
        )  # fmt: skip
    acc, l_i, m_i = _attend_tiles(  # interior: no mask
        acc, l_i, m_i, q, k_base, v_base, bt_row, tl.maximum(u_lo, lo), tl.minimum(u_hi, hi),
        q_abs, seq_len, qk_scale, softcap, stride_kb, stride_ks, stride_vb, stride_vs, offs_d,
        d_ok, offs_t, PAGE, BLOCK_M, TILE_N, False, EVEN_D, SLIDING_WINDOW, USE_SOFTCAP, KV_FP8,
        UPCAST_DOT, OFFSETS_FROM_TILE,
    )  # fmt: skip
    acc, l_i, m_i = _attend_tiles(  # the diagonal and the sequence's end
        acc, l_i, m_i, q, k_base, v_base, bt_row, tl.maximum(u_hi, lo), tl.minimum(t_hi, hi),
        q_abs, seq_len, qk_scale, softcap, stride_kb, stride_ks, stride_vb, stride_vs, offs_d,
        d_ok, offs_t, PAGE, BLOCK_M, TILE_N, True, EVEN_D, SLIDING_WINDOW, USE_SOFTCAP, KV_FP8,
        UPCAST_DOT, OFFSETS_FROM_TILE,
    )  # fmt: skip
    return acc, l_i, m_i


@triton.jit
def _merge_partials(
    out_ptr,
    part_o_ptr,
    part_ml_ptr,
    pbase,  # [BLOCK_M] int64: index of each row's split 0 in the partial arrays
    out_offs,  # [BLOCK_M, HEAD_PAD] int64 offsets of each row in out
    row_ok,  # [BLOCK_M] rows to write
    sink,  # [BLOCK_M] fp32 sink logit in base-2 units (read only if USE_SINKS)
    # (BLOCK_M here: the merge's rows, a power of two >= QPOS * GROUP)
    num_splits,
    offs_d,
    d_ok,
    BLOCK_M: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    RED_SPLITS: tl.constexpr,  # splits merged per step
    USE_SINKS: tl.constexpr,
):
    # out = sum_s 2^(m_s - M) acc_s / (sum_s 2^(m_s - M) l_s [+ 2^(sink - M)]), M = max of all m,
    # accumulated online over steps of RED_SPLITS splits. Loads bypass L1 (.cg): the partials
    # were written by other programs of this launch.
    m_run = tl.full([BLOCK_M], NEG_BIG, dtype=tl.float32)
    l_run = tl.zeros([BLOCK_M], dtype=tl.float32)
    if USE_SINKS:
        m_run = sink
        l_run = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    offs_r = tl.arange(0, RED_SPLITS)
    for s0 in range(0, num_splits, RED_SPLITS):
        s_idx = s0 + offs_r
        ok = row_ok[:, None] & (s_idx < num_splits)[None, :]
        pidx = pbase[:, None] + s_idx[None, :]  # [BLOCK_M, RED_SPLITS]
        m_s = tl.load(part_ml_ptr + pidx * 2, mask=ok, other=NEG_BIG, cache_modifier=".cg")
        l_s = tl.load(part_ml_ptr + pidx * 2 + 1, mask=ok, other=0.0, cache_modifier=".cg")
        o_s = tl.load(
            part_o_ptr + pidx[:, :, None] * HEAD_PAD + offs_d[None, None, :],
            mask=ok[:, :, None] & d_ok[None, None, :],
            other=0.0,
            cache_modifier=".cg",
        )
        m_new = tl.maximum(m_run, tl.max(m_s, 1))
        alpha = tl.math.exp2(m_run - m_new)
        w = tl.math.exp2(m_s - m_new[:, None])
        l_run = l_run * alpha + tl.sum(w * l_s, 1)
        acc = acc * alpha[:, None] + tl.sum(o_s * w[:, :, None], 1)
        m_run = m_new
    o = acc / tl.where(l_run > 0.0, l_run, 1.0)[:, None]
    tl.store(
        out_ptr + out_offs,
        o.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


# Runtime ints that vary from batch to batch are not specialized (Triton would compile a new
# variant for a value of 1 or a multiple of 16 in the middle of serving).
@triton.jit(do_not_specialize=["num_splits", "num_seqs", "budget"])
def _decode_kernel(
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
    part_o_ptr,  # [num_seqs * QPOS, Hq, num_splits, HEAD_PAD] fp32 workspace (if SPLIT)
    part_ml_ptr,  # [num_seqs * QPOS, Hq, num_splits, 2] fp32 workspace: (m, l) in base 2
    counter_ptr,  # [num_seqs * Hkv] int32 workspace, zero between launches (if FUSED_REDUCE)
    sched_ptr,  # [num_seqs + budget, ENTRY] int32: (sequence, piece, pieces) (if BALANCED)
    scale,  # fp32 softmax scale
    softcap,  # fp32, used only if USE_SOFTCAP
    num_splits,  # programs per (sequence, kv head); 1 unless SPLIT (not read if BALANCED)
    num_seqs,  # sequences of the batch (read if BALANCED)
    budget,  # BALANCED: pieces the batch's KV is cut into, at most (items = num_seqs + budget)
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
    NUM_Q_HEADS: tl.constexpr,
    GROUP: tl.constexpr,  # Hq // Hkv
    QPOS: tl.constexpr,  # query positions per tile (rows = QPOS * GROUP, padded to BLOCK_M)
    BLOCK_M: tl.constexpr,  # power of two >= max(16, QPOS * GROUP)
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,  # next power of two >= HEAD_SIZE
    PAGE: tl.constexpr,  # KV-cache block size
    TILE_N: tl.constexpr,  # KV tokens per loop step
    SPLIT: tl.constexpr,  # num_splits > 1: write partials and merge them
    FUSED_REDUCE: tl.constexpr,  # the last split of a (sequence, kv head) merges (else a launch)
    MERGE_M: tl.constexpr,  # rows of the fused merge: next power of two >= QPOS * GROUP
    RED_SPLITS: tl.constexpr,  # splits merged per step of the fused merge
    HEAD_FAST: tl.constexpr,  # grid (Hkv, num_seqs, splits) instead of (num_seqs, Hkv, splits)
    BALANCED: tl.constexpr,  # grid (Hkv, items) / (items, Hkv): pieces by length (needs SPLIT)
    MAX_Q: tl.constexpr,  # query_len > MAX_Q: the prefill kernel's sequence (0: no limit)
    SLIDING_WINDOW: tl.constexpr,  # 0: off; else query p sees keys k with p - k < SLIDING_WINDOW
    USE_SOFTCAP: tl.constexpr,
    USE_SINKS: tl.constexpr,
    KV_FP8: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    OFFSETS_FROM_TILE: tl.constexpr,  # see `_attend_tiles` and `offsets_from_tile`
):
    if BALANCED:
        item = tl.program_id(1) if HEAD_FAST else tl.program_id(0)
        kv_head = tl.program_id(0) if HEAD_FAST else tl.program_id(1)
        entry = sched_ptr + item * ENTRY
        seq = tl.load(entry)
        split = tl.load(entry + 1)
        pieces = tl.load(entry + 2)
        if seq >= num_seqs:  # past the batch's last piece
            return
        # Partial of piece j of (position p, head h): [QPOS, Hq, num_seqs + budget] at column
        # item = first + j (the sequence's pieces side by side).
        part_row0 = 0
        part_cols = num_seqs + budget
        first = item - split
    else:
        if HEAD_FAST:
            kv_head = tl.program_id(0)
            seq = tl.program_id(1)
        else:
            seq = tl.program_id(0)
            kv_head = tl.program_id(1)
        split = tl.program_id(2)
        pieces = num_splits
        # Partial of split j of (position p, head h): [num_seqs * QPOS, Hq, num_splits].
        part_row0 = seq.to(tl.int64) * QPOS
        part_cols = num_splits
        first = 0

    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    if q_len <= 0:  # padding request (CUDA-graph batch padding): nothing to write
        return
    if MAX_Q > 0:
        if q_len > MAX_Q:  # a prefill chunk: the prefill kernel of this call owns it
            return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = seq_len - q_len  # keys before the first query token

    Q_BF16: tl.constexpr = q_ptr.dtype.element_ty == tl.bfloat16
    qk_scale = scale
    if KV_FP8:
        # value = stored * scale: fold k's scale into the logit scale and v's into the output,
        # the fp8 -> fp16 conversion itself is exact.
        qk_scale = _fp8_logit_scale(scale, k_scale_ptr, Q_BF16)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_PAD)
    offs_t = tl.arange(0, TILE_N)
    d_ok = offs_d < HEAD_SIZE
    EVEN_D: tl.constexpr = HEAD_SIZE == HEAD_PAD
    row_in = offs_m < QPOS * GROUP
    head = kv_head * GROUP + offs_m % GROUP  # always a valid head index, padding rows included
    sink = tl.zeros([BLOCK_M], dtype=tl.float32)
    if USE_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * LOG2E

    # The sequence's KV tiles [tile_lo, tile_hi) are divided evenly over num_splits programs. The
    # window is the one of the first query token (keys it may see: k > ctx - SLIDING_WINDOW).
    kv_lo = 0
    if SLIDING_WINDOW > 0:
        kv_lo = tl.maximum(ctx - SLIDING_WINDOW + 1, 0)
    tile_lo = kv_lo // TILE_N
    tile_hi = tl.cdiv(seq_len, TILE_N)
    tiles_per_split = tl.cdiv(tile_hi - tile_lo, pieces)
    split_lo = tile_lo + split * tiles_per_split
    split_hi = tl.minimum(split_lo + tiles_per_split, tile_hi)
    # Whether this program's sequence is one piece (balanced: a short one, written directly)
    # or several (partials and the merge); row vectors, as Triton 3.9's interpreter needs the
    # masks built from them (see store_direct below).
    one_piece = (offs_m * 0 + pieces) == 1
    many_pieces = (offs_m * 0 + pieces) > 1

    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_ptr + kv_head.to(tl.int64) * stride_kh
    v_base = v_ptr + kv_head.to(tl.int64) * stride_vh

    # Query positions come in chunks of QPOS. Chunk 0 (all of a decode or verify row) is the one
    # split over the programs. Later chunks exist only if a sequence has more than QPOS query
    # tokens (a batch shape captured with a smaller max_query_len); the split-0 program then
    # computes them over the whole range and writes them directly, so the result stays exact.
    n_chunks = tl.cdiv(q_len, QPOS)
    for c in range(0, n_chunks):
        pos = c * QPOS + offs_m // GROUP
        row_ok = row_in & (pos < q_len)
        pos = tl.minimum(pos, q_len - 1)  # padding rows repeat a real row (finite, never stored)
        tok = (q_start + pos).to(tl.int64)
        q = tl.load(
            q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
            mask=d_ok[None, :],
            other=0.0,
        )
        if KV_FP8:
            q = _fp8_query(q, scale, Q_BF16)
        q_abs = ctx + pos  # absolute position of each row's query token
        a_lo = ctx + c * QPOS  # first and last query token of the chunk
        a_hi = ctx + tl.minimum(c * QPOS + QPOS, q_len) - 1
        if not SPLIT:
            lo = 0
            hi = tile_hi
            direct = True
        else:
            lo = tl.where(c == 0, split_lo, 0)
            hi = tl.where(c == 0, split_hi, tile_hi)
            hi = tl.where((c > 0) & (split > 0), lo, hi)
            # One piece (balanced: a short sequence) writes its output as it is, no merge.
            direct = (c > 0) | one_piece

        m_i = tl.full([BLOCK_M], NEG_BIG, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        if USE_SINKS:
            # The sink joins the denominator once: here when this program writes the final
            # output, otherwise in the merge.
            if not SPLIT:
                m_i = sink
                l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
            else:
                m_i = tl.where(direct, sink, m_i)
                l_i = tl.where(direct, 1.0, l_i)
        acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
        acc, l_i, m_i = _attend_range(
            acc, l_i, m_i, q, k_base, v_base, bt_row, lo, hi, a_lo, a_hi, q_abs, seq_len,
            qk_scale, softcap, stride_kb, stride_ks, stride_vb, stride_vs, offs_d, d_ok, offs_t,
            PAGE, BLOCK_M, TILE_N, EVEN_D, SLIDING_WINDOW, USE_SOFTCAP, KV_FP8, UPCAST_DOT,
            OFFSETS_FROM_TILE,
        )  # fmt: skip

        if KV_FP8:
            acc = acc * tl.load(v_scale_ptr)
        if not SPLIT:
            store_direct = row_ok
        else:
            # split == 0 compared as a row vector: Triton 3.9's interpreter turns a splatted
            # scalar comparison into an int32 mask, which tl.store refuses.
            store_direct = row_ok & direct & ((offs_m * 0 + split) == 0)
        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=store_direct[:, None] & d_ok[None, :],
        )
        if SPLIT:
            # Partial row of (sequence, position), only for chunk 0 (positions < QPOS).
            store_part = row_ok & (c == 0) & many_pieces
            pidx = ((part_row0 + pos) * NUM_Q_HEADS + head) * part_cols + first + split
            tl.store(
                part_o_ptr + pidx[:, None] * HEAD_PAD + offs_d[None, :],
                acc,
                mask=store_part[:, None],
            )
            tl.store(part_ml_ptr + pidx * 2, m_i, mask=store_part)
            tl.store(part_ml_ptr + pidx * 2 + 1, l_i, mask=store_part)

    if SPLIT:
        if pieces > 1:
            if FUSED_REDUCE:
                # Release: every thread's partial stores are ordered before the counter increment
                # (CTA barrier, then a gpu-scope acq_rel atomic). The program that brings the
                # counter to num_splits sees all partials (acquire), merges them and resets the
                # counter for the next launch.
                tl.debug_barrier()
                cnt_ptr = counter_ptr + seq * (NUM_Q_HEADS // GROUP) + kv_head
                arrived = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
                if arrived == pieces - 1:
                    # Rows of the merge: the chunk-0 (position, head) pairs only, not the tile's
                    # padding, so one step can hold many splits.
                    offs_r = tl.arange(0, MERGE_M)
                    r_pos = offs_r // GROUP
                    r_head = kv_head * GROUP + offs_r % GROUP
                    r_ok = (offs_r < QPOS * GROUP) & (r_pos < q_len)
                    r_pos = tl.minimum(r_pos, q_len - 1)
                    r_sink = tl.zeros([MERGE_M], dtype=tl.float32)
                    if USE_SINKS:
                        r_sink = tl.load(sinks_ptr + r_head).to(tl.float32) * LOG2E
                    r_tok = (q_start + r_pos).to(tl.int64)
                    r_offs_d = tl.arange(0, HEAD_PAD)
                    pbase = ((part_row0 + r_pos) * NUM_Q_HEADS + r_head) * part_cols + first
                    r_out = r_tok[:, None] * stride_ot + r_head[:, None] * stride_oh
                    _merge_partials(
                        out_ptr, part_o_ptr, part_ml_ptr, pbase, r_out + r_offs_d[None, :], r_ok,
                        r_sink, pieces, r_offs_d, r_offs_d < HEAD_SIZE, MERGE_M, HEAD_PAD,
                        RED_SPLITS, USE_SINKS,
                    )  # fmt: skip
                    tl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")


@triton.jit
def _splitkv_reduce_kernel(
    out_ptr,  # [num_tokens, Hq, D] q's dtype
    cu_q_ptr,  # [num_seqs + 1] int32
    sinks_ptr,  # [Hq] fp32 (read only if USE_SINKS)
    part_o_ptr,  # [num_seqs * QPOS, Hq, num_splits, HEAD_PAD] fp32
    part_ml_ptr,  # [num_seqs * QPOS, Hq, num_splits, 2] fp32
    num_splits,
    stride_ot,
    stride_oh,
    NUM_Q_HEADS: tl.constexpr,
    QPOS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,  # next power of two >= num_splits
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    MAX_Q: tl.constexpr,
    USE_SINKS: tl.constexpr,
):
    # The merge of `_merge_partials` as its own launch, grid (num_seqs, Hq).
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    if q_len <= 0:
        return
    if MAX_Q > 0:
        if q_len > MAX_Q:
            return
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_PAD)
    s_ok = offs_s < num_splits
    d_ok = offs_d < HEAD_SIZE
    if USE_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * LOG2E
    for p in range(0, tl.minimum(q_len, QPOS)):
        base = ((seq.to(tl.int64) * QPOS + p) * NUM_Q_HEADS + head) * num_splits
        m = tl.load(part_ml_ptr + (base + offs_s) * 2, mask=s_ok, other=float("-inf"))
        l_s = tl.load(part_ml_ptr + (base + offs_s) * 2 + 1, mask=s_ok, other=0.0)
        m_max = tl.max(m, 0)
        if USE_SINKS:
            m_max = tl.maximum(m_max, sink)
        w = tl.math.exp2(m - m_max)
        denom = tl.sum(w * l_s, 0)
        if USE_SINKS:
            denom += tl.math.exp2(sink - m_max)
        acc = tl.load(
            part_o_ptr + (base + offs_s)[:, None] * HEAD_PAD + offs_d[None, :],
            mask=s_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        o = tl.sum(acc * w[:, None], 0) / tl.where(denom > 0.0, denom, 1.0)
        tok = (q_start + p).to(tl.int64)
        tl.store(
            out_ptr + tok * stride_ot + head * stride_oh + offs_d,
            o.to(out_ptr.dtype.element_ty),
            mask=d_ok,
        )


# Elements of one step of the fused merge ([rows, splits, head] fp32): 64 per thread at 4
# warps; 16 splits of a GQA-4 decode row at D=128 in one step.
MERGE_STEP_ELEMENTS = 8192


def layout_strides(
    q: torch.Tensor,
    out: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
) -> tuple[int, ...]:
    """The element strides every attention kernel takes, in their argument order: q and out
    (token, head), the K and V caches (block, slot, head) and the block table (row)."""
    return (
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_table.stride(0),
    )  # fmt: skip


def offsets_from_tile(split: bool, num_stages: int, head_pad: int) -> bool:
    """Whether the decode kernel's KV loop takes pages and slots from the offset in the tile
    (`_attend_tiles`): everywhere but the unsplit 3-stage kernel at head size 256, where the
    compiler proves the first tile >= 0 (the token-index form costs no divisions there) and
    the offsets held across the loop made ptxas spill (sm_90a: 225 registers and no spill
    against 255 and 24 bytes; Gemma-2-9B 3.5-6.5% slower; docs/tuning/attention.md, "The
    KV-loop offsets timed")."""
    return split or num_stages != 3 or head_pad <= 128


def launch_decode(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    batch: PagedBatch,
    options: AttentionOptions,
    workspace: AttentionWorkspace | None,
    config: DecodeConfig,
    *,
    upcast_dot: bool,
) -> None:
    """Launch the decode kernel (and, with splits and fused_reduce=False, the split reduction).

    Arguments are already validated by `ops.attention`; the config comes from
    `plan.plan_launch` and depends only on shapes. With splits, the workspace's partial views
    hold `num_seqs * qpos * Hq * num_splits` rows and its counters `num_seqs * Hkv` zeros
    (left at zero).
    """
    cu_seqlens_q, seq_lens, block_table = batch.cu_seqlens_q, batch.seq_lens, batch.block_table
    sinks, k_scale, v_scale = options.sinks, options.k_scale, options.v_scale
    softcap = float(options.softcap)
    part_o = workspace.partial_out if workspace is not None else None
    part_ml = workspace.partial_ml if workspace is not None else None
    counters = workspace.counters if workspace is not None else None
    qpos, tile_n, num_splits = config.qpos, config.tile_n, config.num_splits
    head_fast, max_q, budget = config.head_fast, config.max_q, config.split_budget
    num_seqs = seq_lens.shape[0]
    balanced = budget > 0
    if balanced and not config.fused_reduce:
        raise ValueError("DecodeConfig: a balanced split (split_budget > 0) merges in the kernel "
                         "(fused_reduce=True); got fused_reduce=False")  # fmt: skip
    num_q_heads, head_size = q.shape[1], q.shape[2]
    num_kv_heads = key_cache.shape[2]
    head_pad = next_pow2(head_size)
    kv_fp8 = key_cache.dtype == torch.float8_e4m3fn
    split = balanced or num_splits > 1
    fused = split and config.fused_reduce
    merge_m = next_pow2(qpos * (num_q_heads // num_kv_heads))
    # One merge step size per tile shape, whatever the split count (masked lanes past it): a
    # new split count must not mean a new compiled variant in the middle of serving.
    red_splits = max(1, MERGE_STEP_ELEMENTS // (merge_m * head_pad))
    # Unused pointer arguments get a valid tensor: the constexpr switches keep them unread.
    dummy = seq_lens
    if balanced:
        items = num_seqs + budget
        grid = (num_kv_heads, items) if head_fast else (items, num_kv_heads)
        schedule = balanced_schedule(batch, workspace, budget, tile_n, max_q, options.window)
    elif head_fast:
        grid = (num_kv_heads, num_seqs, num_splits)
    else:
        grid = (num_seqs, num_kv_heads, num_splits)
    launch(
        _decode_kernel,
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
        part_o if split else dummy,
        part_ml if split else dummy,
        counters if fused else dummy,
        schedule if balanced else dummy,
        float(options.scale),
        softcap if softcap > 0 else 1.0,
        num_splits,
        num_seqs,
        budget,
        *layout_strides(q, out, key_cache, value_cache, block_table),
        NUM_Q_HEADS=num_q_heads,
        GROUP=num_q_heads // num_kv_heads,
        QPOS=qpos,
        BLOCK_M=config.block_m,
        HEAD_SIZE=head_size,
        HEAD_PAD=head_pad,
        PAGE=key_cache.shape[1],
        TILE_N=tile_n,
        SPLIT=split,
        FUSED_REDUCE=fused,
        MERGE_M=merge_m,
        RED_SPLITS=red_splits,
        HEAD_FAST=head_fast,
        BALANCED=balanced,
        MAX_Q=max_q,
        SLIDING_WINDOW=options.window,
        USE_SOFTCAP=softcap > 0,
        USE_SINKS=sinks is not None,
        KV_FP8=kv_fp8,
        UPCAST_DOT=upcast_dot,
        OFFSETS_FROM_TILE=offsets_from_tile(split, config.num_stages, head_pad),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if split and not fused:
        launch(
            _splitkv_reduce_kernel,
            (num_seqs, num_q_heads),
            out,
            cu_seqlens_q,
            sinks if sinks is not None else dummy,
            part_o,
            part_ml,
            num_splits,
            out.stride(0),
            out.stride(1),
            NUM_Q_HEADS=num_q_heads,
            QPOS=qpos,
            SPLITS_PAD=next_pow2(num_splits),
            HEAD_SIZE=head_size,
            HEAD_PAD=head_pad,
            MAX_Q=max_q,
            USE_SINKS=sinks is not None,
            num_warps=4,
        )
