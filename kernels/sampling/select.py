"""Triton building blocks of the fused sampler (kernels/sampling/): the per-tile logits
processing, order-preserving keys, vLLM V2's murmur3 Gumbel noise, per-chunk candidate
selection and the threshold searches (over a candidate list, or exact with passes over a row).

Every function here is a `@triton.jit` device function inlined into the two kernels of
sampling.py; none launches anything. Conventions: a tile is [Q, 4] (4 consecutive tokens per
row: Triton gives each thread whole 16-byte rows, so per-row work stays in-thread); values are
fp32 with NaN -> -inf; thresholds are int32 `key`s (order-preserving, -0 read as +0), and a
candidate is stored as one int64 `key << 32 | token`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .penalties import div, mul

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
# vLLM V1 `_SAMPLING_EPS`: temperatures below it mean greedy.
SAMPLING_EPS = 1e-5
# key(-inf); key(-FLT_MAX). ">= KEY_NO_BOUND" holds for every finite value and nothing else.
KEY_NEG_INF = -2139095041
KEY_NO_BOUND = -2139095040

_LOG2E = tl.constexpr(LOG2E)
_EPS = tl.constexpr(SAMPLING_EPS)
_KEY_NO_BOUND = tl.constexpr(KEY_NO_BOUND)


@triton.jit
def key(v):
    """Order-preserving int32 key of fp32 values (no NaN): negative floats get their 31 low bits
    flipped, so signed int order = float order; -0 maps to the key of +0."""
    b = v.to(tl.int32, bitcast=True)
    b = tl.where(v == 0.0, 0, b)
    return b ^ ((b >> 31) & 0x7FFFFFFF)


@triton.jit
def unkey(k):
    """Inverse of `key` (int32 in, fp32 out)."""
    b = k ^ ((k >> 31) & 0x7FFFFFFF)
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _rotl32(v, s: tl.constexpr):
    return (v << s) | (v >> (32 - s))


@triton.jit
def _murmur3_mix(h, k):
    # murmur3_32 block mix with uint32 wrap-around, exactly as vLLM V2's sample/gumbel.py.
    k *= 0xCC9E2D51
    k = _rotl32(k, 15)
    k *= 0x1B873593
    h ^= k
    h = _rotl32(h, 13)
    return h * 5 + 0xE6546B64


@triton.jit
def _murmur3_fmix(h):
    h ^= h >> 16
    h *= 0x85EBCA6B
    h ^= h >> 13
    h *= 0xC2B2AE35
    return h ^ (h >> 16)


@triton.jit
def noise_row_state(seed, pos):
    """murmur3 state after (seed low word, seed high word, position): the per-row hash prefix."""
    seed = seed.to(tl.int64)
    pos = pos.to(tl.int64)
    h = (seed ^ seed).to(tl.uint32)
    h = _murmur3_mix(h, (seed & 0xFFFFFFFF).to(tl.uint32))
    h = _murmur3_mix(h, ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32))
    h = _murmur3_mix(h, (pos & 0xFFFFFFFF).to(tl.uint32))
    return h


@triton.jit
def _log1p_neg(u):
    # log(1 - u): degree-8 series below 0.25 keeps precision in the winning Gumbel tail (V2).
    poly = 1.0 / 8.0
    poly = 1.0 / 7.0 + u * poly
    poly = 1.0 / 6.0 + u * poly
    poly = 1.0 / 5.0 + u * poly
    poly = 1.0 / 4.0 + u * poly
    poly = 1.0 / 3.0 + u * poly
    poly = 1.0 / 2.0 + u * poly
    poly = 1.0 + u * poly
    series = -u * poly
    direct = tl.log(tl.maximum(1.0 - u, 5.960464477539063e-08))
    return tl.where(u < 0.25, series, direct)


@triton.jit
def gumbel(h, tokens):
    """Gumbel(0, 1) noise of `tokens` (int) for the row whose hash prefix is `h`:
    u = (murmur3(seed, pos, token) + 0.5) / 2^32 from two exact 16-bit halves,
    g = -log(-log(1 - u))."""
    r = _murmur3_fmix(_murmur3_mix(h, tokens.to(tl.uint32)) ^ 16)
    hi16 = (r >> 16).to(tl.int32)
    lo16 = (r & 0xFFFF).to(tl.int32)
    u = (
        hi16.to(tl.float32) * 1.52587890625e-05
        + (lo16.to(tl.float32) + 0.5) * 2.3283064365386963e-10
    )
    return -tl.log(-_log1p_neg(u))


@triton.jit
def load_row_params(
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
    seeds_ptr,
    has_seed_ptr,
    rseeds_ptr,
    offsets_ptr,
    HAS_TEMP: tl.constexpr,
    EXACT: tl.constexpr,
    HAS_TOPK: tl.constexpr,
    HAS_TOPP: tl.constexpr,
    HAS_MINP: tl.constexpr,
    HAS_REP: tl.constexpr,
    HAS_FREQ: tl.constexpr,
    HAS_PRES: tl.constexpr,
    HAS_SLOTS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SEED_MODE: tl.constexpr,
    HAS_OFFSETS: tl.constexpr,
):
    """Per-row scalars (a missing tensor means the neutral value). SEED_MODE: 0 = every row
    takes its device-drawn seed, 1 = every row is seeded, 2 = `has_seed` chooses per row."""
    t = tl.full((), 1.0, tl.float32)
    if HAS_TEMP:
        t = tl.load(temp_ptr + row).to(tl.float32)
    greedy = t < _EPS
    t_eff = tl.where(greedy, 1.0, t)
    k = tl.full((), 0, tl.int32)
    if HAS_TOPK:
        k = tl.load(topk_ptr + row).to(tl.int32)
    k_on = (k > 0) & (k < V)
    p = tl.full((), 1.0, tl.float32)
    if HAS_TOPP:
        p = tl.load(topp_ptr + row).to(tl.float32)
    p_on = p < 1.0
    minp = tl.full((), 0.0, tl.float32)
    if HAS_MINP:
        minp = tl.load(minp_ptr + row).to(tl.float32)
    minp_on = minp > 0.0
    rep = tl.full((), 1.0, tl.float32)
    if HAS_REP:
        rep = tl.load(rep_ptr + row).to(tl.float32)
    freq = tl.full((), 0.0, tl.float32)
    if HAS_FREQ:
        freq = tl.load(freq_ptr + row).to(tl.float32)
    pres = tl.full((), 0.0, tl.float32)
    if HAS_PRES:
        pres = tl.load(pres_ptr + row).to(tl.float32)
    use_pen = (rep != 1.0) | (freq != 0.0) | (pres != 0.0)
    slot = row
    if HAS_SLOTS:
        slot = tl.load(slots_ptr + row).to(tl.int64)
    nbias = tl.full((), 0, tl.int32)
    if HAS_BIAS:
        nbias = tl.load(bcount_ptr + slot).to(tl.int32)
    if SEED_MODE == 0:
        seed = tl.load(rseeds_ptr + row).to(tl.int64)
    elif SEED_MODE == 1:
        seed = tl.load(seeds_ptr + row).to(tl.int64)
    else:
        seeded = tl.load(has_seed_ptr + row) != 0
        seed = tl.where(
            seeded, tl.load(seeds_ptr + row).to(tl.int64), tl.load(rseeds_ptr + row).to(tl.int64)
        )
    pos = tl.full((), 0, tl.int64)
    if HAS_OFFSETS:
        pos = tl.load(offsets_ptr + row).to(tl.int64)
    h = noise_row_state(seed, pos)
    return (
        greedy,
        t_eff,
        k,
        k_on,
        p,
        p_on,
        minp,
        minp_on,
        rep,
        freq,
        pres,
        use_pen,
        slot,
        nbias,
        h,
    )


@triton.jit
def _process(
    x,
    tok,
    rowtok,
    inb,
    tlo,
    thi,
    slot,
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
    HAS_TEMP: tl.constexpr,
    EXACT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_PEN: tl.constexpr,
    HAS_OUT_MASK: tl.constexpr,
    BIAS_BLOCK: tl.constexpr,
):
    """Bias, penalties and temperature of loaded logits x [R, 4] (tokens tok [R, 4] int32,
    rowtok [R] = tok[:, 0], a multiple of 4; inb = tok < V; every token of the tile lies in
    [tlo, thi]). Elementwise: a token gets bit-identical values in every tile shape."""
    x = x.to(tl.float32)
    is_nan = x != x
    x = tl.where(is_nan, float("-inf"), x)
    y = x
    if HAS_BIAS:
        # Sparse (token, value) entries of the row's slot, any order: an entry touches at most
        # one element of the tile, so only entries inside it pay a tile-wide select.
        for eb in range(0, nbias, BIAS_BLOCK):
            for j in tl.static_range(BIAS_BLOCK):
                e = eb + j
                ok = e < nbias
                bt = tl.load(btok_ptr + slot * b_stride + e, mask=ok, other=-1)
                bv = tl.load(bval_ptr + slot * b_stride + e, mask=ok, other=0.0)
                if ok & (bt >= tlo) & (bt <= thi):
                    y = tl.where(tok == bt, y + bv, y)
    if HAS_PEN:
        if use_pen:
            # One packed word per 32 tokens and a 4-token row never straddles two: the row's
            # 4 bits are shifted down once per row, then tested with constant masks.
            words = rowtok >> 5
            sh = rowtok & 31
            wmask = rowtok < V
            jbit = 1 << tl.arange(0, 4)[None, :]
            cptr = counts_ptr + slot * counts_stride + tok
            if HAS_OUT_MASK:
                # packed output-presence bits: counts are read (whole rows) only where set
                ow = tl.load(omask_ptr + slot * omask_stride + words, mask=wmask, other=0)
                orow = (ow >> sh) & 15
                obit = (orow[:, None] & jbit) != 0
                cnt = tl.load(cptr, mask=inb & (orow != 0)[:, None], other=0)
                cnt = tl.where(obit, cnt, 0)
            else:
                cnt = tl.load(cptr, mask=inb, other=0)
                obit = cnt > 0
            if rep != 1.0:
                pw = tl.load(pmask_ptr + slot * pmask_stride + words, mask=wmask, other=0)
                pbit = ((pw >> sh)[:, None] & jbit) != 0
                # vLLM: scale = r where seen in prompt or output; y *= (y > 0 ? 1/scale : scale)
                # (y * 1 == y where unseen, so only seen tokens take the product)
                inv_rep = div(1.0, rep, EXACT)
                y = tl.where(pbit | obit, y * tl.where(y > 0, inv_rep, rep), y)
            if freq != 0.0:
                y = y - mul(freq, cnt.to(tl.float32), EXACT)
            if pres != 0.0:
                y = y - mul(pres, obit.to(tl.float32), EXACT)
    z = y
    if HAS_TEMP:
        z = div(y, t_eff, EXACT)
    return x, z, is_nan


@triton.jit
def process_tile(
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
    Q: tl.constexpr,
    HAS_TEMP: tl.constexpr,
    EXACT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_PEN: tl.constexpr,
    HAS_OUT_MASK: tl.constexpr,
    BIAS_BLOCK: tl.constexpr,
):
    """Load logits[row, start : start + 4*Q] and apply bias, penalties and temperature.

    start: int64 scalar, a multiple of 32. Returns tok [Q, 4] int32 (token ids), x [Q, 4] fp32
    (raw, NaN -> -inf, -inf past V), z [Q, 4] fp32 (processed), is_nan [Q, 4]. Elementwise,
    so every caller gets bit-identical values for a token.
    """
    local = tl.arange(0, Q)[:, None] * 4 + tl.arange(0, 4)[None, :]  # int32; bases are int64
    inb = local < (V - start).to(tl.int32)
    tok = start.to(tl.int32) + local
    rowtok = start.to(tl.int32) + tl.arange(0, Q) * 4
    x = tl.load(logits_ptr + row * stride_row + start + local, mask=inb, other=float("-inf"))
    x, z, is_nan = _process(
        x,
        tok,
        rowtok,
        inb,
        start.to(tl.int32),
        start.to(tl.int32) + (4 * Q - 1),
        slot,
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
    return tok, x, z, is_nan


@triton.jit
def process_rows(
    rowtok,
    rvalid,
    tlo,
    thi,
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
    HAS_TEMP: tl.constexpr,
    EXACT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_PEN: tl.constexpr,
    HAS_OUT_MASK: tl.constexpr,
    BIAS_BLOCK: tl.constexpr,
):
    """process_tile over gathered 4-token rows: rowtok [R] int32 (multiples of 4, ascending,
    in [tlo, thi]), rvalid [R]. Returns tok [R, 4], x [R, 4], z [R, 4]; -inf where invalid."""
    tok = rowtok[:, None] + tl.arange(0, 4)[None, :]
    inb = rvalid[:, None] & (tok < V)
    x = tl.load(logits_ptr + row * stride_row + tok, mask=inb, other=float("-inf"))
    x, z, _is_nan = _process(
        x,
        tok,
        rowtok,
        inb,
        tlo,
        thi,
        slot,
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
    return tok, x, tl.where(inb, z, float("-inf"))


@triton.jit
def finite_count(v):
    """Values > -inf in a 2-D tile. A tile without -inf is counted whole, so only tiles holding
    one (a row's last chunk, masked past V; -inf logits or bias) pay a pass over the values."""
    n = tl.full((), v.shape[0] * v.shape[1], tl.int32)
    if tl.min(tl.min(v, axis=1), axis=0) == float("-inf"):
        n = tl.sum(tl.sum((v > float("-inf")).to(tl.int32), axis=1), axis=0)
    return n


@triton.jit
def argmax2d(v):
    """(max, flat index) of a 2-D tensor, ties to the lowest flat (token) index."""
    gv, gi = tl.max(v, axis=1, return_indices=True, return_indices_tie_break_left=True)
    bv, br = tl.max(gv, axis=0, return_indices=True, return_indices_tie_break_left=True)
    bc = tl.sum(tl.where(tl.arange(0, v.shape[0]) == br, gi, 0), axis=0)
    return bv, br * v.shape[1] + bc


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
    """
    SG_LO: tl.constexpr = min(max(CAP // 4, 1), Q)
    SG_HI: tl.constexpr = max(SG_LO // 2, 1)
    g_lo = tl.max(tl.reshape(qmax, [SG_LO, Q // SG_LO]), axis=1)
    g_hi = tl.max(tl.reshape(g_lo, [SG_HI, SG_LO // SG_HI]), axis=1)
    # cuts are finite (>= -FLT_MAX), so `v >= cut` never selects an absent value
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
