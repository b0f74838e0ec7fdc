"""The chunk kernel of the fused sampler: one program per (row, chunk of the vocabulary)
processes its logits, keeps its candidates and partial sums for the combine kernel."""

from __future__ import annotations

import triton
import triton.language as tl

from .keys import KEY_NEG_INF, KEY_NO_BOUND, LN2, LOG2E, gumbel
from .penalties import penalize_words
from .search import select_candidates
from .tiles import argmax2d, finite_count, load_row_params, process_tile

_LOG2E = tl.constexpr(LOG2E)
_LN2 = tl.constexpr(LN2)
_KEY_NEG_INF = tl.constexpr(KEY_NEG_INF)
_KEY_NO_BOUND = tl.constexpr(KEY_NO_BOUND)
_INT64_MIN = tl.constexpr(-(2**63))
# an empty candidate slot: fp32 bits of -inf (0xFF800000 as int32) << 32, token 0
_EMPTY = tl.constexpr(-(0x00800000 << 32))


@triton.jit
def chunk_partials(
    c,
    row,
    logits_ptr,
    stride_row,
    V,
    NC,
    PLANE,
    temp_ptr,
    topk_ptr,
    topp_ptr,
    minp_ptr,
    rep_ptr,
    freq_ptr,
    pres_ptr,
    slots_ptr,
    pmask_ptr,
    pmask_stride,
    counts_ptr,
    counts_stride,
    omask_ptr,
    omask_stride,
    bcount_ptr,
    btok_ptr,
    bval_ptr,
    b_stride,
    seeds_ptr,
    has_seed_ptr,
    rseeds_ptr,
    offsets_ptr,
    stf_ptr,
    sti_ptr,
    cand_ptr,
    rcand_ptr,
    CHUNK: tl.constexpr,
    CAP: tl.constexpr,
    SUB: tl.constexpr,
    HAS_TEMP: tl.constexpr,
    EXACT: tl.constexpr,
    HAS_TOPK: tl.constexpr,
    HAS_TOPP: tl.constexpr,
    HAS_MINP: tl.constexpr,
    HAS_REP: tl.constexpr,
    HAS_FREQ: tl.constexpr,
    HAS_PRES: tl.constexpr,
    HAS_SLOTS: tl.constexpr,
    HAS_PEN: tl.constexpr,
    HAS_OUT_MASK: tl.constexpr,
    PEN_IN_PLACE: tl.constexpr,
    BIT_STEPS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SEED_MODE: tl.constexpr,
    HAS_OFFSETS: tl.constexpr,
    NEED_RAW: tl.constexpr,
    RAW_CANDS: tl.constexpr,
    BIAS_BLOCK: tl.constexpr,
    FINITE_GROUPS: tl.constexpr,
):
    """Per-chunk partials of chunk c of row `row` (int64): reads logits[row, c*CHUNK:(c+1)*CHUNK]
    once (logits: [B, V] fp32/bf16/fp16, stride 1 in V; parameters as in fused_sample).

    Writes at flat index i = b*NC + c, planes of PLANE entries: stf (fp32) 0 zmax,
    1 sum exp(z - zmax), 2 floor, 3 raw max, 4 raw sum exp(x - raw max), 5 raw floor,
    6 Gumbel winner score, 7 winner z; sti (int32) 0 candidate count, 1 raw candidate count,
    2 NaN count, 3 winner token, 4 finite z count, 5 finite raw count. Candidates:
    cand[i*CAP + j] int64 key(z) << 32 | token, in token order (rcand: raw values).
    """
    Q: tl.constexpr = CHUNK // 4
    (
        greedy,
        t_eff,
        _k,
        k_on,
        _p,
        p_on,
        _minp,
        minp_on,
        rep,
        freq,
        pres,
        use_pen,
        slot,
        nbias,
        h,
    ) = load_row_params(
        row,
        V,
        temp_ptr,
        topk_ptr,
        topp_ptr,
        minp_ptr,
        rep_ptr,
        freq_ptr,
        pres_ptr,
        slots_ptr,
        bcount_ptr,
        b_stride,
        seeds_ptr,
        has_seed_ptr,
        rseeds_ptr,
        offsets_ptr,
        HAS_TEMP,
        EXACT,
        HAS_TOPK,
        HAS_TOPP,
        HAS_MINP,
        HAS_REP,
        HAS_FREQ,
        HAS_PRES,
        HAS_SLOTS,
        HAS_BIAS,
        SEED_MODE,
        HAS_OFFSETS,
    )
    start = c.to(tl.int64) * CHUNK
    idx = row * NC + c
    if PEN_IN_PLACE:
        if use_pen:
            penalize_words(
                logits_ptr + row * stride_row,
                counts_ptr + slot * counts_stride,
                pmask_ptr + slot * pmask_stride,
                omask_ptr + slot * omask_stride,
                c * (CHUNK // 32),  # packed words of 32 tokens
                V,
                rep,
                freq,
                pres,
                CHUNK // 32,
                HAS_OUT_MASK,
                BIT_STEPS,
                EXACT,
            )
        tl.debug_barrier()  # every rewritten token stored before the chunk is read
    _tok, x, z, is_nan = process_tile(
        start,
        row,
        slot,
        logits_ptr,
        stride_row,
        V,
        t_eff,
        rep,
        freq,
        pres,
        use_pen,
        nbias,
        pmask_ptr,
        pmask_stride,
        counts_ptr,
        counts_stride,
        omask_ptr,
        omask_stride,
        btok_ptr,
        bval_ptr,
        b_stride,
        Q,
        HAS_TEMP,
        EXACT,
        HAS_BIAS,
        HAS_PEN,
        HAS_OUT_MASK,
        BIAS_BLOCK,
    )
    qmax = tl.max(z, axis=1)  # in-thread maxima of the 4-token rows [Q]
    zmax = tl.max(qmax, axis=0)
    # sum exp(z - zmax) = sum 2^(z*log2e - zmax*log2e); -inf values give 0
    zsum = tl.sum(tl.sum(tl.exp2(z * _LOG2E - zmax * _LOG2E), axis=1), axis=0)
    zsum = tl.where(zmax > float("-inf"), zsum, 0.0)
    n_fin = finite_count(z)
    n_nan = tl.full((), 0, tl.int32)
    if n_fin < 4 * Q:  # NaN became -inf: only a chunk with a non-finite value can hold one
        n_nan = tl.sum(tl.sum(is_nan.to(tl.int32), axis=1), axis=0)
    cnt, floor = select_candidates(
        qmax,
        zmax,
        start,
        cand_ptr + idx * CAP,
        False,
        row,
        slot,
        logits_ptr,
        stride_row,
        V,
        t_eff,
        rep,
        freq,
        pres,
        use_pen,
        nbias,
        pmask_ptr,
        pmask_stride,
        counts_ptr,
        counts_stride,
        omask_ptr,
        omask_stride,
        btok_ptr,
        bval_ptr,
        b_stride,
        Q,
        CAP,
        HAS_TEMP,
        EXACT,
        HAS_BIAS,
        HAS_PEN,
        HAS_OUT_MASK,
        BIAS_BLOCK,
        FINITE_GROUPS,
    )
    tl.store(stf_ptr + 0 * PLANE + idx, zmax)
    tl.store(stf_ptr + 1 * PLANE + idx, zsum)
    tl.store(stf_ptr + 2 * PLANE + idx, floor)
    tl.store(sti_ptr + 0 * PLANE + idx, cnt)
    tl.store(sti_ptr + 2 * PLANE + idx, n_nan)
    tl.store(sti_ptr + 4 * PLANE + idx, n_fin)
    if NEED_RAW:
        xmax = tl.max(x, axis=1)
        rmax = tl.max(xmax, axis=0)
        rsum = tl.sum(tl.sum(tl.exp2(x * _LOG2E - rmax * _LOG2E), axis=1), axis=0)
        tl.store(stf_ptr + 3 * PLANE + idx, rmax)
        tl.store(stf_ptr + 4 * PLANE + idx, tl.where(rmax > float("-inf"), rsum, 0.0))
        tl.store(sti_ptr + 5 * PLANE + idx, finite_count(x))
        if RAW_CANDS:
            rcnt, rfloor = select_candidates(
                xmax,
                rmax,
                start,
                rcand_ptr + idx * CAP,
                True,
                row,
                slot,
                logits_ptr,
                stride_row,
                V,
                t_eff,
                rep,
                freq,
                pres,
                use_pen,
                nbias,
                pmask_ptr,
                pmask_stride,
                counts_ptr,
                counts_stride,
                omask_ptr,
                omask_stride,
                btok_ptr,
                bval_ptr,
                b_stride,
                Q,
                CAP,
                HAS_TEMP,
                EXACT,
                HAS_BIAS,
                HAS_PEN,
                HAS_OUT_MASK,
                BIAS_BLOCK,
                FINITE_GROUPS,
            )
            tl.store(stf_ptr + 5 * PLANE + idx, rfloor)
            tl.store(sti_ptr + 1 * PLANE + idx, rcnt)
    # Rows without any truncation draw here: Gumbel argmax over every finite value. The chunk
    # is re-read in sub-tiles (L2 hits) so this path holds no registers across the code above.
    untrunc = (~greedy) & (~k_on) & (~p_on) & (~minp_on)
    wscore = tl.full((), float("-inf"), tl.float32)
    wz = tl.full((), float("-inf"), tl.float32)
    widx = start.to(tl.int32)
    if untrunc:
        for s0 in range(0, CHUNK, SUB):
            stok, _sx, sz, _sn = process_tile(
                start + s0,
                row,
                slot,
                logits_ptr,
                stride_row,
                V,
                t_eff,
                rep,
                freq,
                pres,
                use_pen,
                nbias,
                pmask_ptr,
                pmask_stride,
                counts_ptr,
                counts_stride,
                omask_ptr,
                omask_stride,
                btok_ptr,
                bval_ptr,
                b_stride,
                SUB // 4,
                HAS_TEMP,
                EXACT,
                HAS_BIAS,
                HAS_PEN,
                HAS_OUT_MASK,
                BIAS_BLOCK,
            )
            sc = tl.where(sz > float("-inf"), sz + gumbel(h, stok), float("-inf"))
            bv, bp = argmax2d(sc)
            if bv > wscore:
                wscore = bv
                widx = start.to(tl.int32) + s0 + bp
                wz = tl.max(tl.max(tl.where(stok == widx, sz, float("-inf")), axis=1), axis=0)
    tl.store(stf_ptr + 6 * PLANE + idx, wscore)
    tl.store(stf_ptr + 7 * PLANE + idx, wz)
    tl.store(sti_ptr + 3 * PLANE + idx, widx)


@triton.jit
def _sample_chunk_kernel(
    logits_ptr,
    stride_row,
    V,
    NC,
    PLANE,
    temp_ptr,
    topk_ptr,
    topp_ptr,
    minp_ptr,
    rep_ptr,
    freq_ptr,
    pres_ptr,
    slots_ptr,
    pmask_ptr,
    pmask_stride,
    counts_ptr,
    counts_stride,
    omask_ptr,
    omask_stride,
    bcount_ptr,
    btok_ptr,
    bval_ptr,
    b_stride,
    seeds_ptr,
    has_seed_ptr,
    rseeds_ptr,
    offsets_ptr,
    stf_ptr,
    sti_ptr,
    cand_ptr,
    rcand_ptr,
    CHUNK: tl.constexpr,
    CAP: tl.constexpr,
    SUB: tl.constexpr,
    HAS_TEMP: tl.constexpr,
    EXACT: tl.constexpr,
    HAS_TOPK: tl.constexpr,
    HAS_TOPP: tl.constexpr,
    HAS_MINP: tl.constexpr,
    HAS_REP: tl.constexpr,
    HAS_FREQ: tl.constexpr,
    HAS_PRES: tl.constexpr,
    HAS_SLOTS: tl.constexpr,
    HAS_PEN: tl.constexpr,
    HAS_OUT_MASK: tl.constexpr,
    PEN_IN_PLACE: tl.constexpr,
    BIT_STEPS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SEED_MODE: tl.constexpr,
    HAS_OFFSETS: tl.constexpr,
    NEED_RAW: tl.constexpr,
    RAW_CANDS: tl.constexpr,
    BIAS_BLOCK: tl.constexpr,
):
    """Grid (NC, B): program (c, b) computes the partials of chunk c of row b
    (`chunk_partials`)."""
    chunk_partials(
        tl.program_id(0),
        tl.program_id(1).to(tl.int64),
        logits_ptr,
        stride_row,
        V,
        NC,
        PLANE,
        temp_ptr,
        topk_ptr,
        topp_ptr,
        minp_ptr,
        rep_ptr,
        freq_ptr,
        pres_ptr,
        slots_ptr,
        pmask_ptr,
        pmask_stride,
        counts_ptr,
        counts_stride,
        omask_ptr,
        omask_stride,
        bcount_ptr,
        btok_ptr,
        bval_ptr,
        b_stride,
        seeds_ptr,
        has_seed_ptr,
        rseeds_ptr,
        offsets_ptr,
        stf_ptr,
        sti_ptr,
        cand_ptr,
        rcand_ptr,
        CHUNK,
        CAP,
        SUB,
        HAS_TEMP,
        EXACT,
        HAS_TOPK,
        HAS_TOPP,
        HAS_MINP,
        HAS_REP,
        HAS_FREQ,
        HAS_PRES,
        HAS_SLOTS,
        HAS_PEN,
        HAS_OUT_MASK,
        PEN_IN_PLACE,
        BIT_STEPS,
        HAS_BIAS,
        SEED_MODE,
        HAS_OFFSETS,
        NEED_RAW,
        RAW_CANDS,
        BIAS_BLOCK,
        False,
    )
