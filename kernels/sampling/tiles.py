"""Per-row parameters and per-tile logits processing of the fused sampler (Triton device
functions): penalties, bias, temperature, the keys and the row's running sums. A tile is
[Q, 4] (4 consecutive tokens per row: Triton gives each thread whole 16-byte rows, so per-row
work stays in-thread)."""

from __future__ import annotations

import triton
import triton.language as tl

from .keys import _EPS, noise_row_state
from .penalties import div, mul


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
    b_stride,
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
        # A count outside [0, the list's width] reads only the list (the lists are contiguous
        # [S, width]: b_stride is the width).
        nbias = tl.load(bcount_ptr + slot).to(tl.int32)
        nbias = tl.minimum(tl.maximum(nbias, 0), b_stride)
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
def params_out_of_domain(row, temp_ptr, p, minp, rep, freq, pres, HAS_TEMP: tl.constexpr):
    """Whether a row's parameters lie outside the domain vLLM's SamplingParams accepts
    (temperature finite and >= 0, top_p > 0, min_p in [0, 1], repetition penalty finite and
    > 0, frequency and presence penalties finite): such a row is answered with token -1 and
    nan_rows -1 rather than a token drawn from NaN scores. top_p >= 1 stays "off"."""
    INF: tl.constexpr = float("inf")
    t = tl.full((), 1.0, tl.float32)
    if HAS_TEMP:
        t = tl.load(temp_ptr + row).to(tl.float32)
    bad = (t != t) | (t < 0.0) | (t == INF)
    bad = bad | (p != p) | (p <= 0.0)
    bad = bad | (minp != minp) | (minp < 0.0) | (minp > 1.0)
    bad = bad | (rep != rep) | (rep <= 0.0) | (rep == INF)
    bad = bad | (freq != freq) | (tl.abs(freq) == INF) | (pres != pres) | (tl.abs(pres) == INF)
    return bad


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
