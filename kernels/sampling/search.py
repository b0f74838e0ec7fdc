"""Candidate selection per chunk and the threshold searches of the fused sampler (Triton device
functions): over a chunk's candidate list, or exact, with passes over the row."""

from __future__ import annotations

import triton
import triton.language as tl

from .keys import _LOG2E, key, unkey
from .tiles import process_rows, process_tile


@triton.jit
def _cut_for(v, vmax, lo_cut, LIMIT: tl.constexpr):
    """Smallest value t = unkey(k) >= lo_cut with at most LIMIT entries of v >= t (bisection on
    keys; float compares against unkey(k)). v: any shape, -inf = absent."""
    lo = key(lo_cut).to(tl.int64)
    hi = key(vmax).to(tl.int64) + 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        c = tl.sum(tl.ravel((v >= unkey(mid.to(tl.int32))).to(tl.int32)), axis=0)
        if c > LIMIT:
            lo = mid
        else:
            hi = mid
    return unkey(hi.to(tl.int32))


@triton.jit
def select_candidates(
    qmax,
    vmax,
    start,
    out_ptr,
    RAW: tl.constexpr,
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
    Q: tl.constexpr,
    CAP: tl.constexpr,
    HAS_TEMP: tl.constexpr,
    EXACT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_PEN: tl.constexpr,
    HAS_OUT_MASK: tl.constexpr,
    BIAS_BLOCK: tl.constexpr,
    FINITE_GROUPS: tl.constexpr,
):
    """Store the largest values of a chunk (rows of 4 tokens from `start`, row maxima qmax [Q],
    -inf = absent; values are x if RAW else z) and return (count, floor).

    At most CAP values are stored at out_ptr, in token order, each as int64
    `fp32 bits << 32 | token`; floor = the largest value left out (-inf if none), so every
    value > floor is listed. The cut is chosen on the row maxima alone: the smallest of SG
    super-group maxima, so at least SG rows reach it (SG = CAP/4 unless more than CAP rows do,
    then CAP/8; a bisection past that). Only the rows reaching it (at most CAP) are gathered
    again (L1/L2 hits, the same elementwise processing, so bit-identical values) for the
    value-level cut and the compaction: the per-value work over the whole chunk is the row
    maxima, nothing else. out_ptr's CAP slots carry the row indices between the two steps.
    FINITE_GROUPS: the cuts are the smallest finite super-group maxima (a whole row held as
    one chunk is padded to a power of two: its last super-groups are empty, and their -inf
    maxima would send every such row to the bisection).
    """
    SG_LO: tl.constexpr = min(max(CAP // 4, 1), Q)
    SG_HI: tl.constexpr = max(SG_LO // 2, 1)
    g_lo = tl.max(tl.reshape(qmax, [SG_LO, Q // SG_LO]), axis=1)
    g_hi = tl.max(tl.reshape(g_lo, [SG_HI, SG_LO // SG_HI]), axis=1)
    # cuts are finite (>= -FLT_MAX), so `v >= cut` never selects an absent value
    if FINITE_GROUPS:
        g_lo = tl.where(g_lo > float("-inf"), g_lo, float("inf"))
        g_hi = tl.where(g_hi > float("-inf"), g_hi, float("inf"))
    c_lo = tl.maximum(tl.min(g_lo, axis=0), -3.4028234663852886e38)
    c_hi = tl.maximum(tl.min(g_hi, axis=0), -3.4028234663852886e38)
    c0 = c_lo
    nr = tl.sum((qmax >= c_lo).to(tl.int32), axis=0)
    if nr > CAP:
        c0 = c_hi
        nr = tl.sum((qmax >= c_hi).to(tl.int32), axis=0)
    if nr > CAP:
        c0 = _cut_for(qmax, vmax, c0, CAP)
        nr = tl.sum((qmax >= c0).to(tl.int32), axis=0)
    rsel = qmax >= c0
    floor_rows = tl.max(tl.where(rsel, float("-inf"), qmax), axis=0)
    ar = tl.arange(0, Q)
    rpos = tl.cumsum(rsel.to(tl.int32), axis=0) - 1
    tl.store(out_ptr + rpos, ar.to(tl.int64), mask=rsel)
    tl.debug_barrier()  # the row indices of every thread before the gather reads them
    ri = tl.arange(0, CAP)
    rvalid = ri < nr
    rrow = tl.load(out_ptr + ri, mask=rvalid, other=0).to(tl.int32)
    s32 = start.to(tl.int32)
    tok, x, z = process_rows(
        s32 + rrow * 4,
        rvalid,
        s32,
        s32 + (4 * Q - 1),
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
        HAS_TEMP,
        EXACT,
        HAS_BIAS,
        HAS_PEN,
        HAS_OUT_MASK,
        BIAS_BLOCK,
    )
    if RAW:
        v = tl.where(rvalid[:, None], x, float("-inf"))
    else:
        v = z
    tl.debug_barrier()  # every gather has read its row index before the slots are reused
    cnt = tl.sum(tl.sum((v >= c0).to(tl.int32), axis=1), axis=0)
    if cnt > CAP:
        c0 = _cut_for(v, vmax, c0, CAP)
        cnt = tl.sum(tl.sum((v >= c0).to(tl.int32), axis=1), axis=0)
    sel = v >= c0
    floor = tl.maximum(floor_rows, tl.max(tl.max(tl.where(sel, float("-inf"), v), axis=1), axis=0))
    # compaction in token order: exclusive scan over the gathered rows + in-row prefix
    si = sel.to(tl.int32)
    rc = tl.sum(si, axis=1)
    pos = (tl.cumsum(rc, axis=0) - rc)[:, None] + tl.cumsum(si, axis=1) - 1
    bits = v.to(tl.int32, bitcast=True).to(tl.int64)
    tl.store(out_ptr + pos, (bits << 32) | tok.to(tl.int64), mask=sel)
    return cnt, floor


@triton.jit
def _add2(a, b, c, d):
    return a + c, b + d


@triton.jit
def search_list(keys, w, target, lo, hi, COUNT: tl.constexpr):
    """Largest key t in [lo, hi) with sum(w[keys >= t]) >= target; the caller ensures it holds
    at lo and fails at hi. fp32 sums of non-negative terms in a fixed order are monotone.
    COUNT: w is 1 everywhere (the sum is the count).

    Bisection that stops once [lo, hi) holds a single listed key: the answer is that key (the
    sum only changes at listed keys), so a search takes about log2(range / gap at the answer)
    steps rather than the 31 of a full key range."""
    n_lo = tl.sum((keys >= lo).to(tl.int32), axis=0)
    n_hi = tl.sum((keys >= hi).to(tl.int32), axis=0)
    while (hi - lo > 1) & (n_lo - n_hi > 1):
        mid = (lo + hi) // 2
        ge = keys >= mid
        if COUNT:
            n = tl.sum(ge.to(tl.int32), axis=0)
            s = n.to(tl.float32)
        else:
            s, n = tl.reduce((tl.where(ge, w, 0.0), ge.to(tl.int32)), 0, _add2)
        if s >= target:
            lo = mid
            n_lo = n
        else:
            hi = mid
            n_hi = n
    first = tl.min(tl.where(keys >= lo, keys, 0x7FFFFFFF), axis=0).to(tl.int64)
    return tl.where(n_lo > n_hi, first, lo)


@triton.jit
def row_search(
    frac,
    lo,
    hi,
    bound,
    vmax,
    mass,
    raw,
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
    NP: tl.constexpr,
    TILE: tl.constexpr,
    HAS_TEMP: tl.constexpr,
    EXACT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_PEN: tl.constexpr,
    HAS_OUT_MASK: tl.constexpr,
    BIAS_BLOCK: tl.constexpr,
):
    """Exact search over a whole row: the largest key t in [lo, hi) with W(>= t) >= target.

    W(>= t) = count (mass False) or sum of exp(v - vmax) (mass True) over finite values v of the
    row with key(v) >= t and key(v) >= bound; v = raw x (raw True) or processed z.
    target = frac * W(>= lo) when mass (W(>= lo) comes from the first pass: the mass of
    everything the search may keep), else frac. NP pivots per pass, so a 32-bit key range takes
    at most 8 passes. If W(>= lo) < target (rounding), returns lo.
    """
    lo = lo.to(tl.int64)
    hi = hi.to(tl.int64)
    target = tl.full((), 0.0, tl.float32) + frac
    it = tl.full((), 0, tl.int32)
    while hi - lo > 1:
        step = (hi - lo + NP - 1) // NP
        piv = tl.minimum(lo + tl.arange(0, NP).to(tl.int64) * step, hi - 1)
        piv32 = piv.to(tl.int32)
        acc = tl.zeros([NP], dtype=tl.float32)
        for s in range(0, V, TILE):
            _tok, x, z, _is_nan = process_tile(
                s + tl.zeros((), dtype=tl.int64),
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
                TILE // 4,
                HAS_TEMP,
                EXACT,
                HAS_BIAS,
                HAS_PEN,
                HAS_OUT_MASK,
                BIAS_BLOCK,
            )
            v = tl.reshape(tl.where(raw, x, z), [TILE])
            kv = key(v)
            ok = (v > float("-inf")) & (kv >= bound)
            w = tl.where(ok, tl.where(mass, tl.exp2((v - vmax) * _LOG2E), 1.0), 0.0)
            acc += tl.sum(tl.where(kv[:, None] >= piv32[None, :], w[:, None], 0.0), axis=0)
        if (it == 0) & mass:
            target = frac * tl.max(acc, axis=0)  # pivot 0 = lo: the largest W
        it += 1
        ok = acc >= target
        new_lo = tl.max(tl.where(ok, piv, lo), axis=0)
        new_hi = tl.min(tl.where(ok, hi, piv), axis=0)
        lo = new_lo
        hi = new_hi
    return lo
