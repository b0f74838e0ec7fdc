"""Paged attention, prefill side on Hopper: a warp-specialized kernel (Gluon).

The same computation as `prefill._prefill_kernel` (one program per (q block, kv
head), GQA rows packed as position x head, heaviest block first, causal tiles bounded, only the
diagonal tiles masked), split over two kinds of warps that never wait for each other except
through shared-memory barriers:

- the loader (`LOAD_WARPS` warps): gathers the Q tile once, then every K/V tile of the block
  through the block table with cp.async into a ring of `NUM_BUF` shared-memory slots; each slot
  has a `ready` barrier (every loader thread arrives when its copies have landed) and an
  `empty` barrier (the compute warps arrive when their tensor-core reads of the slot are done);
- the compute warps (the kernel's `num_warps`, whole warpgroups): QK^T and PV on wgmma from the
  shared tiles, the online softmax in fp32 registers, base 2.

In the Triton kernel every warp both copies and computes, so each K/V tile ends with a barrier
over all warps of the program; here the copies run ahead by `NUM_BUF` tiles and each compute
warpgroup moves on as soon as its own tensor-core work allows, so one warpgroup's softmax
overlaps another's matrix products.

Options as the Triton kernel runs them: a sliding window (only the tiles from the window's first
key of the block's first row are gathered; the window-edge tiles are masked like the diagonal
ones), a soft cap (the base-2 logits are cap2 * tanh(s * scale / cap), as `decode._tanh`), and
sinks (each row starts from its head's sink logit with a sum of 1, so the sink joins the
denominator once). An fp8 e4m3 cache with per-tensor scales: the loader copies the fp8 tiles
(half the bytes per slot); each compute warpgroup converts half of a tile's rows to q's dtype
in registers into a staging buffer both read (`_stage_fp8_half`: the ring slot is released once
both halves are read, the staging buffer once both warpgroups' products are done; two staging
buffers at head size <= 128, one at 256), k's scale is folded into the logit scale and v's into
the output. Supported: fp16/bf16 queries with a cache of the same dtype or fp8 e4m3, head
sizes 64, 128 and 256, on sm_90 (`supports`); `plan.plan_launch` says when it runs and uses the
Triton kernel for everything else. Gluon kernels do not run under the Triton
interpreter, so the CPU tests check the launch plan only; the GPU checks (`tests/gpu/`,
`bench_attention`) compare this kernel with the fp32 reference.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .._checks import FP8_E4M3
from .._launch import launch
from .._triton_compat import async_load, cta_barrier
from .decode import LOG2E, NEG_BIG, layout_strides
from .plan import prefill_ws_stage_buffers
from .prefill import prefill_grid

if TYPE_CHECKING:
    from .args import AttentionOptions, PagedBatch
    from .plan import PrefillConfig

# Loader warps (one warpgroup: enough threads for a 16 KiB tile in 8 copies of 16 bytes each).
LOAD_WARPS = gl.constexpr(4)
# Registers per thread of (each compute warpgroup, the loader), by head size: the three
# warpgroups share the 64 Ki register file (2 x 232 + 40 = 504 of 512 per thread slot). The
# loader's tile addresses spill at 40 (sm_90a, ptxas: D=128 168 bytes, D=256 416); at D=256
# 216 / 72 halves the loader's spills and keeps the compute warpgroups' 128-register
# accumulator clear of them (208 / 88 spills inside their loop).
WS_REGISTERS = {64: (232, 40), 128: (232, 40), 256: (216, 72)}

WS_HEAD_SIZES = (64, 128, 256)


@functools.cache
def _is_sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] == 9


def _aligned(t: torch.Tensor) -> bool:
    """16-byte copies of whole rows: the base address and every stride but the last a
    multiple of 16 bytes, the last dimension contiguous."""
    step = 16 // t.element_size()
    return (
        t.stride(-1) == 1
        and t.data_ptr() % 16 == 0
        and all(st % step == 0 for st in t.stride()[:-1])
    )


def tensors_supported(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    cache_dtypes: tuple[torch.dtype, ...],
    head_sizes: tuple[int, ...],
) -> bool:
    """The tensor conditions both Hopper kernels share: an sm_90 GPU, fp16/bf16 queries, K and V
    of one dtype among `cache_dtypes`, a head size among `head_sizes`, rows copied in 16-byte
    pieces (`_aligned`)."""
    if not (q.is_cuda and _is_sm90(q.device.index if q.device.index is not None else 0)):
        return False
    return (
        q.dtype in (torch.float16, torch.bfloat16)
        and key_cache.dtype in cache_dtypes
        and value_cache.dtype == key_cache.dtype
        and q.shape[2] in head_sizes
        and _aligned(key_cache)
        and _aligned(value_cache)
        and _aligned(q)
    )


def supports(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """Whether this prefill kernel can run a call with these tensors, with any sliding window,
    soft cap or sinks (`tensors_supported`): a cache of q's dtype or fp8 e4m3, head size 64,
    128 or 256."""
    return tensors_supported(q, key_cache, value_cache, (q.dtype, FP8_E4M3), WS_HEAD_SIZES)


@gluon.jit
def _locate(qb_global, cu_q_ptr, seq_lens_ptr, num_seqs, BLOCK_Q: gl.constexpr,
            MIN_Q: gl.constexpr):  # fmt: skip
    """(seq, q_start, q_len, qb, ctx, seq_len, live) of q block `qb_global` (as the Triton
    kernel: binary search over cu_seqlens_q, heaviest block first)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = gl.load(cu_q_ptr + mid) // BLOCK_Q + mid
        if first_block <= qb_global:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1
    q_start = gl.load(cu_q_ptr + seq)
    q_len = gl.load(cu_q_ptr + seq + 1) - q_start
    local = qb_global - (q_start // BLOCK_Q + seq)
    live = local * BLOCK_Q < q_len
    if MIN_Q > 0:
        live = live & (q_len > MIN_Q)
    qb = gl.cdiv(q_len, BLOCK_Q) - 1 - local
    seq_len = gl.load(seq_lens_ptr + seq)
    ctx = seq_len - q_len
    return seq, q_start, q_len, qb, ctx, seq_len, live


@gluon.jit
def _tile_bounds(ctx, p0, p_last, BLOCK_N: gl.constexpr, SLIDING_WINDOW: gl.constexpr):
    """(t_lo, u_lo, u_hi, t_hi) of the block's queries a_lo = ctx + p0 .. a_hi = ctx + p_last,
    as `decode._attend_range` cuts them: the rows see keys [kv_lo, a_hi] (kv_lo: a_lo's window
    start); tiles [u_lo, u_hi) are seen whole by every row (unmasked), the tiles before them
    (window edge) and after them (the diagonal) are masked; tiles [t_lo, t_hi) are gathered,
    none past a_hi. With a window shorter than the block, edge tiles can cross the diagonal
    and reach past the sequence's end too."""
    a_lo = ctx + p0
    a_hi = ctx + p_last
    kv_lo = 0
    full_lo = 0
    if SLIDING_WINDOW > 0:
        kv_lo = gl.maximum(a_lo - SLIDING_WINDOW + 1, 0)
        full_lo = gl.maximum(a_hi - SLIDING_WINDOW + 1, 0)
    t_lo = kv_lo // BLOCK_N
    t_hi = gl.cdiv(a_hi + 1, BLOCK_N)
    u_lo = gl.cdiv(full_lo, BLOCK_N)  # first tile that starts at or after full_lo
    u_hi = gl.maximum(gl.minimum((a_lo + 1) // BLOCK_N, t_hi), u_lo)  # tiles ending <= a_lo
    return t_lo, u_lo, u_hi, t_hi


@gluon.jit
def _load_partition(
    q_ptr, k_ptr, v_ptr, bt_ptr, q_smem, k_smem, v_smem, q_bar, ready, empty,
    seq, q_start, q_len, qb, ctx, seq_len, kv_head,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt,
    GROUP: gl.constexpr, BLOCK_Q: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    HEAD: gl.constexpr, PAGE: gl.constexpr, NUM_BUF: gl.constexpr, SLIDING_WINDOW: gl.constexpr,
    KV_VEC: gl.constexpr,
):  # fmt: skip
    # Each thread copies rows of 16-byte pieces: 8 q elements, KV_VEC cache elements (8, or 16
    # of fp8); HEAD // 8 (HEAD // KV_VEC) threads cover a row.
    TPR: gl.constexpr = HEAD // 8
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPR, TPR], [gl.num_warps(), 1], [1, 0])
    rows_l: gl.constexpr = gl.SliceLayout(1, layout)
    cols_l: gl.constexpr = gl.SliceLayout(0, layout)
    offs_d = gl.arange(0, HEAD, layout=cols_l)
    TPR_KV: gl.constexpr = HEAD // KV_VEC
    kv_layout: gl.constexpr = gl.BlockedLayout(
        [1, KV_VEC], [32 // TPR_KV, TPR_KV], [gl.num_warps(), 1], [1, 0]
    )
    kv_rows: gl.constexpr = gl.SliceLayout(1, kv_layout)
    offs_dk = gl.arange(0, HEAD, layout=gl.SliceLayout(0, kv_layout))

    # Q tile: row r is position p0 + r // GROUP of head kv_head * GROUP + r % GROUP; rows past
    # the block's last position repeat it (finite values, never stored).
    p0 = qb * BLOCK_Q
    p_last = gl.minimum(p0 + BLOCK_Q, q_len) - 1
    offs_m = gl.arange(0, BLOCK_M, layout=rows_l)
    pos = gl.minimum(p0 + offs_m // GROUP, p_last)
    head = kv_head * GROUP + offs_m % GROUP
    tok = (q_start + pos).to(gl.int64)
    q_ptrs = q_ptr + (tok * stride_qt + head * stride_qh)[:, None] + offs_d[None, :]
    async_load(q_smem, q_ptrs)
    async_copy.mbarrier_arrive(q_bar, increment_count=False)

    t_lo, _, _, t_hi = _tile_bounds(ctx, p0, p_last, BLOCK_N, SLIDING_WINDOW)
    bt_row = bt_ptr + seq.to(gl.int64) * stride_bt
    k_base = k_ptr + kv_head.to(gl.int64) * stride_kh
    v_base = v_ptr + kv_head.to(gl.int64) * stride_vh
    offs_t = gl.arange(0, BLOCK_N, layout=kv_rows)
    for i in range(0, t_hi - t_lo):  # i: the ring's count, tile t_lo + i
        slot = i % NUM_BUF
        # The first pass over the ring finds every slot free (parity 1 of a fresh barrier).
        mbarrier.wait(empty.index(slot), ((i // NUM_BUF) & 1) ^ 1)
        offs_n = (t_lo + i) * BLOCK_N + offs_t
        n_ok = offs_n < seq_len  # slots past the sequence may hold NaN: never read
        phys = gl.load(bt_row + offs_n // PAGE, mask=n_ok, other=0).to(gl.int64)
        k_ptrs, v_ptrs = _kv_tile_ptrs(k_base, v_base, phys, offs_n, offs_dk, stride_kb,
                                       stride_ks, stride_vb, stride_vs, PAGE)  # fmt: skip
        # A tile that reaches past the sequence's end is zero-filled there: edge tiles can too,
        # when the window is shorter than the block.
        if (t_lo + i + 1) * BLOCK_N <= seq_len:
            _copy_kv_tile(k_smem.index(slot), v_smem.index(slot), k_ptrs, v_ptrs, None, False)
        else:
            _copy_kv_tile(k_smem.index(slot), v_smem.index(slot), k_ptrs, v_ptrs, n_ok, True)
        async_copy.mbarrier_arrive(ready.index(slot), increment_count=False)


@gluon.jit
def _kv_tile_ptrs(k_base, v_base, phys, offs_n, offs_d, stride_kb, stride_ks, stride_vb,
                  stride_vs, PAGE: gl.constexpr):  # fmt: skip
    """[tile rows, HEAD] addresses of one K/V tile: rows `offs_n` of the sequence, in the pages
    `phys` (int64, one entry per row, from the block table)."""
    in_page = offs_n % PAGE
    k_ptrs = (k_base + phys * stride_kb + in_page * stride_ks)[:, None] + offs_d[None, :]
    v_ptrs = (v_base + phys * stride_vb + in_page * stride_vs)[:, None] + offs_d[None, :]
    return k_ptrs, v_ptrs


@gluon.jit
def _copy_kv_tile(k_dst, v_dst, k_ptrs, v_ptrs, n_ok, MASKED: gl.constexpr):
    """Issue the cp.async copies of one K/V tile into the slots `k_dst` / `v_dst`; MASKED: the
    rows that are not `n_ok` (past the sequence's end: garbage or NaN) are zero-filled."""
    if MASKED:
        async_load(k_dst, k_ptrs, mask=n_ok[:, None])
        async_load(v_dst, v_ptrs, mask=n_ok[:, None])
    else:
        async_load(k_dst, k_ptrs)
        async_load(v_dst, v_ptrs)


@gluon.jit
def _tanh(x):
    """tanh as `decode._tanh` computes it: one exponential, saturating cleanly at +-1."""
    return 1.0 - 2.0 / (gl.exp2(x * (2.0 * LOG2E)) + 1.0)


@gluon.jit
def _attend_slot(q_rows, k_tile, v_tile, acc, m_i, l_i, c, s_zero, keep, MASKED: gl.constexpr,
                 cap2, inv_cap, USE_SOFTCAP: gl.constexpr):  # fmt: skip
    """Online-softmax update of (acc, m_i, l_i) by one K/V tile in shared memory: s = q k^T on
    wgmma (raw scores; MASKED: where not `keep`, -inf), p = 2^(c s - m_new) in fp32, acc rescaled,
    then acc += p v on wgmma with p from registers. USE_SOFTCAP: the base-2 logits are
    cap2 * tanh(s * inv_cap) instead (cap2 = softcap * log2(e), inv_cap = scale / softcap).
    Waits for both products: the caller may release the slot afterwards."""
    o_rows: gl.constexpr = gl.SliceLayout(1, acc.type.layout)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc.type.layout,
                                                 k_width=2)  # fmt: skip
    s = warpgroup_mma(q_rows, k_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s,))
    if USE_SOFTCAP:
        s = cap2 * _tanh(s * inv_cap)
        if MASKED:
            s = gl.where(keep, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        p = gl.exp2(s - m_new[:, None])
    else:
        if MASKED:
            s = gl.where(keep, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1) * c)  # c > 0: max(c * s) = c * max(s)
        p = gl.exp2(s * c - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, 1)
    acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
    p_op = gl.convert_layout(p.to(q_rows.dtype), p_layout)
    acc = warpgroup_mma(p_op, v_tile, acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    return acc, m_new, l_i


@gluon.jit
def _stage_fp8_tile(k_slot, v_slot, k_stage, v_stage, empty_bar, HEAD: gl.constexpr):
    """An fp8 ring slot's K and V (or the same rows of each) converted into staging tiles (q's
    dtype): both loaded into registers, then (every warp of the calling warpgroup past that
    point, and past its reads of the staging tiles in the previous step) the slot released to
    the loader and the tiles written, fenced for the tensor cores and made visible to every
    warp of the warpgroup. Hopper's decode kernel stages whole tiles, the prefill kernel's two
    compute warpgroups half a tile each (`_stage_fp8_half`)."""
    TPR: gl.constexpr = HEAD // 16
    cvt: gl.constexpr = gl.BlockedLayout([1, 16], [32 // TPR, TPR], [gl.num_warps(), 1], [1, 0])
    k8 = k_slot.load(cvt)
    v8 = v_slot.load(cvt)
    cta_barrier()
    mbarrier.arrive(empty_bar)
    k_stage.store(k8.to(k_stage.dtype))
    v_stage.store(v8.to(v_stage.dtype))
    fence_async_shared()
    cta_barrier()


@gluon.jit
def _stage_fp8_half(k_slot, v_slot, k_stage, v_stage, empty_bar, staged_bar, freed_bar, use,
                    HALF0: gl.constexpr, HALF: gl.constexpr, HEAD: gl.constexpr):  # fmt: skip
    """This warpgroup's half of an fp8 ring slot (rows [HALF0, HALF0 + HALF) of K and V) staged
    (`_stage_fp8_tile`) into a buffer both compute warpgroups then read: first wait until both
    have finished reading the buffer's previous tile (`freed_bar`, use - 1); last arrive at
    `staged_bar` and wait for the other warpgroup's half (its `use`-th completion). The ring
    slot (`empty_bar`, two arrivals) is free once both halves are loaded."""
    # The buffer's first use finds it free (parity 1 of a fresh barrier).
    mbarrier.wait(freed_bar, (use & 1) ^ 1)
    _stage_fp8_tile(k_slot.slice(HALF0, HALF, dim=0), v_slot.slice(HALF0, HALF, dim=0),
                    k_stage.slice(HALF0, HALF, dim=0), v_stage.slice(HALF0, HALF, dim=0),
                    empty_bar, HEAD)  # fmt: skip
    mbarrier.arrive(staged_bar)
    mbarrier.wait(staged_bar, use & 1)


@gluon.jit
def _consume_tile(
    i, q_rows, k_smem, v_smem, k_stage, v_stage, ready, empty, staged, freed, acc, m_i, l_i, c,
    s_zero, keep, MASKED: gl.constexpr, cap2, inv_cap, USE_SOFTCAP: gl.constexpr,
    NUM_BUF: gl.constexpr, KV_FP8: gl.constexpr, STAGE_BUF: gl.constexpr, HALF0: gl.constexpr,
    HEAD: gl.constexpr,
):  # fmt: skip
    """The ring's `i`-th K/V tile into (acc, m_i, l_i) (`_attend_slot`; MASKED: where not
    `keep`), then its slot released. An fp8 slot is first converted into staging buffer
    i % STAGE_BUF (`_stage_fp8_half`), released as soon as both halves are read, and the
    staging buffer released after the products."""
    slot = i % NUM_BUF
    buf = i % STAGE_BUF
    mbarrier.wait(ready.index(slot), (i // NUM_BUF) & 1)
    if KV_FP8:
        k_tile = k_stage.index(buf)
        v_tile = v_stage.index(buf)
        HALF: gl.constexpr = k_tile.shape[0] // 2
        _stage_fp8_half(k_smem.index(slot), v_smem.index(slot), k_tile, v_tile,
                        empty.index(slot), staged.index(buf), freed.index(buf), i // STAGE_BUF,
                        HALF0, HALF, HEAD)  # fmt: skip
    else:
        k_tile = k_smem.index(slot)
        v_tile = v_smem.index(slot)
    acc, m_i, l_i = _attend_slot(q_rows, k_tile, v_tile, acc, m_i, l_i, c, s_zero, keep, MASKED,
                                 cap2, inv_cap, USE_SOFTCAP)  # fmt: skip
    if KV_FP8:
        mbarrier.arrive(freed.index(buf))
    else:
        mbarrier.arrive(empty.index(slot))
    return acc, m_i, l_i


@gluon.jit
def _visible(offs_n, q_abs, SLIDING_WINDOW: gl.constexpr):
    """[rows, keys] mask of the keys `offs_n` each row (absolute query position `q_abs`) sees:
    causal, and within the window's last SLIDING_WINDOW keys."""
    keep = offs_n[None, :] <= q_abs[:, None]
    if SLIDING_WINDOW > 0:
        keep = keep & (offs_n[None, :] > (q_abs - SLIDING_WINDOW)[:, None])
    return keep


@gluon.jit
def _compute_partition(
    out_ptr, sinks_ptr, q_smem, k_smem, v_smem, k_stage, v_stage, q_bar, ready, empty, staged,
    freed, q_start, q_len, qb, ctx, kv_head, qk_scale, softcap, v_scale,
    stride_ot, stride_oh,
    GROUP: gl.constexpr, BLOCK_Q: gl.constexpr, ROW0: gl.constexpr, BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr, HEAD: gl.constexpr, NUM_BUF: gl.constexpr,
    SLIDING_WINDOW: gl.constexpr, USE_SOFTCAP: gl.constexpr, USE_SINKS: gl.constexpr,
    KV_FP8: gl.constexpr, STAGE_BUF: gl.constexpr,
):  # fmt: skip
    """One warpgroup's rows [ROW0, ROW0 + BLOCK_M) of the block's Q tile, over the tiles the
    loader gathers (`_tile_bounds`): window edge and diagonal masked, the interior not. With an
    fp8 cache this warpgroup converts its half of each tile's keys (the first or the second,
    as its rows are) for both (`_stage_fp8_half`); `v_scale` multiplies the output."""
    NW: gl.constexpr = gl.num_warps()
    q_rows = q_smem.slice(ROW0, BLOCK_M, dim=0)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BLOCK_N, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, HEAD, 16]
    )
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    s_cols: gl.constexpr = gl.SliceLayout(0, s_layout)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    o_cols: gl.constexpr = gl.SliceLayout(0, o_layout)
    HALF0: gl.constexpr = (ROW0 // BLOCK_M) * (BLOCK_N // 2)

    p0 = qb * BLOCK_Q
    p_last = gl.minimum(p0 + BLOCK_Q, q_len) - 1
    t_lo, u_lo, u_hi, t_hi = _tile_bounds(ctx, p0, p_last, BLOCK_N, SLIDING_WINDOW)
    c = qk_scale * LOG2E
    cap2 = softcap * LOG2E
    inv_cap = qk_scale / softcap
    if USE_SINKS:
        s_head = kv_head * GROUP + (ROW0 + gl.arange(0, BLOCK_M, layout=s_rows)) % GROUP
        m_i = gl.load(sinks_ptr + s_head).to(gl.float32) * LOG2E
        l_i = gl.full([BLOCK_M], 1.0, gl.float32, layout=s_rows)
    else:
        m_i = gl.full([BLOCK_M], NEG_BIG, gl.float32, layout=s_rows)
        l_i = gl.zeros([BLOCK_M], gl.float32, layout=s_rows)
    acc = gl.zeros([BLOCK_M, HEAD], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    q_abs = ctx + gl.minimum(p0 + (ROW0 + gl.arange(0, BLOCK_M, layout=s_rows)) // GROUP, p_last)
    offs_n0 = gl.arange(0, BLOCK_N, layout=s_cols)

    mbarrier.wait(q_bar, 0)
    # The ring's count i = j - t_lo runs on over the three phases, as in the loader.
    for j in range(t_lo, u_lo):  # window edge: keys before some rows' windows
        keep = _visible(j * BLOCK_N + offs_n0, q_abs, SLIDING_WINDOW)
        acc, m_i, l_i = _consume_tile(
            j - t_lo, q_rows, k_smem, v_smem, k_stage, v_stage, ready, empty, staged, freed,
            acc, m_i, l_i, c, s_zero, keep, True, cap2, inv_cap, USE_SOFTCAP, NUM_BUF, KV_FP8,
            STAGE_BUF, HALF0, HEAD,
        )  # fmt: skip
    for j in range(u_lo, u_hi):  # interior: every key visible to every row
        acc, m_i, l_i = _consume_tile(
            j - t_lo, q_rows, k_smem, v_smem, k_stage, v_stage, ready, empty, staged, freed,
            acc, m_i, l_i, c, s_zero, None, False, cap2, inv_cap, USE_SOFTCAP, NUM_BUF, KV_FP8,
            STAGE_BUF, HALF0, HEAD,
        )  # fmt: skip
    for j in range(u_hi, t_hi):  # the diagonal: key <= the row's own position
        keep = _visible(j * BLOCK_N + offs_n0, q_abs, SLIDING_WINDOW)
        acc, m_i, l_i = _consume_tile(
            j - t_lo, q_rows, k_smem, v_smem, k_stage, v_stage, ready, empty, staged, freed,
            acc, m_i, l_i, c, s_zero, keep, True, cap2, inv_cap, USE_SOFTCAP, NUM_BUF, KV_FP8,
            STAGE_BUF, HALF0, HEAD,
        )  # fmt: skip
    if KV_FP8:
        acc = acc * v_scale

    l_o = gl.convert_layout(l_i, o_rows)
    o = acc / gl.where(l_o > 0.0, l_o, 1.0)[:, None]
    offs_m = ROW0 + gl.arange(0, BLOCK_M, layout=o_rows)
    pos = p0 + offs_m // GROUP
    row_ok = pos <= p_last
    head = kv_head * GROUP + offs_m % GROUP
    tok = (q_start + gl.minimum(pos, p_last)).to(gl.int64)
    offs_d = gl.arange(0, HEAD, layout=o_cols)
    o_ptrs = out_ptr + (tok * stride_ot + head * stride_oh)[:, None] + offs_d[None, :]
    o_mask = row_ok[:, None] & (offs_d < HEAD)[None, :]
    gl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=o_mask)


@gluon.jit
def _allocate_ring(
    dtype: gl.constexpr, Q_ROWS: gl.constexpr, BLOCK_N: gl.constexpr, HEAD: gl.constexpr,
    NUM_BUF: gl.constexpr, CONSUMERS: gl.constexpr, KV_DTYPE: gl.constexpr,
):  # fmt: skip
    """Shared memory of a warp-specialized program: the Q tile (`dtype`), NUM_BUF K and V slots
    (`KV_DTYPE`; wgmma operand layouts), and their barriers, initialized: `q_bar` and
    `ready[i]` complete when every loader thread's copies have landed, `empty[i]` after
    CONSUMERS arrivals."""
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([Q_ROWS, HEAD], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD], KV_DTYPE)
    q_smem = gl.allocate_shared_memory(dtype, [Q_ROWS, HEAD], q_layout)
    k_smem = gl.allocate_shared_memory(KV_DTYPE, [NUM_BUF, BLOCK_N, HEAD], kv_layout)
    v_smem = gl.allocate_shared_memory(KV_DTYPE, [NUM_BUF, BLOCK_N, HEAD], kv_layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    LOADERS: gl.constexpr = LOAD_WARPS * 32
    mbarrier.init(q_bar, count=LOADERS)
    for i in gl.static_range(NUM_BUF):
        mbarrier.init(ready.index(i), count=LOADERS)
        mbarrier.init(empty.index(i), count=CONSUMERS)
    fence_async_shared()
    return q_smem, k_smem, v_smem, q_bar, ready, empty


@gluon.jit
def _allocate_staging(dtype: gl.constexpr, BLOCK_N: gl.constexpr, HEAD: gl.constexpr,
                      STAGE_BUF: gl.constexpr):  # fmt: skip
    """An fp8 cache's staging buffers: STAGE_BUF converted K and V tiles (`dtype`, wgmma operand
    layout) and their barriers, each completing after both compute warpgroups' arrivals:
    `staged[b]` (both halves written), `freed[b]` (both warpgroups' products read it)."""
    layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD], dtype)
    k_stage = gl.allocate_shared_memory(dtype, [STAGE_BUF, BLOCK_N, HEAD], layout)
    v_stage = gl.allocate_shared_memory(dtype, [STAGE_BUF, BLOCK_N, HEAD], layout)
    staged = gl.allocate_shared_memory(gl.int64, [STAGE_BUF, 1], mbarrier.MBarrierLayout())
    freed = gl.allocate_shared_memory(gl.int64, [STAGE_BUF, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(STAGE_BUF):
        mbarrier.init(staged.index(b), count=2)
        mbarrier.init(freed.index(b), count=2)
    fence_async_shared()
    return k_stage, v_stage, staged, freed


# num_seqs varies per batch: not specialized (no new variant mid-serving for 1 or 16 sequences).
@gluon.jit(do_not_specialize=["num_seqs"])
def _prefill_ws_kernel(
    q_ptr,  # [num_tokens, Hq, D] fp16/bf16
    k_ptr,  # [num_blocks, PAGE, Hkv, D] q's dtype or fp8 e4m3 (last dim contiguous)
    v_ptr,  # [num_blocks, PAGE, Hkv, D]
    out_ptr,  # [num_tokens, Hq, D] q's dtype
    cu_q_ptr,  # [num_seqs + 1] int32
    seq_lens_ptr,  # [num_seqs] int32, KV length including the new tokens
    bt_ptr,  # [num_seqs, max_blocks] int32
    sinks_ptr,  # [Hq] fp32 (read only if USE_SINKS)
    k_scale_ptr,  # [1] fp32 (read only if KV_FP8)
    v_scale_ptr,  # [1] fp32 (read only if KV_FP8)
    scale,
    softcap,  # used only if USE_SOFTCAP
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
    GROUP: gl.constexpr,
    BLOCK_Q: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    HEAD: gl.constexpr,
    PAGE: gl.constexpr,
    MIN_Q: gl.constexpr,
    NUM_BUF: gl.constexpr,
    HEAD_FAST: gl.constexpr,  # grid (Hkv, q blocks) instead of (q blocks, Hkv)
    SLIDING_WINDOW: gl.constexpr,  # 0: off; else query p sees keys k with p - k < SLIDING_WINDOW
    USE_SOFTCAP: gl.constexpr,
    USE_SINKS: gl.constexpr,
    KV_FP8: gl.constexpr,  # fp8 e4m3 cache, per-tensor scales; KV_VEC = 16
    KV_VEC: gl.constexpr,  # cache elements per 16-byte copy
    STAGE_BUF: gl.constexpr,  # fp8: staging buffers of the converted K/V tiles (1 or 2)
    COMPUTE_REGS: gl.constexpr,  # registers per thread of each compute warpgroup (WS_REGISTERS)
    LOAD_REGS: gl.constexpr,  # and of the loader
):
    if HEAD_FAST:
        kv_head = gl.program_id(0)
        qb_global = gl.program_id(1)
    else:
        qb_global = gl.program_id(0)
        kv_head = gl.program_id(1)
    seq, q_start, q_len, qb, ctx, seq_len, live = _locate(
        qb_global, cu_q_ptr, seq_lens_ptr, num_seqs, BLOCK_Q, MIN_Q
    )
    if live:
        dtype: gl.constexpr = q_ptr.dtype.element_ty
        # `empty`: one arrival per compute warpgroup
        q_smem, k_smem, v_smem, q_bar, ready, empty = _allocate_ring(
            dtype, BLOCK_M, BLOCK_N, HEAD, NUM_BUF, 2, k_ptr.dtype.element_ty
        )
        qk_scale = scale
        v_scale = 1.0
        if KV_FP8:  # value = stored * scale: k's folded into the logit scale, v's into the output
            qk_scale = scale * gl.load(k_scale_ptr)
            v_scale = gl.load(v_scale_ptr)
            k_stage, v_stage, staged, freed = _allocate_staging(dtype, BLOCK_N, HEAD, STAGE_BUF)
        else:  # unused
            k_stage = k_smem
            v_stage = v_smem
            staged = ready
            freed = empty
        WG_ROWS: gl.constexpr = BLOCK_M // 2
        gl.warp_specialize(
            [
                (
                    _compute_partition,
                    (out_ptr, sinks_ptr, q_smem, k_smem, v_smem, k_stage, v_stage, q_bar, ready,
                     empty, staged, freed, q_start, q_len, qb, ctx, kv_head, qk_scale, softcap,
                     v_scale, stride_ot, stride_oh, GROUP, BLOCK_Q, 0, WG_ROWS, BLOCK_N, HEAD,
                     NUM_BUF, SLIDING_WINDOW, USE_SOFTCAP, USE_SINKS, KV_FP8, STAGE_BUF),
                ),
                (
                    _compute_partition,
                    (out_ptr, sinks_ptr, q_smem, k_smem, v_smem, k_stage, v_stage, q_bar, ready,
                     empty, staged, freed, q_start, q_len, qb, ctx, kv_head, qk_scale, softcap,
                     v_scale, stride_ot, stride_oh, GROUP, BLOCK_Q, WG_ROWS, WG_ROWS, BLOCK_N,
                     HEAD, NUM_BUF, SLIDING_WINDOW, USE_SOFTCAP, USE_SINKS, KV_FP8, STAGE_BUF),
                ),
                (
                    _load_partition,
                    (q_ptr, k_ptr, v_ptr, bt_ptr, q_smem, k_smem, v_smem, q_bar, ready, empty,
                     seq, q_start, q_len, qb, ctx, seq_len, kv_head, stride_qt, stride_qh,
                     stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
                     GROUP, BLOCK_Q, BLOCK_M, BLOCK_N, HEAD, PAGE, NUM_BUF, SLIDING_WINDOW,
                     KV_VEC),
                ),
            ],
            [4, LOAD_WARPS],
            [COMPUTE_REGS, LOAD_REGS],
        )  # fmt: skip


def launch_prefill_ws(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    batch: PagedBatch,
    options: AttentionOptions,
    config: PrefillConfig,
) -> None:
    """Launch the warp-specialized prefill kernel over every q block of the batch (validated
    arguments; `supports` said yes; the config comes from `plan.plan_launch`)."""
    cu_seqlens_q, seq_lens, block_table = batch.cu_seqlens_q, batch.seq_lens, batch.block_table
    num_seqs = seq_lens.shape[0]
    num_tokens, num_q_heads, head_size = q.shape
    num_kv_heads = key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    block_q = config.block_m // group
    grid, head_fast = prefill_grid(num_tokens, num_seqs, num_kv_heads, block_q, config.head_fast)
    sinks, k_scale, v_scale = options.sinks, options.k_scale, options.v_scale
    softcap = float(options.softcap)
    kv_fp8 = key_cache.dtype == FP8_E4M3
    compute_regs, load_regs = WS_REGISTERS[head_size]
    launch(
        _prefill_ws_kernel,
        grid,
        q,
        key_cache,
        value_cache,
        out,
        cu_seqlens_q,
        seq_lens,
        block_table,
        # Unused pointer arguments get a valid tensor: the constexpr switches keep them unread.
        sinks if sinks is not None else seq_lens,
        k_scale if kv_fp8 else seq_lens,
        v_scale if kv_fp8 else seq_lens,
        float(options.scale),
        softcap if softcap > 0 else 1.0,
        num_seqs,
        *layout_strides(q, out, key_cache, value_cache, block_table),
        GROUP=group,
        BLOCK_Q=block_q,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        HEAD=head_size,
        PAGE=key_cache.shape[1],
        MIN_Q=config.min_q,
        NUM_BUF=config.num_stages,
        HEAD_FAST=head_fast,
        SLIDING_WINDOW=options.window,
        USE_SOFTCAP=softcap > 0,
        USE_SINKS=sinks is not None,
        KV_FP8=kv_fp8,
        KV_VEC=16 // key_cache.element_size(),
        STAGE_BUF=max(1, prefill_ws_stage_buffers(head_size, key_cache.element_size())),
        COMPUTE_REGS=compute_regs,
        LOAD_REGS=load_regs,
        num_warps=config.num_warps,
    )
