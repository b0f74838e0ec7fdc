"""Paged attention, decode side: flash-decoding over a paged KV cache, plus its split reduction.

Handles the sequences of a batch whose query is short (decode rows, query_len 1, and
speculative-verify rows, query_len 2-8). One program per (sequence, kv head, split): the
`GROUP = Hq // Hkv` query heads of that kv head and up to `QPOS` query positions are packed into
the rows of one tile, so every K/V tile is read from memory once for all of them. Each program
walks its share of the sequence's KV tiles (`TILE_N` tokens, i.e. several pages, per step,
gathered through the block table) with an fp32 online softmax in base 2, and then either writes
the normalized output (one split) or a partial (m, l, acc) into the workspace, which
`_splitkv_reduce_kernel` merges.

CUDA graphs: the grid and every constexpr depend only on the batch shape. Each program reads
its sequence's lengths on the device and derives its own KV range from them; a split whose
range is empty still writes a neutral partial (m = -1e30, l = 0, acc = 0).

The entry point, the argument checks and the torch reference are in `attention.py`; the
prefill kernel is in `attention_prefill.py` and reuses the small helpers defined here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

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


@triton.jit
def _logits_log2(qk, qk_scale, softcap, USE_SOFTCAP: tl.constexpr):
    """Logits in base-2 units from raw dot products.

    qk: [M, N] fp32 = q . k (k already dequantized up to its per-tensor scale, which is folded
    into `qk_scale`). Returns log2(e) * s with s = qk_scale * qk, or with the soft cap
    s = softcap * tanh(qk_scale * qk / softcap).
    """
    if USE_SOFTCAP:
        return (softcap * LOG2E) * _tanh(qk * (qk_scale / softcap))
    else:
        return qk * (qk_scale * LOG2E)


@triton.jit
def _mma(a, b, acc, UPCAST: tl.constexpr):
    """acc + a @ b with fp32 accumulation.

    UPCAST is set only under the Triton interpreter: Triton 3.6's interpreter multiplies the raw
    uint16 bits of bfloat16 operands in tl.dot, so there the operands are widened to fp32 first
    (exact for fp16/bf16 values). Compiled GPU code always takes the plain tl.dot.
    """
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        return tl.dot(a, b, acc)


@triton.jit
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
    scale,  # fp32 softmax scale
    softcap,  # fp32, used only if USE_SOFTCAP
    num_splits,  # programs per (sequence, kv head); 1 unless SPLIT
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
    SPLIT: tl.constexpr,  # num_splits > 1: write partials for the reduction
    MAX_Q: tl.constexpr,  # query_len > MAX_Q: the prefill kernel's sequence (0: no limit)
    SLIDING_WINDOW: tl.constexpr,  # 0: off; else query p sees keys k with p - k < SLIDING_WINDOW
    USE_SOFTCAP: tl.constexpr,
    USE_SINKS: tl.constexpr,
    KV_FP8: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    if q_len <= 0:  # padding request (CUDA-graph batch padding): nothing to write
        return
    if MAX_Q > 0:
        if q_len > MAX_Q:  # a prefill chunk: the prefill kernel of this call owns it
            return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = seq_len - q_len  # keys before the first query token

    qk_scale = scale
    if KV_FP8:
        # value = stored * scale: fold k's scale into the logit scale and v's into the output,
        # the fp8 -> fp16/bf16 conversion itself is exact.
        qk_scale = scale * tl.load(k_scale_ptr)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_PAD)
    offs_t = tl.arange(0, TILE_N)
    d_ok = offs_d < HEAD_SIZE
    row_in = offs_m < QPOS * GROUP
    head = kv_head * GROUP + offs_m % GROUP  # always a valid head index, padding rows included
    if USE_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * LOG2E

    # The sequence's KV tiles [tile_lo, tile_hi) are divided evenly over num_splits programs. The
    # window is the one of the first query token (keys it may see: k > ctx - SLIDING_WINDOW).
    kv_lo = 0
    if SLIDING_WINDOW > 0:
        kv_lo = tl.maximum(ctx - SLIDING_WINDOW + 1, 0)
    tile_lo = kv_lo // TILE_N
    tile_hi = tl.cdiv(seq_len, TILE_N)
    tiles_per_split = tl.cdiv(tile_hi - tile_lo, num_splits)
    split_lo = tile_lo + split * tiles_per_split
    split_hi = tl.minimum(split_lo + tiles_per_split, tile_hi)

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
        q_abs = ctx + pos  # absolute position of each row's query token

        # Tiles this chunk needs: its first token's window start .. its last token.
        first_abs = ctx + c * QPOS
        last_abs = ctx + tl.minimum(c * QPOS + QPOS, q_len) - 1
        chunk_lo = 0
        if SLIDING_WINDOW > 0:
            chunk_lo = tl.maximum(first_abs - SLIDING_WINDOW + 1, 0) // TILE_N
        chunk_hi = tl.cdiv(last_abs + 1, TILE_N)
        if not SPLIT:
            t_lo = chunk_lo
            t_hi = chunk_hi
            direct = True
        else:
            t_lo = tl.where(c == 0, tl.maximum(split_lo, chunk_lo), chunk_lo)
            t_hi = tl.where(c == 0, tl.minimum(split_hi, chunk_hi), chunk_hi)
            t_hi = tl.where((c > 0) & (split > 0), t_lo, t_hi)
            direct = c > 0

        m_i = tl.full([BLOCK_M], NEG_BIG, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        if USE_SINKS:
            # The sink joins the denominator once: here when this program writes the final
            # output, otherwise in the reduction.
            if not SPLIT:
                m_i = sink
                l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
            else:
                m_i = tl.where(direct, sink, m_i)
                l_i = tl.where(direct, 1.0, l_i)
        acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)

        for j in range(t_lo, t_hi):
            offs_n = j * TILE_N + offs_t
            n_ok = offs_n < seq_len  # slots past seq_len may hold garbage or NaN: never read
            phys = tl.load(bt_row + offs_n // PAGE, mask=n_ok, other=0).to(tl.int64)
            slot = offs_n % PAGE
            kv_mask = n_ok[:, None] & d_ok[None, :]
            k = tl.load(
                k_base + (phys * stride_kb + slot * stride_ks)[:, None] + offs_d[None, :],
                mask=kv_mask,
                other=0.0,
            )
            if KV_FP8:
                k = k.to(q.dtype)
            qk = _mma(q, tl.trans(k), tl.zeros([BLOCK_M, TILE_N], dtype=tl.float32), UPCAST_DOT)
            s = _logits_log2(qk, qk_scale, softcap, USE_SOFTCAP)
            # causal (key <= query position; implies key < seq_len) and the sliding window
            ok = offs_n[None, :] <= q_abs[:, None]
            if SLIDING_WINDOW > 0:
                ok = ok & (q_abs[:, None] - offs_n[None, :] < SLIDING_WINDOW)
            s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.math.exp2(s - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(
                v_base + (phys * stride_vb + slot * stride_vs)[:, None] + offs_d[None, :],
                mask=kv_mask,
                other=0.0,
            )
            if KV_FP8:
                v = v.to(q.dtype)
            acc = _mma(p.to(v.dtype), v, acc * alpha[:, None], UPCAST_DOT)
            m_i = m_new

        if KV_FP8:
            acc = acc * tl.load(v_scale_ptr)
        if not SPLIT:
            store_direct = row_ok
        else:
            store_direct = row_ok & direct & (split == 0)
        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=store_direct[:, None] & d_ok[None, :],
        )
        if SPLIT:
            # Partial row of (sequence, position), only for chunk 0 (positions < QPOS).
            store_part = row_ok & (c == 0)
            prow = seq.to(tl.int64) * QPOS + pos
            pidx = (prow * NUM_Q_HEADS + head) * num_splits + split
            tl.store(
                part_o_ptr + pidx[:, None] * HEAD_PAD + offs_d[None, :],
                acc,
                mask=store_part[:, None],
            )
            tl.store(part_ml_ptr + pidx * 2, m_i, mask=store_part)
            tl.store(part_ml_ptr + pidx * 2 + 1, l_i, mask=store_part)


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
    # out = sum_s 2^(m_s - M) acc_s / (sum_s 2^(m_s - M) l_s [+ 2^(sink - M)]), M = max of all m.
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


def launch_decode(
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
    part_o: torch.Tensor | None,
    part_ml: torch.Tensor | None,
    *,
    scale: float,
    softcap: float,
    sliding_window: int,
    qpos: int,
    block_m: int,
    tile_n: int,
    num_splits: int,
    max_q: int,
    num_warps: int,
    num_stages: int,
    upcast_dot: bool,
) -> None:
    """Launch the decode kernel (and the split reduction when num_splits > 1).

    Arguments are already validated by `attention.paged_attention`; the config comes from
    `attention.plan_launch` and depends only on shapes. `part_o` / `part_ml` are flat fp32
    workspace views large enough for `num_seqs * qpos * Hq * num_splits` partial rows.
    """
    num_seqs = seq_lens.shape[0]
    num_q_heads, head_size = q.shape[1], q.shape[2]
    num_kv_heads = key_cache.shape[2]
    head_pad = triton.next_power_of_2(head_size)
    kv_fp8 = key_cache.dtype == torch.float8_e4m3fn
    # Unused pointer arguments get a valid tensor: the constexpr switches keep them unread.
    dummy = seq_lens
    grid = (num_seqs, num_kv_heads, num_splits)
    _decode_kernel[grid](
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
        part_o if num_splits > 1 else dummy,
        part_ml if num_splits > 1 else dummy,
        scale,
        softcap if softcap > 0 else 1.0,
        num_splits,
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
        NUM_Q_HEADS=num_q_heads,
        GROUP=num_q_heads // num_kv_heads,
        QPOS=qpos,
        BLOCK_M=block_m,
        HEAD_SIZE=head_size,
        HEAD_PAD=head_pad,
        PAGE=key_cache.shape[1],
        TILE_N=tile_n,
        SPLIT=num_splits > 1,
        MAX_Q=max_q,
        SLIDING_WINDOW=sliding_window,
        USE_SOFTCAP=softcap > 0,
        USE_SINKS=sinks is not None,
        KV_FP8=kv_fp8,
        UPCAST_DOT=upcast_dot,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if num_splits > 1:
        _splitkv_reduce_kernel[(num_seqs, num_q_heads)](
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
            SPLITS_PAD=triton.next_power_of_2(num_splits),
            HEAD_SIZE=head_size,
            HEAD_PAD=head_pad,
            MAX_Q=max_q,
            USE_SINKS=sinks is not None,
            num_warps=4,
        )
