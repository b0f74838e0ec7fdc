"""The combine kernel of the fused sampler: one program per row merges its chunks' candidates,
applies top-k / top-p / min-p, draws the token and writes the logprobs."""

from __future__ import annotations

import triton
import triton.language as tl

from .chunk import _EMPTY, _INT64_MIN, _KEY_NEG_INF, _KEY_NO_BOUND, _LN2, _LOG2E
from .keys import gumbel, key, unkey
from .search import row_search, search_list
from .tiles import load_row_params, params_out_of_domain, process_tile


@triton.jit
def _pick(ar, pos, vals):
    """vals[pos] of a 1-D tensor (0 if pos is out of range)."""
    return tl.sum(tl.where(ar == pos, vals, 0), axis=0)


@triton.jit
def combine_row(
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
    out_tok_ptr,
    out_lp_ptr,
    out_ids_ptr,
    out_tlp_ptr,
    out_nan_ptr,
    out_thr_ptr,
    out_kept_ptr,
    out_fb_ptr,
    scratch_ptr,
    NUM_LOGPROBS,
    NC_PAD: tl.constexpr,
    CAP: tl.constexpr,
    MODE: tl.constexpr,
    TP: tl.constexpr,
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
    HAS_BIAS: tl.constexpr,
    SEED_MODE: tl.constexpr,
    HAS_OFFSETS: tl.constexpr,
    RAW_CANDS: tl.constexpr,
    TOPN: tl.constexpr,
    BIAS_BLOCK: tl.constexpr,
    NP: tl.constexpr,
    FB_TILE: tl.constexpr,
    KC: tl.constexpr,
):
    """Merge of the chunk partials of row `row` (int64). Outputs for row b: out_tok[b] int64,
    out_lp[b] fp32 (MODE > 0), out_ids[b*n:(b+1)*n] int64 and out_tlp[...] fp32 (TOPN),
    out_nan[b] int32, out_thr[b] fp32 (kept = finite z >= thr), out_kept[b] int32,
    out_fb[b] int32 (1: exact fallback drew the token, 2: it built the top-n).
    MODE: 0 none, 1 raw_logprobs, 2 raw_logits, 3 processed_logits, 4 processed_logprobs.
    """
    NCAND: tl.constexpr = NC_PAD * CAP
    LIST_TOPN: tl.constexpr = NCAND >= TP  # tl.topk needs k <= n
    RAW_TOPN: tl.constexpr = MODE == 1 or MODE == 2
    (greedy, t_eff, k, k_on, p, p_on, minp, minp_on, rep, freq, pres, use_pen, slot, nbias, h) = (
        load_row_params(
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
    )
    masked = k_on | p_on | minp_on

    # ---- chunk partials -> row statistics
    cs = tl.arange(0, NC_PAD)
    cm = cs < NC
    sb = row * NC
    zmax_c = tl.load(stf_ptr + 0 * PLANE + sb + cs, mask=cm, other=float("-inf"))
    zsum_c = tl.load(stf_ptr + 1 * PLANE + sb + cs, mask=cm, other=0.0)
    floor_c = tl.load(stf_ptr + 2 * PLANE + sb + cs, mask=cm, other=float("-inf"))
    cnt_c = tl.load(sti_ptr + 0 * PLANE + sb + cs, mask=cm, other=0)
    m = tl.max(zmax_c, axis=0)
    has_fin = m > float("-inf")
    # Z = sum_c zsum_c * exp(zmax_c - m): softmax normaliser of z relative to m
    Z = tl.sum(
        tl.where(zmax_c > float("-inf"), zsum_c * tl.exp2((zmax_c - m) * _LOG2E), 0.0), axis=0
    )
    kF = key(tl.max(floor_c, axis=0)).to(tl.int64)
    complete = kF == _KEY_NEG_INF  # no finite value was left out of any chunk's list
    nfin = tl.sum(tl.load(sti_ptr + 4 * PLANE + sb + cs, mask=cm, other=0), axis=0)
    nnan = tl.sum(tl.load(sti_ptr + 2 * PLANE + sb + cs, mask=cm, other=0), axis=0)
    km = key(m).to(tl.int64)
    # min-p bound (V2): keep z >= m + log(min_p)
    kmin = tl.where(
        minp_on, key(m + tl.log(tl.where(minp_on, minp, 1.0))).to(tl.int64), _KEY_NO_BOUND
    )

    # ---- the row's candidate list, flattened in token order
    sl = tl.arange(0, CAP)
    cvalid = cm[:, None] & (sl[None, :] < cnt_c[:, None])
    cptr = (sb + cs)[:, None] * CAP + sl[None, :]
    packed = tl.reshape(tl.load(cand_ptr + cptr, mask=cvalid, other=_EMPTY), [NCAND])
    cz = (packed >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    ci = (packed & 0xFFFFFFFF).to(tl.int32)
    ck = key(cz)
    fvalid = tl.reshape(cvalid, [NCAND])
    ar = tl.arange(0, NCAND)
    e = tl.exp2((cz - m) * _LOG2E)  # exp(z - m); empty slots hold -inf -> 0

    # ---- thresholds and draw from the lists (exact when the kept set lies above every floor)
    fb = tl.full((), 0, tl.int32)
    tau = tl.full((), _KEY_NO_BOUND, tl.int64)
    tok = tl.full((), 0, tl.int64)
    ztok = tl.full((), float("-inf"), tl.float32)
    Ztau = Z
    kept = nfin
    if has_fin:
        if (~greedy) & (~masked):
            # untruncated random row: the chunks drew already; take the best chunk winner
            ws_c = tl.load(stf_ptr + 6 * PLANE + sb + cs, mask=cm, other=float("-inf"))
            wz_c = tl.load(stf_ptr + 7 * PLANE + sb + cs, mask=cm, other=0.0)
            wi_c = tl.load(sti_ptr + 3 * PLANE + sb + cs, mask=cm, other=0)
            bv, bc = tl.max(ws_c, axis=0, return_indices=True, return_indices_tie_break_left=True)
            tok = _pick(cs, bc, wi_c).to(tl.int64)
            ztok = _pick(cs, bc, wz_c)
        elif ~masked:
            # greedy without masks: the first listed value with key(m), if all maxima are listed
            if km > kF:
                _bk, bpos = tl.max(
                    ck, axis=0, return_indices=True, return_indices_tie_break_left=True
                )
                tok = _pick(ar, bpos, ci).to(tl.int64)
                ztok = m
            else:
                fb = 1
        else:
            lb = kmin
            if k_on & (nfin > k):
                if tl.sum((ck > kF).to(tl.int32), axis=0) >= k:
                    kth = search_list(ck, 1.0, k.to(tl.float32), kF + 1, km + 1, True)
                    lb = tl.maximum(lb, kth)
                else:
                    fb = 1
            if (lb != _KEY_NO_BOUND) & (lb <= kF) & (~complete):
                fb = 1  # a lower bound the lists do not cover
            # Few survivors of top-k / min-p (the usual k): they are gathered into KC slots
            # (the row's own list region, already read), so top-p compares each survivor with
            # the others instead of searching, and only they draw noise.
            surv = ck >= lb
            n_surv = tl.sum(surv.to(tl.int32), axis=0)
            if (fb == 0) & (lb != _KEY_NO_BOUND) & (n_surv <= KC):
                rbase = cand_ptr + sb * CAP
                tl.debug_barrier()  # every thread has read the list before the region is reused
                tl.store(rbase + tl.cumsum(surv.to(tl.int32), axis=0) - 1, packed, mask=surv)
                tl.debug_barrier()
                jj = tl.arange(0, KC)
                jv = jj < n_surv
                sv = tl.load(rbase + jj, mask=jv, other=_EMPTY)
                sz = (sv >> 32).to(tl.int32).to(tl.float32, bitcast=True)
                si = (sv & 0xFFFFFFFF).to(tl.int32)
                sk = key(sz)
                se = tl.exp2((sz - m) * _LOG2E)
                tau = lb
                if p_on:
                    # mass of the survivors at or above each survivor's key
                    mass = tl.sum(tl.where(sk[None, :] >= sk[:, None], se[None, :], 0.0), axis=1)
                    target = p * tl.max(mass, axis=0)
                    top_key = tl.max(tl.where(jv & (mass >= target), sk, _KEY_NO_BOUND), axis=0)
                    tau = tl.maximum(tau, top_key.to(tl.int64))
                keep_s = jv & (sk >= tau)
                Ztau = tl.sum(tl.where(keep_s, se, 0.0), axis=0)
                kept = tl.sum(keep_s.to(tl.int32), axis=0)
                sc = tl.where(keep_s, sz + tl.where(greedy, 0.0, gumbel(h, si)), float("-inf"))
                bv, bpos = tl.max(
                    sc, axis=0, return_indices=True, return_indices_tie_break_left=True
                )
                tok = _pick(jj, bpos, si).to(tl.int64)
                ztok = _pick(jj, bpos, sz)
            else:
                tau = lb
                if (fb == 0) & p_on:
                    eL = tl.where(ck >= lb, e, 0.0)
                    ZL = tl.where(lb == _KEY_NO_BOUND, Z, tl.sum(eL, axis=0))
                    target = p * ZL
                    lo0 = tl.maximum(lb, kF + 1)
                    if tl.sum(tl.where(ck >= lo0, eL, 0.0), axis=0) >= target:
                        tau = tl.maximum(tau, search_list(ck, eL, target, lo0, km + 1, False))
                    elif ~complete:
                        fb = 1
                if (fb == 0) & (tau <= kF) & (~complete):
                    fb = 1  # the kept set reaches below a chunk floor
                if fb == 0:
                    keep = ck >= tau
                    Ztau = tl.sum(tl.where(keep, e, 0.0), axis=0)
                    kept = tl.sum(keep.to(tl.int32), axis=0)
                    noise = gumbel(h, ci)
                    sc = tl.where(keep, cz + tl.where(greedy, 0.0, noise), float("-inf"))
                    bv, bpos = tl.max(
                        sc, axis=0, return_indices=True, return_indices_tie_break_left=True
                    )
                    tok = _pick(ar, bpos, ci).to(tl.int64)
                    ztok = _pick(ar, bpos, cz)

    # ---- raw softmax statistics (raw modes)
    mr = tl.full((), float("-inf"), tl.float32)
    log_sr = tl.full((), 0.0, tl.float32)
    if RAW_TOPN:
        rmax_c = tl.load(stf_ptr + 3 * PLANE + sb + cs, mask=cm, other=float("-inf"))
        rsum_c = tl.load(stf_ptr + 4 * PLANE + sb + cs, mask=cm, other=0.0)
        mr = tl.max(rmax_c, axis=0)
        Sr = tl.sum(
            tl.where(rmax_c > float("-inf"), rsum_c * tl.exp2((rmax_c - mr) * _LOG2E), 0.0), axis=0
        )
        log_sr = tl.log2(Sr) * _LN2

    # ---- top-n from the lists when they cover it
    n_lp = NUM_LOGPROBS
    top = tl.full([TP], _INT64_MIN, tl.int64)
    topn_fb = tl.full((), 0, tl.int1)
    vmax_n = m
    nfin_n = nfin
    if TOPN:
        if RAW_TOPN:
            if RAW_CANDS:
                rcnt_c = tl.load(sti_ptr + 1 * PLANE + sb + cs, mask=cm, other=0)
                rvalid = cm[:, None] & (sl[None, :] < rcnt_c[:, None])
                rpacked = tl.reshape(tl.load(rcand_ptr + cptr, mask=rvalid, other=_EMPTY), [NCAND])
                lv = (rpacked >> 32).to(tl.int32).to(tl.float32, bitcast=True)
                li = (rpacked & 0xFFFFFFFF).to(tl.int32)
                lk = key(lv)
                rfloor_c = tl.load(stf_ptr + 5 * PLANE + sb + cs, mask=cm, other=float("-inf"))
                lF = key(tl.max(rfloor_c, axis=0)).to(tl.int64)
                list_ok = (lF == _KEY_NEG_INF) | (tl.sum((lk > lF).to(tl.int32), axis=0) >= n_lp)
            else:
                # The z list ranked by raw value: without bias and penalties z is a monotone
                # function of x, so every value outside it is below every listed value whose
                # z is above the z floor.
                lv = tl.load(
                    logits_ptr + row * stride_row + ci, mask=fvalid, other=float("-inf")
                ).to(tl.float32)
                li = ci
                lk = key(lv)
                list_ok = complete | (tl.sum((ck > kF).to(tl.int32), axis=0) >= n_lp)
            lvalid = lv > float("-inf")
            nfin_n = tl.sum(tl.load(sti_ptr + 5 * PLANE + sb + cs, mask=cm, other=0), axis=0)
            vmax_n = mr
        else:
            li = ci
            lk = ck
            lvalid = fvalid
            list_ok = complete | (tl.sum((ck > kF).to(tl.int32), axis=0) >= n_lp)
        if LIST_TOPN:
            if list_ok & has_fin:
                ranked = tl.where(
                    lvalid, (lk.to(tl.int64) << 32) | (0x7FFFFFFF - li.to(tl.int64)), _INT64_MIN
                )
                top = tl.topk(ranked, TP)
            else:
                topn_fb = has_fin
        else:
            topn_fb = has_fin

    # ---- exact fallback: searches with passes over the row (one call site for all of them)
    if (fb != 0) | topn_fb:
        lb = tl.full((), _KEY_NO_BOUND, tl.int64)
        tp = tl.full((), _KEY_NO_BOUND, tl.int64)
        tn = tl.full((), _KEY_NO_BOUND, tl.int64)
        kmax_n = key(vmax_n).to(tl.int64)
        for job in range(0, 3):
            # job 0: top-k (count), 1: top-p (mass, relative to the top-k/min-p survivors),
            # 2: n-th best value for the top-n
            run0 = (job == 0) & (fb != 0) & k_on & (nfin > k)
            run1 = (job == 1) & (fb != 0) & p_on
            run2 = (job == 2) & topn_fb & (nfin_n > n_lp)
            lbp = tl.maximum(lb, kmin)
            if run0 | run1 | run2:
                frac = tl.where(run0, k.to(tl.float32), tl.where(run1, p, n_lp + 0.0))
                lo = tl.where(run1, lbp, _KEY_NO_BOUND)
                hi = tl.where(run2, kmax_n + 1, km + 1)
                bound = tl.where(run1, lbp, _KEY_NO_BOUND).to(tl.int32)
                res = row_search(
                    frac,
                    lo,
                    hi,
                    bound,
                    tl.where(run2, vmax_n, m),
                    run1,
                    run2 & RAW_TOPN,
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
                    NP,
                    FB_TILE,
                    HAS_TEMP,
                    EXACT,
                    HAS_BIAS,
                    HAS_PEN,
                    HAS_OUT_MASK,
                    BIAS_BLOCK,
                )
                lb = tl.where(run0, res, lb)
                tp = tl.where(run1, res, tp)
                tn = tl.where(run2, res, tn)
        if fb != 0:
            tau = tl.maximum(lb, kmin)
            if p_on:
                tau = tl.maximum(tau, tp)
            Ztau = tl.full((), 0.0, tl.float32)
            kept = tl.full((), 0, tl.int32)
        # one pass: draw (kept mass, count, argmax of z + noise over z >= tau) and/or collect
        # the top-n (values above tn, fewer than n, plus the first TP ties at tn)
        best = tl.full((), float("-inf"), tl.float32)
        n_strict = tl.full((), 0, tl.int32)
        n_tie = tl.full((), 0, tl.int32)
        sbase = scratch_ptr + row * (2 * TP)
        for s0 in range(0, V, FB_TILE):
            tile_tok, x, z, _is_nan = process_tile(
                s0 + tl.zeros((), dtype=tl.int64),
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
                FB_TILE // 4,
                HAS_TEMP,
                EXACT,
                HAS_BIAS,
                HAS_PEN,
                HAS_OUT_MASK,
                BIAS_BLOCK,
            )
            z1 = tl.reshape(z, [FB_TILE])
            t1 = tl.reshape(tile_tok, [FB_TILE])
            if fb != 0:
                keep = (z1 > float("-inf")) & (key(z1) >= tau)
                Ztau += tl.sum(tl.where(keep, tl.exp2((z1 - m) * _LOG2E), 0.0), axis=0)
                kept += tl.sum(keep.to(tl.int32), axis=0)
                sc = tl.where(keep, z1 + tl.where(greedy, 0.0, gumbel(h, t1)), float("-inf"))
                bv, bp = tl.max(sc, axis=0, return_indices=True, return_indices_tie_break_left=True)
                if bv > best:
                    best = bv
                    tok = s0 + bp.to(tl.int64)
                    ztok = tl.sum(tl.where(tl.arange(0, FB_TILE) == bp, z1, 0.0), axis=0)
            if TOPN:
                if topn_fb:
                    if RAW_TOPN:
                        v1 = tl.reshape(x, [FB_TILE])
                    else:
                        v1 = z1
                    kv = key(v1)
                    okv = v1 > float("-inf")
                    strict = okv & (kv > tn)
                    tie = okv & (kv == tn)
                    pk = (kv.to(tl.int64) << 32) | (0x7FFFFFFF - t1.to(tl.int64))
                    ps = n_strict + tl.cumsum(strict.to(tl.int32), axis=0) - 1
                    tl.store(sbase + ps, pk, mask=strict)
                    pt = n_tie + tl.cumsum(tie.to(tl.int32), axis=0) - 1
                    tl.store(sbase + TP + pt, pk, mask=tie & (pt < TP))
                    n_strict += tl.sum(strict.to(tl.int32), axis=0)
                    n_tie += tl.sum(tie.to(tl.int32), axis=0)
        if TOPN:
            if topn_fb:
                tl.debug_barrier()  # this program's scratch stores before its loads
                a2 = tl.arange(0, 2 * TP)
                avalid = tl.where(a2 < TP, a2 < n_strict, (a2 - TP) < n_tie)
                top = tl.topk(tl.load(sbase + a2, mask=avalid, other=_INT64_MIN), TP)

    # ---- outputs
    log_z = tl.log2(Ztau) * _LN2
    if MODE != 0:
        if RAW_TOPN:
            xt = tl.load(logits_ptr + row * stride_row + tok).to(tl.float32)
            xt = tl.where(xt != xt, float("-inf"), xt)
            if MODE == 1:
                lp = tl.where(mr > float("-inf"), xt - mr - log_sr, float("-inf"))
            else:
                lp = xt
        elif MODE == 3:
            lp = ztok
        else:
            lp = tl.where(has_fin, ztok - m - log_z, float("-inf"))
        tl.store(out_lp_ptr + row, lp)
    if TOPN:
        # top: sorted descending, key << 32 | (2^31 - 1 - id), INT64_MIN = empty
        valid = top != _INT64_MIN
        tkey = (top >> 32).to(tl.int32)
        ids = tl.where(valid, 0x7FFFFFFF - (top & 0xFFFFFFFF), -1)
        j = tl.arange(0, TP)
        wmask = j < n_lp
        if RAW_TOPN:
            xv = tl.load(
                logits_ptr + row * stride_row + tl.maximum(ids, 0),
                mask=valid & wmask,
                other=float("-inf"),
            ).to(tl.float32)
            if MODE == 1:
                val = xv - mr - log_sr
            else:
                val = xv
        else:
            zv = unkey(tkey)
            kept_j = tkey >= tau
            if MODE == 3:
                val = tl.where(kept_j, zv, float("-inf"))
            else:
                val = tl.where(kept_j, zv - m - log_z, float("-inf"))
        val = tl.where(valid, val, float("-inf"))
        tl.store(out_ids_ptr + row * n_lp + j, ids, mask=wmask)
        tl.store(out_tlp_ptr + row * n_lp + j, val, mask=wmask)

    bad = params_out_of_domain(row, temp_ptr, p, minp, rep, freq, pres, HAS_TEMP)
    tl.store(out_tok_ptr + row, tl.where(bad, -1, tok))
    tl.store(out_nan_ptr + row, tl.where(bad, -1, nnan))
    thr = tl.where(tau == _KEY_NO_BOUND, float("-inf"), unkey(tau.to(tl.int32)))
    tl.store(out_thr_ptr + row, tl.where(has_fin, thr, float("inf")))
    tl.store(out_kept_ptr + row, tl.where(has_fin, kept, 0))
    tl.store(out_fb_ptr + row, fb + 2 * topn_fb.to(tl.int32))


@triton.jit(do_not_specialize=["NUM_LOGPROBS"])
def _sample_combine_kernel(
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
    out_tok_ptr,
    out_lp_ptr,
    out_ids_ptr,
    out_tlp_ptr,
    out_nan_ptr,
    out_thr_ptr,
    out_kept_ptr,
    out_fb_ptr,
    scratch_ptr,
    NUM_LOGPROBS,
    NC_PAD: tl.constexpr,
    CAP: tl.constexpr,
    MODE: tl.constexpr,
    TP: tl.constexpr,
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
    HAS_BIAS: tl.constexpr,
    SEED_MODE: tl.constexpr,
    HAS_OFFSETS: tl.constexpr,
    RAW_CANDS: tl.constexpr,
    TOPN: tl.constexpr,
    BIAS_BLOCK: tl.constexpr,
    NP: tl.constexpr,
    FB_TILE: tl.constexpr,
    KC: tl.constexpr,
):
    """Grid (B,): program b merges the partials of row b (`combine_row`)."""
    combine_row(
        tl.program_id(0).to(tl.int64),
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
        out_tok_ptr,
        out_lp_ptr,
        out_ids_ptr,
        out_tlp_ptr,
        out_nan_ptr,
        out_thr_ptr,
        out_kept_ptr,
        out_fb_ptr,
        scratch_ptr,
        NUM_LOGPROBS,
        NC_PAD,
        CAP,
        MODE,
        TP,
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
        HAS_BIAS,
        SEED_MODE,
        HAS_OFFSETS,
        RAW_CANDS,
        TOPN,
        BIAS_BLOCK,
        NP,
        FB_TILE,
        KC,
    )
