"""Paged attention, decode side on Hopper: a warp-specialized split-KV kernel (Gluon).

For decode batches too small to fill the GPU (one to a few sequences with long contexts), time
goes to memory latency, not bandwidth: in `decode._decode_kernel` every warp both
gathers a K/V tile and computes on it, so a program has at most one tile in flight and the
block-table read that addresses the next tile waits behind the current one. Here a loader
warpgroup gathers the tiles of the program's split through the block table with cp.async into a
ring of `NUM_BUF` shared-memory slots, up to `NUM_BUF` tiles ahead of a compute warpgroup that
runs QK^T and PV on wgmma (the `GROUP` query heads of the kv head padded to 64 rows) with an
fp32 online softmax, as `prefill_ws` does for prefill tiles.

Same semantics and workspace as the Triton decode kernel for decode rows (query_len 1): one
program per (sequence, kv head, split), each split a contiguous range of tiles; with several
splits each program writes its partial (acc, m, l) and the last of a (sequence, kv head) to
finish merges them (`decode._merge_partials`'s arithmetic, atomic counter left at
zero: CUDA-graph safe). Options as the Triton kernel runs them: a sliding window (the splits
cover only the tiles from the window's first key; the edge tile is masked), a soft cap, sinks
(joining the denominator once: without splits as the initial running max and sum, with splits
in the merge), and an fp8 e4m3 cache with per-tensor scales: the loader copies the fp8 tiles
(half the bytes of bf16 per slot), the compute warpgroup converts each to q's dtype in
registers into one staging tile per operand (two barriers over its four warps per tile: the
staging tiles are free, then written), k's scale is folded into the logit scale and v's into
the output. `supports` says which tensors it runs; `plan.plan_launch` says when it runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from .._checks import FP8_E4M3
from .._launch import launch, next_pow2
from .._triton_compat import async_load, cta_barrier
from .decode import LOG2E, MERGE_STEP_ELEMENTS, NEG_BIG, layout_strides
from .prefill_ws import (
    LOAD_WARPS,
    _allocate_ring,
    _attend_slot,
    _copy_kv_tile,
    _kv_tile_ptrs,
    _stage_fp8_tile,
    tensors_supported,
)

# Rows of the compute tile: one wgmma warpgroup's minimum, holding the kv head's query heads.
ROWS = gl.constexpr(64)
# Registers of a loader thread: the compute warpgroup needs few here (a 64-row tile), and a
# 128-token tile's copy addresses spill below about 100.
LOAD_REGS = gl.constexpr(128)
HEAD_SIZES = (64, 128, 256)

if TYPE_CHECKING:
    from .args import AttentionOptions, PagedBatch
    from .plan import AttentionWorkspace, DecodeConfig


def supports(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """Whether the kernel can run a decode call with these tensors, with any window, soft cap
    or sinks (`prefill_ws.tensors_supported`): a cache of q's dtype or fp8 e4m3, head size 64,
    128 or 256. The query heads per kv head (at most 64) are the rule's to check."""
    return tensors_supported(q, key_cache, value_cache, (q.dtype, FP8_E4M3), HEAD_SIZES)


@gluon.jit
def _split_range(seq_len, kv_lo, split, num_splits, BLOCK_N: gl.constexpr):
    """(lo, hi): this split's tiles [lo, hi) of the tiles from key `kv_lo`'s (the window's
    first key, else 0) to the sequence's last."""
    n_tiles = gl.cdiv(seq_len, BLOCK_N)
    t0 = kv_lo // BLOCK_N
    per_split = gl.cdiv(n_tiles - t0, num_splits)
    lo = gl.minimum(t0 + split * per_split, n_tiles)
    hi = gl.minimum(lo + per_split, n_tiles)
    return lo, hi


@gluon.jit
def _whole_tile(t, kv_lo, seq_len, BLOCK_N: gl.constexpr):
    """Whether every key of tile `t` is visible: in [kv_lo, seq_len)."""
    return (t * BLOCK_N >= kv_lo) & ((t + 1) * BLOCK_N <= seq_len)


@gluon.jit
def _decode_load_partition(
    q_row, k_ptr, v_ptr, bt_ptr, q_smem, k_smem, v_smem, q_bar, ready, empty,
    seq, seq_len, kv_lo, kv_head, split, num_splits,
    stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    GROUP: gl.constexpr, BLOCK_N: gl.constexpr, HEAD: gl.constexpr, PAGE: gl.constexpr,
    NUM_BUF: gl.constexpr, KV_VEC: gl.constexpr,
):  # fmt: skip
    # 16-byte copies: 8 q elements, KV_VEC cache elements (8, or 16 of fp8) per thread and row.
    TPRQ: gl.constexpr = HEAD // 8
    q_layout: gl.constexpr = gl.BlockedLayout(
        [1, 8], [32 // TPRQ, TPRQ], [gl.num_warps(), 1], [1, 0]
    )
    TPR: gl.constexpr = HEAD // KV_VEC
    layout: gl.constexpr = gl.BlockedLayout(
        [1, KV_VEC], [32 // TPR, TPR], [gl.num_warps(), 1], [1, 0]
    )
    rows_l: gl.constexpr = gl.SliceLayout(1, layout)
    cols_l: gl.constexpr = gl.SliceLayout(0, layout)
    offs_d = gl.arange(0, HEAD, layout=cols_l)

    # Q rows: the kv head's query heads, repeated to fill the tile (padding rows never stored).
    offs_m = gl.arange(0, ROWS, layout=gl.SliceLayout(1, q_layout))
    offs_dq = gl.arange(0, HEAD, layout=gl.SliceLayout(0, q_layout))
    head = kv_head * GROUP + offs_m % GROUP
    async_load(q_smem, q_row + (head * stride_qh)[:, None] + offs_dq[None, :])
    async_copy.mbarrier_arrive(q_bar, increment_count=False)

    lo, hi = _split_range(seq_len, kv_lo, split, num_splits, BLOCK_N)
    bt_row = bt_ptr + seq.to(gl.int64) * stride_bt
    k_base = k_ptr + kv_head.to(gl.int64) * stride_kh
    v_base = v_ptr + kv_head.to(gl.int64) * stride_vh
    offs_t = gl.arange(0, BLOCK_N, layout=rows_l)
    # Block-table entries one tile ahead: a tile's copies are addressed by entries that
    # arrived while the previous tile's copies were issued, so the loader never stalls on
    # the block table (at decode, a tile's copy takes about as long as that read's latency).
    offs_n = lo * BLOCK_N + offs_t
    phys_next = gl.load(bt_row + offs_n // PAGE, mask=offs_n < seq_len, other=0)
    for i in range(0, hi - lo):
        slot = i % NUM_BUF
        offs_n = (lo + i) * BLOCK_N + offs_t
        phys = phys_next.to(gl.int64)
        offs_ahead = offs_n + BLOCK_N
        phys_next = gl.load(bt_row + offs_ahead // PAGE, mask=offs_ahead < seq_len, other=0)
        # The first pass over the ring finds every slot free (parity 1 of a fresh barrier).
        mbarrier.wait(empty.index(slot), ((i // NUM_BUF) & 1) ^ 1)
        k_ptrs, v_ptrs = _kv_tile_ptrs(k_base, v_base, phys, offs_n, offs_d, stride_kb,
                                       stride_ks, stride_vb, stride_vs, PAGE)  # fmt: skip
        if _whole_tile(lo + i, kv_lo, seq_len, BLOCK_N):
            _copy_kv_tile(k_smem.index(slot), v_smem.index(slot), k_ptrs, v_ptrs, None, False)
        else:  # the sequence's last tile or the window's first: keys outside are zero-filled
            n_ok = (offs_n >= kv_lo) & (offs_n < seq_len)  # past the end: NaN is possible
            _copy_kv_tile(k_smem.index(slot), v_smem.index(slot), k_ptrs, v_ptrs, n_ok, True)
        async_copy.mbarrier_arrive(ready.index(slot), increment_count=False)


@gluon.jit
def _decode_compute_partition(
    q_smem, k_smem, v_smem, k_stage, v_stage, q_bar, ready, empty, sinks_ptr, kv_head, seq_len,
    kv_lo, split, num_splits, c, cap2, inv_cap,
    GROUP: gl.constexpr, BLOCK_N: gl.constexpr, HEAD: gl.constexpr, NUM_BUF: gl.constexpr,
    KV_FP8: gl.constexpr, USE_SOFTCAP: gl.constexpr, SINK_ROWS: gl.constexpr,
):  # fmt: skip
    """(acc, m, l) of the split's tiles: unnormalized output, running max (base 2), sum.
    SINK_ROWS: the rows start from their head's sink (max = the sink logit, sum = 1)."""
    NW: gl.constexpr = gl.num_warps()
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BLOCK_N, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, HEAD, 16]
    )
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    s_cols: gl.constexpr = gl.SliceLayout(0, s_layout)

    lo, hi = _split_range(seq_len, kv_lo, split, num_splits, BLOCK_N)
    if SINK_ROWS:
        head = kv_head * GROUP + gl.arange(0, ROWS, layout=s_rows) % GROUP
        m_i = gl.load(sinks_ptr + head).to(gl.float32) * LOG2E
        l_i = gl.full([ROWS], 1.0, gl.float32, layout=s_rows)
    else:
        m_i = gl.full([ROWS], NEG_BIG, gl.float32, layout=s_rows)
        l_i = gl.zeros([ROWS], gl.float32, layout=s_rows)
    acc = gl.zeros([ROWS, HEAD], gl.float32, layout=o_layout)
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)
    offs_n0 = gl.arange(0, BLOCK_N, layout=s_cols)

    mbarrier.wait(q_bar, 0)
    for i in range(0, hi - lo):
        slot = i % NUM_BUF
        mbarrier.wait(ready.index(slot), (i // NUM_BUF) & 1)
        if KV_FP8:
            _stage_fp8_tile(k_smem.index(slot), v_smem.index(slot), k_stage, v_stage,
                            empty.index(slot), HEAD)  # fmt: skip
            k_tile = k_stage
            v_tile = v_stage
        else:
            k_tile = k_smem.index(slot)
            v_tile = v_smem.index(slot)
        if _whole_tile(lo + i, kv_lo, seq_len, BLOCK_N):
            acc, m_i, l_i = _attend_slot(q_smem, k_tile, v_tile, acc, m_i, l_i, c, s_zero, None,
                                         False, cap2, inv_cap, USE_SOFTCAP)  # fmt: skip
        else:
            offs_n = (lo + i) * BLOCK_N + offs_n0
            keep = ((offs_n >= kv_lo) & (offs_n < seq_len))[None, :]
            acc, m_i, l_i = _attend_slot(q_smem, k_tile, v_tile, acc, m_i, l_i, c, s_zero, keep,
                                         True, cap2, inv_cap, USE_SOFTCAP)  # fmt: skip
        if not KV_FP8:
            mbarrier.arrive(empty.index(slot))
    return acc, m_i, l_i


@gluon.jit
def _merge_splits(
    out_row, part_o_ptr, part_ml_ptr, sinks_ptr, pbase, kv_head, num_splits, stride_oh,
    GROUP: gl.constexpr, HEAD: gl.constexpr, MERGE_M: gl.constexpr, RED_SPLITS: gl.constexpr,
    USE_SINKS: gl.constexpr,
):  # fmt: skip
    """out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s over the splits of this (sequence,
    kv head), for its GROUP query heads; online over steps of RED_SPLITS splits; a head's sink
    joins the sum as one more term (max = the sink logit, sum = 1). Loads bypass L1 (.cg): the
    partials were written by other programs of this launch."""
    NW: gl.constexpr = gl.num_warps()
    l3: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 1, 32], [1, NW, 1], [2, 1, 0])
    l_ms: gl.constexpr = gl.SliceLayout(2, l3)  # [MERGE_M, RED_SPLITS]
    l_md: gl.constexpr = gl.SliceLayout(1, l3)  # [MERGE_M, HEAD]
    offs_r = gl.arange(0, MERGE_M, layout=gl.SliceLayout(1, l_ms))
    offs_s = gl.arange(0, RED_SPLITS, layout=gl.SliceLayout(0, l_ms))
    offs_d = gl.arange(0, HEAD, layout=gl.SliceLayout(0, gl.SliceLayout(1, l3)))
    r_ok = offs_r < GROUP
    if USE_SINKS:
        sink = gl.load(sinks_ptr + kv_head * GROUP + offs_r, mask=r_ok, other=0.0)
        m_run = sink.to(gl.float32) * LOG2E
        l_run = gl.full([MERGE_M], 1.0, gl.float32, layout=gl.SliceLayout(1, l_ms))
    else:
        m_run = gl.full([MERGE_M], NEG_BIG, gl.float32, layout=gl.SliceLayout(1, l_ms))
        l_run = gl.zeros([MERGE_M], gl.float32, layout=gl.SliceLayout(1, l_ms))
    acc = gl.zeros([MERGE_M, HEAD], gl.float32, layout=l_md)
    rbase = pbase + offs_r.to(gl.int64) * num_splits  # row r's split 0
    for s0 in range(0, num_splits, RED_SPLITS):
        s_idx = s0 + offs_s
        ok = r_ok[:, None] & (s_idx < num_splits)[None, :]
        pidx = rbase[:, None] + s_idx[None, :]
        m_s = gl.load(part_ml_ptr + pidx * 2, mask=ok, other=NEG_BIG, cache_modifier=".cg")
        l_s = gl.load(part_ml_ptr + pidx * 2 + 1, mask=ok, other=0.0, cache_modifier=".cg")
        o_ptrs = part_o_ptr + (pidx * HEAD)[:, :, None] + offs_d[None, None, :]
        o_s = gl.load(o_ptrs, mask=ok[:, :, None], other=0.0, cache_modifier=".cg")
        m_new = gl.maximum(m_run, gl.max(m_s, 1))
        alpha = gl.exp2(m_run - m_new)
        w = gl.exp2(m_s - m_new[:, None])
        l_run = l_run * alpha + gl.sum(w * l_s, 1)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, l_md))[:, None] + gl.sum(
            o_s * w[:, :, None], 1
        )
        m_run = m_new
    l_o = gl.convert_layout(l_run, gl.SliceLayout(1, l_md))
    o = acc / gl.where(l_o > 0.0, l_o, 1.0)[:, None]
    offs_ro = gl.arange(0, MERGE_M, layout=gl.SliceLayout(1, l_md))
    head = kv_head * GROUP + offs_ro
    o_ptrs = out_row + (head * stride_oh)[:, None] + offs_d[None, :]
    gl.store(o_ptrs, o.to(out_row.dtype.element_ty), mask=(offs_ro < GROUP)[:, None])


# num_splits and num_seqs vary per batch: not specialized (no new variant mid-serving).
@gluon.jit(do_not_specialize=["num_splits"])
def _decode_ws_kernel(
    q_ptr,  # [num_tokens, Hq, D] fp16/bf16
    k_ptr,  # [num_blocks, PAGE, Hkv, D] q's dtype (last dim contiguous)
    v_ptr,  # [num_blocks, PAGE, Hkv, D]
    out_ptr,  # [num_tokens, Hq, D] q's dtype
    cu_q_ptr,  # [num_seqs + 1] int32
    seq_lens_ptr,  # [num_seqs] int32
    bt_ptr,  # [num_seqs, max_blocks] int32
    part_o_ptr,  # [num_seqs, Hq, num_splits, D] fp32 workspace (if SPLIT)
    part_ml_ptr,  # [num_seqs, Hq, num_splits, 2] fp32 workspace: (m, l) in base 2
    counter_ptr,  # [num_seqs * Hkv] int32 workspace, zero between launches (if SPLIT)
    sinks_ptr,  # [Hq] fp32 (read only if USE_SINKS)
    k_scale_ptr,  # [1] fp32 (read only if KV_FP8)
    v_scale_ptr,  # [1] fp32 (read only if KV_FP8)
    scale,
    softcap,  # used only if USE_SOFTCAP
    num_splits,
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
    NUM_Q_HEADS: gl.constexpr,
    GROUP: gl.constexpr,
    BLOCK_N: gl.constexpr,
    HEAD: gl.constexpr,
    PAGE: gl.constexpr,
    NUM_BUF: gl.constexpr,
    SPLIT: gl.constexpr,
    MERGE_M: gl.constexpr,
    RED_SPLITS: gl.constexpr,
    HEAD_FAST: gl.constexpr,  # grid (Hkv, num_seqs, splits) instead of (num_seqs, Hkv, splits)
    SLIDING_WINDOW: gl.constexpr,  # 0: off; else the query sees the last SLIDING_WINDOW keys
    USE_SOFTCAP: gl.constexpr,
    USE_SINKS: gl.constexpr,
    KV_FP8: gl.constexpr,  # fp8 e4m3 cache, per-tensor scales; KV_VEC = 16
    KV_VEC: gl.constexpr,  # cache elements per 16-byte copy
):
    if HEAD_FAST:
        kv_head = gl.program_id(0)
        seq = gl.program_id(1)
    else:
        seq = gl.program_id(0)
        kv_head = gl.program_id(1)
    split = gl.program_id(2)
    q_start = gl.load(cu_q_ptr + seq)
    q_len = gl.load(cu_q_ptr + seq + 1) - q_start
    if q_len > 0:  # else a padding request (CUDA-graph batch padding): nothing to write
        seq_len = gl.load(seq_lens_ptr + seq)
        tok = q_start.to(gl.int64)
        kv_lo = 0
        if SLIDING_WINDOW > 0:
            kv_lo = gl.maximum(seq_len - SLIDING_WINDOW, 0)
        qk_scale = scale
        if KV_FP8:
            qk_scale = scale * gl.load(k_scale_ptr)  # value = stored * scale
        c = qk_scale * LOG2E
        cap2 = softcap * LOG2E
        inv_cap = qk_scale / softcap
        dtype: gl.constexpr = q_ptr.dtype.element_ty
        q_smem, k_smem, v_smem, q_bar, ready, empty = _allocate_ring(
            dtype, ROWS, BLOCK_N, HEAD, NUM_BUF, 1, k_ptr.dtype.element_ty
        )
        if KV_FP8:  # the compute warpgroup's converted tiles
            stage_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD],
                                                                              dtype)  # fmt: skip
            k_stage = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD], stage_layout)
            v_stage = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD], stage_layout)
        else:
            k_stage = q_smem  # unused
            v_stage = q_smem
        acc, m_i, l_i = gl.warp_specialize(
            [
                (
                    _decode_compute_partition,
                    (q_smem, k_smem, v_smem, k_stage, v_stage, q_bar, ready, empty, sinks_ptr,
                     kv_head, seq_len, kv_lo, split, num_splits, c, cap2, inv_cap, GROUP,
                     BLOCK_N, HEAD, NUM_BUF, KV_FP8, USE_SOFTCAP, USE_SINKS and not SPLIT),
                ),
                (
                    _decode_load_partition,
                    (q_ptr + tok * stride_qt, k_ptr, v_ptr, bt_ptr, q_smem, k_smem, v_smem,
                     q_bar, ready, empty, seq, seq_len, kv_lo, kv_head, split, num_splits,
                     stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                     stride_vh, stride_bt, GROUP, BLOCK_N, HEAD, PAGE, NUM_BUF, KV_VEC),
                ),
            ],
            [LOAD_WARPS],
            [LOAD_REGS],
        )  # fmt: skip
        if KV_FP8:
            acc = acc * gl.load(v_scale_ptr)

        o_layout: gl.constexpr = acc.type.layout
        o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
        offs_m = gl.arange(0, ROWS, layout=o_rows)
        offs_d = gl.arange(0, HEAD, layout=gl.SliceLayout(0, o_layout))
        row_ok = offs_m < GROUP
        head = kv_head * GROUP + offs_m
        if SPLIT:
            # This split's partial rows; the last program of the (sequence, kv head) to count
            # itself merges. Release: every thread's stores, then the CTA barrier, then one
            # gpu-scope acq_rel increment; the merging program acquires the others' partials.
            pidx = (seq.to(gl.int64) * NUM_Q_HEADS + head) * num_splits + split
            gl.store(part_o_ptr + (pidx * HEAD)[:, None] + offs_d[None, :], acc,
                     mask=row_ok[:, None])  # fmt: skip
            m_r = gl.convert_layout(m_i, o_rows)
            l_r = gl.convert_layout(l_i, o_rows)
            gl.store(part_ml_ptr + pidx * 2, m_r, mask=row_ok)
            gl.store(part_ml_ptr + pidx * 2 + 1, l_r, mask=row_ok)
            cta_barrier()
            cnt_ptr = counter_ptr + seq * (NUM_Q_HEADS // GROUP) + kv_head
            arrived = gl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
            if arrived == num_splits - 1:
                pbase = (seq.to(gl.int64) * NUM_Q_HEADS + kv_head * GROUP) * num_splits
                _merge_splits(
                    out_ptr + tok * stride_ot, part_o_ptr, part_ml_ptr, sinks_ptr, pbase,
                    kv_head, num_splits, stride_oh, GROUP, HEAD, MERGE_M, RED_SPLITS, USE_SINKS,
                )  # fmt: skip
                gl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")
        else:
            l_o = gl.convert_layout(l_i, o_rows)
            o = acc / gl.where(l_o > 0.0, l_o, 1.0)[:, None]
            o_ptrs = out_ptr + tok * stride_ot + (head * stride_oh)[:, None] + offs_d[None, :]
            gl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def launch_decode_ws(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    batch: PagedBatch,
    options: AttentionOptions,
    workspace: AttentionWorkspace | None,
    config: DecodeConfig,
) -> None:
    """Launch the warp-specialized decode kernel (a decode-only batch, query_len <= 1; validated
    arguments; `supports` said yes; config from `plan.plan_launch`). The workspace is read
    with splits only (`num_splits` > 1), as `decode.launch_decode` reads it; every option is
    run as the Triton kernel runs it."""
    cu_seqlens_q, seq_lens, block_table = batch.cu_seqlens_q, batch.seq_lens, batch.block_table
    tile_n, num_splits, head_fast = config.tile_n, config.num_splits, config.head_fast
    num_seqs = seq_lens.shape[0]
    num_q_heads, head_size = q.shape[1], q.shape[2]
    num_kv_heads = key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    split = num_splits > 1
    merge_m = next_pow2(group)
    red_splits = max(1, MERGE_STEP_ELEMENTS // (merge_m * head_size))
    sinks, k_scale, v_scale = options.sinks, options.k_scale, options.v_scale
    softcap = float(options.softcap)
    kv_fp8 = key_cache.dtype == FP8_E4M3
    # Unused pointer arguments get a valid tensor: the constexpr switches keep them unread.
    dummy = seq_lens
    grid = (
        (num_kv_heads, num_seqs, num_splits) if head_fast else (num_seqs, num_kv_heads, num_splits)
    )
    launch(
        _decode_ws_kernel,
        grid,
        q,
        key_cache,
        value_cache,
        out,
        cu_seqlens_q,
        seq_lens,
        block_table,
        workspace.partial_out if split else dummy,
        workspace.partial_ml if split else dummy,
        workspace.counters if split else dummy,
        sinks if sinks is not None else dummy,
        k_scale if kv_fp8 else dummy,
        v_scale if kv_fp8 else dummy,
        float(options.scale),
        softcap if softcap > 0 else 1.0,
        num_splits,
        *layout_strides(q, out, key_cache, value_cache, block_table),
        NUM_Q_HEADS=num_q_heads,
        GROUP=group,
        BLOCK_N=tile_n,
        HEAD=head_size,
        PAGE=key_cache.shape[1],
        NUM_BUF=config.num_stages,
        SPLIT=split,
        MERGE_M=merge_m,
        RED_SPLITS=red_splits,
        HEAD_FAST=head_fast,
        SLIDING_WINDOW=options.window,
        USE_SOFTCAP=softcap > 0,
        USE_SINKS=sinks is not None,
        KV_FP8=kv_fp8,
        KV_VEC=16 // key_cache.element_size(),
        num_warps=4,
    )
